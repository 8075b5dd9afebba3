"""LoRA adapters from the command line: ``NAME=PATH`` arguments and the ``peft.PeftModel`` they make
(``hf-contbatch generate --adapter``; a .jsonl row names its own with "adapter": ``job_inputs``)."""

from __future__ import annotations

from typing import Sequence


def parse_adapter_args(values: Sequence[str]) -> dict[str, str]:
    """``["sql=path/a", "chat=path/b"]`` as ``{"sql": "path/a", "chat": "path/b"}`` (insertion order).

    Raises:
        ValueError: an entry without ``=``, an empty name or path, a repeated name, or the reserved
            name "__base__".
    """
    adapters: dict[str, str] = {}
    for value in values:
        name, sep, path = value.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"--adapter must be NAME=PATH (a name, '=', a PEFT adapter folder), got {value!r}")
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
