"""Several LoRA adapters: one continuous batch vs adapter by adapter vs PEFT's mixed batches.

    python benchmarks/bench_lora.py                       # small anchor model, 4 adapters of rank 16
    python benchmarks/bench_lora.py --model tiny --requests 16 --cooldown 0   # a quick check

The standard workload (64 requests, ``workload.make_workload``), request i on adapter i % 4, every
adapter of rank ``--rank`` on the attention's q/k/v/o and the MLP (random non-zero weights):

- ``mixed``: hf_contbatch, one engine, all requests at once, each with its ``adapter_name``;
- ``by_adapter``: hf_contbatch, adapter after adapter: ``set_adapter(name)``, then that adapter's
  requests in one call (what a user without per-request adapters does);
- ``peft``: PEFT's own ``generate(adapter_names=...)`` mixed batches, static batches of 16 in
  arrival order, left-padded, each running to its longest ``max_new_tokens``.

Throughput = generated tokens asked for / wall time, model build excluded; each engine runs in its
own fresh process after ``--cooldown`` idle seconds (``workload.run_in_own_process``), with a
warm-up first. Greedy outputs are compared token for token and the agreement printed.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
from workload import build_model, make_workload, run_in_own_process  # noqa: E402

ADAPTERS = ("a0", "a1", "a2", "a3")
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def build_peft_model(size: str, rank: int):
    """The anchor model with four LoRA adapters of rank ``rank`` (seeded, non-zero weights)."""
    import peft

    model = build_model(size)
    torch.manual_seed(1)
    cfg = dict(r=rank, lora_alpha=2 * rank, target_modules=TARGETS, init_lora_weights=False)
    pm = peft.get_peft_model(model, peft.LoraConfig(**cfg), adapter_name=ADAPTERS[0])
    for name in ADAPTERS[1:]:
        pm.add_adapter(name, peft.LoraConfig(**cfg))
    return pm.eval()


def _engine(pm, args):
    from hf_contbatch import CacheConfig, EngineConfig, LLMEngine, SchedulerConfig

    cfg = EngineConfig(
        cache=CacheConfig(block_size=16, num_blocks=args.num_blocks),
        scheduler=SchedulerConfig(max_num_seqs=64, max_num_batched_tokens=1024),
    )
    return LLMEngine(pm, cfg)


def run_mixed(pm, prompts, new_tokens, names, args):
    """All requests in one engine at once, each with its own adapter."""
    from hf_contbatch import SamplingParams

    engine = _engine(pm, args)
    try:
        engine.submit([1, 2, 3], SamplingParams(max_new_tokens=2, adapter_name=names[0])).result()  # warm-up
        t0 = time.perf_counter()
        handles = [
            engine.submit(p, SamplingParams(max_new_tokens=n, ignore_eos=True, adapter_name=a))
            for p, n, a in zip(prompts, new_tokens, names)
        ]
        outs = [h.result().output_token_ids for h in handles]
        return time.perf_counter() - t0, outs
    finally:
        engine.close()


def run_by_adapter(pm, prompts, new_tokens, names, args):
    """Adapter after adapter: ``set_adapter``, then that adapter's requests as one call."""
    from hf_contbatch import SamplingParams

    engine = _engine(pm, args)
    outs: list = [None] * len(prompts)
    try:
        engine.submit([1, 2, 3], SamplingParams(max_new_tokens=2)).result()  # warm-up
        t0 = time.perf_counter()
        for name in ADAPTERS:
            pm.set_adapter(name)  # requests without an adapter_name take the active one
            mine = [i for i, a in enumerate(names) if a == name]
            handles = [
                engine.submit(prompts[i], SamplingParams(max_new_tokens=new_tokens[i], ignore_eos=True)) for i in mine
            ]
            for i, h in zip(mine, handles):
                outs[i] = h.result().output_token_ids
        return time.perf_counter() - t0, outs
    finally:
        engine.close()
        pm.set_adapter(ADAPTERS[0])


def run_peft(pm, prompts, new_tokens, names, batch_size=16):
    """PEFT's ``generate(adapter_names=...)``: static left-padded batches of ``batch_size``."""
    outs = []
    ids = torch.tensor([[1, 2, 3]])
    with torch.no_grad():
        pm.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=2, adapter_names=[names[0]])
        t0 = time.perf_counter()
        for start in range(0, len(prompts), batch_size):
            batch = prompts[start : start + batch_size]
            width = max(map(len, batch))
            input_ids = torch.tensor([[0] * (width - len(p)) + p for p in batch])
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
            n = max(new_tokens[start : start + batch_size])
            out = pm.generate(
                input_ids=input_ids,
                attention_mask=mask,
                max_new_tokens=n,
                do_sample=False,
                adapter_names=names[start : start + batch_size],
            )
            outs += [row[width : width + k].tolist() for row, k in zip(out, new_tokens[start : start + batch_size])]
    return time.perf_counter() - t0, outs


RUNS = {"mixed": run_mixed, "by_adapter": run_by_adapter, "peft": run_peft}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="small", choices=["tiny", "small"])
    ap.add_argument("--engines", default="mixed,by_adapter,peft")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--num-blocks", type=int, default=2048)
    ap.add_argument("--cooldown", type=float, default=15.0, help="idle seconds before each engine")
    ap.add_argument("--json", default=None, help="write the results here")
    ap.add_argument("--single", default=None, help=argparse.SUPPRESS)  # internal: run one engine, write here
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    pm = build_peft_model(args.model, args.rank)
    prompts, new_tokens = make_workload(args.requests, pm.config.vocab_size, args.seed)
    names = [ADAPTERS[i % len(ADAPTERS)] for i in range(len(prompts))]
    asked = sum(new_tokens)
    engines = args.engines.split(",")
    if args.single:
        name = engines[0]
        if name not in RUNS:
            raise SystemExit(f"unknown engine {name!r}; choose from {', '.join(RUNS)}")
        extra = () if name == "peft" else (args,)
        wall, outs = RUNS[name](pm, prompts, new_tokens, names, *extra)
        result = {"seconds": round(wall, 3), "tokens_per_s": round(asked / wall, 1)}
        with open(args.single, "w") as f:
            json.dump({"results": {name: result}, "outputs": outs}, f)
        return 0
    print(
        f"workload: {len(prompts)} requests over {len(ADAPTERS)} adapters of rank {args.rank}, prompt tokens "
        f"{sum(map(len, prompts))}, new tokens asked {asked}; model {args.model}, torch threads {args.threads}"
    )
    results, outputs = {}, {}
    for name in engines:
        child = run_in_own_process(__file__, name, argv if argv is not None else sys.argv[1:], args.cooldown)
        results.update(child["results"])
        outputs[name] = child["outputs"]
        r = results[name]
        print(f"{name:>11}: {r['seconds']:7.2f} s  {r['tokens_per_s']:8.1f} tok/s", flush=True)
    for base in ("by_adapter", "peft"):
        if "mixed" in results and base in results:
            ratio = results[base]["seconds"] / results["mixed"]["seconds"]
            results[f"mixed_vs_{base}"] = round(ratio, 2)
            same = sum(a == b for a, b in zip(outputs["mixed"], outputs[base]))
            results[f"identical_greedy_vs_{base}"] = f"{same}/{len(prompts)}"
            print(f"mixed / {base}: {ratio:.2f}x tokens/s; identical greedy outputs {same}/{len(prompts)}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "results": results}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
