"""What ``hf-contbatch generate`` checks before it loads torch or a model: the prompts file's lines
(``prompt_from_json``, used per row by ``job_inputs``), the output path, the model name or path, the engine settings, and the argparse types of its numbers.

Each problem raises :class:`UsageError` with one line that names the option (or the file and line),
what was found and what is allowed; the command prints it and exits with status 2. Standard library
only (the Hub check imports ``huggingface_hub``, which loads no torch).
"""

from __future__ import annotations

import argparse
import difflib
import json
from pathlib import Path
from typing import Iterable, Optional, Sequence

from ..config import CacheConfig, EngineConfig, SchedulerConfig


class UsageError(Exception):
    """A user error of the command line: printed as one line, exit status 2."""


# --- argparse types -----------------------------------------------------------------------------------
def int_at_least(low: int):
    """An argparse ``type``: an int >= ``low``."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be an int >= {low}, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be an int >= {low}, got {value}")
        return value

    return parse


def float_in(low: float, high: Optional[float], low_open: bool = False):
    """An argparse ``type``: a float in ``[low, high]`` (``(low, high]`` when ``low_open``; no upper
    bound when ``high`` is None)."""
    bounds = f"{'(' if low_open else '['}{low:g}, {'inf)' if high is None else f'{high:g}]'}"

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be a number in {bounds}, got {text!r}") from None
        if not (value > low if low_open else value >= low) or (high is not None and value > high):  # NaN fails too
            raise argparse.ArgumentTypeError(f"must be a number in {bounds}, got {text}")
        return value

    return parse


def non_empty_text(text: str) -> str:
    """An argparse ``type``: any text but the empty string (``--stop ''`` would stop at once)."""
    if not text:
        raise argparse.ArgumentTypeError("must be a non-empty text, got ''")
    return text


def option_suggestions(unknown: Sequence[str], options: Iterable[str]) -> str:
    """What to say after argparse's "unrecognized arguments" for the ``unknown`` command-line words:
    for each unknown option (a word starting with ``--``, ``=value`` ignored), its dashed spelling
    when that is one of ``options`` (``--max_new_tokens`` -> ``--max-new-tokens``), else the
    nearest of ``options`` (difflib), if any is near. Returns ``""`` when there is nothing to
    suggest, else ``"; did you mean --a?"`` or ``"; did you mean --a (for --x), --b (for --y)?"``."""
    options = [o for o in options if o.startswith("--")]
    pairs = []
    for word in unknown:
        if not word.startswith("--") or word == "--":
            continue  # a value, or a lone "--"
        name = word.split("=", 1)[0]
        dashed = "--" + name[2:].replace("_", "-")
        if dashed in options:
            pairs.append((name, dashed))
            continue
        close = difflib.get_close_matches(dashed, options, n=1, cutoff=0.75)
        if close:
            pairs.append((name, close[0]))
    if not pairs:
        return ""
    if len(pairs) == 1:
        return f"; did you mean {pairs[0][1]}?"
    return "; did you mean " + ", ".join(f"{right} (for {wrong})" for wrong, right in pairs) + "?"


# --- the prompts file ---------------------------------------------------------------------------------
def _json_kind(value) -> str:
    """What a JSON value is, in JSON's words."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "null"
    if isinstance(value, (int, float)):
        return f"the number {value}"
    return {str: "a string", list: "an array", dict: "an object"}.get(type(value), type(value).__name__)


def _checked_messages(messages, where: str) -> list:
    """``messages`` if it is a chat: a non-empty array of objects with a string "role" and a
    "content" (a string, or an array of content parts)."""
    if not isinstance(messages, list) or not messages:
        found = "an empty array" if messages == [] else _json_kind(messages)
        raise UsageError(
            f'{where}: \'messages\' must be an array of {{"role": ..., "content": ...}} objects, found {found}'
        )
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise UsageError(
                f"{where}: messages[{i}] must be an object with 'role' and 'content', found {_json_kind(message)}"
            )
        for key in ("role", "content"):
            if key not in message:
                keys = ", ".join(repr(k) for k in message) or "none"
                raise UsageError(f"{where}: messages[{i}] has no '{key}' (its keys: {keys})")
        if not isinstance(message["role"], str):
            raise UsageError(f"{where}: messages[{i}]['role'] must be a string, found {_json_kind(message['role'])}")
        if not isinstance(message["content"], (str, list)):
            raise UsageError(
                f"{where}: messages[{i}]['content'] must be a string (or an array of content parts), "
                f"found {_json_kind(message['content'])}"
            )
    return messages


