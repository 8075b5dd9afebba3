"""``hf-contbatch`` command line: ``generate`` (the main job) and ``eval`` (lm-eval with our model type)."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from .config import ATTENTION_BACKENDS, PREEMPTION_MODES  # light: no torch import


def _read_prompts(path: str) -> list:
    """Prompts from a .txt file (one per line) or a .jsonl file (objects with "prompt" or
    "messages", or bare strings)."""
    p = Path(path)
    if not p.exists():
        raise SystemExit(f"--input: file not found: {path}")
    if p.suffix == ".jsonl":
        prompts = []
        for n, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as exc:
                raise SystemExit(f"--input {path} line {n}: not valid JSON ({exc})") from None
            if isinstance(obj, str):
                prompts.append(obj)
            elif isinstance(obj, dict) and "prompt" in obj:
                prompts.append(obj["prompt"])
            elif isinstance(obj, dict) and "messages" in obj:
                prompts.append(obj["messages"])
            else:
                raise SystemExit(f"--input line {n}: expected a string or an object with 'prompt' or 'messages'")
        if not prompts:
            raise SystemExit(f"--input {path}: no prompts in the file")
        return prompts
    if p.suffix == ".txt":
        prompts = [line for line in p.read_text(encoding="utf-8").splitlines() if line.strip()]
        if not prompts:
            raise SystemExit(f"--input {path}: no prompts in the file")
        return prompts
    raise SystemExit(f"--input must be a .jsonl or .txt file, got {path}")


def _as_response_format(obj, where: str) -> dict:
    """A response_format object (OpenAI's shape), or a bare JSON schema wrapped as one."""
    if not isinstance(obj, dict):
        raise SystemExit(f"{where}: a response_format must be a JSON object, got {type(obj).__name__}")
    if obj.get("type") in ("json_schema", "json_object", "text"):
        return obj
    return {"type": "json_schema", "json_schema": {"name": "schema", "schema": obj}}


def _read_response_formats(args: argparse.Namespace, num_prompts: int):
    """One response_format per prompt (None: unconstrained), or None when nothing asks for one:
    ``--response-format FILE.json`` for every prompt, overridden by a ``.jsonl`` line's own
    ``"response_format"``. A file or line may hold a response_format object or a bare JSON schema."""
    default = None
    if args.response_format:
        path = Path(args.response_format)
        if not path.exists():
            raise SystemExit(f"--response-format: file not found: {path}")
        try:
            default = _as_response_format(json.loads(path.read_text(encoding="utf-8")), "--response-format")
        except json.JSONDecodeError as exc:
            raise SystemExit(f"--response-format {path}: not valid JSON ({exc})") from None
    formats = [default] * num_prompts
    if args.input and Path(args.input).suffix == ".jsonl":
        lines = [line for line in Path(args.input).read_text(encoding="utf-8").splitlines() if line.strip()]
        for i, line in enumerate(lines):
            obj = json.loads(line)
            if isinstance(obj, dict) and obj.get("response_format") is not None:
                formats[i] = _as_response_format(obj["response_format"], f"--input line {i + 1}")
    return formats if any(f is not None for f in formats) else None


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


def cmd_generate(args: argparse.Namespace) -> int:
    import torch

    from . import CacheConfig, EngineConfig, SchedulerConfig
    from .frontends.pipeline import pipeline

    if args.threads:
        torch.set_num_threads(args.threads)
    if args.max_new_tokens < 1:
        raise SystemExit(f"--max-new-tokens must be an int >= 1, got {args.max_new_tokens}")
    prompts = _read_prompts(args.input) if args.input else _default_prompts()  # fail before loading the model
    response_formats = _read_response_formats(args, len(prompts))
    cache = CacheConfig(block_size=args.block_size, num_blocks=args.num_blocks, cpu_cache_gib=args.cache_gib)
    sched = SchedulerConfig(
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        preemption_mode=args.preemption_mode,
    )
    t_load = time.monotonic()
    pipe = pipeline(
        "text-generation",
        model=args.model,
        dtype=args.dtype,
        engine_config=EngineConfig(
            cache=cache,
            scheduler=sched,
            attention_backend=args.attention_backend,
            seed=args.seed,
            compile_model=True if args.compile else None,
        ),
    )
    load_s = time.monotonic() - t_load
    gen_kwargs = {"max_new_tokens": args.max_new_tokens, "do_sample": args.do_sample, "return_full_text": False}
    if args.do_sample:
        gen_kwargs.update(temperature=args.temperature, top_p=args.top_p)
    if args.stop:
        gen_kwargs["stop_strings"] = args.stop
    if response_formats is not None:
        gen_kwargs["response_format"] = response_formats
    with pipe:
        results = pipe(prompts, progress_bar=not args.quiet, **gen_kwargs)
        call = pipe.last_call_stats
        stats = pipe.stats()
    out_f = open(args.output, "w", encoding="utf-8") if args.output else None
    try:
        for prompt, recs in zip(prompts, results):
            row = {"prompt": prompt, "generated_text": recs[0]["generated_text"]}
            if out_f:
                out_f.write(json.dumps(row, ensure_ascii=False) + "\n")
            elif not args.quiet:
                print(f"--- {prompt!r}\n{recs[0]['generated_text']}\n")
    finally:
        if out_f:
            out_f.close()
    summary = {
        "model": args.model or "embedded default (hf_contbatch/default_model)",
        "requests": call["num_requests"],
        "generated_tokens": call["generated_tokens"],
        "seconds": round(call["seconds"], 3),
        "throughput_tokens_per_s": round(call["tokens_per_s"], 1),
        "preemptions": stats.num_preemptions,
        "peak_used_blocks": stats.peak_used_blocks,
        "num_blocks": stats.num_blocks,
        "block_size": stats.block_size,
        "load_seconds": round(load_s, 2),
    }
    print(
        f"{summary['requests']} requests, {summary['generated_tokens']} generated tokens in {summary['seconds']} s: "
        f"{summary['throughput_tokens_per_s']} tok/s; preemptions {summary['preemptions']}; "
        f"peak blocks {summary['peak_used_blocks']}/{summary['num_blocks']} (block size {summary['block_size']})",
        file=sys.stderr,
    )
    if args.output:
        print(f"wrote {args.output}", file=sys.stderr)
    return 0


def cmd_eval(args: argparse.Namespace) -> int:
    """``lm_eval``'s own command line with the ``hf-contbatch`` model type registered (the stock
    ``lm_eval`` command cannot see a plugin model). ``--model`` defaults to ``hf-contbatch``."""
    try:
        import lm_eval.__main__ as lm_eval_main
    except ImportError:
        raise SystemExit('hf-contbatch eval needs lm-eval: pip install "hf_contbatch[eval]"') from None
    from .frontends.integrations import lm_eval as _plugin  # noqa: F401  (registers the model type)

    rest = list(args.lm_eval_args)
    if rest and rest[0] == "--":
        rest = rest[1:]
    is_run = not rest or rest[0] not in ("ls", "validate")
    if (
        is_run
        and not any(a == "--model" or a.startswith("--model=") for a in rest)
        and "-h" not in rest
        and "--help" not in rest
    ):
        rest = ["--model", _plugin.MODEL_TYPE] + rest
    if is_run and (not rest or rest[0] != "run"):
        rest = ["run"] + rest
    saved = sys.argv
    sys.argv = ["hf-contbatch eval"] + rest
    try:
        lm_eval_main.cli_evaluate()
    finally:
        sys.argv = saved
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hf-contbatch", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="generate for a file of prompts with continuous batching")
    g.add_argument("--model", default=None, help="Hub id or local path (default: the embedded model)")
    g.add_argument("--input", default=None, help="prompts.jsonl or prompts.txt (default: a few built-in prompts)")
    g.add_argument("--output", default=None, help="out.jsonl (default: print to stdout)")
    g.add_argument("--max-new-tokens", type=int, default=64)
    g.add_argument("--do-sample", action="store_true")
    g.add_argument("--temperature", type=float, default=0.7)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--dtype", default="float32", help="float32, bfloat16, float16 or auto")
    g.add_argument("--block-size", type=int, default=16)
    g.add_argument("--num-blocks", type=int, default=None)
    g.add_argument(
        "--cache-gib",
        type=float,
        default=None,
        help="KV pool size on CPU when --num-blocks is not given (default: --max-num-seqs requests at "
        "the model's full context, at most 1 GiB)",
    )
    g.add_argument("--max-num-seqs", type=int, default=128)
    g.add_argument("--max-num-batched-tokens", type=int, default=1024)
    g.add_argument("--preemption-mode", default="recompute", choices=list(PREEMPTION_MODES))
    g.add_argument("--attention-backend", default="auto", choices=list(ATTENTION_BACKENDS))
    g.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    g.add_argument(
        "--compile",
        action="store_true",
        help="compile the model forward with torch.compile (faster steps after tens of seconds of compiling; "
        "EngineConfig.compile_model)",
    )
    g.add_argument(
        "--response-format",
        default=None,
        metavar="FILE.json",
        help="constrain every output to this response_format ({'type': 'json_schema', ...} or a bare JSON "
        "schema); a .jsonl line's own 'response_format' overrides it (needs hf_contbatch[structured])",
    )
    g.add_argument("--quiet", action="store_true")
    g.set_defaults(func=cmd_generate)
    e = sub.add_parser(
        "eval",
        add_help=False,
        prefix_chars="\0",
        help="lm-eval with the hf-contbatch model type (arguments as for lm_eval; --model defaults to hf-contbatch)",
    )
    e.add_argument("lm_eval_args", nargs=argparse.REMAINDER)
    e.set_defaults(func=cmd_eval)
    return parser


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, ImportError) as exc:
        parser.exit(2, f"hf-contbatch: error: {exc}\n")


if __name__ == "__main__":
    sys.exit(main())
