"""Text in and out of the pipeline, as ``transformers.TextGenerationPipeline`` does it: prompts
(strings or chats) to token ids, and generated ids to output records."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

from transformers import GenerationConfig

Chat = list  # a list of {"role": ..., "content": ...} dicts

TextInput = Union[str, Chat]


def is_chat(x) -> bool:
    """True for a non-empty list/tuple of dicts that all have a "role"."""
    return isinstance(x, (list, tuple)) and len(x) > 0 and all(isinstance(m, dict) and "role" in m for m in x)


def tokenize_prompt(tokenizer, prompt: TextInput, pre: dict) -> list[int]:
    """Token ids of ``prompt`` (a string, with the pipeline ``prefix``; or a chat, through the chat
    template) with the set preprocessing arguments ``pre``.

    Raises:
        ValueError: ``prompt`` is neither a string nor a chat.
    """
    # As TextGenerationPipeline.preprocess: only the set tokenizer arguments, then tokenizer_encode_kwargs.
    extra = {k: pre[k] for k in ("add_special_tokens", "truncation", "padding", "max_length") if pre.get(k) is not None}
    extra.update(pre.get("tokenizer_encode_kwargs") or {})
    if isinstance(prompt, str):
        return list(tokenizer(pre.get("prefix", "") + prompt, **extra)["input_ids"])
    if is_chat(prompt):
        extra.pop("add_special_tokens", None)
        cont = pre.get("continue_final_message")
        if cont is None:
            cont = prompt[-1]["role"] == "assistant"
        enc = tokenizer.apply_chat_template(
            list(prompt),
            add_generation_prompt=not cont,
            continue_final_message=cont,
            return_dict=True,
            tools=pre.get("tools"),
            documents=pre.get("documents"),
            **extra,
        )
        ids = enc["input_ids"]
        return list(ids[0]) if ids and isinstance(ids[0], list) else list(ids)
    raise ValueError(
        "each input must be a string or a chat (a list of {'role': ..., 'content': ...} dicts), "
        f"got {type(prompt).__name__}"
    )


def truncate_for_hole(tokenizer, ids: list[int], cfg: GenerationConfig) -> list[int]:
    """``handle_long_generation="hole"``: drop prompt tokens from the left so the prompt plus the
    new tokens fit ``tokenizer.model_max_length`` (as transformers does)."""
    new_tokens = cfg.max_new_tokens if cfg.max_new_tokens is not None else cfg.max_length - len(ids)
    if new_tokens < 0:
        raise ValueError("We cannot infer how many new tokens are expected")
    limit = tokenizer.model_max_length
    if len(ids) + new_tokens > limit:
        keep = limit - new_tokens
        if keep <= 0:
            raise ValueError(
                "We cannot use `hole` to handle this generation the number of desired tokens exceeds the models max length"
            )
        ids = ids[-keep:]
    return ids


def prefix_length(tokenizer, pre: dict) -> int:
    """Tokens transformers counts for ``prefix`` (tokenized without special tokens unless asked)."""
    prefix = pre.get("prefix")
    if not prefix:
        return 0
    return len(tokenizer(prefix, add_special_tokens=bool(pre.get("add_special_tokens", False)))["input_ids"])


@dataclass(frozen=True)
class OutputOptions:
    """How a call's generated ids become output records and stream deltas (the pipeline's
    postprocessing arguments, resolved: ``generation_args.resolve_return_type``).

    Attributes:
        return_type: "full_text" (prompt + new text), "new_text" or "tensors" (token ids).
        skip_special_tokens: drop special tokens from the text; None: True (see ``skip_special_tokens``).
        clean_up_tokenization_spaces: as in ``tokenizer.decode``; None: the tokenizer's setting.
        continue_final_message: a chat's last message is continued (None: when it is the
            assistant's).
        stop_strings: the call's stop strings (streams end before them), or None.
    """

    return_type: str = "full_text"
    skip_special_tokens: Optional[bool] = None
    clean_up_tokenization_spaces: Optional[bool] = None
    continue_final_message: Optional[bool] = None
    stop_strings: Optional[tuple[str, ...]] = None


def skip_special_tokens(tokenizer, options: OutputOptions) -> bool:
    """Whether output text drops special tokens (``skip_special_tokens``, default True)."""
    if getattr(tokenizer, "response_template", None):
        return False  # as transformers: the response parser needs the special tokens
    skip = options.skip_special_tokens
    return True if skip is None else skip


def output_record(tokenizer, prompt: TextInput, out, options: OutputOptions) -> dict:
    """One output record, as ``TextGenerationPipeline.postprocess`` builds it."""
    return_type = options.return_type
    scores = {}
    if getattr(out, "logprobs", None) is not None:
        # generate(output_scores=True)'s processed scores, as the chosen token's log-prob
        scores["logprobs"] = list(out.logprobs)
        if out.top_logprobs is not None:
            scores["top_logprobs"] = [list(t) for t in out.top_logprobs]
    if return_type == "tensors":
        return {"generated_token_ids": out.prompt_token_ids + out.output_token_ids, **scores}
    skip = skip_special_tokens(tokenizer, options)
    clean = options.clean_up_tokenization_spaces
    text = tokenizer.decode(out.output_token_ids, skip_special_tokens=skip, clean_up_tokenization_spaces=clean)
    if return_type == "full_text":
        if isinstance(prompt, str):
            text = prompt + text
        else:
            msgs = [dict(m) for m in prompt]
            cont = options.continue_final_message
            if cont is None:
                cont = msgs[-1]["role"] == "assistant"
            if cont:
                msgs[-1]["content"] = msgs[-1]["content"] + text
                text = msgs
            elif getattr(tokenizer, "response_template", None) is not None:
                prompt_text = tokenizer.decode(
                    out.prompt_token_ids, skip_special_tokens=skip, clean_up_tokenization_spaces=clean
                )
                text = msgs + [tokenizer.parse_response(text, prefix=prompt_text, tools=None)]
            else:
                text = msgs + [{"role": "assistant", "content": text}]
    return {"generated_text": text, **scores}