# The keys a .jsonl line's object may have: its prompt, and the per-line options read later. Other
# keys (an id, a reference answer: a dataset's own fields) are ignored, unless they set generation
# (those are the command's options, for every prompt: ignoring one would be silent) or are a typo of
# one of these.
LINE_KEYS = ("prompt", "messages", "response_format", "adapter")
# Generation settings a line might carry: transformers' names for this command's options and their
# neighbours, and the sampling fields of OpenAI-style batch files (vLLM's, OpenAI's).
LINE_GENERATION_KEYS = frozenset(
    (
        "max_new_tokens", "min_new_tokens", "max_length", "min_length", "do_sample", "temperature", "top_p",
        "top_k", "min_p", "typical_p", "repetition_penalty", "seed", "stop", "stop_strings",
        "num_return_sequences", "ignore_eos", "priority", "logprobs", "generation_config",
        "max_tokens", "max_completion_tokens", "min_tokens", "n", "best_of", "presence_penalty",
        "frequency_penalty", "logit_bias", "stream", "sampling_params",
    )
)  # fmt: skip


def _line_key_typo(key: str) -> Optional[str]:
    """The line key ``key`` is a near miss of (``"promt"``, ``"adapte"``, PEFT's ``"adapter_name"``),
    or None. Other names that extend one (``"prompt_id"``) are a dataset's own fields, not typos."""
    if key in ("adapter_name", "adapter_names"):
        return "adapter"
    close = difflib.get_close_matches(key, LINE_KEYS, n=1, cutoff=0.85)
    return close[0] if close else None


def prompt_from_json(obj, where: str):
    """The prompt of one ``.jsonl`` line: a string, ``{"prompt": str}`` or ``{"messages": [...]}``,
    with optional ``"response_format"`` and ``"adapter"`` (other keys are ignored, see ``LINE_KEYS``).
    ``where`` names the file and line in errors. Raises UsageError for any other shape, and for a key
    that names a generation setting or nearly names a line key."""
    if isinstance(obj, str):
        return obj
    if not isinstance(obj, dict):
        raise UsageError(
            f"{where}: found {_json_kind(obj)}; each line must be a string or an object with 'prompt' or 'messages'"
        )
    if "prompt" in obj and "messages" in obj:
        raise UsageError(f"{where}: found both 'prompt' and 'messages'; give one")
    if "prompt" in obj or "messages" in obj:  # without either, the message below says more
        for key in obj:
            close = None if key in LINE_KEYS else _line_key_typo(str(key))
            if close or key in LINE_GENERATION_KEYS:
                hint = f" (did you mean {close!r}?)" if close else ""
                raise UsageError(
                    f"{where}: unknown key {key!r}{hint}; a line's object takes 'prompt' or 'messages', and "
                    "optionally 'response_format' and 'adapter'; generation settings such as --max-new-tokens "
                    "are the command's options, for every prompt"
                )
    if "prompt" in obj:
        if not isinstance(obj["prompt"], str):
            raise UsageError(f"{where}: 'prompt' must be a string, found {_json_kind(obj['prompt'])}")
        return obj["prompt"]
    if "messages" in obj:
        return _checked_messages(obj["messages"], where)
    keys = ", ".join(repr(k) for k in obj)
    found = f"the keys {keys}" if len(obj) > 1 else f"the key {keys}" if obj else "an empty object"
    raise UsageError(
        f"{where}: found {found}; each line must be a string or an object with 'prompt' or 'messages' "
        "(an array of role/content objects)"
    )


