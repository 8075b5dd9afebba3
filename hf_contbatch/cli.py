"""The ``hf-contbatch`` command: ``generate`` (the main job) and ``eval`` (lm-eval with our model type).

Only the standard library and the configs are imported before a command runs, so ``--help`` and
argument errors answer without loading torch. Every user error (an argument, the input file, the
model name) is one line, ``hf-contbatch: error: ...``, and exit status 2, argparse's convention;
``--debug`` or ``HF_CONTBATCH_DEBUG=1`` shows the traceback instead. ``generate``'s options are
added by one function per group (``add_*_arguments``); its checks before any model is loaded are
in ``frontends.cli_checks``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from . import __version__
from .config import (  # light: no torch
    ATTENTION_BACKENDS,
    KV_CACHE_DTYPES,
    PREEMPTION_MODES,
    QUANTIZATIONS,
    CacheConfig,
    EngineConfig,
    SchedulerConfig,
)
from .frontends.cli_checks import (
    UsageError,
    check_library,
    check_model,
    check_output,
    engine_config,
    float_in,
    int_at_least,
    non_empty_text,
    option_suggestions,
    read_response_format,
)

DESCRIPTION = """\
Continuous batching over a paged KV cache for Hugging Face text generation.

Run `hf-contbatch COMMAND --help` for a command's options. Errors print one line; set
HF_CONTBATCH_DEBUG=1 (or pass --debug to generate) for the traceback."""

GENERATE_DESCRIPTION = """\
Generate for every prompt of a file with continuous batching and print the throughput.
Decoding is greedy unless --do-sample is given; outputs then equal transformers' greedy
pipeline on the same model.

Each row's record is written as the row finishes, so a killed job keeps its work:
rerun it with --resume to finish it. A bad row (not JSON, a prompt the model refuses)
gets an error record and the other rows run.

Exit status: 0 every row generated; 2 a usage error (nothing ran); 3 some rows failed
(their error records are in --output, the others ran)."""

DTYPES = ("float32", "bfloat16", "float16", "auto")
DEFAULT_TEMPERATURE = 0.7  # with --do-sample: transformers' text-generation pipeline default
DEFAULT_TOP_P = 1.0
SAMPLING_OPTIONS = ("temperature", "top_p", "top_k")  # apply only with --do-sample


class _Parser(argparse.ArgumentParser):
    """argparse with its errors on one line, like the command's other user errors."""

    def error(self, message: str):
        self.exit(2, f"hf-contbatch: error: {message} (see `{self.prog} --help`)\n")


class _HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """Descriptions as written; each option's default shown, except None (the help says what it
    means) and the False of a flag."""

    def _get_help_string(self, action):
        if action.default is None or action.default is False:
            return action.help
        return super()._get_help_string(action)


def _default_prompts() -> list[str]:
    return [
        "The for statement",
        "A class is",
        "The with statement",
        "Exceptions are",
        "The import system",
        "Lambda expressions",
        "A dictionary",
        "The while statement",
    ]


def _generation_kwargs(args: argparse.Namespace) -> dict:
    """The pipeline call's generation arguments; sampling options given without ``--do-sample``
    are ignored with a warning (as transformers warns when ``do_sample=False``)."""
    kwargs = {"max_new_tokens": args.max_new_tokens, "do_sample": args.do_sample, "return_full_text": False}
    given = [name for name in SAMPLING_OPTIONS if getattr(args, name) is not None]
    if args.do_sample:
        kwargs["temperature"] = DEFAULT_TEMPERATURE if args.temperature is None else args.temperature
        kwargs["top_p"] = DEFAULT_TOP_P if args.top_p is None else args.top_p
        if args.top_k is not None:
            kwargs["top_k"] = args.top_k
    elif given:
        names = ", ".join("--" + name.replace("_", "-") for name in given)
        print(f"hf-contbatch: warning: {names} ignored without --do-sample (decoding is greedy)", file=sys.stderr)
    if args.stop:
        kwargs["stop_strings"] = args.stop
    return kwargs


