"""reconcile.plan decisions a fresh user's trial against ``testflinger-magic lab up`` found
wrong: one waiting home job took back two devices; a device of a stale agent host was lent; a
bring-up went on after its only job was cancelled. One test per decision, each failing on the
planner of before."""

import dataclasses

from testflinger_magic.queues import MagicQueue
from testflinger_magic.reconcile import (AGENT_PICKUP, DeviceView, Inputs, LeaseView, QueueDemand,
                                         VMAgentView, plan)

NOW = 1_000_000.0


def queue(name="one-gpu-vm", home=("gpu-hosts",), **policy):
    base = {"max_devices": 2, "max_starting": 2, "idle_timeout": 600.0,
            "reclaim": {"owner_wait": 5.0, "grace": 2.0}, "provision_timeout": 2700.0}
    base.update(policy)
    return MagicQueue(name=name, description=name, devices={"home_queues": list(home)},
                      vm={"gpus": 1}, policy=base)


def device(name, gpus=8, home=("gpu-hosts",), host="h1", **kw):
    kw.setdefault("agent_state", "waiting")
    kw.setdefault("last_home_use", NOW - 3600)
    return DeviceView(name=name, agent_host=host, gpus=gpus, tags=(), home_queues=home, **kw)


def lease(id, device, state="active", queue="one-gpu-vm", vms=8, created_at=NOW - 3600, **kw):
    kw.setdefault("updated_at", created_at)
    kw.setdefault("deadline", None)
    return LeaseView(id=id, device=device, queue=queue, state=state, generation=3,
                     created_at=created_at, vms=vms, **kw)


def busy_agents(lease_id, n, queue="one-gpu-vm"):
    return [VMAgentView(f"{lease_id}-b{i}", lease_id, queue, "test", f"j{i}", True)
            for i in range(n)]


def inputs(defs, devices, demand=None, leases=(), vm_agents=(), now=NOW, **kw):
    return Inputs(definitions=list(defs), devices=list(devices), demand=dict(demand or {}),
                  leases=list(leases), vm_agents=list(vm_agents), now=now, **kw)


def drains(actions):
    return [(a.lease_id, a.data["kind"]) for a in actions if a.kind == "drain"]


# ---------------------------------------------------------------- 1. one job, one device back

def test_a_device_just_given_back_counts_for_its_owners_waiting_job():
    """The trial: gpu-host-01 was reclaimed for the one gpu-hosts job and returned; 28 ms
    later, before its restarted agent had posted, gpu-host-02 was reclaimed too. The device
    back home is the job's device: nothing more is reclaimed."""
    q = queue()
    owner = {"gpu-hosts": QueueDemand(waiting=1, oldest_age=12.0)}
    l2 = lease("l2", "gpu-host-02")
    vm = busy_agents("l2", 8)
    # Returned, its agent restarted but not seen yet (agent_back False).
    back = device("gpu-host-01", agent_back=False)
    assert drains(plan(inputs([q], [back, device("gpu-host-02", agent_state="offline")],
                              owner, [l2], vm))) == []
    # Its agent posted waiting a moment ago: it asks for the job right after that post.
    posted = device("gpu-host-01", last_home_use=NOW - 1.0)
    assert drains(plan(inputs([q], [posted, device("gpu-host-02", agent_state="offline")],
                              owner, [l2], vm))) == []
    # Two owner jobs: the device back home takes one, one more device is reclaimed.
    two = {"gpu-hosts": QueueDemand(waiting=2, oldest_age=12.0)}
    assert drains(plan(inputs([q], [back, device("gpu-host-02", agent_state="offline")],
                              two, [l2], vm))) == [("l2", "reclaim")]


def test_a_device_at_home_that_is_not_about_to_take_the_job_does_not_count():
    """Bounded: an agent that took a job, is offline, posted long ago (it would have taken the
    job by now: dead or stuck) or whose device is quarantined is no supply; the lease is
    reclaimed as before."""
    q = queue()
    owner = {"gpu-hosts": QueueDemand(waiting=1, oldest_age=12.0)}
    l2 = lease("l2", "gpu-host-02")
    vm = busy_agents("l2", 8)
    other = device("gpu-host-02", agent_state="offline")
    for home in (device("gpu-host-01", agent_back=False, agent_state="setup", job_id="j9"),
                 device("gpu-host-01", agent_back=False, agent_state="offline"),
                 device("gpu-host-01", last_home_use=NOW - AGENT_PICKUP - 1),
                 device("gpu-host-01", agent_back=False, quarantined=True),
                 device("gpu-host-01", agent_back=False, home=("elsewhere",))):
        assert drains(plan(inputs([q], [home, other], owner, [l2], vm))) == [("l2", "reclaim")], home


