"""reconcile.plan's yield of a *partly busy* lease (issue 11: "no magic queue starving while
another sharing its devices has idle VMs"; reconcile_sharing.Sharing.plan_yields): a queue that
starves gets a lease of a quiet queue sharing its devices even when some of that lease's VMs
run jobs; admission closes, the jobs finish (the drain's grace is at least YIELD_GRACE, never a
cancel for a yield), and the anti-thrash rule keeps a device from going back and forth. One
decision per test, each beside the inputs that must not yield."""

from __future__ import annotations

from test_reconcile_knobs import (HOUR, MON_10, device, idle_agents, inputs, lease, queue)

from testflinger_magic.reconcile import YIELD_GRACE, QueueDemand, plan


def _lab(n_a=2, b_leases=0, last_job_ago=HOUR, b_max=3, **a_policy):
    """one-gpu-vm (A, yield_idle 5m) holds ``n_a`` 4-GPU devices: a1 has 4 busy VMs, the others
    1 busy and 3 idle (a2), 2 busy and 2 idle (a3...); two-gpu-vm (B) holds ``b_leases``
    devices full of jobs and has 2 jobs waiting; no device is free. A's last job was
    submitted or started ``last_job_ago`` seconds ago."""
    a = queue("one-gpu-vm", yield_idle="5m", idle_timeout="3h", **a_policy)
    b = queue("two-gpu-vm", gpus=2, max_devices=b_max)
    devs, ls, ags = [], [], []
    for k in range(1, n_a + 1):
        devs.append(device(f"a-dev{k}", agent_state="offline"))
        ls.append(lease(f"a{k}", f"a-dev{k}", active_since=MON_10 - 2 * HOUR))
        busy = 4 if k == 1 else min(4, k - 1)
        ags += idle_agents(f"a{k}", 4 - busy, busy=busy)
    for k in range(1, b_leases + 1):
        devs.append(device(f"b-dev{k}", agent_state="offline"))
        ls.append(lease(f"b{k}", f"b-dev{k}", queue="two-gpu-vm", vms=2))
        ags += idle_agents(f"b{k}", 0, "two-gpu-vm", busy=2)
    demand = {"two-gpu-vm": QueueDemand(waiting=2),
              "one-gpu-vm": QueueDemand(waiting=0, last_job_at=MON_10 - last_job_ago)}
    return [a, b], devs, demand, ls, ags


def yields(actions):
    return [(x.lease_id, x.data.get("for")) for x in actions
            if x.kind == "drain" and x.data.get("kind") == "yield"]


def test_a_partly_busy_lease_is_drained_for_a_starving_queue_and_its_jobs_finish():
    defs, devs, demand, ls, ags = _lab()
    acts = plan(inputs(defs, devs, demand, ls, ags))
    assert yields(acts) == [("a2", "two-gpu-vm")]  # a2: 3 idle VMs; a1 is full
    (d,) = [x for x in acts if x.kind == "drain"]
    # Never a forced cancel for a yield: the grace outlasts any job Testflinger lets run.
    assert d.data["grace"] == YIELD_GRACE >= 10 * HOUR and d.data["force"] is False
    assert "has 3 idle VMs and 1 running job" in d.reason
    assert "let the running ones finish" in d.reason
    # Without yield_idle, the old plan: only consolidation's pause of a2 (it empties when
    # its job ends, then goes home), whoever starves meanwhile.
    old = [queue("one-gpu-vm", idle_timeout="3h"), defs[1]]
    assert [(x.kind, x.lease_id) for x in plan(inputs(old, devs, demand, ls, ags))] \
        == [("pause", "a2")]


def test_the_lease_with_most_idle_vms_goes_first_and_only_as_many_as_needed():
    defs, devs, demand, ls, ags = _lab(n_a=3)
    # a2: 3 idle 1 busy; a3: 2 idle 2 busy. Two jobs of two-gpu-vm: one device (2 VMs) covers.
    assert yields(plan(inputs(defs, devs, demand, ls, ags))) == [("a2", "two-gpu-vm")]
    more = dict(demand, **{"two-gpu-vm": QueueDemand(waiting=4)})
    assert yields(plan(inputs(defs, devs, more, ls, ags))) == [("a2", "two-gpu-vm")]
    # (a second would leave one-gpu-vm with fewer leases than two-gpu-vm: the anti-thrash rule)


