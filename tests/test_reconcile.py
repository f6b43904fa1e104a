"""reconcile.plan: one test per rule, and hypothesis properties over random labs."""

import dataclasses

import pytest

from hypothesis import given, settings, strategies as st

from testflinger_magic.queues import MagicQueue
from testflinger_magic.reconcile import (Action, DeviceView, Inputs, LeaseView, QueueDemand,
                                         STALE_HOST_AFTER, VMAgentView, overdue_leases, plan,
                                         stale_hosts)

NOW = 1_000_000.0


def queue(name="one-gpu-vm", home=("gpu-hosts",), **policy):
    base = {"max_devices": 2, "max_starting": 2, "idle_timeout": 600.0, "max_lease": 8 * 3600.0,
            "reclaim": {"owner_wait": 1800.0, "grace": 900.0}, "provision_timeout": 2700.0}
    base.update(policy)
    return MagicQueue(name=name, description=name, devices={"home_queues": list(home)},
                      vm={"gpus": 1}, policy=base)


def device(name, gpus=8, home=("gpu-hosts",), **kw):
    kw.setdefault("agent_state", "waiting")
    return DeviceView(name=name, agent_host="h1", gpus=gpus, tags=(), home_queues=home, **kw)


def lease(id, device, state="active", queue="one-gpu-vm", vms=8, created_at=NOW - 3600, **kw):
    kw.setdefault("updated_at", created_at)
    kw.setdefault("deadline", None)
    return LeaseView(id=id, device=device, queue=queue, state=state, generation=3,
                     created_at=created_at, vms=vms, **kw)


def agents(lease_id, idle, busy=0, queue="one-gpu-vm"):
    out = [VMAgentView(f"{lease_id}-a{i}", lease_id, queue, "waiting", "", False) for i in range(idle)]
    out += [VMAgentView(f"{lease_id}-b{i}", lease_id, queue, "test", f"j{i}", True) for i in range(busy)]
    return out


def inputs(defs, devices, demand=None, leases=(), vm_agents=(), now=NOW):
    return Inputs(definitions=list(defs), devices=list(devices), demand=dict(demand or {}),
                  leases=list(leases), vm_agents=list(vm_agents), now=now)


def kinds(actions):
    return [(a.kind, a.lease_id or a.device) for a in actions]


# ---------------------------------------------------------------- scale up

def test_scale_from_zero_lends_ceil_of_demand_over_vms():
    q = queue(max_devices=5, max_starting=5)
    devs = [device(f"gpu-{i}", gpus=4) for i in range(1, 6)]
    actions = plan(inputs([q], devs, {"one-gpu-vm": QueueDemand(waiting=9)}))
    assert [a.kind for a in actions] == ["lend"] * 3  # ceil(9 / 4)
    assert all(a.data["vms"] == 4 and a.queue == "one-gpu-vm" for a in actions)
    assert actions[0].reason == "one-gpu-vm: 9 waiting jobs, 0 idle or starting VMs; lend gpu-1 (4 GPUs -> 4 VMs)"


def test_a_lend_says_when_vms_per_device_is_capped_by_the_gpus():
    """Trial finding 14: vms_per_device 16 of 1 GPU on an 8-GPU device lends 8 VMs, and says so."""
    q = MagicQueue.model_validate(dict(queue().model_dump(), vms_per_device=16))
    (a,) = plan(inputs([q], [device("gpu-1", gpus=8)], {"one-gpu-vm": QueueDemand(waiting=20)}))
    assert a.data["vms"] == 8
    assert a.reason.endswith("lend gpu-1 (8 GPUs -> 8 VMs (vms_per_device 16, capped by 8 GPUs "
                             "at 1 per VM))")
    assert q.vms_text(16) == "16 VMs" and q.vms_text(4) .startswith("4 VMs (vms_per_device 16")


def test_lend_respects_max_devices_and_max_starting():
    devs = [device(f"gpu-{i}", gpus=1) for i in range(1, 6)]
    demand = {"one-gpu-vm": QueueDemand(waiting=10)}
    assert len(plan(inputs([queue(max_devices=3, max_starting=5)], devs, demand))) == 3
    assert len(plan(inputs([queue(max_devices=5, max_starting=2)], devs, demand))) == 2
    starting = [lease("l1", "gpu-1", "deploying", vms=1, created_at=NOW - 60)]
    acts = plan(inputs([queue(max_devices=5, max_starting=2)], devs, demand, starting))
    assert [a.kind for a in acts] == ["lend"] and acts[0].device != "gpu-1"


def test_no_more_lends_when_bringup_and_idle_vms_cover_demand():
    q = queue(max_devices=4, max_starting=4)
    devs = [device(f"gpu-{i}") for i in range(1, 5)]
    leases = [lease("l1", "gpu-1", "splitting", created_at=NOW - 60), lease("l2", "gpu-2")]
    demand = {"one-gpu-vm": QueueDemand(waiting=12)}
    # 8 starting + 4 idle (of 8, the other 4 busy) = 12 = demand.
    acts = plan(inputs([q], devs, demand, leases, agents("l2", idle=4, busy=4)))
    assert acts == []
    demand = {"one-gpu-vm": QueueDemand(waiting=13)}
    acts = plan(inputs([q], devs, demand, leases, agents("l2", idle=4, busy=4)))
    assert [a.kind for a in acts] == ["lend"] and "12 idle or starting VMs" in acts[0].reason


def test_active_lease_whose_agents_have_not_reported_counts_as_supply():
    q = queue()
    devs = [device("gpu-1"), device("gpu-2")]
    acts = plan(inputs([q], devs, {"one-gpu-vm": QueueDemand(waiting=8)},
                       [lease("l1", "gpu-1", updated_at=NOW)], agents("l1", idle=2)))
    assert acts == []


def test_device_choice_fewest_gpus_wasted_then_least_recent_home_use():
    q = MagicQueue(name="two-gpu-vm", description="x", devices={"home_queues": ["gpu-hosts"]},
                   vm={"gpus": 2}, policy={"max_devices": 1})
    devs = [device("odd", gpus=7), device("even-recent", gpus=8, last_home_use=NOW - 10),
            device("even-old", gpus=8, last_home_use=NOW - 1000)]
    acts = plan(inputs([q], devs, {"two-gpu-vm": QueueDemand(waiting=1)}))
    assert kinds(acts) == [("lend", "even-old")] and acts[0].data["vms"] == 4


def test_ineligible_devices_are_never_lent():
    q = queue(max_devices=10, max_starting=10)
    devs = [
        device("busy", job_id="j1"),
        device("offline", agent_state="offline"),
        device("quarantined", quarantined=True),
        device("unregistered", registered=False),
        device("other-home", home=("cpu-hosts",)),
        device("no-gpu", gpus=0),
        device("leased"),
        device("failed"),
        device("ok"),
    ]
    leases = [lease("l1", "leased", "restoring", queue="other"), lease("l2", "failed", "failed")]
    acts = plan(inputs([q], devs, {"one-gpu-vm": QueueDemand(waiting=80)}, leases))
    assert kinds(acts) == [("lend", "ok")]