def _prebuild_kernels(args: argparse.Namespace) -> float:
    """Build (or load) the C kernels before anything is timed; returns the seconds it took. The
    first run on a machine compiles them, and says so."""
    if args.dtype not in ("float32", "bfloat16", "auto"):
        return 0.0  # the C kernels serve float32 and bfloat16
    from .kernels.prebuild import prebuild_cpu_kernels

    build = prebuild_cpu_kernels()
    if build.built:
        print(f"built CPU kernels in {build.seconds:.1f} s (cached for next time)", file=sys.stderr)
    return build.seconds


def _report_gemm_choices(packed_linears, quiet: bool) -> None:
    """Say on stderr how long timing the GEMMs took (the first engine on a CPU) and, unless
    ``quiet``, the kernel chosen per linear shape."""
    choices = getattr(packed_linears, "choices", None)
    if choices is None:
        return
    if choices.measured_seconds:
        print(
            f"timed the GEMMs for this CPU in {choices.measured_seconds:.1f} s (cached for next time)", file=sys.stderr
        )
    if not quiet:
        shapes = ", ".join(f"{shape} {label}" for shape, label in choices.summary().items())
        print(f"GEMM per linear shape: {shapes}", file=sys.stderr)


def cmd_generate(args: argparse.Namespace) -> int:
    """Run the job (``frontends.batch_job``); returns 0 when every row has a generated record,
    ``EXIT_ROWS_FAILED`` (3) when some rows have error records."""
    from .frontends.adapters import parse_adapter_args
    from .frontends.batch_job import EXIT_ROWS_FAILED, JobOutput, latency_line, run_job
    from .frontends.job_inputs import ListInput, open_input

    # Everything that can be wrong with the arguments is found before torch or the model loads.
    source = open_input(args.input, args.input_column) if args.input else ListInput(_default_prompts())
    if args.output:
        check_output(args.output)
    if args.resume and not args.output:
        raise UsageError("--resume needs --output (the file of the interrupted job)")
    model = check_model(args.model) if args.model else None  # None: the embedded model
    config = engine_config(args)
    gen_kwargs = _generation_kwargs(args)
    if args.response_format:
        check_library("xgrammar", "--response-format", "structured")
        gen_kwargs["response_format"] = read_response_format(args.response_format)
    adapters = None
    if args.adapter:
        adapters = parse_adapter_args(args.adapter)
        check_library("peft", "--adapter", "lora")
    output = None
    try:
        if args.resume:  # the kept records are checked before the model loads (a new --output is started after)
            output = JobOutput(args.output, source.num_rows, resume=True)
            output.check_ids(source.rows())
        pipe, weight_format, kernel_s, load_s = _load_pipeline(args, model, config, gen_kwargs, adapters)
    except BaseException:
        if output is not None:
            output.close()
        raise
    if output is None and args.output:
        output = JobOutput(args.output, source.num_rows, resume=False)
    model_name = args.model or "hf_contbatch/default_model"
    try:
        with pipe:
            job = run_job(
                pipe,
                source,
                gen_kwargs,
                output,
                in_flight=4 * config.scheduler.max_num_seqs,
                show_progress=not args.quiet,
                print_texts=not args.quiet,
                model_name=model_name,
            )
            stats = pipe.stats()
    except KeyboardInterrupt:
        if output is None:
            raise
        output.close()
        print(
            f"hf-contbatch: interrupted; {output.num_done:,} of {source.num_rows:,} rows have their record in "
            f"{args.output}: rerun with --resume to finish",
            file=sys.stderr,
        )
        return 130  # the shell's status for SIGINT
    finally:
        if output is not None:
            output.close()
    summary = {
        "model": args.model or "embedded default (hf_contbatch/default_model)",
        "rows": source.num_rows,
        "ran": job.ran,
        "skipped": job.skipped,
        "failed": job.failed,
        "generated_tokens": job.tokens,
        "seconds": round(job.seconds, 3),
        "throughput_tokens_per_s": round(job.tokens / job.seconds if job.seconds else 0.0, 1),
        "preemptions": stats.num_preemptions,
        "peak_used_blocks": stats.peak_used_blocks,
        "num_blocks": stats.num_blocks,
        "block_size": stats.block_size,
        "load_seconds": round(load_s, 2),
        "kernel_build_seconds": round(kernel_s, 2),
        "weights": weight_format,
        "kv_cache_dtype": stats.kv_cache_dtype,
    }
    skipped = f" ({summary['skipped']:,} already in {args.output})" if summary["skipped"] else ""
    from .frontends.machine_load import load_note

    load_text, busy = load_note()  # tok/s depends on the machine's load
    if busy:
        print(busy, file=sys.stderr)  # before the summary, which stays the last line
    latency = latency_line(job.latency)
    if latency is not None:
        print(latency, file=sys.stderr)
    print(
        f"{summary['ran']:,} request{'s' if summary['ran'] != 1 else ''} done, {summary['failed']:,} failed"
        f"{skipped}; {summary['generated_tokens']:,} generated tokens in {summary['seconds']} s: "
        f"{summary['throughput_tokens_per_s']} tok/s; preemptions {summary['preemptions']}; "
        f"peak blocks {summary['peak_used_blocks']:,}/{summary['num_blocks']:,} (block size {summary['block_size']}); "
        f"weights {weight_format}; KV cache {summary['kv_cache_dtype']}{load_text}",
        file=sys.stderr,
    )
    for message in job.errors:
        print(f"hf-contbatch: failed {message}", file=sys.stderr)
    if args.check_quality:  # after close(): the model is back to its own weights
        from .engine.quality import quality_report

        report = quality_report(
            pipe.model, pipe.tokenizer, quantization=args.quantization or "int8", kv_cache_dtype="int8"
        )
        for line in report.lines():
            print(line, file=sys.stderr)
    if args.output:
        print(f"wrote {args.output}", file=sys.stderr)
    if job.failed:
        where = f"error records in {args.output}" if args.output else "errors above"
        print(f"hf-contbatch: {job.failed:,} of {source.num_rows:,} rows failed ({where})", file=sys.stderr)
        return EXIT_ROWS_FAILED
    return 0


