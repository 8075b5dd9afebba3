"""``ModelRunner.build_metadata``: the row layout of one flattened step, by arithmetic on a plan.

No model runs: the runner reads only the plan, the cache's head count and its backend (which
builds the metadata); never the block manager or the live requests, which the test takes away
before building.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch

from hf_contbatch.core.block_manager import BlockManager
from hf_contbatch.core.plan import NewRequestData, ScheduledRequest, StepPlan
from hf_contbatch.engine.input_batch import InputBatch
from hf_contbatch.engine.runner import ModelRunner
from hf_contbatch.kernels.attention.backends import TorchAttentionBackend
from hf_contbatch.request import Request, SamplingParams


class _ForwardSignature:
    """Only the forward's parameter names matter to ``build_metadata``."""

    def forward(self, input_ids, position_ids, past_key_values, logits_to_keep):
        raise AssertionError("build_metadata must not run the model")


def _request(rid, prompt, output=(), computed=0, **sampling):
    req = Request(rid, list(prompt), SamplingParams(**sampling))
    req.output_token_ids = list(output)
    req.num_computed_tokens = computed
    return req


def test_rows_are_decodes_then_draft_rows_then_prefill_chunks_and_the_lm_head_reads_sample_score_draft():
    bs = 4
    bm = BlockManager(num_blocks=32, block_size=bs)
    decode = _request(0, range(100, 105), output=[7], computed=5)  # its 6th token: 1 row
    drafting = _request(1, range(200, 206), output=[8], computed=6)  # last token + 2 drafts: 3 rows
    scoring = _request(2, range(300, 310), computed=4, prompt_logprobs=1)  # prompt 4..9: 6 rows, samples
    chunk = _request(3, range(400, 412))  # prompt 0..4: 5 rows, does not sample yet
    bm.allocate(0, 6)
    bm.allocate(1, 9)
    bm.allocate(2, 10)
    bm.allocate(3, 5)
    rows = [
        ScheduledRequest.for_tokens(decode, 1),
        ScheduledRequest.for_tokens(drafting, 3, [31, 32]),
        ScheduledRequest.for_tokens(scoring, 6),
        ScheduledRequest.for_tokens(chunk, 5),
    ]
    table = {rid: bm.get_block_table(rid) for rid in range(4)}
    # The plan is a value: the live requests and the block manager are gone when the runner reads it.
    plan = StepPlan(
        iteration=0,
        scheduled=[s.with_blocks(table[s.request_id]) for s in rows],
        new_requests=[NewRequestData.of(r) for r in (decode, drafting, scoring, chunk)],
    )
    for req in (decode, drafting, scoring, chunk):
        bm.free(req.request_id)
        req.output_token_ids.append(-1)
        req.num_computed_tokens = -1
    cache = SimpleNamespace(num_kv_heads=2, backend=TorchAttentionBackend())
    runner = ModelRunner(_ForwardSignature(), cache, torch.device("cpu"), None, bs, 4)

    inputs = runner.build_metadata(plan)

    # Rows: 0 decode | 1-3 drafting | 4-9 scoring chunk | 10-14 plain chunk.
    assert inputs.input_ids.tolist() == [7, 8, 31, 32, *range(304, 310), *range(400, 405)]
    assert inputs.positions.tolist() == [5, 6, 7, 8, *range(4, 10), *range(0, 5)]
    assert inputs.sample_rows == [0, 9]  # the decode and the scoring chunk's last row
    # Row 4 + (p - 4) predicts prompt token p + 1, for p + 1 in [1, 10) within this chunk.
    assert inputs.score_rows == [4, 5, 6, 7, 8]
    assert inputs.score_targets == [(2, p + 1, 301 + p) for p in range(4, 9)]
    assert inputs.draft_rows == [1, 2, 3]
    assert inputs.logits_rows == [0, 9, 4, 5, 6, 7, 8, 1, 2, 3]
    meta = inputs.metadata
    assert meta.num_decodes == 4  # the decode and the drafting request's 3 rows
    assert meta.query_start_loc_cpu == [0, 1, 2, 3, 4, 10, 15]
    assert meta.seq_lens_cpu == [6, 7, 8, 9, 10, 5]
    want_slots = [table[0][1] * bs + 1]  # position 5: block 1, offset 1
    want_slots += [table[1][p // bs] * bs + p % bs for p in (6, 7, 8)]
    want_slots += [table[2][p // bs] * bs + p % bs for p in range(4, 10)]
    want_slots += [table[3][p // bs] * bs + p % bs for p in range(0, 5)]
    assert meta.slot_mapping.tolist() == want_slots


def test_the_persistent_buffers_give_a_small_step_after_a_large_one_what_a_fresh_runner_gives():
    bs = 4
    bm = BlockManager(num_blocks=64, block_size=bs)
    big = [_request(i, range(10 * i, 10 * i + 9)) for i in range(3)]  # 27 prefill rows, 3 blocks each
    small = _request(7, range(500, 506), output=[9], computed=6)  # one decode
    for req in (*big, small):
        bm.allocate(req.request_id, req.num_tokens)

    def plan_of(reqs, n):
        rows = [ScheduledRequest.for_tokens(r, n(r)) for r in reqs]
        new = [NewRequestData.of(r) for r in reqs]  # sent again: adding a row twice changes nothing
        return StepPlan(0, [s.with_blocks(bm.get_block_table(s.request_id)) for s in rows], new_requests=new)

    def inputs_of(runner, plan):
        i = runner.build_metadata(plan)
        m = i.metadata
        return (
            i.input_ids.tolist(),
            i.positions.tolist(),
            m.slot_mapping.tolist(),
            m.query_start_loc.tolist(),
            m.seq_lens.tolist(),
            m.block_tables.tolist(),
            i.logits_index.tolist(),
        )

    def new_runner(capacity):
        return ModelRunner(
            _ForwardSignature(),
            SimpleNamespace(num_kv_heads=1, backend=TorchAttentionBackend()),
            torch.device("cpu"),
            None,
            bs,
            capacity,
        )

    reused = new_runner(2)  # grows on the first step
    inputs_of(reused, plan_of(big, lambda r: r.num_tokens))
    got = inputs_of(reused, plan_of([small], lambda r: 1))
    table = bm.get_block_table(7)
    # By arithmetic: position 6 of request 7 (block 1, offset 2), one query row of 7 tokens.
    assert got == ([9], [6], [table[1] * bs + 2], [0, 1], [7], [table], [0])
    assert got == inputs_of(new_runner(2), plan_of([small], lambda r: 1))
    assert reused.build_metadata(plan_of([small], lambda r: 1)).metadata.block_tables.is_contiguous()


def test_the_input_batch_changes_only_by_the_plans_diffs():
    prompt = _request(0, [1, 2, 3, 4, 5])
    other = _request(1, [9, 9])
    batch = InputBatch()
    first = ScheduledRequest.for_tokens(prompt, 3)  # a chunk: positions 0..2
    batch.apply(StepPlan(0, [first], new_requests=[NewRequestData.of(prompt), NewRequestData.of(other)]))
    assert sorted(batch.rows) == [0, 1] and batch.get(0).token_ids == [1, 2, 3, 4, 5]  # the whole prompt
    prompt.num_computed_tokens = 3
    last = ScheduledRequest.for_tokens(prompt, 2)  # the rest of the prompt: it samples
    batch.apply(StepPlan(1, [last]))
    assert batch.get(0).token_ids == [1, 2, 3, 4, 5] and batch.get(0).output_token_ids == []
    prompt.output_token_ids.append(6)
    prompt.num_computed_tokens = 5
    drafting = ScheduledRequest.for_tokens(prompt, 3, [7, 8])  # 6, then drafts 7 and 8
    batch.apply(StepPlan(2, [drafting]))
    assert batch.get(0).token_ids == [1, 2, 3, 4, 5, 6, 7, 8]
    prompt.output_token_ids += [7, 0]  # draft 7 accepted, 8 rejected: the greedy token 0 instead
    prompt.num_computed_tokens = 7
    decode = ScheduledRequest.for_tokens(prompt, 1)
    batch.apply(StepPlan(3, [decode], finished_ids=[1]))
    assert batch.get(0).token_ids == [1, 2, 3, 4, 5, 6, 7, 0] and sorted(batch.rows) == [0]
    assert batch.get(0).output_token_ids == [6, 7, 0]
    batch.apply(StepPlan(4, [], preempted_ids=[0]))
    assert len(batch) == 0
