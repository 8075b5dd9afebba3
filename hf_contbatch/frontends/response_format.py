"""A call's ``response_format=`` (OpenAI's and ``transformers serve``'s spelling) and
``structured_outputs=`` (vLLM's fields) as one ``StructuredOutputsParams`` per prompt.

``response_format``: ``{"type": "json_schema", "json_schema": {"name": ..., "schema": {...}}}``,
``{"type": "json_object"}``, ``{"type": "text"}`` (unconstrained), or a pydantic model class.
``structured_outputs``: ``{"json": schema}``, ``{"regex": pattern}``, ``{"choice": [strings]}``,
``{"grammar": ebnf}``, ``{"json_object": True}``, or a ``StructuredOutputsParams``. Either may be a
list with one entry per prompt (None: that prompt is unconstrained). The grammar itself is checked
by the engine when it builds the request (``engine.structured.GrammarSpec``).
"""

from __future__ import annotations

from typing import Optional

from ..engine.structured import as_structured_outputs_params
from ..request import StructuredOutputsParams

_RESPONSE_FORMAT_TYPES = ("json_schema", "json_object", "text")


def response_format_params(value) -> Optional[StructuredOutputsParams]:
    """One ``response_format`` value as ``StructuredOutputsParams`` (None for ``"text"`` or None).

    Raises:
        ValueError: not one of the accepted shapes; the message names the allowed ones.
    """
    if value is None:
        return None
    if isinstance(value, type) and hasattr(value, "model_json_schema"):  # a pydantic model class
        return StructuredOutputsParams(json=value.model_json_schema(), argument="response_format")
    if not isinstance(value, dict) or value.get("type") not in _RESPONSE_FORMAT_TYPES:
        raise ValueError(
            "`response_format` must be {'type': 'json_schema', 'json_schema': {'name': ..., 'schema': {...}}}, "
            f"{{'type': 'json_object'}}, {{'type': 'text'}} or a pydantic model class, got {value!r}"
        )
    kind = value["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True, argument="response_format")
    spec = value.get("json_schema")
    if not isinstance(spec, dict) or "schema" not in spec:
        raise ValueError(
            "`response_format` of type 'json_schema' needs 'json_schema': {'name': ..., 'schema': {...}}, "
            f"got {spec!r}"
        )
    return StructuredOutputsParams(json=spec["schema"], argument="response_format")


def structured_outputs_per_prompt(
    response_format, structured_outputs, num_prompts: int
) -> list[Optional[StructuredOutputsParams]]:
    """The call's constraint for each of its ``num_prompts`` prompts (None: unconstrained).

    Raises:
        ValueError: both arguments given, a list of the wrong length, or a malformed entry.
    """
    if response_format is not None and structured_outputs is not None:
        raise ValueError("give `response_format` or `structured_outputs`, not both")
    name, value = (
        ("response_format", response_format)
        if response_format is not None
        else ("structured_outputs", structured_outputs)
    )
    convert = response_format_params if name == "response_format" else _structured_outputs_params
    if isinstance(value, (list, tuple)):
        if len(value) != num_prompts:
            raise ValueError(
                f"`{name}` has {len(value)} entries for {num_prompts} prompts; give one value or one per prompt"
            )
        return [convert(v) for v in value]
    return [convert(value)] * num_prompts


def _structured_outputs_params(value) -> Optional[StructuredOutputsParams]:
    return None if value is None else as_structured_outputs_params(value)