def test_home_queue_with_waiting_jobs_blocks_unless_magic_priority_higher():
    devs = [device("gpu-1")]
    demand = {"one-gpu-vm": QueueDemand(waiting=1), "gpu-hosts": QueueDemand(waiting=2, max_priority=5)}
    assert plan(inputs([queue(priority=5)], devs, demand)) == []
    assert kinds(plan(inputs([queue(priority=6)], devs, demand))) == [("lend", "gpu-1")]


def test_a_device_is_lent_to_one_queue_per_tick_highest_priority_first():
    low, high = queue("a-low", priority=0), queue("z-high", priority=10)
    demand = {"a-low": QueueDemand(waiting=1), "z-high": QueueDemand(waiting=1)}
    acts = plan(inputs([low, high], [device("gpu-1")], demand))
    assert [(a.kind, a.queue, a.device) for a in acts] == [("lend", "z-high", "gpu-1")]


def test_min_devices_kept_warm_without_demand_and_not_drained_for_idleness():
    q = queue(min_devices=1)
    devs = [device("gpu-1"), device("gpu-2")]
    acts = plan(inputs([q], devs))
    assert len(acts) == 1 and acts[0].kind == "lend" and "min_devices 1" in acts[0].reason
    idle_lease = [lease("l1", "gpu-1", idle_since=NOW - 7200)]
    assert plan(inputs([q], devs, {}, idle_lease, agents("l1", idle=8))) == []


# ---------------------------------------------------------------- scale down

def test_idle_lease_drains_after_idle_timeout_only():
    q = queue()
    devs = [device("gpu-1")]
    demand = {"one-gpu-vm": QueueDemand(waiting=0, last_job_at=NOW - 900)}
    l1 = lease("l1", "gpu-1", idle_since=NOW - 700)
    acts = plan(inputs([q], devs, demand, [l1], agents("l1", idle=8)))
    assert [(a.kind, a.lease_id, a.data["kind"], a.generation) for a in acts] == [("drain", "l1", "idle", 3)]
    # A job 5 minutes ago resets the clock; a busy agent or waiting jobs keep it.
    recent = {"one-gpu-vm": QueueDemand(waiting=0, last_job_at=NOW - 300)}
    assert plan(inputs([q], devs, recent, [l1], agents("l1", idle=8))) == []
    assert plan(inputs([q], devs, demand, [l1], agents("l1", idle=7, busy=1))) == []
    assert plan(inputs([q], devs, {"one-gpu-vm": QueueDemand(waiting=1)}, [l1], agents("l1", idle=8))) == []


def test_reclaim_when_owner_jobs_wait_too_long():
    q = queue()
    l1 = lease("l1", "gpu-1")
    demand = {"gpu-hosts": QueueDemand(waiting=2, oldest_age=1801)}
    acts = plan(inputs([q], [device("gpu-1")], demand, [l1], agents("l1", idle=0, busy=8)))
    assert [(a.kind, a.data["kind"], a.data["grace"]) for a in acts] == [("drain", "reclaim", 900.0)]
    assert "home queue gpu-hosts" in acts[0].reason
    demand = {"gpu-hosts": QueueDemand(waiting=2, oldest_age=1700)}
    assert plan(inputs([q], [device("gpu-1")], demand, [l1], agents("l1", idle=0, busy=8))) == []


def test_max_lease_drains():
    q = queue(max_lease=3600.0)
    l1 = lease("l1", "gpu-1", created_at=NOW - 3600)
    acts = plan(inputs([q], [device("gpu-1")], {"one-gpu-vm": QueueDemand(waiting=5)}, [l1],
                       agents("l1", idle=0, busy=8)))
    assert [(a.kind, a.data["kind"]) for a in acts if a.lease_id == "l1"] == [("drain", "max_lease")]


def drain_doc(kind="idle", grace_until=NOW + 600, forced=False):
    return {"reason": kind, "kind": kind, "requested_at": NOW - 60, "grace_until": grace_until, "forced": forced}


def test_draining_lease_restores_when_idle_and_forces_after_grace():
    q = queue()
    devs = [device("gpu-1")]
    l1 = lease("l1", "gpu-1", "draining", drain=drain_doc("reclaim"))
    owner = {"gpu-hosts": QueueDemand(waiting=1, oldest_age=2000)}  # the job it returns for
    assert kinds(plan(inputs([q], devs, owner, [l1], agents("l1", idle=8)))) == [("restore", "l1")]
    assert plan(inputs([q], devs, owner, [l1], agents("l1", idle=6, busy=2))) == []
    late = dataclasses.replace(l1, drain=drain_doc("reclaim", grace_until=NOW - 1))
    acts = plan(inputs([q], devs, owner, [late], agents("l1", idle=6, busy=2)))
    assert kinds(acts) == [("force", "l1")] and "2 busy VM agents" in acts[0].reason
    # An operator's forced drain (forced, not yet committed) is forced at grace end too.
    asked = dataclasses.replace(l1, drain=drain_doc("reclaim", grace_until=NOW - 1, forced=True))
    assert kinds(plan(inputs([q], devs, owner, [asked], agents("l1", idle=6, busy=2)))) == [("force", "l1")]


def test_committed_force_waits_for_busy_agents_then_restores_anyway():
    """A force cancels and then waits (agents notice a cancel only every 10 s, never during
    provision): restore when all idle, or at force_until with data force_timeout."""
    q = queue()
    devs = [device("gpu-1")]
    committed = dict(drain_doc("reclaim", grace_until=NOW - 60, forced=True),
                     forced_at=NOW - 30, force_until=NOW + 570, cancelled=["j1"])
    l1 = lease("l1", "gpu-1", "draining", drain=committed)
    assert plan(inputs([q], devs, {}, [l1], agents("l1", idle=6, busy=2))) == []
    assert kinds(plan(inputs([q], devs, {}, [l1], agents("l1", idle=8)))) == [("restore", "l1")]
    late = dataclasses.replace(l1, drain=dict(committed, force_until=NOW - 1))
    (act,) = plan(inputs([q], devs, {}, [late], agents("l1", idle=6, busy=2)))
    assert (act.kind, act.data) == ("restore", {"force_timeout": True})
    assert "2 VM agents still busy" in act.reason
    # Committed but the cancel was never recorded (crash): force again (the cancel is idempotent).
    lost = dataclasses.replace(l1, drain=dict(committed, cancelled=None))
    assert kinds(plan(inputs([q], devs, {}, [lost], agents("l1", idle=6, busy=2)))) == [("force", "l1")]


