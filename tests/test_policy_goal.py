"""Issue 11's goal on the shipped policy (examples/magic-queues-workhours.yaml), simulated as
``simulate TRACE --queues FILE --baseline static:1 --baseline none`` does, on both example traces
(benchmarks/policy_goal.py prints the same figures): one-gpu-vm mean wait <= 0.5x a permanent
VM host's, home p95 wait <= +10% over no lending, lent GPU-hours busy >= 2x, no magic queue
starving (beyond 0.1% of the trace) beside a sharing queue's idle VMs, wholly idle lease or
partly busy, and no job cancelled by a drain of the policy. The baseline is the fair static split of
lab/baselines.py, untouched. A few seconds (two simulated weeks)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _goal():
    spec = importlib.util.spec_from_file_location("policy_goal",
                                                  ROOT / "benchmarks" / "policy_goal.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


GOAL = _goal()


@pytest.mark.parametrize("trace", GOAL.TRACES, ids=lambda p: p.stem)
def test_the_shipped_policy_meets_the_goal(trace):
    row = GOAL.measure(trace)
    assert row["policy"] == "as defined" and row["reference"] == "static:1"
    assert row["queue"] == "one-gpu-vm"  # the static host serves the busiest magic queue
    missed = [v for v in GOAL.verdicts(row) if not v[-1]]
    assert not missed, (row["line"], missed)
    r = row["result"]
    assert r.unfinished == {"magic": 0, "home": 0} and r.cancelled["home"] == 0
    assert r.forced_cancels == 0 and r.cancelled["magic"] == 0
    assert set(r.starved) == {"one-gpu-vm", "two-gpu-vm"}


def test_the_closest_old_policy_does_not():
    """The figures can fail: magic-queues.yaml with one warm device all week (the closest
    before issue 11) misses the home p95 and busy goals on the week trace."""
    row = GOAL.measure(GOAL.TRACES[0], ROOT / "examples" / "magic-queues.yaml",
                       "one-gpu-vm:min_devices=1")
    missed = {v[0] for v in GOAL.verdicts(row) if not v[-1]}
    assert {"home_p95_change", "busy_ratio"} <= missed, row["line"]
