"""Engine statistics: the immutable ``EngineStats`` snapshot, and the counters it is built from."""

from __future__ import annotations

import collections
import dataclasses
from dataclasses import dataclass
from typing import Optional

from ..core.phases import PHASES
from ..core.plan import StepResult
from ..request import BASE_ADAPTER, RequestMetrics, percentile

# The fields a snapshot's repr shows, in this order: what a notebook cell ending in ``pipe.stats()``
# should tell at a glance. The per-block tuples (one entry per KV block) would run to pages.
_REPR_FIELDS = (
    "num_used_blocks",
    "num_blocks",
    "peak_used_blocks",
    "kv_cache_dtype",
    "num_waiting",
    "num_running",
    "num_swapped",
    "num_finished",
    "num_preemptions",
    "num_generated_tokens",
    "num_iterations",
    "throughput_tokens_per_s",
    "mean_ttft_s",
    "mean_itl_s",
)


def _short(value) -> str:
    """``value`` for a repr: floats to four significant digits (rates over 1,000 to one decimal)."""
    if isinstance(value, float):
        return f"{value:.1f}" if abs(value) >= 1000 else f"{value:.4g}"
    return repr(value)


@dataclass(frozen=True, repr=False)
class EngineStats:
    """An immutable snapshot for dashboards and scripts (units in the names).

    Its repr shows the main counts only (``_REPR_FIELDS``, floats rounded); every field stays
    exact on the object, and ``dataclasses.asdict(stats)`` gives them all.
    """

    num_blocks: int
    block_size: int
    num_free_blocks: int
    num_used_blocks: int
    peak_used_blocks: int
    capacity_tokens: int
    num_waiting: int
    num_running: int
    num_swapped: int
    num_finished: int
    num_preemptions: int
    num_generated_tokens: int
    num_iterations: int
    throughput_tokens_per_s: float
    mean_ttft_s: Optional[float]  # over the last 1,024 requests' first tokens
    mean_itl_s: Optional[float]  # over the last 4,096 gaps between two tokens of a request
    recent_phases: tuple = ()  # ((phase, seconds), ...) for recent iterations
    block_owner: tuple = ()  # request id (or -1) per block
    # Memory management. Counters are cumulative since the engine started.
    watermark_blocks: int = 0
    budget_blocks: int = 0  # last iteration: free - reservations - watermark, as measured in the budget step
    reserved_blocks: int = 0  # last iteration: running requests' blocks for the step + swap-ins + forks
    num_swap_blocks: int = 0  # host swap pool size
    swap_capacity_tokens: int = 0
    num_swapped_blocks: int = 0  # host blocks holding swapped-out KV now
    num_preemptions_swap: int = 0
    num_preemptions_recompute: int = 0
    num_swap_fallbacks: int = 0  # swap wanted but the host pool was full: recomputed instead
    num_blocks_swapped_out: int = 0
    num_blocks_swapped_in: int = 0
    swap_seconds: float = 0.0  # time spent executing swap and copy mappings
    prefix_caching: bool = False
    num_cached_blocks: int = 0  # free blocks still holding a reusable prefix (evictable)
    prefix_cache_hit_rate: float = 0.0  # prompt tokens served from the cache / prompt tokens looked up
    prefix_cache_query_tokens: int = 0
    prefix_cache_hit_tokens: int = 0
    num_prefix_evictions: int = 0
    num_forks: int = 0  # parallel-sampling sequences forked off a parent (blocks shared)
    num_fork_fallbacks: int = 0  # sequences that could not be forked and recompute their prompt
    block_ref_counts: tuple = ()  # per block; > 1 means shared (prefix cache or fork)
    phase_seconds: tuple = ()  # ((phase, total seconds), ...) over all iterations, in PHASES order
    last_phases: tuple = ()  # ((phase, seconds), ...) of the latest iteration
    # Tokens of KV in the device pool: each slot once, though a block shared by forks or prefix-cache
    # hits serves several requests (at most num_used_blocks * block_size; the dashboard's tokens bar).
    num_kv_tokens: int = 0
    num_logical_kv_tokens: int = 0  # the same tokens as the requests see them: a shared block once per request
    # Prompt-lookup speculative decoding (cumulative): drafts verified, and those kept.
    num_draft_tokens: int = 0
    num_accepted_draft_tokens: int = 0
    # LoRA adapters (a peft.PeftModel): ((adapter, waiting, running, swapped), ...) by adapter name,
    # "__base__" for the base model; empty when the engine serves a plain model.
    requests_per_adapter: tuple = ()
    kv_cache_dtype: str = ""  # the KV pools' dtype: "float32", "bfloat16", "int8" (with per-token scales), ...
    # The KV cache group's sliding window in tokens (every layer slides over it: a request holds only
    # the blocks its window still reads); None: full attention, every block of the context is kept.
    kv_sliding_window: Optional[int] = None
    # The linears' weights as served ("float32", "int8", "w8a8", "torchao Int8Tensor"), and under a
    # quantization the weights it leaves float (a mixture of experts' 3-D expert weights and router:
    # kernels.linears.unquantized): their names, bytes and share of the model's parameter bytes.
    weight_format: str = ""
    unquantized_weights: tuple = ()
    unquantized_weight_bytes: int = 0
    unquantized_weight_fraction: float = 0.0
    # Latency percentiles over the same samples as the means (None before any), and the latest
    # request to get a token (running or finished): what a one-request view shows, its own figures
    # rather than a mean over earlier requests.
    median_ttft_s: Optional[float] = None
    p90_ttft_s: Optional[float] = None
    median_itl_s: Optional[float] = None
    p90_itl_s: Optional[float] = None
    latest_request_id: Optional[int] = None
    latest_request: Optional[RequestMetrics] = None

    def __repr__(self) -> str:
        shown = ", ".join(f"{name}={_short(getattr(self, name))}" for name in _REPR_FIELDS)
        hidden = len(dataclasses.fields(self)) - len(_REPR_FIELDS)
        return f"EngineStats({shown}, ... {hidden} more fields)"

    def _repr_pretty_(self, printer, cycle: bool) -> None:
        """IPython's display (a cell's last expression): the same short text as ``repr``."""
        printer.text(repr(self))

    @property
    def draft_acceptance_rate(self) -> Optional[float]:
        """Accepted / verified draft tokens; None before any draft."""
        return self.num_accepted_draft_tokens / self.num_draft_tokens if self.num_draft_tokens else None