# --- output, model, engine settings -------------------------------------------------------------------
def check_output(path: str) -> None:
    """``--output`` must name a file in an existing directory (checked before hours of generating)."""
    p = Path(path)
    if p.is_dir():
        raise UsageError(f"--output {path}: is a directory; give a file name such as {p / 'out.jsonl'}")
    if not p.parent.is_dir():
        raise UsageError(f"--output {path}: the directory {p.parent} does not exist")


def looks_local(name: str) -> bool:
    """A path rather than a Hub id (``name`` or ``namespace/name``)."""
    return name.startswith((".", "/", "~")) or "\\" in name or name.count("/") > 1 or name.endswith("/")


def check_model(name: str) -> str:
    """``--model`` must be a model directory (with a ``config.json``) or a Hub id that resolves: in
    the Hugging Face cache or on the Hub (``HF_HUB_OFFLINE=1`` allows the cache only). Returns what
    to load: the directory (``~`` expanded) or the Hub id."""
    path = Path(name).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise UsageError(f"--model {name}: the directory has no config.json (not a transformers model directory)")
        return str(path)
    if path.exists():
        raise UsageError(f"--model {name}: is a file; give the model's directory (with config.json) or a Hub id")
    if looks_local(name):
        raise UsageError(f"--model {name}: no such directory")
    _check_hub_model(name)
    return name


HUB_PROBE_SECONDS = 3.0
"""How long the one request that asks whether the Hub answers may take."""


def hub_unreachable(timeout: float = HUB_PROBE_SECONDS) -> Optional[str]:
    """One short request to the Hub endpoint (``HF_ENDPOINT``), no retries: None when anything
    answers (any HTTP status), else why not (the connection error's text). ``huggingface_hub``'s own
    downloads retry a refused or timed-out connection five times with back-off (about 25 s)."""
    from huggingface_hub import constants
    from huggingface_hub.utils import get_session

    try:
        get_session().head(constants.ENDPOINT, timeout=timeout)
    except Exception as exc:  # refused, DNS failure, timeout, proxy error: all mean "not reachable"
        return str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    return None


def _go_offline() -> None:
    """Make this process load from the Hugging Face cache only (as ``HF_HUB_OFFLINE=1`` would)."""
    import os

    from huggingface_hub import constants

    os.environ["HF_HUB_OFFLINE"] = "1"
    constants.HF_HUB_OFFLINE = True


def _check_hub_model(repo_id: str) -> None:
    """``repo_id`` resolves: in the cache under ``HF_HUB_OFFLINE=1``; else after one short probe of
    the Hub (``hub_unreachable``). When the Hub does not answer and the cache has the model, this
    process goes offline (one line on stderr says so) so that loading does not retry either."""
    import sys

    import huggingface_hub
    from huggingface_hub import constants, errors

    where = f"--model {repo_id}: neither a local directory nor"
    if not constants.HF_HUB_OFFLINE:
        reason = hub_unreachable()
        if reason is not None:
            try:
                cached = huggingface_hub.try_to_load_from_cache(repo_id, "config.json")
            except errors.HFValidationError:
                raise UsageError(f"{where} a Hub id (name or namespace/name)") from None
            if not isinstance(cached, str):
                raise UsageError(
                    f"{where} reachable on the Hub: {constants.ENDPOINT} does not answer "
                    f"({reason}) and the Hugging Face cache has no copy (HF_HUB_OFFLINE=1 skips the Hub)"
                )
            print(
                f"hf-contbatch: {constants.ENDPOINT} does not answer ({reason}); "
                f"loading {repo_id} from the Hugging Face cache (as HF_HUB_OFFLINE=1)",
                file=sys.stderr,
            )
            _go_offline()
    try:
        huggingface_hub.hf_hub_download(repo_id, "config.json")
    except errors.HFValidationError:
        raise UsageError(f"{where} a Hub id (name or namespace/name)") from None
    except errors.LocalEntryNotFoundError:  # before EntryNotFoundError, its base class
        why = (
            "offline (HF_HUB_OFFLINE=1) and not in the Hugging Face cache"
            if constants.HF_HUB_OFFLINE
            else "the Hub cannot be reached and the Hugging Face cache has no copy"
        )
        raise UsageError(f"{where} reachable on the Hub: {why}") from None
    except errors.GatedRepoError:  # before RepositoryNotFoundError, its base class
        raise UsageError(
            f"--model {repo_id}: a gated model; accept its terms on the Hub and log in (hf auth login)"
        ) from None
    except errors.RepositoryNotFoundError:
        raise UsageError(f"{where} a model on the Hub (a private one needs hf auth login)") from None
    except errors.EntryNotFoundError:
        raise UsageError(
            f"--model {repo_id}: the Hub repository has no config.json (not a transformers model)"
        ) from None