def test_overdue_leases_and_stale_hosts_are_pure():
    restoring = lease("l1", "gpu-1", "restoring", deadline=NOW - 1)
    on_time = lease("l2", "gpu-2", "restoring", deadline=NOW + 1)
    draining = lease("l3", "gpu-3", "draining", deadline=NOW - 1)
    assert [l.id for l in overdue_leases([restoring, on_time, draining], NOW)] == ["l1"]
    assert stale_hosts({"a": NOW - 10, "b": NOW - STALE_HOST_AFTER - 1, "c": None}, NOW) == ["b", "c"]


def test_undrain_idle_drain_when_demand_returns_but_never_a_reclaim():
    q = queue(max_devices=1)
    devs = [device("gpu-1"), device("gpu-2")]
    demand = {"one-gpu-vm": QueueDemand(waiting=3)}
    idle_drain = lease("l1", "gpu-1", "draining", drain=drain_doc("idle"))
    acts = plan(inputs([q], devs, demand, [idle_drain], agents("l1", idle=8)))
    assert kinds(acts) == [("undrain", "l1")]
    reclaim = dataclasses.replace(idle_drain, drain=drain_doc("reclaim"))
    assert kinds(plan(inputs([q], devs, demand, [reclaim], agents("l1", idle=8)))) == [("restore", "l1")]
    forced = dataclasses.replace(idle_drain, drain=drain_doc("idle", forced=True))
    assert kinds(plan(inputs([q], devs, demand, [forced], agents("l1", idle=8)))) == [("restore", "l1")]


def test_bringup_past_deadline_restores_with_failure():
    q = queue()
    l1 = lease("l1", "gpu-1", "deploying", deadline=NOW - 1)
    acts = plan(inputs([q], [device("gpu-1")], {"one-gpu-vm": QueueDemand(waiting=8)}, [l1]))
    assert [(a.kind, a.lease_id, a.data) for a in acts][0] == ("restore", "l1", {"failure": True})
    l2 = lease("l2", "gpu-1", "claimed", created_at=NOW - 2701)  # no deadline stored: policy's
    assert plan(inputs([q], [device("gpu-1")], {}, [l2]))[0].kind == "restore"
    l3 = lease("l3", "gpu-1", "claimed", deadline=NOW + 5)  # still needed: its 8 jobs wait
    assert plan(inputs([q], [device("gpu-1")], {"one-gpu-vm": QueueDemand(waiting=8)}, [l3])) == []


def test_quarantine_at_failure_threshold():
    q = queue(failures_before_quarantine=3)
    devs = [device("gpu-1", failures=3), device("gpu-2", failures=2),
            device("gpu-3", failures=5, quarantined=True)]
    acts = plan(inputs([q], devs))
    assert kinds(acts) == [("quarantine", "gpu-1")]


def test_consolidation_pauses_least_busy_and_resumes_on_demand():
    q = queue(max_devices=2)
    devs = [device("gpu-1"), device("gpu-2")]
    l1, l2 = lease("l1", "gpu-1"), lease("l2", "gpu-2")
    vm = agents("l1", idle=2, busy=6) + agents("l2", idle=6, busy=2)
    acts = plan(inputs([q], devs, {"one-gpu-vm": QueueDemand(waiting=1)}, [l1, l2], vm))
    assert kinds(acts) == [("pause", "l2")]
    # Not when the rest cannot cover demand.
    assert plan(inputs([q], devs, {"one-gpu-vm": QueueDemand(waiting=3)}, [l1, l2], vm)) == []
    paused = dataclasses.replace(l2, admission="paused")
    acts = plan(inputs([q], devs, {"one-gpu-vm": QueueDemand(waiting=5)}, [l1, paused], vm))
    assert kinds(acts) == [("resume", "l2")]
    # Emptied and not needed: give it back.
    vm_empty = agents("l1", idle=2, busy=6) + agents("l2", idle=8)
    acts = plan(inputs([q], devs, {"one-gpu-vm": QueueDemand(waiting=1)}, [l1, paused], vm_empty))
    assert [(a.kind, a.lease_id, a.data.get("kind")) for a in acts] == [("drain", "l2", "consolidate")]
    assert "2 idle VMs elsewhere cover 1 waiting job; drain" in acts[0].reason
    # With no job waiting, the reason says so (not "0 idle VMs elsewhere cover 0 waiting jobs").
    # (idle for less than its idle_timeout: else the idle drain comes first)
    fresh = dataclasses.replace(paused, idle_since=NOW - 5)
    acts = plan(inputs([q], devs, {"one-gpu-vm": QueueDemand(waiting=0)}, [l1, fresh], vm_empty))
    assert [(a.kind, a.lease_id) for a in acts] == [("drain", "l2")]
    assert acts[0].reason.endswith("has emptied and no job waits there; drain")


def test_orphan_lease_of_removed_queue_drains():
    acts = plan(inputs([], [device("gpu-1")], {}, [lease("l1", "gpu-1", queue="gone")],
                       agents("l1", idle=8, queue="gone")))
    assert [(a.kind, a.data["kind"]) for a in acts] == [("drain", "orphan")]


@pytest.mark.parametrize("state", ["claimed", "fenced", "deploying", "splitting", "enrolling"])
def test_bringup_of_a_removed_queue_stops_at_once(state):
    """Nothing can run on a bring-up whose queue was removed: it is drained now with no grace
    (the engine restores a drained bring-up at once, no failure counted), not carried on to
    ``active`` and drained then (found while fixing trial finding 4)."""
    acts = plan(inputs([], [device("gpu-1")], {},
                       [lease("l1", "gpu-1", state=state, queue="gone", deadline=NOW + 3600)]))
    assert [(a.kind, a.lease_id, a.data["kind"], a.data["grace"]) for a in acts] == [
        ("drain", "l1", "orphan", 0.0)]
    assert "stop the bring-up" in acts[0].reason


def test_plan_is_deterministic_and_every_action_has_a_reason():
    q = queue(max_devices=3, max_starting=3)
    devs = [device(f"gpu-{i}", gpus=2) for i in range(5)]
    inp = inputs([q], devs, {"one-gpu-vm": QueueDemand(waiting=5)})
    assert plan(inp) == plan(inp)
    assert all(isinstance(a, Action) and a.reason.startswith("one-gpu-vm: ") for a in plan(inp))


# ---------------------------------------------------------------- properties

QUEUES = ["qa", "qb", "qc"]
HOMES = ["h1", "h2"]


