"""``hf-contbatch generate`` jobs that never lose work (frontends/batch_job.py, job_inputs.py): a job
killed mid-run and resumed equals an uninterrupted run record for record; OpenAI batch request
files round-trip with their ``custom_id``; Parquet and CSV inputs through ``datasets``. Expected
texts come from transformers' text-generation pipeline (float32, greedy)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time

import datasets
import pytest
import torch
import transformers

from hf_contbatch.cli import main
from hf_contbatch.default_model import default_model_path

from conftest import cli_command, cli_env

WORDS = ["The for statement", "A class is", "Exceptions are", "The import system", "A dictionary", "Lambda"]


@pytest.fixture(scope="module")
def hf_pipe():
    return transformers.pipeline("text-generation", model=default_model_path(), dtype=torch.float32)


def greedy(hf_pipe, prompt, n: int) -> str:
    return hf_pipe(prompt, max_new_tokens=n, do_sample=False, return_full_text=False)[0]["generated_text"]


def read_records(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_job_killed_mid_run_and_resumed_equals_an_uninterrupted_run(tmp_path):
    rows = [{"id": f"row-{i}", "prompt": f"{WORDS[i % len(WORDS)]} {i}"} for i in range(60)]
    inp = tmp_path / "rows.jsonl"
    inp.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    # One request at a time: the job runs long enough to be killed with some records written.
    opts = ["--input", str(inp), "--max-new-tokens", "40", "--max-num-seqs", "1", "--quiet"]
    killed = tmp_path / "killed.jsonl"
    proc = subprocess.Popen(
        cli_command() + ["generate", *opts, "--output", str(killed)],
        env=cli_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        deadline = time.monotonic() + 200
        while time.monotonic() < deadline and proc.poll() is None:
            if killed.exists() and killed.read_bytes().count(b"\n") >= 5:
                break
            time.sleep(0.02)
        assert proc.poll() is None, "the job ended before it could be killed: " + proc.stderr.read().decode()[-2000:]
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.wait(30)
        proc.stderr.close()
    kept = killed.read_bytes().count(b"\n")
    assert 5 <= kept < len(rows)
    with open(killed, "ab") as f:  # a record torn by the kill mid-write (no newline, not JSON)
        f.write(b'{"index": 59, "id": "row-59", "prompt": "Lamb')
    resumed = subprocess.run(
        cli_command() + ["generate", *opts, "--output", str(killed), "--resume"],
        env=cli_env(),
        capture_output=True,
        text=True,
        timeout=200,
    )
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert f"({kept} already in {killed})" in resumed.stderr
    whole = tmp_path / "whole.jsonl"
    assert main(["generate", *opts, "--output", str(whole)]) == 0
    assert killed.read_bytes() == whole.read_bytes()  # record for record, in input order
    records = read_records(whole)
    assert [(r["index"], r["id"]) for r in records] == [(i, r["id"]) for i, r in enumerate(rows)]


@pytest.mark.timeout(120)
def test_resume_repairs_a_torn_line_skips_done_rows_and_refuses_a_foreign_output(tmp_path, hf_pipe, capsys):
    inp = tmp_path / "rows.jsonl"
    inp.write_text("".join(json.dumps({"id": i, "prompt": w}) + "\n" for i, w in enumerate(WORDS)), encoding="utf-8")
    out = tmp_path / "out.jsonl"
    done = {"index": 2, "id": 2, "prompt": WORDS[2], "generated_text": "kept as it was"}
    out.write_text(json.dumps(done) + "\n" + '{"index": 4, "id": 4, "pro', encoding="utf-8")
    args = ["generate", "--input", str(inp), "--output", str(out), "--max-new-tokens", "5", "--quiet"]
    assert main([*args, "--resume"]) == 0
    records = read_records(out)
    assert [r["index"] for r in records] == list(range(len(WORDS)))
    assert records[2] == done  # not run again
    for i in (0, 1, 3, 4, 5):
        assert records[i] == {"index": i, "id": i, "prompt": WORDS[i], "generated_text": greedy(hf_pipe, WORDS[i], 5)}
    assert "(1 already in" in capsys.readouterr().err
    # An output whose ids are not this input's is refused before anything is appended.
    out.write_text(json.dumps({**done, "id": "other"}) + "\n", encoding="utf-8")
    with pytest.raises(SystemExit) as exc:
        main([*args, "--resume"])
    assert exc.value.code == 2
    assert "has row 2 with id 'other' but the input's row 2 (line 3) has id 2" in capsys.readouterr().err
    assert read_records(out) == [{**done, "id": "other"}]  # nothing appended
    # Only the last line can be torn by a kill: a bad line before it is not cut away with what follows.
    out.write_text("not json\n" + json.dumps(done) + "\n", encoding="utf-8")
    with pytest.raises(SystemExit) as exc:
        main([*args, "--resume"])
    assert exc.value.code == 2
    assert "has a line that is not a JSON record before its last line (at byte 0)" in capsys.readouterr().err


@pytest.mark.timeout(120)
def test_an_openai_batch_file_round_trips_with_its_custom_ids(tmp_path, hf_pipe):
    chat = [{"role": "user", "content": "What is a generator?"}]
    full = greedy(hf_pipe, WORDS[0], 12)
    stop = full.split()[2]  # a word the greedy text reaches: the output ends before it
    requests = [
        {
            "custom_id": "chat-1",
            "url": "/v1/chat/completions",
            "body": {"model": "m", "messages": chat, "max_tokens": 8},
        },
        {
            "custom_id": "cmpl-2",
            "url": "/v1/completions",
            "body": {"prompt": WORDS[0], "max_completion_tokens": 12, "temperature": 0, "stop": [stop]},
        },
        {"custom_id": "bad-3", "url": "/v1/embeddings", "body": {"input": "x"}},
        {
            "custom_id": "n-4",
            "url": "/v1/completions",
            "body": {"prompt": WORDS[1], "n": 2, "seed": 7, "max_tokens": 3},
        },
        {"custom_id": "bad-5", "url": "/v1/completions", "body": {"prompt": WORDS[1], "logit_bias": {"1": 2}}},
    ]
    inp, out = tmp_path / "batch.jsonl", tmp_path / "results.jsonl"
    inp.write_text("".join(json.dumps({"method": "POST", **r}) + "\n" for r in requests), encoding="utf-8")
    assert main(["generate", "--input", str(inp), "--output", str(out), "--quiet"]) == 3
    records = read_records(out)
    assert [r["custom_id"] for r in records] == [r["custom_id"] for r in requests]
    assert all(r["id"].startswith("batch_req_") and len({x["id"] for x in records}) == 5 for r in records)
    chat_rec, cmpl_rec, bad, sampled, bad_field = records
    body = chat_rec["response"]["body"]
    assert chat_rec["error"] is None and chat_rec["response"]["status_code"] == 200
    assert body["object"] == "chat.completion"
    assert body["choices"] == [
        {"index": 0, "message": {"role": "assistant", "content": greedy(hf_pipe, chat, 8)}, "finish_reason": "length"}
    ]
    encoded = hf_pipe.tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=True, return_dict=True)
    prompt_ids = encoded["input_ids"]
    assert body["usage"] == {
        "prompt_tokens": len(prompt_ids),
        "completion_tokens": 8,
        "total_tokens": len(prompt_ids) + 8,
    }
    (choice,) = cmpl_rec["response"]["body"]["choices"]
    assert choice == {"index": 0, "text": full[: full.index(stop)], "finish_reason": "stop"}
    assert bad["response"] is None and "'url' must be one of /v1/chat/completions" in bad["error"]["message"]
    assert "body field 'logit_bias' is not supported" in bad_field["error"]["message"]
    choices = sampled["response"]["body"]["choices"]
    assert [c["index"] for c in choices] == [0, 1] and sampled["response"]["body"]["usage"]["completion_tokens"] <= 6


@pytest.mark.timeout(120)
@pytest.mark.parametrize("suffix", ["jsonl", "txt"])
def test_a_file_starting_with_a_utf8_byte_order_mark_reads_as_without_one(tmp_path, hf_pipe, suffix):
    # Notepad and PowerShell write UTF-8 with a BOM (EF BB BF): it is not part of the first row, which
    # was an invalid-JSON error record (.jsonl) or a prompt starting with U+FEFF (.txt).
    lines = [json.dumps({"id": i, "prompt": w}) if suffix == "jsonl" else w for i, w in enumerate(WORDS[:2])]
    inp, out = tmp_path / f"rows.{suffix}", tmp_path / "out.jsonl"
    inp.write_bytes(b"\xef\xbb\xbf" + "".join(line + "\n" for line in lines).encode("utf-8"))
    assert main(["generate", "--input", str(inp), "--output", str(out), "--max-new-tokens", "4", "--quiet"]) == 0
    assert read_records(out) == [
        {"index": i, "id": i if suffix == "jsonl" else None, "prompt": w, "generated_text": greedy(hf_pipe, w, 4)}
        for i, w in enumerate(WORDS[:2])
    ]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("suffix", ["parquet", "csv"])
def test_parquet_and_csv_inputs_read_through_datasets(tmp_path, hf_pipe, suffix, capsys):
    table = datasets.Dataset.from_dict({"id": [11, 12, 13], "text": WORDS[:3], "label": ["a", "b", "c"]})
    inp, out = tmp_path / f"rows.{suffix}", tmp_path / "out.jsonl"
    table.to_parquet(str(inp)) if suffix == "parquet" else table.to_csv(str(inp), index=False)
    args = ["generate", "--input", str(inp), "--output", str(out), "--max-new-tokens", "4", "--quiet"]
    assert main([*args, "--input-column", "text"]) == 0
    assert read_records(out) == [
        {"index": i, "id": 11 + i, "prompt": w, "generated_text": greedy(hf_pipe, w, 4)}
        for i, w in enumerate(WORDS[:3])
    ]
    with pytest.raises(SystemExit) as exc:
        main(args)  # the default column, "prompt", is not there
    assert exc.value.code == 2
    assert f"--input {inp}: no column 'prompt' (its columns: id, text, label); choose one with --input-column" in (
        capsys.readouterr().err
    )


@pytest.mark.timeout(120)
def test_ctrl_c_keeps_the_records_written_says_how_to_resume_and_resume_finishes(
    tmp_path, hf_pipe, capsys, monkeypatch
):
    from hf_contbatch.frontends import batch_job

    inp, out = tmp_path / "rows.txt", tmp_path / "out.jsonl"
    inp.write_text("\n".join(WORDS) + "\n", encoding="utf-8")
    args = ["generate", "--input", str(inp), "--output", str(out), "--max-new-tokens", "5", "--quiet"]
    write = batch_job.JobOutput.write

    def interrupted_at_the_third(self, index, record):
        if sum(1 for o in self.offsets if o >= 0) == 2:
            raise KeyboardInterrupt
        write(self, index, record)

    monkeypatch.setattr(batch_job.JobOutput, "write", interrupted_at_the_third)
    assert main(args) == 130
    assert (
        f"interrupted; 2 of 6 rows have their record in {out}: rerun with --resume to finish" in capsys.readouterr().err
    )
    assert len(read_records(out)) == 2
    monkeypatch.setattr(batch_job.JobOutput, "write", write)
    assert main([*args, "--resume"]) == 0
    assert read_records(out) == [
        {"index": i, "id": None, "prompt": w, "generated_text": greedy(hf_pipe, w, 5)} for i, w in enumerate(WORDS)
    ]
