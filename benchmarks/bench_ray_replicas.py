"""Ray Data throughput with one and with two replicas of the engine on a local Ray cluster:
``build_processor`` over N prompts (embedded model, greedy, float32, CPU).

    python benchmarks/bench_ray_replicas.py                        # N = 256, 32 new tokens, 1 and 2 replicas
    python benchmarks/bench_ray_replicas.py --prompts 1024 --cpus 8 --replicas 1 2 4

Each replica is a Ray actor with ``--cpus-per-replica`` CPUs (its torch threads) and one engine.
The time counts everything a user waits for: actor start-up (importing torch, loading the model)
and the generation. "start-up alone" is a run of two prompts per replica beforehand (new actors
each run), what the total spends before generating at full speed.
"""

from __future__ import annotations

import argparse
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=256)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--cpus", type=int, default=2, help="the local Ray cluster's CPUs")
    parser.add_argument("--cpus-per-replica", type=int, default=1)
    parser.add_argument("--replicas", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--batch-size", type=int, default=32)
    args = parser.parse_args()

    import ray
    import torch

    from hf_contbatch.integrations.ray import build_processor

    ray.init(num_cpus=args.cpus, include_dashboard=False, log_to_driver=False)
    ray.data.DataContext.get_current().enable_progress_bars = False
    rows = [{"id": i, "prompt": f"Prompt number {i} is about"} for i in range(args.prompts)]
    for replicas in args.replicas:
        process = build_processor(
            None,
            concurrency=replicas,
            batch_size=args.batch_size,
            num_cpus=args.cpus_per_replica,
            pipeline_kwargs={"dtype": torch.float32},
            max_new_tokens=args.max_new_tokens,
            do_sample=False,
            ignore_eos=True,  # every prompt generates exactly --max-new-tokens tokens
        )
        warm = process(ray.data.from_items(rows[: replicas * 2])).materialize  # start-up alone
        t0 = time.monotonic()
        warm()
        startup = time.monotonic() - t0
        t0 = time.monotonic()
        out = process(ray.data.from_items(rows)).take_all()
        total = time.monotonic() - t0
        tokens = len(out) * args.max_new_tokens
        print(
            f"{replicas} replica{'s' if replicas > 1 else ''} x {args.cpus_per_replica} CPU: {len(out)} prompts in "
            f"{total:.1f} s ({tokens / total:.0f} generated tok/s, {len(out) / total:.1f} prompts/s); "
            f"start-up alone {startup:.1f} s",
            flush=True,
        )
    ray.shutdown()


if __name__ == "__main__":
    main()
