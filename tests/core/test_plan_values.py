"""The plan's rows as values, the runner's typed output, and the verbs of ``StepBudget`` and
``RequestQueues`` (the only code that changes the budget and moves requests between queues)."""

from __future__ import annotations

import pytest

from hf_contbatch.config import SchedulerConfig
from hf_contbatch.core.block_manager import BlockManager
from hf_contbatch.core.budget import StepBudget
from hf_contbatch.core.plan import NewRequestData, RunnerOutput, ScheduledRequest
from hf_contbatch.core.queues import RequestQueues
from hf_contbatch.request import Request, RequestStatus, SamplingParams


def _request(rid, prompt, output=(), computed=0, **sampling):
    req = Request(rid, list(prompt), SamplingParams(**sampling))
    req.output_token_ids = list(output)
    req.num_computed_tokens = computed
    return req


def test_a_row_holds_its_tokens_position_and_scoring_as_of_scheduling():
    req = _request(3, range(100, 110), computed=4, prompt_logprobs=2, adapter_name="sql")
    row = ScheduledRequest.for_tokens(req, 5)
    # Prompt positions 4..8; positions p with p + 1 in [2, 10) score token p + 1: p = 4..8.
    assert (row.request_id, row.token_ids, row.start_position) == (3, tuple(range(104, 109)), 4)
    assert not row.samples and not row.is_decode
    assert list(row.scored_positions(2, req.num_prompt_tokens)) == [4, 5, 6, 7, 8]
    assert list(row.scored_positions(0, req.num_prompt_tokens)) == []  # prompt_logprobs off
    assert list(row.scored_positions(9, req.num_prompt_tokens)) == [8]  # only p + 1 = 9 from 9 on
    req.num_computed_tokens = 9  # the live request moves on; the row does not
    assert row.start_position == 4 and row.with_blocks([7, 2, 5]).block_ids == (7, 2, 5)
    with pytest.raises(AttributeError):
        row.num_new_tokens = 1  # frozen


def test_a_new_request_reaches_the_runner_once_as_values():
    req = _request(3, [1, 2, 3], output=[4], computed=3, adapter_name="sql", do_sample=True, top_k=5, seed=7)
    new = NewRequestData.of(req)
    assert (new.request_id, new.token_ids, new.num_prompt_tokens, new.adapter_name) == (3, (1, 2, 3, 4), 3, "sql")
    assert (new.sampling.do_sample, new.sampling.top_k, new.sampling.seed, new.sampling.has_grammar) == (
        True,
        5,
        7,
        False,
    )
    req.output_token_ids.append(5)  # the live request moves on; the value does not
    assert new.token_ids == (1, 2, 3, 4)
    with pytest.raises(AttributeError):
        new.sampling.top_k = 1  # frozen


def test_a_drafting_row_runs_the_last_token_then_the_drafts_and_samples():
    req = _request(1, [5, 6, 7], output=[8], computed=3)
    row = ScheduledRequest.for_tokens(req, 3, [9, 10])
    assert row.token_ids == (8, 9, 10) and row.start_position == 3 and row.samples and row.is_speculative
    decode = ScheduledRequest.for_tokens(req, 1)
    assert decode.is_decode and decode.token_ids == (8,) and decode.samples


def test_runner_outputs_of_two_halves_merge():
    a = RunnerOutput(sampled={1: 5}, greedy={2: [3, 4]}, prompt_logprobs={1: [(2, -0.5, True)]})
    a.merge(RunnerOutput(sampled={3: 6}, prompt_logprobs={1: [(3, -1.0, False)], 4: [(1, -2.0, True)]}))
    assert a.sampled == {1: 5, 3: 6} and a.greedy == {2: [3, 4]}
    assert a.prompt_logprobs == {1: [(2, -0.5, True), (3, -1.0, False)], 4: [(1, -2.0, True)]}


def test_step_budget_changes_only_through_its_verbs():
    cfg = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=32)
    bm = BlockManager(num_blocks=20, block_size=4)
    queues = RequestQueues(cfg, 0.0)
    step = StepBudget(queues, bm, cfg, watermark_blocks=2)
    running = _request(0, range(10), computed=0)
    step.schedule(ScheduledRequest.for_tokens(running, 10))
    step.open_blocks(bm.num_free_blocks)
    assert (step.token_budget, step.block_budget) == (22, 20 - 3 - 2)  # 10 tokens need 3 blocks
    step.reserve_swap_in(_request(1, range(4)), 4, 1)
    step.take_blocks(2)
    assert (step.token_budget, step.block_budget) == (18, 12)
    step.replace_row(0, ScheduledRequest.for_tokens(running, 10), blocks=0)
    assert step.unschedule(running)[0].num_new_tokens == 10 and step.token_budget == 28
    step.give_back_blocks(3)
    assert step.block_budget == 15
    with pytest.raises(AttributeError):
        step.token_budget = 0
    with pytest.raises(AttributeError):
        step.block_budget = 0


def test_request_queues_move_requests_and_set_their_status():
    queues = RequestQueues(SchedulerConfig(), 0.0)
    a, b = _request(0, [1, 2]), _request(1, [3, 4])
    queues.add_waiting(a)
    queues.add_waiting(b)
    queues.admit_waiting(b)
    assert queues.waiting == [a] and queues.running == [b] and b.status is RequestStatus.RUNNING
    queues.swap_out(b)
    assert queues.swapped == [b] and b.status is RequestStatus.SWAPPED and not queues.running
    queues.swap_in(b)
    queues.preempt_to_waiting(b)
    assert queues.waiting == [a, b] and b.status is RequestStatus.WAITING
    queues.admit_waiting(a)
    queues.remove([a])
    assert queues.queued() == [b]
    with pytest.raises(ValueError):
        queues.swap_out(b)  # not running