def test_a_device_reclaimed_for_its_owner_is_not_lent_to_a_queue_that_outranks_the_job():
    """TRIAL5 finding 5: burn-vm (priority 5) may lend while a priority-0 owner job waits. The
    owner reclaim freed gpu-host-02 for that job; re-lent to burn-vm the second its agent
    posted, the owner job kept waiting and the reclaim took the next lent device, cancelling
    its jobs, device after device. The agent that just posted ``waiting`` is left its pickup
    window (AGENT_PICKUP); after it, priorities apply as before."""
    burn = queue("burn-vm", priority=5, max_devices=3)
    owner = {"gpu-hosts": QueueDemand(waiting=1, oldest_age=70.0, max_priority=0),
             "burn-vm": QueueDemand(waiting=4, oldest_age=30.0)}
    back = device("gpu-host-02", last_home_use=NOW - 1.0)
    acts = plan(inputs([burn], [back], owner), explain=True)
    assert [a.kind for a in acts] == ["blocked"]
    assert "1 owner first" in acts[0].reason
    later = device("gpu-host-02", last_home_use=NOW - AGENT_PICKUP - 1)
    assert [(a.kind, a.device) for a in plan(inputs([burn], [later], owner))] == [
        ("lend", "gpu-host-02")]


def test_the_owner_reclaim_leaves_a_lease_whose_queue_outranks_the_owner_jobs():
    """TRIAL5 finding 5, the other half: a queue that may lend while the owner's jobs wait
    (its priority above theirs) keeps its lease; a queue they outrank or equal gives one
    back."""
    burn = queue("burn-vm", priority=5)
    one = queue("one-gpu-vm", priority=0)
    owner = {"gpu-hosts": QueueDemand(waiting=1, oldest_age=70.0, max_priority=0)}
    devs = [device("gpu-host-01", agent_state="offline"),
            device("gpu-host-02", agent_state="offline")]
    high = lease("lb", "gpu-host-01", queue="burn-vm")
    low = lease("lo", "gpu-host-02", queue="one-gpu-vm")
    vm = busy_agents("lb", 8, "burn-vm") + busy_agents("lo", 8)
    assert drains(plan(inputs([burn, one], devs, owner, [high, low], vm))) == [("lo", "reclaim")]
    assert drains(plan(inputs([burn, one], devs, owner, [high], vm[:8]))) == []
    urgent = {"gpu-hosts": QueueDemand(waiting=1, oldest_age=70.0, max_priority=5)}
    assert drains(plan(inputs([burn, one], devs, urgent, [high], vm[:8]))) == [("lb", "reclaim")]


def test_a_max_lease_drain_waits_for_the_running_jobs():
    """TRIAL5 finding 7: a max_lease drain with ``reclaim.grace`` (15s in the trial) cancelled
    jobs started moments before, and a queue whose jobs outlast max_lease never completed one.
    It closes admission and waits for them, as a yield does (YIELD_GRACE)."""
    from testflinger_magic.reconcile import YIELD_GRACE

    q = queue(max_lease=7200.0, reclaim={"owner_wait": 5.0, "grace": 15.0})
    old = lease("l1", "gpu-host-01", created_at=NOW - 7300)
    acts = [a for a in plan(inputs([q], [device("gpu-host-01", agent_state="offline")],
                                   {"one-gpu-vm": QueueDemand(waiting=3, oldest_age=10.0)},
                                   [old], busy_agents("l1", 8))) if a.kind == "drain"]
    assert [(a.lease_id, a.data) for a in acts] == [
        ("l1", {"kind": "max_lease", "grace": YIELD_GRACE, "force": False})]
    assert "max_lease 2h" in acts[0].reason and "grace 10h" in acts[0].reason