def kv_token_counts(requests, bm) -> tuple[int, int]:
    """``(tokens in distinct slots, logical tokens)`` of the KV in the device pool ``bm`` (a
    ``BlockManager``) for ``requests`` (those holding its blocks, with ``num_computed_tokens``).

    A request's first ``num_computed_tokens`` positions are written, position ``p`` in slot
    ``p % block_size`` of block ``table[p // block_size]``. A block shared by forks or prefix-cache
    hits is counted once in the first figure (its fullest user decides how many of its slots hold
    KV) and once per request in the second. Positions whose block a sliding window released
    (null entries) count in neither."""
    bs = bm.block_size
    computed = {r.request_id: r.num_computed_tokens for r in requests}
    filled: dict[int, int] = {}  # block -> slots holding KV
    logical = 0
    for rid, table in bm.block_tables.items():
        n = min(computed.get(rid, 0), len(table) * bs)
        logical += n
        for i in range(-(-n // bs)):
            b = table[i]
            if b == bm.null_block:  # the window moved on: those positions hold no KV any more
                logical -= min(bs, n - i * bs)
                continue
            filled[b] = max(filled.get(b, 0), min(bs, n - i * bs))
    return sum(filled.values()), logical


class EngineCounters:
    """What the engine counts as it runs, and the ``EngineStats`` snapshot built from it.

    The driving thread calls ``record_*`` during an iteration; ``snapshot`` reads the counters and
    the scheduler's and block managers' state. The engine calls both with its state lock held, so a
    snapshot never sees half an iteration.

    Args:
        record_phases: keep the per-iteration phase log (``EngineConfig.record_phases``).
        per_adapter: count requests per LoRA adapter (the engine serves a ``peft.PeftModel``).
        kv_cache_dtype: the KV pools' dtype (``KVCacheSpec.dtype``), reported as its name.
        weight_format: the linears' weights as served (``ModelPatches.weight_format``).
        unquantized: the weights a quantization leaves float (``ModelPatches.unquantized``, an
            ``UnquantizedWeights``; None without a quantization).
    """

    def __init__(
        self,
        record_phases: bool = True,
        per_adapter: bool = False,
        kv_cache_dtype=None,
        weight_format: str = "",
        unquantized=None,
    ) -> None:
        self.weight_format = weight_format
        self.unquantized = unquantized
        self.per_adapter = per_adapter
        self.kv_cache_dtype = str(kv_cache_dtype).removeprefix("torch.") if kv_cache_dtype is not None else ""
        self.phase_log: collections.deque = collections.deque(maxlen=4096 if record_phases else 0)
        self.num_finished = 0
        self.num_generated = 0
        self.peak_used_blocks = 0
        self.busy_seconds = 0.0
        self.ttfts: collections.deque = collections.deque(maxlen=1024)
        self.itls: collections.deque = collections.deque(maxlen=4096)
        self.phase_totals = dict.fromkeys(PHASES, 0.0)
        self.swap_seconds = 0.0
        self.last_budget = (0, 0)  # (budget_blocks, reserved_blocks) of the latest iteration
        self.latest_request = None  # the Request that got a token last (one kept alive, no more)

    def record_scheduled(self, report, now: float) -> None:
        """The step's plan (its ``StepReport``: admitted and forked requests) was made at ``now``
        (seconds, monotonic): those scheduled for the first time get their ``first_scheduled_time``."""
        for req in (*report.admitted, *report.forked):
            if req.first_scheduled_time is None:
                req.first_scheduled_time = now

    def record_token(self, req, now: float) -> None:
        """A new token of ``req`` arrived at ``now`` (seconds, monotonic): TTFT or ITL sample."""
        if req.first_token_time is None:
            req.first_token_time = now
            self.ttfts.append(now - req.arrival_time)
        else:
            self.itls.append(now - req.last_token_time)
        req.last_token_time = now
        self.num_generated += 1
        self.latest_request = req

    def record_used_blocks(self, used_blocks: int) -> None:
        """The pool's used blocks at a point of an iteration, for ``peak_used_blocks``: sampled once
        the plan allocated the step's blocks, before its update releases any (rejected drafts'
        blocks, blocks a sliding window no longer reads), and again at the end."""
        self.peak_used_blocks = max(self.peak_used_blocks, used_blocks)

    def record_iteration(self, result: StepResult, used_blocks: int, busy_seconds: float, swap_seconds: float) -> None:
        """One iteration's plan and report (``result``, the report with its phases), the pool's used
        blocks after it, its wall seconds and the seconds spent moving blocks."""
        plan, report = result.plan, result.report
        self.record_used_blocks(used_blocks)
        if not plan.is_empty:
            self.busy_seconds += busy_seconds
        self.phase_log.append((report.iteration, tuple(report.phases)))
        for name, seconds in report.phases:
            self.phase_totals[name] += seconds
        if plan.moves_blocks:
            self.swap_seconds += swap_seconds
        self.last_budget = (report.budget_blocks, report.reserved_blocks)

    def snapshot(self, sched, bm, host_bm) -> EngineStats:
        """An ``EngineStats`` of the counters, the scheduler ``sched``, the device pool's ``bm`` and
        the host swap pool's ``host_bm``."""
        owners = [-1] * bm.num_blocks
        for rid in bm.block_tables:
            for b in bm.live_blocks(rid):  # a sliding window's null entries own nothing
                owners[b] = rid
        itl = list(self.itls)
        ttft = list(self.ttfts)
        recent = tuple(list(self.phase_log)[-32:])
        counts = sched.counters
        kv_tokens, logical_kv_tokens = kv_token_counts(sched.all_requests(), bm)
        return EngineStats(
            num_blocks=bm.num_blocks,
            kv_cache_dtype=self.kv_cache_dtype,
            kv_sliding_window=bm.sliding_window,
            weight_format=self.weight_format,
            unquantized_weights=self.unquantized.names if self.unquantized is not None else (),
            unquantized_weight_bytes=self.unquantized.bytes if self.unquantized is not None else 0,
            unquantized_weight_fraction=self.unquantized.fraction if self.unquantized is not None else 0.0,
            block_size=bm.block_size,
            num_free_blocks=bm.num_free_blocks,
            num_used_blocks=bm.num_used_blocks,
            peak_used_blocks=self.peak_used_blocks,
            capacity_tokens=bm.num_blocks * bm.block_size,
            num_waiting=len(sched.waiting),
            num_running=len(sched.running),
            num_swapped=len(sched.swapped),
            num_finished=self.num_finished,
            num_preemptions=counts.num_preemptions,
            num_generated_tokens=self.num_generated,
            num_iterations=sched.iteration,
            throughput_tokens_per_s=self.num_generated / self.busy_seconds if self.busy_seconds else 0.0,
            mean_ttft_s=sum(ttft) / len(ttft) if ttft else None,
            mean_itl_s=sum(itl) / len(itl) if itl else None,
            median_ttft_s=percentile(ttft, 50),
            p90_ttft_s=percentile(ttft, 90),
            median_itl_s=percentile(itl, 50),
            p90_itl_s=percentile(itl, 90),
            latest_request_id=self.latest_request.request_id if self.latest_request is not None else None,
            latest_request=RequestMetrics.of(self.latest_request) if self.latest_request is not None else None,
            recent_phases=recent,
            block_owner=tuple(owners),
            watermark_blocks=sched.watermark_blocks,
            budget_blocks=self.last_budget[0],
            reserved_blocks=self.last_budget[1],
            num_swap_blocks=host_bm.num_blocks,
            swap_capacity_tokens=host_bm.num_blocks * bm.block_size,
            num_swapped_blocks=host_bm.num_used_blocks,
            num_preemptions_swap=counts.num_swap_preemptions,
            num_preemptions_recompute=counts.num_recompute_preemptions,
            num_swap_fallbacks=counts.num_swap_fallbacks,
            num_blocks_swapped_out=counts.num_blocks_swapped_out,
            num_blocks_swapped_in=counts.num_blocks_swapped_in,
            swap_seconds=self.swap_seconds,
            prefix_caching=bm.enable_prefix_caching,
            num_cached_blocks=bm.num_cached_free_blocks,
            prefix_cache_hit_rate=bm.prefix_hit_rate,
            prefix_cache_query_tokens=bm.num_prefix_query_tokens,
            prefix_cache_hit_tokens=bm.num_prefix_hit_tokens,
            num_prefix_evictions=bm.num_evictions,
            num_forks=counts.num_forks,
            num_fork_fallbacks=counts.num_fork_fallbacks,
            block_ref_counts=tuple(bm.ref_counts),
            phase_seconds=tuple(self.phase_totals.items()),
            last_phases=recent[-1][1] if recent else (),
            num_kv_tokens=kv_tokens,
            num_logical_kv_tokens=logical_kv_tokens,
            num_draft_tokens=counts.num_draft_tokens,
            num_accepted_draft_tokens=counts.num_accepted_draft_tokens,
            requests_per_adapter=_requests_per_adapter(sched) if self.per_adapter else (),
        )


def _requests_per_adapter(sched) -> tuple:
    """``((adapter, waiting, running, swapped), ...)`` sorted by name (base model: "__base__")."""
    counts: dict[str, list[int]] = {}
    for state, queue in enumerate((sched.waiting, sched.running, sched.swapped)):
        for req in queue:
            counts.setdefault(req.sampling.adapter_name or BASE_ADAPTER, [0, 0, 0])[state] += 1
    return tuple((name, *c) for name, c in sorted(counts.items()))
