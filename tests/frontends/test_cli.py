"""`hf-contbatch generate`, the main job: reads prompts, writes one record per prompt, equal to
transformers' greedy pipeline on the same model, and rejects bad input before loading anything."""

from __future__ import annotations

import json

import pytest
import torch
import transformers

from hf_contbatch.cli import main
from hf_contbatch.default_model import default_model_path


@pytest.mark.timeout(180)
def test_generate_writes_records_equal_to_transformers_greedy(tmp_path, capsys):
    prompts = ["The for statement", "A class is", "Exceptions are raised"]
    inp = tmp_path / "prompts.jsonl"
    inp.write_text("\n".join(json.dumps({"prompt": p}) for p in prompts) + "\n", encoding="utf-8")
    out = tmp_path / "out.jsonl"
    assert main(["generate", "--input", str(inp), "--output", str(out), "--max-new-tokens", "12", "--quiet"]) == 0
    rows = [json.loads(line) for line in out.read_text(encoding="utf-8").splitlines()]
    hf = transformers.pipeline("text-generation", model=default_model_path(), dtype=torch.float32)
    expected = [hf(p, max_new_tokens=12, do_sample=False, return_full_text=False)[0]["generated_text"] for p in prompts]
    assert [r["prompt"] for r in rows] == prompts
    assert [r["generated_text"] for r in rows] == expected
    summary = capsys.readouterr().err
    assert "3 requests" in summary and "tok/s" in summary and "peak blocks" in summary


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "content,suffix,args,message",
    [
        ('{"prompt": "x"}\nnot json\n', ".jsonl", [], "line 2: not valid JSON"),
        ("", ".txt", [], "no prompts"),
        ('{"text": "x"}\n', ".jsonl", [], "'prompt' or 'messages'"),
        ("x\n", ".csv", [], ".jsonl or .txt"),
        ("x\n", ".txt", ["--max-new-tokens", "0"], "--max-new-tokens must be an int >= 1"),
    ],
)
def test_bad_input_files_and_arguments_fail_with_a_message_naming_them(tmp_path, content, suffix, args, message):
    inp = tmp_path / f"prompts{suffix}"
    inp.write_text(content, encoding="utf-8")
    with pytest.raises(SystemExit, match=message):
        main(["generate", "--input", str(inp), *args])
