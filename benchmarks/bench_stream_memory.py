"""Peak memory of a streamed pipeline call against its input's size: a generator of N short prompts
through ``pipe(generator, max_new_tokens=1)`` on the embedded model (greedy, float32, CPU).

    python benchmarks/bench_stream_memory.py                   # N = 10^4 and 10^5
    python benchmarks/bench_stream_memory.py --sizes 10000 1000000

Each size runs in its own process (a process's peak RSS never goes down), which reports its RSS
after the model loaded and a warm-up call, its peak RSS (``ru_maxrss``) at the end, the wall time
and the prompts per second. Flat memory means the peak grows by a bounded amount whatever N is:
the call holds at most ``4 * max_num_seqs`` prompts and records at a time
(``frontends.streamed_call``), and each record is dropped by the consumer as it comes.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time


def _rss_mib() -> float:
    """This process's resident set now (Linux ``/proc/self/statm``), in MiB."""
    with open("/proc/self/statm") as f:
        pages = int(f.read().split()[1])
    return pages * os.sysconf("SC_PAGE_SIZE") / 2**20


def run_one(n: int) -> dict:
    """Stream ``n`` prompts through a fresh pipeline; return the figures of this process."""
    import torch

    import hf_contbatch

    pipe = hf_contbatch.pipeline("text-generation", dtype=torch.float32)
    kw = dict(do_sample=False, max_new_tokens=1, progress_bar=False)

    def prompts(count):
        for i in range(count):
            yield f"Prompt number {i} says"

    for _ in pipe(prompts(1000), **kw):  # warm-up: kernels, allocator pools, the first steps
        pass
    base = _rss_mib()
    t0 = time.monotonic()
    count = 0
    for records in pipe(prompts(n), **kw):
        count += len(records)
    seconds = time.monotonic() - t0
    pipe.close()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB
    return {
        "prompts": n,
        "records": count,
        "rss_after_warmup_mib": round(base, 1),
        "peak_rss_mib": round(peak, 1),
        "seconds": round(seconds, 1),
        "prompts_per_s": round(n / seconds, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=int, nargs="+", default=[10_000, 100_000])
    parser.add_argument("--one", type=int, default=None, help=argparse.SUPPRESS)  # the child process
    args = parser.parse_args()
    if args.one is not None:
        print(json.dumps(run_one(args.one)))
        return
    for n in args.sizes:
        out = subprocess.run(
            [sys.executable, __file__, "--one", str(n)], capture_output=True, text=True, check=True
        ).stdout
        row = json.loads(out.strip().splitlines()[-1])
        print(
            f"{row['prompts']:>9,} prompts: peak RSS {row['peak_rss_mib']:.0f} MiB "
            f"(after warm-up {row['rss_after_warmup_mib']:.0f} MiB), {row['seconds']} s, "
            f"{row['prompts_per_s']} prompts/s",
            flush=True,
        )


if __name__ == "__main__":
    main()
