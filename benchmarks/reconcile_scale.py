#!/usr/bin/env python3
"""How ``reconcile.plan()`` grows with the lab: 10, 100 and 1000 devices.

Each size N builds one pure ``reconcile.Inputs``: N registered 4-GPU devices (a quarter busy with
home jobs), two magic queues that may use all of them (``max_devices`` = N), N/2 open leases
(mostly active with 4 VM agents each, some in bring-up, some draining, some paused), and waiting
jobs on the magic and home queues. ``plan()`` is timed over repeats (median), and the table shows
the time per device and the growth ratio against the previous size, per 10x more devices:
near-linear means the ratio stays near 10 (time per device stays flat).
Goal (benchmarks/README.md): growth ratio <= 15 per 10x (per-device time within 1.5x).
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from testflinger_magic import reconcile as R  # noqa: E402
from testflinger_magic.queues import load_text  # noqa: E402

QUEUES = """
magic_queues:
  one-gpu-vm:
    description: bench
    devices: {home_queues: [gpu-hosts]}
    vm: {gpus: 1}
    policy: {max_devices: %(n)d, max_starting: %(n)d, idle_timeout: 10m}
  two-gpu-vm:
    description: bench
    devices: {tags: [nvidia]}
    vm: {gpus: 2}
    policy: {max_devices: %(n)d, max_starting: %(n)d, idle_timeout: 10m, priority: 5}
"""
NOW = 1_000_000.0


def inputs(n: int) -> R.Inputs:
    defs = load_text(QUEUES % {"n": n}, "bench.yaml")
    devices, leases, agents = [], [], []
    for i in range(n):
        name = f"gpu-host-{i:04d}"
        leased = i % 2 == 0
        busy_home = not leased and i % 4 == 1
        devices.append(R.DeviceView(
            name=name, agent_host=f"host-{i // 8}", gpus=4, tags=["nvidia"],
            home_queues=["gpu-hosts", f"rack-{i % 10}"],
            agent_state="offline" if leased else ("test" if busy_home else "waiting"),
            job_id=f"home-{i}" if busy_home else None, failures=i % 3,
            last_home_use=NOW - 60 * i))
        if not leased:
            continue
        queue = "one-gpu-vm" if i % 4 == 0 else "two-gpu-vm"
        vms = 4 if queue == "one-gpu-vm" else 2
        kind = i % 10
        state = "deploying" if kind == 2 else ("draining" if kind == 4 else "active")
        drain = {"kind": "idle", "reason": "idle", "grace_until": NOW + 600, "forced": False} \
            if state == "draining" else None
        lid = f"lease-{i:06d}"
        leases.append(R.LeaseView(
            id=lid, device=name, queue=queue, state=state, generation=3,
            created_at=NOW - 3600 - i, updated_at=NOW - 900, deadline=None, vms=vms, drain=drain,
            admission="paused" if kind == 6 else "open", idle_since=NOW - 700 if kind == 8 else None))
        if state in ("active", "draining"):
            for v in range(vms):
                busy = (i + v) % 3 != 0
                agents.append(R.VMAgentView(f"{name}-vm{v + 1}", lid, queue, "test" if busy
                                            else "waiting", f"job-{i}-{v}" if busy else None, busy))
    demand = {"one-gpu-vm": R.QueueDemand(n // 2, 0, 300.0, NOW - 10),
              "two-gpu-vm": R.QueueDemand(n // 5, 3, 120.0, NOW - 5),
              "gpu-hosts": R.QueueDemand(n // 10, 0, 900.0, NOW - 20)}
    for r in range(10):
        demand[f"rack-{r}"] = R.QueueDemand(r % 2, 0, 60.0 * r, NOW - 30)
    return R.Inputs(definitions=defs, devices=devices, demand=demand, leases=leases,
                    vm_agents=agents, now=NOW)


def timed(inp: R.Inputs, budget: float = 2.5) -> tuple[float, int]:
    """Median seconds of one plan() over as many repeats as fit in ``budget`` (at least 3)."""
    times, actions = [], 0
    start = time.perf_counter()
    while len(times) < 3 or (time.perf_counter() - start < budget and len(times) < 200):
        t0 = time.perf_counter()
        actions = len(R.plan(inp))
        times.append(time.perf_counter() - t0)
    return statistics.median(times), actions


def main() -> int:
    print("reconcile.plan() on synthetic labs (median of repeats)")
    print(f"{'devices':>8}{'leases':>8}{'vm agents':>10}{'actions':>9}{'plan ms':>10}"
          f"{'µs/device':>11}{'growth/10x':>12}")
    prev = None
    worst = 0.0
    for n in (10, 100, 1000):
        inp = inputs(n)
        seconds, actions = timed(inp)
        growth = seconds / prev if prev else None
        worst = max(worst, growth or 0.0)
        print(f"{n:>8}{len(inp.leases):>8}{len(inp.vm_agents):>10}{actions:>9}"
              f"{seconds * 1e3:>10.2f}{seconds / n * 1e6:>11.1f}"
              f"{(f'{growth:.1f}' if growth else '-'):>12}")
        prev = seconds
    print("goal met (growth <= 15 per 10x)" if worst <= 15 else
          f"goal NOT met: growth {worst:.1f} per 10x (> 15; see benchmarks/README.md)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
