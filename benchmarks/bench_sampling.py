"""Cost of one sampling step for a batch of requests: hf_contbatch's ``Sampler`` (batched argmax,
batched temperature/top-k/top-p with one multinomial draw for unseeded rows, per-request
processors on a preallocated token history) against the per-row way (each request's transformers
``LogitsProcessorList`` on ``torch.tensor([prompt + output])`` and its own draw, as ``generate``
does for one sequence and as our sampler did before), in one run, with ratios.

    python benchmarks/bench_sampling.py --rows 64 --vocab 32000 --steps 50

No model runs: the logits are random, so this isolates the sampling phase of a step.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from hf_contbatch.core.plan import NewRequestData  # noqa: E402
from hf_contbatch.engine.input_batch import InputBatch  # noqa: E402
from hf_contbatch.engine.sampler import Sampler, build_logits_processors  # noqa: E402
from hf_contbatch.request import Request, SamplingParams  # noqa: E402

WORKLOADS = {
    "greedy": dict(do_sample=False),
    "sampled (temperature/top-k/top-p)": dict(do_sample=True, temperature=0.7, top_k=50, top_p=0.9),
    "sampled + repetition_penalty": dict(do_sample=True, temperature=0.7, top_k=50, top_p=0.9, repetition_penalty=1.2),
}


def per_row_step(logits, reqs, procs, gen):
    out = []
    for i, r in enumerate(reqs):
        scores = logits[i : i + 1]
        if procs[i]:
            scores = procs[i](torch.tensor([r.prompt_token_ids + r.output_token_ids]), scores)
        if not r.sampling.do_sample:
            out.append(int(scores.argmax(-1).item()))
        else:
            out.append(int(torch.multinomial(torch.softmax(scores, -1), 1, generator=gen).item()))
    return out


def run(kind, kw, rows, vocab, steps, prompt_len, seed=0):
    g = torch.Generator().manual_seed(seed)
    logits = [torch.randn(rows, vocab, generator=g) for _ in range(steps)]
    times = {}
    for way in ("per-row", "ours"):
        reqs = [
            Request(
                request_id=i,
                prompt_token_ids=torch.randint(3, vocab, (prompt_len,), generator=g).tolist(),
                sampling=SamplingParams(max_new_tokens=steps + 1, **kw),
            )
            for i in range(rows)
        ]
        sampler = Sampler(torch.Generator().manual_seed(seed))
        procs = [build_logits_processors(r.sampling, r.num_prompt_tokens) for r in reqs]
        batch = InputBatch()  # the runner's rows: what the sampler reads instead of the requests
        for r in reqs:
            sampler.processors.track(r)
            batch.add(NewRequestData.of(r))
        batch_rows = [batch.get(r.request_id) for r in reqs]
        gen = torch.Generator().manual_seed(seed)
        t0 = time.perf_counter()
        for s in range(steps):
            x = logits[s].clone()
            toks = sampler.sample(x, batch_rows)[0] if way == "ours" else per_row_step(x, reqs, procs, gen)
            for r, row, t in zip(reqs, batch_rows, toks):
                r.output_token_ids.append(t)  # a benchmark's own requests: no engine
                row.token_ids.append(t)
        times[way] = (time.perf_counter() - t0) / steps * 1e3
    print(
        f"{kind:36s} per-row {times['per-row']:8.2f} ms/step   ours {times['ours']:8.2f} ms/step   "
        f"speed-up {times['per-row'] / times['ours']:5.2f}x"
    )


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(f"rows={args.rows} vocab={args.vocab} steps={args.steps} prompt_len={args.prompt_len} threads={args.threads}")
    for kind, kw in WORKLOADS.items():
        run(kind, kw, args.rows, args.vocab, args.steps, args.prompt_len)


if __name__ == "__main__":
    main()