def test_a_quarantined_devices_lease_takes_no_new_job_and_goes_back_once_empty():
    """TRIAL6 finding 3: jobs kept starting on a lent device just quarantined for ECC errors
    while another lease idled, and the healthy lease was the one given back. A quarantined
    device's bring-up stops; its active lease is paused (no new job; running ones finish) and
    counts as no supply, so the waiting jobs get another device; emptied, it is drained."""
    q = queue(max_devices=3)
    sick = device("gpu-host-01", agent_state="offline", quarantined=True)
    spare = device("gpu-host-02")
    jobs = {"one-gpu-vm": QueueDemand(waiting=4, oldest_age=10.0)}
    bringing = lease("l1", "gpu-host-01", "deploying", created_at=NOW - 60)
    acts = plan(inputs([q], [sick, spare], jobs, [bringing]))
    assert [(a.kind, a.lease_id or a.device, (a.data or {}).get("kind")) for a in acts] == [
        ("drain", "l1", "quarantined"), ("lend", "gpu-host-02", None)]
    active = lease("l1", "gpu-host-01")
    acts = plan(inputs([q], [sick, spare], jobs, [active], busy_agents("l1", 4)))
    assert [(a.kind, a.lease_id or a.device) for a in acts] == [("pause", "l1"),
                                                                ("lend", "gpu-host-02")]
    paused = dataclasses.replace(active, admission="paused")
    acts = plan(inputs([q], [sick, spare], jobs, [paused], busy_agents("l1", 4)))
    assert [(a.kind, a.lease_id or a.device) for a in acts] == [("lend", "gpu-host-02")]
    idle = [VMAgentView(f"l1-b{i}", "l1", "one-gpu-vm", "waiting", None, False)
            for i in range(8)]
    acts = plan(inputs([q], [sick, spare], {}, [paused], idle))
    assert [(a.kind, a.lease_id, (a.data or {}).get("kind")) for a in acts] == [
        ("drain", "l1", "quarantined")]


# ---------------------------------------------------------------- 3. a bring-up no job needs

def test_a_bringup_whose_only_job_was_cancelled_is_drained_after_the_hold():
    """The trial: one job, cancelled 1 s later; the lease deployed, split and enrolled 8 VMs
    for nothing. Once no job was submitted or started for min(idle_timeout, UNNEEDED_HOLD),
    the bring-up is drained (kind ``unneeded``); before that it is kept (a quick resubmit)."""
    q = queue(idle_timeout=600.0)
    claimed = lease("l1", "gpu-host-01", "deploying", created_at=NOW - 61)
    none = {"one-gpu-vm": QueueDemand(waiting=0, last_job_at=NOW - 62)}
    (act,) = plan(inputs([q], [device("gpu-host-01", agent_state="offline")], none, [claimed]))
    assert (act.kind, act.lease_id, act.data) == ("drain", "l1", {"kind": "unneeded",
                                                                  "grace": 0.0, "force": False})
    assert "still deploying" in act.reason and "hold 1m" in act.reason
    # Within the hold: from the claim, or from the queue's last job if later (a resubmit).
    young = dataclasses.replace(claimed, created_at=NOW - 30)
    assert plan(inputs([q], [device("gpu-host-01", agent_state="offline")], none, [young])) == []
    resubmitted = {"one-gpu-vm": QueueDemand(waiting=0, last_job_at=NOW - 10)}
    assert plan(inputs([q], [device("gpu-host-01", agent_state="offline")], resubmitted,
                       [claimed])) == []
    # A shorter idle_timeout is the hold.
    quick = queue(idle_timeout=8.0)
    assert drains(plan(inputs([quick], [device("gpu-host-01", agent_state="offline")],
                              {"one-gpu-vm": QueueDemand(last_job_at=NOW - 9)},
                              [dataclasses.replace(claimed, created_at=NOW - 9)]))) == [
        ("l1", "unneeded")]


def test_an_operators_lend_runs_its_bring_up_out_with_no_job_waiting():
    """TRIAL5 finding 3: ``lend DEVICE QUEUE`` with no job waiting (a pre-warm before a burst,
    a check of one device) was drained as ``unneeded`` 60 s into a deploy of 15-30 minutes on
    real iron. A lease lent by hand is never drained so; the same lease lent by a plan is."""
    q = queue(idle_timeout=600.0)
    claimed = lease("l1", "gpu-host-01", "deploying", created_at=NOW - 120)
    none = {"one-gpu-vm": QueueDemand(waiting=0, last_job_at=NOW - 121)}
    devs = [device("gpu-host-01", agent_state="offline")]
    assert drains(plan(inputs([q], devs, none, [claimed]))) == [("l1", "unneeded")]
    by_hand = dataclasses.replace(claimed, by_hand=True)
    assert plan(inputs([q], devs, none, [by_hand])) == []


def test_a_bringup_still_needed_or_kept_warm_is_not_drained():
    q = queue()
    devs = [device("gpu-host-01", agent_state="offline"), device("gpu-host-02", agent_state="offline")]
    l1 = lease("l1", "gpu-host-01", "enrolling", created_at=NOW - 600)
    # A job still waits that nothing else covers.
    assert drains(plan(inputs([q], devs, {"one-gpu-vm": QueueDemand(waiting=1, last_job_at=NOW - 600)},
                              [l1]))) == []
    # The warm level (min_devices 1) keeps it.
    warm = queue(min_devices=1)
    assert drains(plan(inputs([warm], devs, {"one-gpu-vm": QueueDemand(last_job_at=NOW - 600)},
                              [l1]))) == []