def _load_pipeline(args: argparse.Namespace, model, config: EngineConfig, gen_kwargs: dict, adapters):
    """Import torch, build the kernels and load the pipeline (with ``adapters``, the parsed
    ``--adapter`` values, over the base model; sets ``gen_kwargs["adapter_names"]``). Returns the
    pipeline, its weight format, and the kernel-build and load seconds."""
    import torch
    import transformers

    from .frontends.pipeline import pipeline

    if args.threads:
        torch.set_num_threads(args.threads)
    if not _debug(args):
        _quiet_quantizer_imports()
    if args.quiet:
        transformers.utils.logging.disable_progress_bar()  # the weights' loading bar
    kernel_s = _prebuild_kernels(args)
    t_load = time.monotonic()
    tokenizer = None
    if adapters:  # LoRA adapters over the base model; a row's own "adapter", else the first
        model, gen_kwargs["adapter_names"], tokenizer = _model_with_adapters(args, model, adapters)
    pipe = pipeline("text-generation", model=model, tokenizer=tokenizer, dtype=args.dtype, engine_config=config)
    load_s = time.monotonic() - t_load
    _report_gemm_choices(pipe.engine.patches.packed_linears, args.quiet)
    return pipe, pipe.engine.patches.weight_format, kernel_s, load_s


def _model_with_adapters(args: argparse.Namespace, model, adapters: dict):
    """The base model (``model``: the checked ``--model``, None for the embedded one) with the
    ``--adapter`` adapters (``adapters``: name -> path, from ``parse_adapter_args``) loaded, the
    first adapter's name (the rows' default), and the base model's path for the tokenizer."""
    from transformers import AutoModelForCausalLM

    from .default_model import default_model_path
    from .frontends.adapters import load_adapters

    path = model if model is not None else default_model_path()
    base = AutoModelForCausalLM.from_pretrained(path, dtype=args.dtype)
    return load_adapters(base, adapters), next(iter(adapters)), path


