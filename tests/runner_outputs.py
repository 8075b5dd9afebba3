"""Test helper: a ``RunnerOutput`` from the ``{request_id: token or [greedy token per row]}`` a test
writes for a fake forward."""

from __future__ import annotations

from hf_contbatch.core.plan import RunnerOutput


def runner_output(tokens: dict) -> RunnerOutput:
    """``tokens[request_id]``: an int for a sampling row, a list for a request verifying drafts."""
    return RunnerOutput(
        sampled={rid: t for rid, t in tokens.items() if not isinstance(t, list)},
        greedy={rid: t for rid, t in tokens.items() if isinstance(t, list)},
    )