def test_only_the_bringups_the_remaining_jobs_do_not_need_are_drained_newest_first():
    """Two bring-ups of 8 VMs and 3 waiting jobs (the rest were cancelled): one lease covers
    them; the newer one (it has done the least) is drained. Idle VMs of an active lease that
    cover the jobs make the bring-up unneeded too."""
    q = queue(max_devices=3, max_starting=3)
    devs = [device(f"gpu-host-0{i}", agent_state="offline") for i in (1, 2, 3)]
    older = lease("l1", "gpu-host-01", "deploying", created_at=NOW - 300)
    newer = lease("l2", "gpu-host-02", "claimed", created_at=NOW - 200)
    three = {"one-gpu-vm": QueueDemand(waiting=3, last_job_at=NOW - 300)}
    assert drains(plan(inputs([q], devs, three, [older, newer]))) == [("l2", "unneeded")]
    active = lease("l3", "gpu-host-03")
    idle = [VMAgentView(f"l3-a{i}", "l3", "one-gpu-vm", "waiting", "", False) for i in range(4)]
    assert drains(plan(inputs([q], devs, three, [active, older], idle))) == [("l1", "unneeded")]


# ---------------------------------------------------------------- 2. a stale agent host

def test_a_device_of_a_stale_agent_host_is_not_lent_and_plan_says_why():
    """The trial: agent host h1 was reported stale ("its leases are not being worked"); 2 s
    later its device was lent. Now it is not, and the plan names the host; a device of a live
    host is lent instead, and h1's again once it heartbeats."""
    q = queue()
    demand = {"one-gpu-vm": QueueDemand(waiting=1, last_job_at=NOW)}
    stale = {"h1": 130.0}
    assert plan(inputs([q], [device("gpu-host-01")], demand, stale_hosts=stale)) == []
    (why,) = plan(inputs([q], [device("gpu-host-01")], demand, stale_hosts=stale), explain=True)
    assert (why.kind, why.data["why"], why.data["devices"]["on stale host"]) == \
        ("blocked", "no_device", 1)
    assert "1 on stale host, 0 idle" in why.reason
    assert "agent host h1 sent no heartbeat for 130s" in why.reason
    devs = [device("gpu-host-01"), device("gpu-host-02", host="h2")]
    assert [(a.kind, a.device) for a in plan(inputs([q], devs, demand, stale_hosts=stale))] == \
        [("lend", "gpu-host-02")]
    assert [(a.kind, a.device) for a in plan(inputs([q], devs, demand))] == \
        [("lend", "gpu-host-01")]


def test_a_bringup_on_a_stale_agent_host_is_restored_without_a_failure():
    """A lease the trial left in ``claimed`` on a stale host kept its device fenced from its
    home queue, and its jobs waiting for nothing. It is restored (no failure counted: the
    device did nothing wrong) and the queue lends a device of a live host; active leases there
    keep their lifecycle (their VMs may still serve jobs: only the daemon may be down)."""
    q = queue()
    devs = [device("gpu-host-01", agent_state="offline"), device("gpu-host-02", host="h2")]
    claimed = lease("l1", "gpu-host-01", "claimed", created_at=NOW - 10)
    demand = {"one-gpu-vm": QueueDemand(waiting=1, last_job_at=NOW - 10)}
    acts = plan(inputs([q], devs, demand, [claimed], stale_hosts={"h1": None}))
    assert [(a.kind, a.lease_id or a.device, a.data.get("host_stale")) for a in acts] == \
        [("restore", "l1", True), ("lend", "gpu-host-02", None)]
    assert "agent host h1 sent no heartbeat yet" in acts[0].reason
    active = lease("l2", "gpu-host-01")
    vm = busy_agents("l2", 8)
    assert plan(inputs([q], devs, {}, [active], vm, stale_hosts={"h1": 300.0})) == []


def idle_agents(lease_id, n, queue="one-gpu-vm"):
    return [VMAgentView(f"{lease_id}-a{i}", lease_id, queue, "waiting", "", False)
            for i in range(n)]