@st.composite
def labs(draw):
    defs = []
    for name in QUEUES[: draw(st.integers(1, 3))]:
        defs.append(MagicQueue(
            name=name, description=name,
            devices={"home_queues": draw(st.lists(st.sampled_from(HOMES), min_size=1, unique=True))},
            vm={"gpus": draw(st.integers(1, 2))},
            vms_per_device=draw(st.sampled_from(["gpus", 1, 3])),
            policy={"max_devices": draw(st.integers(1, 4)), "max_starting": draw(st.integers(1, 3)),
                    "min_devices": draw(st.integers(0, 1)), "priority": draw(st.integers(-1, 2))}))
    devices = [DeviceView(name=f"d{i}", agent_host="h", gpus=draw(st.integers(0, 8)), tags=(),
                          home_queues=tuple(draw(st.lists(st.sampled_from(HOMES), max_size=2, unique=True))),
                          agent_state=draw(st.sampled_from(["waiting", "waiting", "offline", "test"])),
                          job_id="", quarantined=draw(st.booleans()) and draw(st.booleans()),
                          failures=draw(st.integers(0, 1)))
               for i in range(draw(st.integers(0, 8)))]
    leases, vm_agents = [], []
    for i, d in enumerate(devices):
        if draw(st.integers(0, 3)) == 0:
            q = draw(st.sampled_from(defs))
            state = draw(st.sampled_from(["claimed", "deploying", "active", "draining", "restoring"]))
            n = draw(st.integers(1, 4))
            leases.append(LeaseView(id=f"l{i}", device=d.name, queue=q.name, state=state, generation=0,
                                    created_at=NOW - 100, updated_at=NOW - 100, deadline=NOW + 1000,
                                    vms=n,
                                    drain=drain_doc(draw(st.sampled_from(["idle", "consolidate", "reclaim"])),
                                                    grace_until=NOW + draw(st.sampled_from([-1, 600])),
                                                    forced=draw(st.booleans())) if state == "draining" else None,
                                    admission=draw(st.sampled_from(["open", "paused"]))))
            if state in ("active", "draining"):
                for k in range(n):
                    vm_agents.append(VMAgentView(f"{d.name}-vm{k}", f"l{i}", q.name, "waiting", "",
                                                 draw(st.booleans())))
    demand = {n: QueueDemand(waiting=draw(st.integers(0, 30)), max_priority=draw(st.integers(0, 2)))
              for n in QUEUES + HOMES}
    return Inputs(defs, devices, demand, leases, vm_agents, NOW)


def apply_lends(inp, actions):
    """What the engine does with lends: a claimed lease each, device agent set offline."""
    lent = {a.device: a for a in actions if a.kind == "lend"}
    leases = list(inp.leases) + [
        LeaseView(id=f"new-{a.device}", device=a.device, queue=a.queue, state="claimed", generation=0,
                  created_at=NOW, updated_at=NOW, deadline=NOW + 2700, vms=a.data["vms"])
        for a in lent.values()]
    devices = [dataclasses.replace(d, agent_state="offline") if d.name in lent else d for d in inp.devices]
    return dataclasses.replace(inp, leases=leases, devices=devices)


@settings(max_examples=150, deadline=None)
@given(labs())
def test_properties(inp):
    actions = plan(inp)
    lends = [a for a in actions if a.kind == "lend"]
    # No device lent twice, and never one that is held, ineligible or busy.
    assert len({a.device for a in lends}) == len(lends)
    held = {l.device for l in inp.leases}
    devs = {d.name: d for d in inp.devices}
    defs = {q.name: q for q in inp.definitions}
    for a in lends:
        d = devs[a.device]
        assert a.device not in held and not d.quarantined and d.agent_state == "waiting"
        assert defs[a.queue].matches({"_id": d.name, "gpus": d.gpus, "tags": [], "home_queues": list(d.home_queues)})
        assert a.data["vms"] == defs[a.queue].vms_for(d.gpus) >= 1
    # Never more than max_devices open, nor max_starting in bring-up, because of this plan.
    for q in inp.definitions:
        mine = [l for l in inp.leases if l.queue == q.name]
        new = sum(1 for a in lends if a.queue == q.name)
        if new:
            assert len(mine) + new <= q.policy.max_devices
            assert sum(1 for l in mine if l.state in ("claimed", "deploying")) + new <= q.policy.max_starting
    # At most one action per lease per tick; every action explained.
    lease_ids = [a.lease_id for a in actions if a.lease_id]
    assert len(lease_ids) == len(set(lease_ids))
    assert all(a.reason for a in actions)
    # Idempotence: once the lends are claimed leases, the same demand lends nothing more.
    again = plan(apply_lends(inp, actions))
    assert [a for a in again if a.kind == "lend"] == []


# ---------------------------------------------------------------- explaining unmet demand

def test_blocked_explains_why_no_device_is_lent():
    # The user's case: every device quarantined, a job waiting; the plan said "nothing to do".
    q = queue()
    devs = [device("gpu-1", quarantined=True, failures=3), device("gpu-2", quarantined=True, failures=3)]
    demand = {"one-gpu-vm": QueueDemand(waiting=1)}
    assert plan(inputs([q], devs, demand)) == []  # executors see nothing to do
    (act,) = plan(inputs([q], devs, demand), explain=True)
    assert (act.kind, act.queue, act.data["why"]) == ("blocked", "one-gpu-vm", "no_device")
    assert act.reason == ("one-gpu-vm: 1 waiting job, 0 idle or starting VMs; no device can be "
                          "lent: 2 quarantined, 0 idle")
    # Mixed reasons are all counted; no demand means nothing to explain.
    devs = [device("gpu-1", quarantined=True), device("gpu-2", agent_state="test", job_id="j1"),
            device("gpu-3")]
    leases = [lease("l3", "gpu-3", state="failed")]  # a failed lease keeps its device
    (act,) = plan(inputs([q], devs, demand, leases), explain=True)
    assert act.reason.endswith("no device can be lent: 1 quarantined, 1 lent in a failed lease, 1 busy, 0 idle")
    assert plan(inputs([q], devs, {}), explain=True) == []


def test_blocked_when_no_device_matches_or_max_devices_reached():
    demand = {"one-gpu-vm": QueueDemand(waiting=20)}
    (act,) = plan(inputs([queue(home=("elsewhere",))], [device("gpu-1")], demand), explain=True)
    assert "no registered device matches its devices selection (1 device registered)" in act.reason
    # Issue 10 item 3: the devices are selected but too small; the GPU count is the limit.
    big = MagicQueue(name="eight", description="x", devices={"home_queues": ["gpu-hosts"]},
                     vm={"gpus": 8}, policy=queue().policy.model_dump())
    (act,) = plan(inputs([big], [device("gpu-1", gpus=4), device("gpu-2", gpus=2)],
                         {"eight": QueueDemand(waiting=1)}), explain=True)
    assert act.reason.endswith("no device can be lent: needs 8 GPUs per VM; the largest of the "
                               "2 devices its devices selection picks has 4"), act.reason
    q = queue(max_devices=1, max_starting=1)
    acts = plan(inputs([q], [device("gpu-1"), device("gpu-2")], demand), explain=True)
    assert [a.kind for a in acts] == ["lend", "blocked"]
    assert acts[1].reason == ("one-gpu-vm: 20 waiting jobs, 8 idle or starting VMs; "
                              "max_devices 1 reached")


