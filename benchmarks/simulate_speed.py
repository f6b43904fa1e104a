#!/usr/bin/env python3
"""How fast ``testflinger-magic simulate`` replays: virtual seconds per wall second.

Replays examples/traces/gpu-week.yaml with examples/magic-queues.yaml as defined, then the same
week repeated twice (two weeks, the second shifted by 7 days) to show how cost grows with trace
length. Peak memory comes from separate ``tracemalloc`` replays of the first one and two days
(tracemalloc slows Python several times over, so full weeks would not fit the time budget).
Goals (benchmarks/README.md): >= 20 000 virtual seconds per wall second (a simulated week in
under 30 s); two weeks cost <= 2.5x one week in time; two days <= 2.5x one day in peak memory.
"""

from __future__ import annotations

import sys
import time
import tracemalloc
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from testflinger_magic.lab import simulate as S  # noqa: E402
from testflinger_magic.queues import load_file  # noqa: E402

WEEK = 7 * 86400.0


def weeks(trace: S.Trace, n: int) -> S.Trace:
    jobs = [replace(j, id=f"{j.id}-w{w}", submit=j.submit + w * WEEK)
            for w in range(n) for j in trace.jobs]
    return S.Trace(lab=trace.lab, jobs=tuple(jobs), until=None, source=f"{trace.source} x{n}")


def days(trace: S.Trace, n: int) -> S.Trace:
    return S.Trace(lab=trace.lab, jobs=tuple(j for j in trace.jobs if j.submit < n * 86400.0),
                   until=n * 86400.0, source=f"{trace.source} first {n}d")


def peak_bytes(trace: S.Trace, defs) -> int:
    tracemalloc.start()
    try:
        S.simulate(trace, defs)
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def main() -> int:
    base = S.load_trace(ROOT / "examples" / "traces" / "gpu-week.yaml")
    defs = load_file(ROOT / "examples" / "magic-queues.yaml")
    rows = []
    for n in (1, 2):
        trace = weeks(base, n)
        t0 = time.perf_counter()
        r = S.simulate(trace, defs)
        wall = time.perf_counter() - t0
        rows.append((n, len(trace.jobs), r.reconciles, r.virtual_seconds, wall))
    mem = [(n, peak_bytes(days(base, n), defs)) for n in (1, 2)]
    print("simulate: examples/traces/gpu-week.yaml, queues as defined")
    print(f"{'weeks':>6}{'jobs':>7}{'plans':>8}{'virtual h':>11}{'wall s':>8}"
          f"{'virt s/wall s':>15}{'µs/plan':>9}")
    for n, jobs, plans, virt, wall in rows:
        print(f"{n:>6}{jobs:>7}{plans:>8}{virt / 3600:>11.1f}{wall:>8.2f}{virt / wall:>15.0f}"
              f"{wall / plans * 1e6:>9.0f}")
    for n, peak in mem:
        print(f"peak memory, first {n} day(s): {peak / 2**20:.2f} MiB (tracemalloc)")
    (_, _, _, v1, w1), (_, _, _, v2, w2) = rows
    speed, t_ratio, m_ratio = v1 / w1, w2 / w1, mem[1][1] / mem[0][1]
    print(f"two weeks / one week: time x{t_ratio:.2f}; two days / one day: peak memory "
          f"x{m_ratio:.2f}")
    ok = speed >= 20000 and t_ratio <= 2.5 and m_ratio <= 2.5
    print("goal met" if ok else "goal NOT met (see benchmarks/README.md)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