def _eval_help() -> str:
    from .frontends.integrations.lm_eval_args import MODEL_TYPE, describe_engine_args

    return (
        "usage: hf-contbatch eval [lm_eval run options]\n\n"
        f"lm-eval's command line with the {MODEL_TYPE} model type registered. --model defaults to\n"
        f"{MODEL_TYPE}: lm-eval's hf model with every request of every task in the engine at once.\n"
        "--model_args takes the hf model's arguments (pretrained=..., dtype=..., trust_remote_code=...;\n"
        "without pretrained=, the embedded model) and these engine settings (name=default):\n"
        f"{describe_engine_args()}\n"
        "example: hf-contbatch eval --model_args pretrained=HuggingFaceTB/SmolLM2-135M,max_num_seqs=64 "
        "--tasks hellaswag\n"
    )


def cmd_eval(args: argparse.Namespace) -> int:
    """``lm_eval``'s own command line with the ``hf-contbatch`` model type registered (the stock
    ``lm_eval`` command cannot see a plugin model). ``--model`` defaults to ``hf-contbatch``."""
    rest = list(args.lm_eval_args)
    if rest and rest[0] == "--":
        rest = rest[1:]
    wants_help = "-h" in rest or "--help" in rest
    if wants_help:
        print(_eval_help() + "\nlm-eval's own options follow.\n", flush=True)
    try:
        import lm_eval.__main__ as lm_eval_main
    except ImportError:
        raise UsageError('hf-contbatch eval needs lm-eval: pip install "hf_contbatch[eval]"') from None
    from .frontends.integrations.lm_eval_args import MODEL_TYPE

    if not wants_help:
        from .frontends.integrations import lm_eval as _plugin  # noqa: F401  (registers the model type)
    is_run = not rest or rest[0] not in ("ls", "validate")
    if is_run and not any(a == "--model" or a.startswith("--model=") for a in rest) and not wants_help:
        rest = ["--model", MODEL_TYPE] + rest
    if is_run and (not rest or rest[0] != "run"):
        rest = ["run"] + rest
    saved = sys.argv
    sys.argv = ["hf-contbatch eval"] + rest
    try:
        lm_eval_main.cli_evaluate()
    finally:
        sys.argv = saved
    return 0


# --- the parser: one function per group of generate's options ---------------------------------------
def add_input_output_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("input and output")
    g.add_argument(
        "--model",
        default=None,
        help="a local model directory or a Hugging Face Hub id (name or namespace/name) (default: the "
        "embedded 4M-parameter model, offline)",
    )
    g.add_argument(
        "--input",
        default=None,
        metavar="FILE",
        help='prompts: .txt (one per line); .jsonl (per line a string, {"prompt": "..."} or '
        '{"messages": [{"role": "user", "content": "..."}]}, with an optional "id" or "custom_id" kept in '
        'the output, "response_format" and "adapter"; a dataset\'s other keys are ignored); an OpenAI '
        "batch request file (.jsonl of {custom_id, method, url, body} for /v1/chat/completions or "
        "/v1/completions; the body's max_tokens, temperature, top_p, stop, n, seed and response_format "
        "apply to its row); or .parquet/.csv through datasets (see --input-column) (default: eight "
        "built-in prompts)",
    )
    g.add_argument(
        "--input-column",
        default="prompt",
        metavar="NAME",
        help="the prompt column of a .parquet/.csv --input (text or a chat); an id or custom_id column is kept",
    )
    g.add_argument(
        "--output",
        default=None,
        metavar="FILE",
        help='write one JSON record per row to this .jsonl as each row finishes, {"index": ..., "id": ..., '
        '"prompt": ..., "generated_text": ...}, or {"index": ..., "id": ..., "error": ...} for a row that '
        "failed (OpenAI batch output records for an OpenAI batch input); the file is put in input order "
        "when every row has its record (default: print the texts to stdout)",
    )
    g.add_argument(
        "--resume",
        action="store_true",
        help="finish the interrupted job whose --output this is: keep its records (a torn last line is "
        "cut), skip their rows, run the others",
    )
    g.add_argument(
        "--quiet", action="store_true", help="no progress bars and no texts on stdout; the summary still goes to stderr"
    )


