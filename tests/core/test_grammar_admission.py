"""A request whose grammar still compiles (``Request.waiting_for_grammar``) is passed over at
admission without holding back the requests behind it, and admitted once its grammar is ready;
the drafts of a request are cut by the scheduler's ``draft_filter``."""

from __future__ import annotations

import pytest

from hf_contbatch import SamplingParams, SchedulerConfig
from hf_contbatch.core.block_manager import BlockManager
from hf_contbatch.core.scheduler import Scheduler
from hf_contbatch.request import Request

from runner_outputs import runner_output


def _req(rid, n=6, **sampling):
    return Request(rid, list(range(3, 3 + n)), SamplingParams(max_new_tokens=8, **sampling), arrival_time=float(rid))


@pytest.mark.timeout(150)
def test_a_request_waiting_for_its_grammar_is_passed_over_then_admitted():
    sched = Scheduler(SchedulerConfig(watermark=0.0), BlockManager(num_blocks=32, block_size=4))
    first, second, third = _req(0), _req(1), _req(2)
    first.waiting_for_grammar = True
    for r in (first, second, third):
        sched.add_request(r)
    out = sched.schedule()
    assert [sched.request(s.request_id) for s in out.plan.scheduled] == [second, third]
    assert sched.waiting == [first]
    first.waiting_for_grammar = False
    out = sched.schedule()
    assert first in [sched.request(s.request_id) for s in out.plan.scheduled]
    assert sched.waiting == []


@pytest.mark.timeout(150)
def test_the_draft_filter_cuts_a_requests_drafts_to_the_prefix_it_returns():
    seen = []

    def keep_two(req, drafts):
        seen.append(list(drafts))
        return drafts[:2]

    sched = Scheduler(SchedulerConfig(watermark=0.0), BlockManager(num_blocks=32, block_size=4), draft_filter=keep_two)
    req = Request(0, [5, 6, 7, 8, 9, 5, 6], SamplingParams(max_new_tokens=12, prompt_lookup_num_tokens=4))
    sched.add_request(req)
    out = sched.schedule()  # prefill, first token sampled below
    sched.update_from_output(out.plan, runner_output({0: 7}))  # context ... 5 6 7: the lookup proposes 8 9 5 6
    out = sched.schedule()
    assert seen == [[8, 9, 5, 6]]
    assert [s.draft_token_ids for s in out.plan.scheduled] == [(8, 9)]
