"""Data-parallel generation with one continuous-batching engine per process.

Two CPU processes (gloo), from the repository root:

    ACCELERATE_USE_CPU=1 accelerate launch --multi_gpu --num_processes 2 --num_machines 1 \
        --mixed_precision no --dynamo_backend no examples/accelerate_generate.py --max-new-tokens 32

or ``ACCELERATE_USE_CPU=1 torchrun --nproc_per_node 2 examples/accelerate_generate.py``; on GPUs drop
ACCELERATE_USE_CPU and --multi_gpu picks one GPU per process. (``accelerate launch --cpu
--num_processes 2`` silently starts ONE process.) Every process generates for its shard of the
prompts; the main process prints (or writes) the results in input order.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from hf_contbatch.integrations.accelerate import distributed_generate, process_info

DEFAULT_PROMPTS = [
    "The for statement",
    "A class is",
    "The with statement",
    "Exceptions are",
    "The import system",
    "Lambda expressions",
    "A dictionary",
    "The while statement",
    "A generator is",
    "The try statement",
    "Modules are",
    "A list comprehension",
]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="Hub id or local path (default: the embedded model)")
    parser.add_argument(
        "--input", default=None, help="a .txt file of prompts, one per line (default: built-in prompts)"
    )
    parser.add_argument("--output", default=None, help="write results as JSON lines here (main process)")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--dtype", default="float32")
    args = parser.parse_args(argv)

    prompts = DEFAULT_PROMPTS
    if args.input:
        with open(args.input, encoding="utf-8") as f:
            prompts = [line.rstrip("\n") for line in f if line.strip()]
    info = process_info()
    t0 = time.monotonic()
    results = distributed_generate(
        prompts,
        model=args.model,
        pipeline_kwargs={"dtype": args.dtype},
        max_new_tokens=args.max_new_tokens,
        do_sample=False,
        return_full_text=False,
    )
    seconds = time.monotonic() - t0
    # One write per line: the ranks share stderr, and print() writes the text and its newline
    # separately, so another rank's line could land between them.
    sys.stderr.write(f"[rank {info['process_index']}/{info['num_processes']}] done in {seconds:.1f} s\n")
    if results is None:
        return 0
    rows = [{"prompt": p, "generated_text": r[0]["generated_text"]} for p, r in zip(prompts, results)]
    if args.output:
        with open(args.output, "w", encoding="utf-8") as f:
            for row in rows:
                f.write(json.dumps(row, ensure_ascii=False) + "\n")
    else:
        for row in rows:
            print(f"--- {row['prompt']!r}\n{row['generated_text']}\n")
    summary = {
        "num_processes": info["num_processes"],
        "distributed_type": info["distributed_type"],
        "num_prompts": len(prompts),
        "seconds": round(seconds, 2),
    }
    sys.stderr.write(json.dumps(summary) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