def two_gpu_queue(**kw):
    return MagicQueue(name="two-gpu-vm", description="x",
                      devices={"home_queues": ["gpu-hosts"]}, vm={"gpus": 2},
                      policy=queue(**kw).policy.model_dump())


def test_nvswitch_devices_are_never_picked_for_several_gpus_per_vm():
    """Issue: a split refused on an NVSwitch host (MultiGPUNeedsFabric) suspended the whole
    queue; the device's NVSwitches are now a fact reconcile keeps it out of such queues by."""
    from testflinger_magic import fabric

    hgx = device("gpu-1", gpus=4, nvswitches=4, nvswitches_found={"lease_id": "l9"})
    pcie = device("gpu-2", gpus=2)
    demand = {"two-gpu-vm": QueueDemand(waiting=2), "one-gpu-vm": QueueDemand(waiting=1)}
    # The HGX board wastes no GPU (4 // 2) and comes first by name: picked before the rule.
    acts = plan(inputs([two_gpu_queue()], [hgx, pcie], demand))
    assert kinds(acts) == [("lend", "gpu-2")], acts
    # The rule itself: several GPUs per VM, NVSwitches known, no opt-in of the agent host.
    assert fabric.refuses(2, hgx) and not fabric.refuses(1, hgx) and not fabric.refuses(2, pcie)
    assert not fabric.refuses(2, dataclasses.replace(hgx, nvswitch_multi_gpu=True))
    assert not fabric.refuses(2, dataclasses.replace(hgx, nvswitches=0))
    # One GPU per VM on the same board is fine; so is the agent host's opt-in.
    assert kinds(plan(inputs([queue()], [hgx], demand))) == [("lend", "gpu-1")]
    opted = dataclasses.replace(hgx, nvswitch_multi_gpu=True)
    assert kinds(plan(inputs([two_gpu_queue()], [opted], demand))) == [("lend", "gpu-1")]
    # Only NVSwitch devices selected: nothing lent, and plan says which, why and what to do.
    acts = plan(inputs([two_gpu_queue()], [hgx], demand), explain=True)
    (act,) = acts
    assert (act.kind, act.data["why"], act.data["nvswitch_devices"]) == \
        ("blocked", "no_device", ["gpu-1"])
    assert act.reason.startswith("two-gpu-vm: 2 waiting jobs, 0 idle or starting VMs; no device "
                                 "can be lent: 2 GPUs per VM need NVIDIA Fabric Manager")
    assert "gpu-1 (4 NVSwitches, found by lease l9) is not lent to it" in act.reason
    assert "splitter.nvswitch_multi_gpu: true" in act.reason and "apply" not in act.reason
    # With another device picked but busy, the NVSwitch one is still named.
    busy = dataclasses.replace(pcie, agent_state="test", job_id="j1")
    (act,) = plan(inputs([two_gpu_queue()], [hgx, busy], demand), explain=True)
    assert "1 busy, 0 idle; 2 GPUs per VM need NVIDIA Fabric Manager" in act.reason
    assert "gpu-1 (4 NVSwitches" in act.reason


def test_suspended_queue_lends_nothing_and_says_why():
    q = queue(min_devices=1)
    devs = [device("gpu-1"), device("gpu-2")]
    demand = {"one-gpu-vm": QueueDemand(waiting=3)}
    susp = dataclasses.replace(inputs([q], devs, demand),
                               suspended={"one-gpu-vm": "VM spec does not fit gpu-1"})
    assert plan(susp) == []
    (act,) = plan(susp, explain=True)
    assert act.kind == "blocked" and act.data["why"] == "suspended"
    assert act.reason == ("one-gpu-vm: 3 waiting jobs; lending suspended: VM spec does not fit "
                          "gpu-1; fix the definition and apply it again")
    # Its leases keep their lifecycle: an idle one still drains.
    idle = dataclasses.replace(susp, demand={}, leases=[lease("l1", "gpu-1", updated_at=NOW - 7200),
                                                        lease("l2", "gpu-2", updated_at=NOW - 7200)],
                               vm_agents=agents("l1", idle=8) + agents("l2", idle=8))
    assert [a.kind for a in plan(idle)] == ["drain"]


# ---------------------------------------------------------------- user findings

def test_vm_agent_that_never_registers_stops_counting_after_the_grace():
    # One of 8 VM agents never started: the lease must still drain for idleness once the grace
    # after activation is over, and the missing agent is named.
    from testflinger_magic.reconcile import VM_AGENT_GRACE, missing_vm_agents
    q = queue()
    names = [f"l1-a{i}" for i in range(7)] + ["gpu-1-vm8"]
    demand = {"one-gpu-vm": QueueDemand(waiting=0, last_job_at=NOW - 900)}
    l1 = lease("l1", "gpu-1", idle_since=NOW - 700, active_since=NOW - 800, vm_names=names)
    inp = inputs([q], [device("gpu-1")], demand, [l1], agents("l1", idle=7))
    assert [(a.kind, a.data["kind"]) for a in plan(inp)] == [("drain", "idle")]
    assert missing_vm_agents(inp) == {"l1": ["gpu-1-vm8"]}
    # Within the grace the silent VM is still coming: no drain, nothing missing.
    young = dataclasses.replace(l1, active_since=NOW - VM_AGENT_GRACE + 1)
    inp = dataclasses.replace(inp, leases=[young])
    assert plan(inp) == [] and missing_vm_agents(inp) == {}
    # The grace is an input (the lab shrinks it).
    assert missing_vm_agents(dataclasses.replace(inp, vm_agent_grace=10.0)) == {"l1": ["gpu-1-vm8"]}


def test_missing_vm_agents_are_not_supply():
    from testflinger_magic.reconcile import VM_AGENT_GRACE
    q = queue()
    devs = [device("gpu-1"), device("gpu-2")]
    l1 = lease("l1", "gpu-1", active_since=NOW - VM_AGENT_GRACE - 1,
               vm_names=[f"gpu-1-vm{i}" for i in range(1, 9)])
    acts = plan(inputs([q], devs, {"one-gpu-vm": QueueDemand(waiting=8)}, [l1], agents("l1", idle=2)))
    assert kinds(acts) == [("lend", "gpu-2")]


