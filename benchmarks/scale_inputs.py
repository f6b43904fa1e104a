"""The lab that benchmarks/reconcile_scale.py measures: its magic queues and devices, and
``reconcile.Inputs`` built from them without a database (the ``plan()`` rows), with every
lending knob of issue 11 when asked (``with_every_knob``). Shared constants: the benchmark's
clock (``NOW``), racks, devices per agent host, GPUs per device."""

from __future__ import annotations

import statistics
import time

from testflinger_magic import reconcile as R
from testflinger_magic.queues import load_text

NOW = 1_900_000_000.0
RACKS = 10
DEVICES_PER_HOST = 8
GPUS = 4


def queue_yaml(n_queues: int, n_devices: int) -> str:
    """``n_queues`` magic queues: queue k selects rack ``k % 10`` by tag (every tenth one all
    devices by home queue), 1 or 2 GPUs per VM, priorities 0-4."""
    out = ["magic_queues:"]
    for k in range(n_queues):
        sel = ("{home_queues: [gpu-hosts]}" if k % 10 == 9 else f"{{tags: [rack-{k % RACKS}]}}")
        out.append(f"""  mq-{k:02d}:
    description: bench queue {k}
    devices: {sel}
    vm: {{gpus: {1 + k % 2}}}
    policy: {{max_devices: {n_devices}, max_starting: 2, idle_timeout: 10m, priority: {k % 5},
              failures_before_quarantine: {3 + k % 3}}}""")
    return "\n".join(out) + "\n"


def device_name(i: int) -> str:
    return f"gpu-host-{i:04d}"


def queue_of(i: int, n_queues: int) -> int:
    """The queue device ``i`` is lent to: one that selects its rack."""
    rack = i % RACKS
    choices = [k for k in range(n_queues) if k % 10 != 9 and k % RACKS == rack] or [0]
    return choices[(i // RACKS) % len(choices)]


# ------------------------------------------------------------------ plan() on synthetic inputs

def synthetic_inputs(n: int, n_queues: int) -> R.Inputs:
    defs = load_text(queue_yaml(n_queues, n), "bench.yaml")
    by_name = {q.name: q for q in defs}
    devices, leases, agents = [], [], []
    for i in range(n):
        name = device_name(i)
        leased = i % 2 == 0 and n_queues > 0
        busy_home = not leased and i % 4 == 1
        devices.append(R.DeviceView(
            name=name, agent_host=f"host-{i // DEVICES_PER_HOST}", gpus=GPUS,
            tags=[f"rack-{i % RACKS}"], home_queues=["gpu-hosts", f"rack-{i % RACKS}"],
            agent_state="offline" if leased else ("test" if busy_home else "waiting"),
            job_id=f"home-{i}" if busy_home else None, failures=(i % 7 == 3) * (i % 5),
            last_home_use=NOW - 60 * i))
        if not leased:
            continue
        q = by_name[f"mq-{queue_of(i, n_queues):02d}"]
        vms = q.vms_for(GPUS)
        kind = i % 10
        state = "deploying" if kind == 2 else ("draining" if kind == 4 else "active")
        drain = {"kind": "idle", "reason": "idle", "grace_until": NOW + 600, "forced": False} \
            if state == "draining" else None
        lid = f"lease-{i:06d}"
        leases.append(R.LeaseView(
            id=lid, device=name, queue=q.name, state=state, generation=3,
            created_at=NOW - 3600 - i, updated_at=NOW - 900, deadline=None, vms=vms, drain=drain,
            admission="paused" if kind == 6 else "open",
            idle_since=NOW - 700 if kind == 8 else None, active_since=NOW - 3000,
            vm_names=[f"{name}-vm{v + 1}" for v in range(vms)]))
        if state in ("active", "draining"):
            for v in range(vms):
                busy = (i + v) % 3 != 0
                agents.append(R.VMAgentView(f"{name}-vm{v + 1}", lid, q.name, "test" if busy
                                            else "waiting", f"job-{i}-{v}" if busy else None, busy))
    demand = {q.name: R.QueueDemand(k % 4, k % 3, 300.0, NOW - 10) for k, q in enumerate(defs)}
    demand["gpu-hosts"] = R.QueueDemand(n // 50, 0, 900.0, NOW - 20)
    for r in range(RACKS):
        demand[f"rack-{r}"] = R.QueueDemand(r % 2, 0, 60.0 * r, NOW - 30)
    return R.Inputs(definitions=defs, devices=devices, demand=demand, leases=leases,
                    vm_agents=agents, now=NOW)


def timed_plan(inp: R.Inputs, budget: float = 2.0) -> tuple[float, int]:
    """Median seconds of one plan() over as many repeats as fit in ``budget`` (at least 3)."""
    times, actions = [], 0
    start = time.perf_counter()
    while len(times) < 3 or (time.perf_counter() - start < budget and len(times) < 200):
        t0 = time.perf_counter()
        actions = len(R.plan(inp))
        times.append(time.perf_counter() - t0)
    return statistics.median(times), actions


def with_every_knob(inp: R.Inputs) -> R.Inputs:
    """``inp`` with every lending knob of issue 11 on every queue (queue_policy.py: a warm
    window covering the whole week, warm_learn over 200 arrivals an hour apart, device_fit
    demand, yield_idle, max_share 0.6, reclaim.idle_wait 0s): the cost of the knobs at size
    (printed, not a goal)."""
    import dataclasses  # noqa: PLC0415

    defs = []
    for q in inp.definitions:
        q = q.model_copy(deep=True)
        q.policy.max_devices = max(q.policy.max_devices, 2)
        q.policy.warm = [{"days": "mon-sun", "hours": "00:00-24:00", "devices": 1}]
        q.policy.warm_learn = {"lookback": "7d", "ahead": "1h", "max_devices": 1}
        q.policy.device_fit = "demand"
        q.policy.yield_idle = 300.0
        q.policy.max_share = 0.6
        q.policy.reclaim.idle_wait = 0.0
        defs.append(q)
    arrivals = {q.name: sorted(inp.now - k * 3600.0 for k in range(200)) for q in defs}
    return dataclasses.replace(inp, definitions=defs, arrivals=arrivals)
