"""``ModelRunner.build_metadata``: the row layout of one flattened step, by arithmetic on a plan.

No model runs: the runner only reads the plan, the block tables, the cache's head count and its backend (which builds the metadata) here.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch

from hf_contbatch.core.block_manager import BlockManager
from hf_contbatch.core.plan import ScheduledRequest, StepPlan
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
    plan = StepPlan(
        iteration=0,
        scheduled=[
            ScheduledRequest.for_tokens(decode, 1),
            ScheduledRequest(drafting, 3, True, [31, 32]),
            ScheduledRequest.for_tokens(scoring, 6),
            ScheduledRequest.for_tokens(chunk, 5),
        ],
    )
    runner = ModelRunner(
        _ForwardSignature(),
        SimpleNamespace(num_kv_heads=2, backend=TorchAttentionBackend()),
        bm,
        torch.device("cpu"),
        None,
    )

    inputs = runner.build_metadata(plan)

    # Rows: 0 decode | 1-3 drafting | 4-9 scoring chunk | 10-14 plain chunk.
    assert inputs.input_ids.tolist() == [7, 8, 31, 32, *range(304, 310), *range(400, 405)]
    assert inputs.positions.tolist() == [5, 6, 7, 8, *range(4, 10), *range(0, 5)]
    assert inputs.sample_rows == [0, 9]  # the decode and the scoring chunk's last row
    # Row 4 + (p - 4) predicts prompt token p + 1, for p + 1 in [1, 10) within this chunk.
    assert inputs.score_rows == [4, 5, 6, 7, 8]
    assert [(r.request_id, t, tok) for r, t, tok in inputs.score_targets] == [(2, p + 1, 301 + p) for p in range(4, 9)]
    assert inputs.draft_rows == [1, 2, 3]
    assert inputs.logits_rows == [0, 9, 4, 5, 6, 7, 8, 1, 2, 3]
    meta = inputs.metadata
    assert meta.num_decodes == 4  # the decode and the drafting request's 3 rows
    assert meta.query_start_loc_cpu == [0, 1, 2, 3, 4, 10, 15]
    assert meta.seq_lens_cpu == [6, 7, 8, 9, 10, 5]
    table = {rid: bm.get_block_table(rid) for rid in range(4)}
    want_slots = [table[0][1] * bs + 1]  # position 5: block 1, offset 1
    want_slots += [table[1][p // bs] * bs + p % bs for p in (6, 7, 8)]
    want_slots += [table[2][p // bs] * bs + p % bs for p in range(4, 10)]
    want_slots += [table[3][p // bs] * bs + p % bs for p in range(0, 5)]
    assert meta.slot_mapping.tolist() == want_slots