def add_generation_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group(
        "generation",
        "Greedy decoding unless --do-sample is given; --temperature, --top-p and --top-k apply only with\n"
        "--do-sample (without it they are ignored, with a warning).",
    )
    g.add_argument("--max-new-tokens", type=int_at_least(1), default=64, metavar="N", help="most tokens per prompt")
    g.add_argument("--do-sample", action="store_true", help="sample instead of decoding greedily")
    g.add_argument(
        "--temperature",
        type=float_in(0.0, None, low_open=True),
        default=None,
        metavar="T",
        help=f"sampling temperature, > 0 (default: {DEFAULT_TEMPERATURE} with --do-sample)",
    )
    g.add_argument(
        "--top-p",
        type=float_in(0.0, 1.0, low_open=True),
        default=None,
        metavar="P",
        help=f"nucleus sampling: keep the most likely tokens up to probability P, in (0, 1] (default: "
        f"{DEFAULT_TOP_P}, i.e. off, with --do-sample)",
    )
    g.add_argument(
        "--top-k",
        type=int_at_least(0),
        default=None,
        metavar="K",
        help="sample among the K most likely tokens, 0 for all (default: the model's generation_config, "
        "else transformers' 50)",
    )
    g.add_argument("--seed", type=int, default=0, help="the engine's sampling seed")
    g.add_argument(
        "--response-format",
        default=None,
        metavar="FILE.json",
        help="constrain every output to this response_format ({'type': 'json_schema', ...} or a bare JSON "
        "schema); a .jsonl line's own 'response_format' overrides it (needs hf_contbatch[structured]) "
        "(default: unconstrained)",
    )
    g.add_argument(
        "--stop",
        action="append",
        type=non_empty_text,
        default=None,
        metavar="TEXT",
        help="stop a prompt's generation at this text, which is kept in the output (repeatable; default: none)",
    )


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("model and engine")
    g.add_argument("--dtype", default="float32", choices=DTYPES, help="the weights' dtype (auto: the checkpoint's)")
    g.add_argument(
        "--block-size", type=int_at_least(1), default=CacheConfig.block_size, metavar="N", help="tokens per KV block"
    )
    g.add_argument(
        "--num-blocks",
        type=int_at_least(1),
        default=None,
        metavar="N",
        help="KV blocks in the pool (default: see --cache-gib)",
    )
    g.add_argument(
        "--cache-gib",
        type=float_in(0.0, None, low_open=True),
        default=None,
        metavar="GIB",
        help="KV pool size on CPU when --num-blocks is not given (default: --max-num-seqs requests at "
        "the model's full context, at most 1 GiB)",
    )
    g.add_argument(
        "--kv-cache-dtype",
        default="auto",
        choices=("auto", *(d for d in KV_CACHE_DTYPES if d)),
        help="the KV cache's dtype (auto: the weights'; int8: one float32 scale per token and KV head, "
        "about a quarter of float32's bytes, a small accuracy cost)",
    )
    g.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=CacheConfig.enable_prefix_caching,
        help="reuse the KV blocks of repeated prompt prefixes (as vLLM; --no-enable-prefix-caching "
        "recomputes every prompt)",
    )
    g.add_argument(
        "--max-num-seqs",
        type=int_at_least(1),
        default=SchedulerConfig.max_num_seqs,
        metavar="N",
        help="most requests running at once",
    )
    g.add_argument(
        "--max-num-batched-tokens",
        type=int_at_least(1),
        default=SchedulerConfig.max_num_batched_tokens,
        metavar="N",
        help="token budget of one step (longer prompts are prefilled in chunks)",
    )
    g.add_argument(
        "--preemption-mode",
        default=SchedulerConfig.preemption_mode,
        choices=list(PREEMPTION_MODES),
        help="when the pool is full: free a request's blocks and recompute it later, swap them to a host "
        "pool, or choose by cost (auto)",
    )
    g.add_argument(
        "--attention-backend",
        default=EngineConfig.attention_backend,
        choices=list(ATTENTION_BACKENDS),
        help="paged attention kernels (auto: Triton on CUDA where they serve the model, else torch; on CPU "
        "torch with a C decode kernel)",
    )
    g.add_argument(
        "--threads", type=int_at_least(1), default=None, metavar="N", help="torch threads (default: torch's choice)"
    )
    g.add_argument(
        "--quantization",
        default=None,
        choices=list(QUANTIZATIONS),
        help="serve the linears with int8 weights (per output channel, absmax/127): int8 keeps the "
        "activations in the model's dtype, w8a8 quantizes them to int8 per row too "
        "(EngineConfig.quantization) (default: the weights as loaded)",
    )
    g.add_argument(
        "--check-quality",
        action="store_true",
        help="after generating, print what int8 costs on this model: the perplexity of a held-out text "
        "(the embedded model's README) and greedy agreement, float weights against int8 weights, and through "
        "the engine a float KV cache against an int8 one",
    )
    g.add_argument(
        "--compile",
        action="store_true",
        help="compile the model forward with torch.compile (faster steps after tens of seconds of compiling; "
        "EngineConfig.compile_model)",
    )
    g.add_argument(
        "--adapter",
        action="append",
        default=None,
        metavar="NAME=PATH",
        help="a PEFT LoRA adapter over --model: NAME=PATH (a folder or Hub id), or the PATH of an adapter "
        'folder, named by its last component (repeatable); a .jsonl prompt picks one with "adapter", '
        'else the first is used ("__base__": the base model) (default: none, the model as it is)',
    )