def test_no_partly_busy_yield_while_the_queue_is_not_quiet_or_needs_the_idle_vms():
    defs, devs, demand, ls, ags = _lab(last_job_ago=60)  # a job started a minute ago
    assert yields(plan(inputs(defs, devs, demand, ls, ags))) == []
    defs, devs, demand, ls, ags = _lab()
    fresh = [l if l.id != "a2" else lease("a2", "a-dev2", active_since=MON_10 - 60) for l in ls]
    assert yields(plan(inputs(defs, devs, demand, fresh, ags))) == []  # active for 1 min
    # one-gpu-vm's own waiting jobs need a2's idle VMs (its other leases have none).
    needy = dict(demand, **{"one-gpu-vm": QueueDemand(waiting=2, last_job_at=MON_10 - HOUR)})
    assert yields(plan(inputs(defs, devs, needy, ls, ags))) == []


def test_anti_thrash_a_queue_yields_only_to_one_holding_two_fewer_leases():
    # A holds 2, B 0: after the yield 1 and 1.
    defs, devs, demand, ls, ags = _lab(n_a=2, b_leases=0)
    assert yields(plan(inputs(defs, devs, demand, ls, ags))) == [("a2", "two-gpu-vm")]
    # A holds 2, B 1 (B's jobs beyond its lease): a yield would leave A 1 and B 2, and B, just
    # given the device, would then owe it back: none.
    defs, devs, demand, ls, ags = _lab(n_a=2, b_leases=1)
    assert yields(plan(inputs(defs, devs, demand, ls, ags))) == []
    # A holds 3, B 1: one (2 and 2).
    defs, devs, demand, ls, ags = _lab(n_a=3, b_leases=1)
    assert yields(plan(inputs(defs, devs, demand, ls, ags))) == [("a2", "two-gpu-vm")]
    # A lone partly busy lease is never yielded (the old rule: only a wholly idle one).
    defs, devs, demand, ls, ags = _lab(n_a=1)
    ls = [lease("a1", "a-dev1", active_since=MON_10 - 2 * HOUR)]
    assert yields(plan(inputs(defs, devs, demand, ls, idle_agents("a1", 3, busy=1)))) == []


def test_the_reverse_yield_never_follows():
    """After the yield (A 1 lease, B 1 lease, both partly busy), A's jobs come back beyond its
    supply and no device is free: B's lease is not yielded back to A."""
    a = queue("one-gpu-vm", yield_idle="5m", idle_timeout="3h")
    b = queue("two-gpu-vm", gpus=2, yield_idle="5m", idle_timeout="3h")
    devs = [device("a-dev1", agent_state="offline"), device("a-dev2", agent_state="offline")]
    ls = [lease("a1", "a-dev1", active_since=MON_10 - 2 * HOUR),
          lease("b1", "a-dev2", queue="two-gpu-vm", vms=2, active_since=MON_10 - HOUR)]
    ags = idle_agents("a1", 0, busy=4) + idle_agents("b1", 1, "two-gpu-vm", busy=1)
    demand = {"one-gpu-vm": QueueDemand(waiting=3),
              "two-gpu-vm": QueueDemand(waiting=0, last_job_at=MON_10 - HOUR)}
    assert yields(plan(inputs([a, b], devs, demand, ls, ags))) == []


def test_a_partly_busy_yield_keeps_priorities_owners_max_devices_and_max_share():
    # A warm lease (within min_devices) does not yield to a lower-priority queue.
    defs, devs, demand, ls, ags = _lab(priority=5, min_devices=2)
    assert yields(plan(inputs(defs, devs, demand, ls, ags))) == []
    # Owners whose jobs of at least B's priority wait would take it back: no use to B.
    defs, devs, demand, ls, ags = _lab()
    owners = dict(demand, **{"gpu-hosts": QueueDemand(waiting=1, max_priority=5, oldest_age=10)})
    assert yields(plan(inputs(defs, devs, owners, ls, ags))) == []
    # B can hold one device and one is already on its way to it by a yield: no second.
    defs, devs, demand, ls, ags = _lab(n_a=4, b_max=1)
    on_way = [l if l.id != "a4" else lease("a4", "a-dev4", state="draining",
                                            drain={"kind": "yield", "for": "two-gpu-vm"})
              for l in ls]
    more = dict(demand, **{"two-gpu-vm": QueueDemand(waiting=6)})
    assert yields(plan(inputs(defs, devs, more, on_way, ags))) == []
    # A device idle at home that max_share forbids to B is no device: B starves, A yields.
    defs, devs, demand, ls, ags = _lab()
    defs[1] = queue("two-gpu-vm", gpus=2, max_share=0.5)
    home = devs + [device("free-1")]  # 2 of 3 gpu-hosts lent: the cap (1) is passed
    assert yields(plan(inputs(defs, home, demand, ls, ags))) == [("a2", "two-gpu-vm")]