def test_idle_vms_of_a_lease_on_a_stale_host_are_no_supply_for_waiting_jobs():
    """An active lease on stale h1 with 8 idle VM agents (their documents still say waiting):
    the queue's waiting job would wait forever on them. They count as no supply, so a device
    of a live host is lent; the lease itself is neither drained nor restored for staleness
    (the host may come back, a running job is never cancelled for it). With h1 live the idle
    VMs cover the job and nothing is lent."""
    q = queue()
    devs = [device("gpu-host-01"), device("gpu-host-02", host="h2")]
    active = lease("l1", "gpu-host-01")
    demand = {"one-gpu-vm": QueueDemand(waiting=1, last_job_at=NOW - 10)}
    acts = plan(inputs([q], devs, demand, [active], idle_agents("l1", 8),
                       stale_hosts={"h1": 300.0}))
    assert [(a.kind, a.device) for a in acts] == [("lend", "gpu-host-02")]
    assert "0 idle or starting VMs" in acts[0].reason
    assert plan(inputs([q], devs, demand, [active], idle_agents("l1", 8))) == []
    # Half busy on the stale host: still no drain, no force; nothing else to lend -> blocked.
    mixed = idle_agents("l1", 4) + busy_agents("l1", 4)
    (why,) = plan(inputs([q], devs[:1], demand, [active], mixed, stale_hosts={"h1": 300.0}),
                  explain=True)
    assert (why.kind, why.data["why"], why.data["supply"]) == ("blocked", "no_device", 0)


def test_a_paused_or_draining_lease_on_a_stale_host_is_not_resumed_for_demand():
    """Resuming or undraining a lease on a stale host would give the waiting job nothing: a
    device of a live host is lent instead, and the lease keeps its admission and drain."""
    q = queue()
    devs = [device("gpu-host-01"), device("gpu-host-02", host="h2")]
    demand = {"one-gpu-vm": QueueDemand(waiting=1, last_job_at=NOW - 10)}
    paused = lease("l1", "gpu-host-01", admission="paused")
    draining = lease("l1", "gpu-host-01", state="draining",
                     drain={"kind": "idle", "grace_until": NOW + 600})
    for l, vms in ((paused, idle_agents("l1", 4)),
                   (draining, idle_agents("l1", 4) + busy_agents("l1", 1))):
        acts = plan(inputs([q], devs, demand, [l], vms, stale_hosts={"h1": 300.0}))
        assert [(a.kind, a.device) for a in acts] == [("lend", "gpu-host-02")], acts
        assert [a.kind for a in plan(inputs([q], devs, demand, [l], vms))] == \
            ["resume" if l is paused else "undrain"]


# ---------------------------------------------------------------- TRIAL (2026-12-02) 3 and 11

def test_a_device_held_by_a_failed_lease_is_counted_apart():
    """TRIAL finding 3: WHY JOBS WAIT said "2 lent, 0 idle" while one device sat in a failed
    lease (out of its home queue until a person acts); it now says so."""
    q = queue()
    devs = [device("gpu-host-01", agent_state="offline"), device("gpu-host-02", agent_state="offline")]
    leases = [lease("l1", "gpu-host-01", "failed"), lease("l2", "gpu-host-02", "active")]
    busy = busy_agents("l2", 8)
    demand = {"one-gpu-vm": QueueDemand(waiting=9, last_job_at=NOW)}
    (why,) = [a for a in plan(inputs([q], devs, demand, leases, busy), explain=True)
              if a.kind == "blocked"]
    assert why.data["devices"]["lent in a failed lease"] == 1, why.data
    assert "1 lent, 1 lent in a failed lease, 0 idle" in why.reason, why.reason


def test_max_devices_filled_by_leases_of_a_stale_host_names_the_host():
    """TRIAL finding 11: with the daemon dead, its leases fill max_devices and serve nothing;
    the reason names the stale host and its leases rather than only "max_devices 2 reached"."""
    q = queue()
    devs = [device("gpu-host-01", agent_state="offline"), device("gpu-host-02", agent_state="offline")]
    leases = [lease("l1", "gpu-host-01", "restoring"), lease("l2", "gpu-host-02", "restoring")]
    demand = {"one-gpu-vm": QueueDemand(waiting=1, last_job_at=NOW)}
    (why,) = [a for a in plan(inputs([q], devs, demand, leases, stale_hosts={"h1": 180.0}),
                              explain=True) if a.kind == "blocked"]
    assert why.data["why"] == "max_devices"
    assert ("max_devices 2 reached; 2 of them on stale agent host h1 (no heartbeat for 3m: "
            "l1 restoring on gpu-host-01, l2 restoring on gpu-host-02)") in why.reason, why.reason
    (live,) = [a for a in plan(inputs([q], devs, demand, leases), explain=True)
               if a.kind == "blocked"]
    assert live.reason.endswith("max_devices 2 reached"), live.reason