# The configs name their fields; the command line's options are spelled differently.
_OPTION_OF_FIELD = {
    "block_size": "--block-size",
    "num_blocks": "--num-blocks",
    "cpu_cache_gib": "--cache-gib",
    "max_num_seqs": "--max-num-seqs",
    "max_num_batched_tokens": "--max-num-batched-tokens",
    "preemption_mode": "--preemption-mode",
    "attention_backend": "--attention-backend",
    "seed": "--seed",
    "quantization": "--quantization",
}


def engine_config(args: argparse.Namespace) -> EngineConfig:
    """The ``EngineConfig`` of ``generate``'s options; a value the configs reject raises UsageError
    naming the option."""
    try:
        return EngineConfig(
            cache=CacheConfig(
                block_size=args.block_size,
                num_blocks=args.num_blocks,
                cpu_cache_gib=args.cache_gib,
                enable_prefix_caching=args.enable_prefix_caching,
                dtype=None if getattr(args, "kv_cache_dtype", "auto") == "auto" else args.kv_cache_dtype,
            ),
            scheduler=SchedulerConfig(
                max_num_seqs=args.max_num_seqs,
                max_num_batched_tokens=args.max_num_batched_tokens,
                preemption_mode=args.preemption_mode,
            ),
            attention_backend=args.attention_backend,
            seed=args.seed,
            compile_model=True if args.compile else None,
            quantization=getattr(args, "quantization", None),
        )
    except ValueError as exc:
        message = str(exc)
        for field, option in _OPTION_OF_FIELD.items():
            message = message.replace(f"`{field}`", option)
        raise UsageError(message) from None


def as_response_format(obj, where: str) -> dict:
    """A response_format object (OpenAI's shape), or a bare JSON schema wrapped as one, checked as
    the engine will check it (its schema parsed by the grammar library), so that an error names
    ``where`` (the file, and the line of a ``.jsonl``) before the model loads."""
    if not isinstance(obj, dict):
        raise UsageError(f"{where}: a response_format must be a JSON object, found {_json_kind(obj)}")
    if obj.get("type") not in ("json_schema", "json_object", "text"):
        obj = {"type": "json_schema", "json_schema": {"name": "schema", "schema": obj}}
    # Imported here: `hf-contbatch --help` must not import torch.
    from ..engine.structured.specs import GrammarSpec
    from .response_format import response_format_params

    try:
        params = response_format_params(obj)
        if params is not None:
            GrammarSpec.parse(params)
    except ValueError as exc:
        raise UsageError(f"{where}: {exc}") from None
    return obj


def read_response_format(path: str) -> dict:
    """The ``--response-format FILE.json`` for every row (a response_format object or a bare JSON
    schema), checked as the engine will check it. Raises UsageError naming the file."""
    p = Path(path)
    if not p.is_file():
        raise UsageError(f"--response-format {p}: no such file")
    try:
        return as_response_format(json.loads(p.read_text(encoding="utf-8")), f"--response-format {p}")
    except json.JSONDecodeError as exc:
        raise UsageError(f"--response-format {p}: not valid JSON ({exc})") from None


def check_library(module: str, option: str, extra: str) -> None:
    """Raise ``UsageError`` when ``option`` needs the optional library ``module`` and it is not
    installed, before anything loads (found by name only: nothing is imported)."""
    import importlib.util

    if importlib.util.find_spec(module) is None:
        raise UsageError(f'{option} needs the library {module}: pip install "hf_contbatch[{extra}]"')