def test_reclaim_takes_only_as_many_devices_as_owner_jobs_need_idlest_first():
    q = queue()
    devs = [device("gpu-1"), device("gpu-2")]
    leases = [lease("l1", "gpu-1", created_at=NOW - 7200), lease("l2", "gpu-2")]
    vm = agents("l1", idle=2, busy=6) + agents("l2", idle=8)
    demand = {"gpu-hosts": QueueDemand(waiting=1, oldest_age=1801)}
    acts = plan(inputs([q], devs, demand, leases, vm))
    assert [(a.kind, a.lease_id, a.data["kind"]) for a in acts] == [("drain", "l2", "reclaim")]
    # Two owner jobs need both devices.
    demand = {"gpu-hosts": QueueDemand(waiting=2, oldest_age=1801)}
    assert sorted(a.lease_id for a in plan(inputs([q], devs, demand, leases, vm))) == ["l1", "l2"]
    # A device already returning for the owner counts: one job, nothing more to reclaim.
    back = dataclasses.replace(leases[1], state="draining",
                               drain={"kind": "reclaim", "grace_until": NOW + 600})
    demand = {"gpu-hosts": QueueDemand(waiting=1, oldest_age=1801)}
    acts = plan(inputs([q], devs, demand, [leases[0], back], vm))
    assert [a for a in acts if a.kind == "drain"] == []


def test_reclaim_leaves_a_device_the_owners_jobs_exclude_and_it_stays_lendable():
    """TRIAL11 F4: the owner's waiting job excluded gpu-host-01 (``exclude_agents``); the
    reclaim took gpu-host-01 back anyway (the idlest), which then sat at home, not lent, while
    magic jobs waited ("owner first"), and the owner's job waited for a second reclaim."""
    def reclaims(acts):
        return [a.lease_id for a in acts if a.kind == "drain" and a.data["kind"] == "reclaim"]

    q = queue()
    devs = [device("gpu-1"), device("gpu-2")]
    leases = [lease("l1", "gpu-1", created_at=NOW - 7200), lease("l2", "gpu-2")]
    vm = agents("l1", idle=2, busy=6) + agents("l2", idle=8)
    # l2 (gpu-2) is the idlest, but the owner's job excludes gpu-2: l1 goes back instead.
    demand = {"gpu-hosts": QueueDemand(waiting=1, oldest_age=1801, avoid=frozenset({"gpu-2"}))}
    acts = plan(inputs([q], devs, demand, leases, vm))
    assert reclaims(acts) == ["l1"], acts
    # Excluding both: nothing the reclaim could take serves it.
    demand = {"gpu-hosts": QueueDemand(waiting=1, oldest_age=1801,
                                       avoid=frozenset({"gpu-1", "gpu-2"}))}
    assert reclaims(plan(inputs([q], devs, demand, leases, vm))) == []
    # A device back home that the owner's jobs all exclude is no supply for them (a reclaim
    # still takes one for them), and is lent to a magic queue whose jobs wait, not kept for
    # an owner who will not use it.
    home = device("gpu-3")
    demand = {"gpu-hosts": QueueDemand(waiting=1, oldest_age=1801, avoid=frozenset({"gpu-3"})),
              "one-gpu-vm": QueueDemand(waiting=20)}  # more than the 10 idle VMs
    acts = plan(inputs([q.model_copy(update={"policy": q.policy.model_copy(
        update={"max_devices": 3})})], devs + [home], demand, leases, vm))
    assert ("lend", "gpu-3") in kinds(acts), acts
    assert reclaims(acts) == ["l2"], acts
    # Without the exclusion the owner's job keeps gpu-3 (owner first) and counts it as coming.
    demand["gpu-hosts"] = QueueDemand(waiting=1, oldest_age=1801)
    acts = plan(inputs([q.model_copy(update={"policy": q.policy.model_copy(
        update={"max_devices": 3})})], devs + [dataclasses.replace(home, last_home_use=NOW - 1)],
        demand, leases, vm))
    assert ("lend", "gpu-3") not in kinds(acts) and reclaims(acts) == [], acts


def test_reclaim_skips_a_lease_on_a_stale_agent_host():
    """TRIAL2: the owner reclaim picked the idlest lease although its agent host was stale
    (nobody works it, so it cannot come back); it takes a lease on a live host instead, and a
    stale one only waits for its host."""
    q = queue()
    devs = [device("gpu-1"), dataclasses.replace(device("gpu-2"), agent_host="h2")]
    leases = [lease("l1", "gpu-1", created_at=NOW - 7200), lease("l2", "gpu-2")]
    vm = agents("l1", idle=2, busy=6) + agents("l2", idle=8)
    demand = {"gpu-hosts": QueueDemand(waiting=1, oldest_age=1801)}
    live = inputs([q], devs, demand, leases, vm)
    assert [(a.kind, a.lease_id) for a in plan(live)] == [("drain", "l2")]  # the idlest
    stale = dataclasses.replace(live, stale_hosts={"h2": 300.0})
    reclaims = [a.lease_id for a in plan(stale) if (a.data or {}).get("kind") == "reclaim"]
    assert reclaims == ["l1"]  # (l2 may still drain as idle: its own lifecycle, not the owner's)


def test_blocked_explains_max_starting():
    q = queue(max_devices=4, max_starting=1)
    devs = [device("gpu-1"), device("gpu-2")]
    starting = [lease("l1", "gpu-1", "deploying", created_at=NOW - 60)]
    demand = {"one-gpu-vm": QueueDemand(waiting=20)}
    assert plan(inputs([q], devs, demand, starting)) == []
    (act,) = plan(inputs([q], devs, demand, starting), explain=True)
    assert (act.kind, act.data["why"]) == ("blocked", "max_starting")
    assert act.reason == ("one-gpu-vm: 20 waiting jobs, 8 idle or starting VMs; "
                          "max_starting 1 reached (1 bringing up)")


