"""Test helper: a ``RunnerOutput`` from the ``{request_id: token or [greedy token per row]}`` a test
writes for a fake forward."""

from __future__ import annotations

from hf_contbatch.core.plan import RunnerOutput, StopDecision
from hf_contbatch.request import RequestStatus


def runner_output(tokens: dict) -> RunnerOutput:
    """``tokens[request_id]``: an int for a sampling row, a list for a request verifying drafts."""
    return RunnerOutput(
        sampled={rid: t for rid, t in tokens.items() if not isinstance(t, list)},
        greedy={rid: t for rid, t in tokens.items() if isinstance(t, list)},
    )


def length_decisions(sched, plan, output: RunnerOutput) -> dict:
    """The engine's length check on each request's proposed tokens (``Scheduler.proposed_tokens``):
    a request stops with "length" at the token that reaches its ``max_new_tokens``."""
    decisions = {}
    for rid, tokens in sched.proposed_tokens(plan, output).items():
        req = sched.request(rid)
        room = req.sampling.max_new_tokens - len(req.output_token_ids)
        if room <= len(tokens):
            decisions[rid] = StopDecision(room, RequestStatus.FINISHED_LENGTH)
    return decisions