def add_generate_parser(sub) -> argparse.ArgumentParser:
    g = sub.add_parser(
        "generate",
        help="generate for a file of prompts with continuous batching",
        description=GENERATE_DESCRIPTION,
        formatter_class=_HelpFormatter,
    )
    add_input_output_arguments(g)
    add_generation_arguments(g)
    add_engine_arguments(g)
    g.add_argument("--debug", action="store_true", help="show an error's traceback (also HF_CONTBATCH_DEBUG=1)")
    g.set_defaults(func=cmd_generate)
    return g


def add_eval_parser(sub) -> argparse.ArgumentParser:
    # Every argument goes to lm-eval as it is (no option of ours: "\0" is never a prefix).
    e = sub.add_parser(
        "eval",
        add_help=False,
        prefix_chars="\0",
        help="lm-eval's command line with the hf-contbatch model type as --model's default",
    )
    e.add_argument("lm_eval_args", nargs=argparse.REMAINDER)
    e.set_defaults(func=cmd_eval)
    return e


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="hf-contbatch", description=DESCRIPTION, formatter_class=_HelpFormatter)
    parser.add_argument("--version", action="version", version=f"hf-contbatch {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND", title="commands")
    add_generate_parser(sub)
    add_eval_parser(sub)
    parser.command_parsers = sub.choices  # for errors about a command's arguments
    return parser


def _quiet_quantizer_imports() -> None:
    """Keep optional libraries' known harmless import-time notices (``frontends.quiet_imports``) off
    the command's stderr, so an error stays one line."""
    from .frontends.quiet_imports import quiet_known_import_notices

    quiet_known_import_notices()


def _debug(args: argparse.Namespace) -> bool:
    return bool(getattr(args, "debug", False)) or os.environ.get("HF_CONTBATCH_DEBUG", "0") not in ("", "0")


def main(argv=None) -> int:
    """Run the command; returns its exit status (0), or exits with 2 after a one-line user error."""
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:  # said by the command's parser, whose --help lists its options
        command_parser = parser.command_parsers[args.command]
        hint = option_suggestions(unknown, command_parser._option_string_actions)
        command_parser.error(f"unrecognized arguments: {' '.join(unknown)}{hint}")
    try:
        return args.func(args)
    except (UsageError, ValueError, ImportError) as exc:  # the library's own checks; a missing extra
        if _debug(args):
            raise
        message = " ".join(line.strip() for line in str(exc).splitlines() if line.strip())
        parser.exit(2, f"hf-contbatch: error: {message}\n")


if __name__ == "__main__":
    sys.exit(main())