def test_a_reclaim_moves_to_a_lease_gone_idle_during_its_grace_and_the_busy_one_keeps_its_jobs():
    """TRIAL6 M1: the owner's one job drains the busiest-but-idlest-then lease; another goes
    wholly idle during the grace. That one is reclaimed too (it cancels nothing), and the next
    plan undrains the busy one before its grace ends: no job is cancelled for the owner."""
    q = queue(max_devices=3)
    devs = [device("gpu-1"), device("gpu-2")]
    owner = {"gpu-hosts": QueueDemand(waiting=1, oldest_age=2000)}
    busy = lease("l1", "gpu-1", "draining", drain=drain_doc("reclaim"))
    idle = lease("l2", "gpu-2", created_at=NOW - 100)
    vms = agents("l1", idle=2, busy=6) + agents("l2", idle=8)
    acts = plan(inputs([q], devs, owner, [busy, idle], vms))
    assert [(a.kind, a.lease_id, (a.data or {}).get("kind")) for a in acts] == [
        ("drain", "l2", "reclaim")]
    assert "taken instead of lease l1 on gpu-1, whose 6 busy VM agents keep their jobs" \
        in acts[0].reason
    # Next plan: l2 is draining for the reclaim too (idle: restored at once); one more device
    # returns than the owner's one job needs, so the busy drain is undrained.
    idle_drain = dataclasses.replace(idle, state="draining", drain=drain_doc("reclaim"))
    acts = plan(inputs([q], devs, owner, [busy, idle_drain], vms))
    assert [(a.kind, a.lease_id) for a in acts] == [("undrain", "l1"), ("restore", "l2")]
    assert acts[0].data == {"kind": "reclaim", "surplus": True}
    assert "6 busy VM agents keep their jobs" in acts[0].reason
    # Even at the end of its grace: undrained, not forced.
    late = dataclasses.replace(busy, drain=drain_doc("reclaim", grace_until=NOW - 1))
    acts = plan(inputs([q], devs, owner, [late, idle_drain], vms))
    assert ("undrain", "l1") in [(a.kind, a.lease_id) for a in acts]
    # Without the idle lease the busy drain stays (and is forced at its grace's end).
    assert plan(inputs([q], devs, owner, [busy], agents("l1", idle=2, busy=6))) == []
    assert kinds(plan(inputs([q], devs, owner, [late], agents("l1", idle=2, busy=6)))) == [
        ("force", "l1")]


def test_a_busy_reclaim_drain_is_undrained_when_the_owner_no_longer_waits():
    """The owner's job was served by another device (or cancelled): its reclaim drain would
    cancel jobs for nothing. A forced one, a restoring one and one for a home queue that still
    needs it are left as they are."""
    q = queue()
    devs = [device("gpu-1")]
    busy = lease("l1", "gpu-1", "draining", drain=drain_doc("reclaim"))
    vms = agents("l1", idle=2, busy=6)
    acts = plan(inputs([q], devs, {}, [busy], vms))
    assert kinds(acts) == [("undrain", "l1")]
    assert ("home queue gpu-hosts (0 jobs waiting) no longer needs gpu-1: no job waits there "
            "any more") in acts[0].reason
    forced = dataclasses.replace(busy, drain=drain_doc("reclaim", forced=True))
    assert plan(inputs([q], devs, {}, [forced], vms)) == []
    operator = dataclasses.replace(busy, drain=drain_doc("operator"))
    assert plan(inputs([q], devs, {}, [operator], vms)) == []
    # A device with two home queues: undrained only when neither needs it.
    two = [device("gpu-1", home=("gpu-hosts", "rack-a"))]
    needs = {"rack-a": QueueDemand(waiting=1, oldest_age=2000)}
    assert plan(inputs([q], two, needs, [busy], vms)) == []
    assert kinds(plan(inputs([q], two, {}, [busy], vms))) == [("undrain", "l1")]


def test_a_device_restoring_for_another_drain_counts_as_returning_for_the_owner():
    """TRIAL7: an idle lease restoring (its idle drain) when the owner's jobs came due was not
    counted, so the reclaim took one more device than the jobs needed."""
    q = queue(max_devices=3)
    devs = [device("gpu-1"), device("gpu-2"), device("gpu-3")]
    owner = {"gpu-hosts": QueueDemand(waiting=2, oldest_age=2000)}
    going = lease("l1", "gpu-1", "restoring", drain=drain_doc("idle"))
    rest = [lease("l2", "gpu-2", created_at=NOW - 200), lease("l3", "gpu-3", created_at=NOW - 100)]
    vms = agents("l2", idle=0, busy=8) + agents("l3", idle=0, busy=8)
    acts = [a for a in plan(inputs([q], devs, owner, [going, *rest], vms)) if a.kind == "drain"]
    assert [(a.lease_id, a.data["kind"]) for a in acts] == [("l2", "reclaim")]


def test_an_idle_vm_every_waiting_job_excludes_is_no_supply():
    """TRIAL7: the one waiting job excludes each device's -vm1; the active lease's only idle VM
    is its -vm1 (its -vm2 runs a reservation). That VM is no supply: the lease in bring-up the
    job could use is kept, not drained as unneeded; and with nothing starting, a device is lent."""
    q = queue(max_devices=3)
    devs = [device("gpu-1", gpus=2), device("gpu-2", gpus=2), device("gpu-3", gpus=2)]
    vms = [VMAgentView("gpu-1-vm1", "l1", "one-gpu-vm", "waiting", "", False),
           VMAgentView("gpu-1-vm2", "l1", "one-gpu-vm", "reserve", "j1", True)]
    active = lease("l1", "gpu-1", vms=2)
    starting = lease("l2", "gpu-2", "enrolling", vms=2, created_at=NOW - 90)
    excl = frozenset({"gpu-1-vm1", "gpu-2-vm1", "gpu-3-vm1"})
    job = QueueDemand(waiting=1, oldest_age=90, last_job_at=NOW - 90, avoid_agents=excl)
    acts = plan(inputs([q], devs, {"one-gpu-vm": job}, [active, starting], vms))
    assert not [a for a in acts if a.kind == "drain"], acts
    # Counted as supply before: the same plan without the exclusion drains the bring-up.
    plain = QueueDemand(waiting=1, oldest_age=90, last_job_at=NOW - 90)
    assert [(a.kind, a.lease_id) for a in plan(inputs([q], devs, {"one-gpu-vm": plain},
                                                     [active, starting], vms))
            if a.kind == "drain"] == [("drain", "l2")]
    acts = plan(inputs([q], devs, {"one-gpu-vm": job}, [active], vms))
    assert [a.kind for a in acts if a.kind == "lend"] == ["lend"]


def test_a_lease_whose_vms_every_waiting_job_excludes_is_not_kept_nor_resumed_for_them():
    """TRIAL8 (HIGH): the queue at max_devices 1 held gpu-1; the only waiting job excluded both
    of its VMs. Its idle drain was undone every tick ("1 waiting job, 0 idle or starting VMs;
    cancel the idle drain") and the job waited for ever. Now the drained lease is restored, a
    paused one is not resumed for them, and the next plan lends another device."""
    q = queue(max_devices=1, idle_timeout=20.0)
    devs = [device("gpu-1", gpus=2), device("gpu-2", gpus=2)]
    job = QueueDemand(waiting=1, oldest_age=60, last_job_at=NOW - 60,
                      avoid=frozenset({"gpu-1"}), avoid_agents=frozenset({"l1-a0", "l1-a1"}))
    draining = lease("l1", "gpu-1", "draining", vms=2, drain=drain_doc("idle"))
    acts = plan(inputs([q], devs, {"one-gpu-vm": job}, [draining], agents("l1", idle=2)))
    assert kinds(acts) == [("restore", "l1")], acts
    paused = lease("l1", "gpu-1", vms=2, admission="paused")
    acts = plan(inputs([q], devs, {"one-gpu-vm": job}, [paused], agents("l1", idle=2)))
    assert "resume" not in [a.kind for a in acts], acts
    # Once it is returned, gpu-2 is lent for the job.
    acts = plan(inputs([q], devs, {"one-gpu-vm": job}, []))
    assert [(a.kind, a.device) for a in acts if a.kind == "lend"] == [("lend", "gpu-2")]
    # Without the exclusion the drain is undone for the job, as before.
    plain = QueueDemand(waiting=1, oldest_age=60, last_job_at=NOW - 60)
    acts = plan(inputs([q], devs, {"one-gpu-vm": plain}, [draining], agents("l1", idle=2)))
    assert kinds(acts) == [("undrain", "l1")], acts


