"""LoRA adapters from the command line: ``NAME=PATH`` arguments and the ``peft.PeftModel`` they make
(``hf-contbatch generate --adapter``; a .jsonl row names its own with "adapter": ``job_inputs``)."""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

from .cli_checks import looks_local


def parse_adapter_args(values: Sequence[str]) -> dict[str, str]:
    """``["sql=path/a", "chat=path/b"]`` as ``{"sql": "path/a", "chat": "path/b"}`` (insertion order).
    A value without ``=`` that is an existing directory is named by its last component
    (``path/to/sql`` -> ``sql``). Standard library only: ``generate`` checks these before torch loads.

    Raises:
        ValueError: an entry without ``=`` that is not an existing directory (``--adapter sql``: a
            name with no path), an empty name or path, a local path that does not exist or has no
            ``adapter_config.json``, a repeated name, or the reserved name "__base__".
    """
    adapters: dict[str, str] = {}
    for value in values:
        name, sep, path = value.partition("=")
        if not sep and value and Path(value).expanduser().is_dir():
            name, path = Path(value).expanduser().resolve().name, value  # "peft/sql" -> "sql"
        elif not sep or not name or not path:
            raise ValueError(
                f"--adapter {value}: must be NAME=PATH (a name, '=', a PEFT adapter folder or Hub id) or the "
                "path of an existing adapter folder"
            )
        # A Hub id (name or namespace/name) is PEFT's to resolve; a local path must be an adapter folder.
        folder = Path(path).expanduser()
        if folder.exists() and not (folder / "adapter_config.json").is_file():
            raise ValueError(f"--adapter {value}: {path} has no adapter_config.json (not a PEFT adapter folder)")
        if not folder.exists() and looks_local(path):
            raise ValueError(f"--adapter {value}: no such directory {path}")
        if name == "__base__":
            raise ValueError("--adapter: '__base__' names the base model; choose another adapter name")
        if name in adapters:
            raise ValueError(f"--adapter: the name {name!r} is given twice")
        adapters[name] = path
    return adapters


def load_adapters(model, adapters: dict[str, str]):
    """``model`` with every adapter of ``adapters`` (name -> PEFT adapter folder or Hub id) loaded
    under its name, as a ``peft.PeftModel`` in eval mode; the first one is active (PEFT's default).

    Raises:
        ValueError: ``adapters`` is empty. PEFT's own errors (a missing folder) propagate.
        ImportError: peft is not installed (``pip install "hf_contbatch[lora]"``).
    """
    if not adapters:
        raise ValueError("no adapters given")
    try:
        from peft import PeftModel
    except ImportError as exc:
        raise ImportError('LoRA adapters need peft: pip install "hf_contbatch[lora]"') from exc
    items = list(adapters.items())
    name, path = items[0]
    peft_model = PeftModel.from_pretrained(model, path, adapter_name=name)
    for name, path in items[1:]:
        peft_model.load_adapter(path, adapter_name=name)
    return peft_model.eval()