def test_a_bring_up_deadline_passing_while_its_host_is_silent_counts_no_failure():
    from testflinger_magic import reconcile as R

    """TRIAL13 F4: a daemon frozen mid-deploy (no heartbeat for 108 s, not yet stale at 120 s)
    when provision_timeout ran out: the silence is the host's, not the device's. A host that
    heartbeats as it should still has the failure counted."""
    q = MagicQueue(name="q", description="q", devices={"home_queues": ["gpu-hosts"]}, vm={"gpus": 1},
                   policy={"provision_timeout": 100.0})
    dev = R.DeviceView(name="d1", agent_host="h1", gpus=1, home_queues=["gpu-hosts"],
                       agent_state="maintenance")
    lease = R.LeaseView(id="l1", device="d1", queue="q", state="deploying", generation=2,
                        created_at=0.0, updated_at=10.0, deadline=100.0, vms=1)
    beats = {"h1": 0.0}  # last heartbeat at t=0, the tick at t=108
    inputs = R.Inputs(definitions=[q], devices=[dev], demand={}, leases=[lease], vm_agents=[],
                      now=108.0, quiet_hosts=R.quiet_hosts(beats, 108.0))
    assert inputs.quiet_hosts == {"h1": 108.0}
    (restore,) = [a for a in R.plan(inputs) if a.kind == "restore"]
    assert not restore.data.get("failure") and restore.data.get("host_stale")
    assert "has sent no heartbeat for" in restore.reason and "no failure counted" in restore.reason
    heard = dataclasses.replace(inputs, quiet_hosts=R.quiet_hosts({"h1": 100.0}, 108.0))
    (restore,) = [a for a in R.plan(heard) if a.kind == "restore"]
    assert restore.data.get("failure")
    assert R.quiet_hosts({"h1": 108.0 - 60.0}, 108.0) == {}  # a daemon may be 60 s apart
    assert R.quiet_hosts({"h1": 108.0 - 121.0}, 108.0) == {}  # stale: stale_hosts' case


def test_a_host_that_turned_stale_when_the_deadline_passed_is_not_the_devices_fault():
    """TRIAL14 F1: the tick that first sees the host stale is also past the bring-up deadline
    (or no tick ran while the host was dead): restored with no failure counted. And TRIAL14 F3:
    a silent host (quiet, not yet stale) is not lent another device."""
    from testflinger_magic import reconcile as R

    q = MagicQueue(name="q", description="q", devices={"home_queues": ["gpu-hosts"]},
                   vm={"gpus": 1}, policy={"provision_timeout": 100.0, "max_devices": 4,
                                                    "max_starting": 4})
    dev = R.DeviceView(name="d1", agent_host="h1", gpus=1, home_queues=["gpu-hosts"],
                       agent_state="maintenance")
    idle = R.DeviceView(name="d2", agent_host="h1", gpus=1, home_queues=["gpu-hosts"],
                        agent_state="waiting")
    lease = R.LeaseView(id="l1", device="d1", queue="q", state="deploying", generation=2,
                        created_at=0.0, updated_at=10.0, deadline=100.0, vms=1)
    inputs = R.Inputs(definitions=[q], devices=[dev, idle], leases=[lease], vm_agents=[],
                      demand={"q": R.QueueDemand(waiting=3)}, now=130.0,
                      stale_hosts={"h1": 130.0})
    (restore,) = [a for a in R.plan(inputs) if a.kind == "restore"]
    assert restore.data.get("host_stale") and not restore.data.get("failure")
    quiet = dataclasses.replace(inputs, now=90.0, stale_hosts={}, quiet_hosts={"h1": 90.0})
    assert [a for a in R.plan(quiet) if a.kind == "lend"] == []
    blocked = [a for a in R.plan(quiet, explain=True) if a.kind == "blocked"]
    assert blocked and "1 on a silent agent host" in blocked[0].reason, blocked
    heard = dataclasses.replace(quiet, quiet_hosts={})
    assert [a.device for a in R.plan(heard) if a.kind == "lend"] == ["d2"]


def test_a_removed_queues_drain_is_undone_when_the_queue_is_defined_again():
    """TRIAL16 F1: an operator removed a magic queue and applied it again 3 s later; its lease
    stayed draining under the removal (its idle VMs took no job, a new machine was deployed
    beside them, and its running jobs were to be cancelled when the removed-queue grace ended).
    The queue defined again, the removed-queue drain is undone at once, busy VMs or not; a
    forced one (its grace ended, jobs cancelled) is not."""
    q = queue()
    drain = {"kind": "orphan", "requested_at": NOW - 60, "grace_until": NOW + 840,
             "force": False, "reason": "one-gpu-vm: queue definition removed"}
    draining = lease("l1", "gpu-1", state="draining", drain=drain)
    for vms in (agents("l1", idle=6, busy=2), agents("l1", idle=8)):
        acts = plan(inputs([q], [device("gpu-1")], {"one-gpu-vm": QueueDemand(waiting=0)},
                           [draining], vms))
        assert [(a.kind, a.lease_id, a.data.get("kind")) for a in acts] == [
            ("undrain", "l1", "orphan")], acts
        assert acts[0].data.get("requeued") is True
        assert "defined again" in acts[0].reason
    forced = lease("l1", "gpu-1", state="draining",
                   drain=dict(drain, forced_at=NOW - 5, cancelled=["j0"], force_until=NOW + 600))
    acts = plan(inputs([q], [device("gpu-1")], {}, [forced], agents("l1", idle=6, busy=2)))
    assert "undrain" not in [a.kind for a in acts]
    # Still removed: the drain goes on (no undrain).
    acts = plan(inputs([], [device("gpu-1")], {}, [lease("l1", "gpu-1", state="draining",
                                                          queue="gone", drain=drain)],
                       agents("l1", idle=6, busy=2, queue="gone")))
    assert "undrain" not in [a.kind for a in acts]
