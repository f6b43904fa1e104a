"""reconcile.plan with the smarter-lending knobs of issue 11 (queue_policy.py,
reconcile_sharing.py): warm windows and their time zone, the learnt warm level, device_fit,
yield_idle (a starving queue gets an idle lease of a queue sharing its devices), max_share and
reclaim.idle_wait. One test per decision, each beside the same inputs with the knob off (the
old plan)."""

from __future__ import annotations

import pytest

from testflinger_magic.queue_policy import WarmLearn, learned_jobs, scheduled_level, WarmWindow
from testflinger_magic.queues import MagicQueue
from testflinger_magic.reconcile import (DeviceView, Inputs, LeaseView, QueueDemand, VMAgentView,
                                         plan)

#: Monday 2024-01-08 10:00 UTC.
MON_10 = 1704708000.0
DAY = 86400.0
HOUR = 3600.0


def queue(name="one-gpu-vm", gpus=1, home=("gpu-hosts",), **policy):
    base = {"max_devices": 3, "max_starting": 3, "idle_timeout": 600.0}
    base.update(policy)
    return MagicQueue(name=name, description=name, devices={"home_queues": list(home)},
                      vm={"gpus": gpus}, policy=base)


def device(name, gpus=4, home=("gpu-hosts",), **kw):
    kw.setdefault("agent_state", "waiting")
    return DeviceView(name=name, agent_host="h1", gpus=gpus, tags=(), home_queues=home, **kw)


def lease(id, device, queue="one-gpu-vm", vms=4, state="active", idle_since=None, **kw):
    return LeaseView(id=id, device=device, queue=queue, state=state, generation=1,
                     created_at=MON_10 - 2 * HOUR, updated_at=MON_10 - 2 * HOUR, deadline=None,
                     vms=vms, idle_since=idle_since, **kw)


def idle_agents(lease_id, n, queue="one-gpu-vm", busy=0):
    out = [VMAgentView(f"{lease_id}-vm{i}", lease_id, queue, "waiting", None, False)
           for i in range(n)]
    out += [VMAgentView(f"{lease_id}-b{i}", lease_id, queue, "test", f"j{i}", True)
            for i in range(busy)]
    return out


def inputs(defs, devices, demand=None, leases=(), vm_agents=(), now=MON_10, **kw):
    return Inputs(definitions=list(defs), devices=list(devices), demand=dict(demand or {}),
                  leases=list(leases), vm_agents=list(vm_agents), now=now, **kw)


def lends(actions):
    return [a.device for a in actions if a.kind == "lend"]


# ---------------------------------------------------------------- warm by schedule

def test_a_warm_window_lends_inside_it_and_not_outside():
    q = queue(warm=[{"days": "mon-fri", "hours": "08:00-18:00", "devices": 2}])
    devs = [device(f"gpu-{i}") for i in range(1, 4)]
    acts = plan(inputs([q], devs))
    assert lends(acts) == ["gpu-1", "gpu-2"]
    assert "warm schedule 2 now (UTC), 0 lent" in acts[0].reason
    assert lends(plan(inputs([q], devs, now=MON_10 + 9 * HOUR))) == []       # 19:00
    assert lends(plan(inputs([q], devs, now=MON_10 + 5 * DAY))) == []        # Saturday 10:00
    assert lends(plan(inputs([queue()], devs))) == []                        # no window: no lend


def test_the_window_is_read_in_the_policy_time_zone():
    # 10:00 UTC is 05:00 in New York (EST, UTC-5): before the window there.
    q = queue(warm=[{"days": "mon", "hours": "08:00-18:00"}], timezone="America/New_York")
    assert lends(plan(inputs([q], [device("gpu-1")]))) == []
    assert lends(plan(inputs([q], [device("gpu-1")], now=MON_10 + 4 * HOUR))) == ["gpu-1"]


def test_the_simulator_clock_uses_inputs_wall_for_the_calendar():
    q = queue(warm=[{"days": "mon", "hours": "08:00-18:00"}])
    # now on a 0-based clock (Thursday 1970 as epoch); wall says Monday 10:00
    assert lends(plan(inputs([q], [device("gpu-1")], now=36000.0))) == []
    assert lends(plan(inputs([q], [device("gpu-1")], now=36000.0, wall=MON_10))) == ["gpu-1"]


def test_no_idle_drain_below_the_scheduled_level_but_after_the_window():
    q = queue(warm=[{"days": "mon-fri", "hours": "08:00-18:00", "devices": 1}], max_lease="1d")
    devs = [device("gpu-1", agent_state="offline")]
    ls = [lease("l1", "gpu-1", idle_since=MON_10 - HOUR)]
    ags = idle_agents("l1", 4)
    assert [a.kind for a in plan(inputs([q], devs, leases=ls, vm_agents=ags))] == []
    after = MON_10 + 8 * HOUR + 60  # 18:01
    acts = plan(inputs([q], devs, leases=ls, vm_agents=ags, now=after))
    assert [(a.kind, a.data.get("kind")) for a in acts] == [("drain", "idle")]


def test_scheduled_level_takes_the_largest_covering_window():
    windows = [WarmWindow(days="mon-fri", hours="08:00-18:00", devices=1),
               WarmWindow(days=["mon"], hours="09:00-10:30", devices=3)]
    assert scheduled_level(windows, "UTC", MON_10) == 3
    assert scheduled_level(windows, "UTC", MON_10 + DAY) == 1       # Tuesday
    assert scheduled_level(windows, "UTC", MON_10 + 8 * HOUR) == 0  # 18:00: the end is out


# ---------------------------------------------------------------- warm learnt from arrivals

def _week_of_bursts(now, at=30 * 60, n=8):
    """``n`` jobs submitted ``at`` seconds after this time of day on each earlier day."""
    return sorted(now - k * DAY + at + i for k in range(1, 8) for i in range(n))


def test_learned_jobs_counts_the_same_kind_of_day_and_takes_the_quantile():
    learn = WarmLearn(lookback="7d", ahead="1h", quantile=0.5)
    arrivals = _week_of_bursts(MON_10)
    # Monday: the earlier working days in 7 days are Fri..Tue (4 of them: 8 each).
    assert learned_jobs(learn, "UTC", MON_10, MON_10, arrivals) == 8
    # Only weekend days had jobs: the median working day had none.
    weekend = [t for t in arrivals if (MON_10 - t) < 2 * DAY]  # Sat, Sun
    assert learned_jobs(learn, "UTC", MON_10, MON_10, weekend) == 0
    # A burst on 1 of the 4 working days: the 0.8 quantile ignores it, 1.0 takes it.
    one = [t for t in arrivals if 2 * DAY < MON_10 - t < 3 * DAY]  # Friday
    assert learned_jobs(learn, "UTC", MON_10, MON_10, one) == 0
    top = WarmLearn(quantile=1.0)
    assert learned_jobs(top, "UTC", MON_10, MON_10, one) == 8
    # Outside the look-ahead: nothing expected.
    late = _week_of_bursts(MON_10, at=2 * HOUR)
    assert learned_jobs(learn, "UTC", MON_10, MON_10, late) == 0


def test_a_learnt_warm_level_lends_devices_for_the_expected_jobs():
    q = queue(warm_learn={"lookback": "7d", "ahead": "1h", "max_devices": 2})
    devs = [device(f"gpu-{i}") for i in range(1, 5)]
    arrivals = {"one-gpu-vm": _week_of_bursts(MON_10, n=6)}
    acts = plan(inputs([q], devs, arrivals=arrivals))
    assert lends(acts) == ["gpu-1", "gpu-2"]  # ceil(6 jobs / 4 VMs) = 2
    assert "learnt warm level 2 (6 jobs expected in the next 1h)" in acts[0].reason
    capped = queue(warm_learn={"max_devices": 1})
    assert lends(plan(inputs([capped], devs, arrivals=arrivals))) == ["gpu-1"]
    assert lends(plan(inputs([q], devs))) == []  # no history: nothing learnt


# ---------------------------------------------------------------- device fit

def test_device_fit_demand_takes_the_smallest_device_that_covers_the_jobs():
    # The 8-GPU machine was used at home longest ago: by waste it is first (both waste 0).
    devs = [device("big", gpus=8, last_home_use=MON_10 - DAY),
            device("small", gpus=4, last_home_use=MON_10 - 60)]
    demand = {"one-gpu-vm": QueueDemand(waiting=3)}
    assert lends(plan(inputs([queue()], devs, demand))) == ["big"]
    assert lends(plan(inputs([queue(device_fit="demand")], devs, demand))) == ["small"]
    # Six jobs: no 4-GPU machine covers them, the 8-GPU one does.
    demand = {"one-gpu-vm": QueueDemand(waiting=6)}
    assert lends(plan(inputs([queue(device_fit="demand")], devs, demand))) == ["big"]
    # Twenty: none covers them; the largest first, then the next.
    demand = {"one-gpu-vm": QueueDemand(waiting=20)}
    assert lends(plan(inputs([queue(device_fit="demand")], devs, demand))) == ["big", "small"]


# ---------------------------------------------------------------- sharing: yield_idle

def _sharing(yield_idle="5m", a_priority=0, b_priority=0, a_min=0, idle_for=HOUR):
    a = queue("one-gpu-vm", yield_idle=yield_idle, priority=a_priority, min_devices=a_min,
              idle_timeout="3h")
    b = queue("two-gpu-vm", gpus=2, priority=b_priority)
    devs = [device("gpu-1", agent_state="offline")]
    ls = [lease("l1", "gpu-1", idle_since=MON_10 - idle_for)]
    return a, b, devs, ls, idle_agents("l1", 4)


def test_an_idle_lease_is_drained_for_a_queue_that_starves_on_its_device():
    a, b, devs, ls, ags = _sharing()
    demand = {"two-gpu-vm": QueueDemand(waiting=2)}
    acts = plan(inputs([a, b], devs, demand, ls, ags))
    drains = [a_ for a_ in acts if a_.kind == "drain"]
    assert [(d.lease_id, d.data["kind"]) for d in drains] == [("l1", "yield")]
    assert "two-gpu-vm has 2 jobs waiting and no device to lend" in drains[0].reason
    assert "would give it 2 VMs" in drains[0].reason
    # Without the knob: the lease stays (idle_timeout would drain it, but not below min, and
    # here it is idle only 1h < max_lease: with a long idle_timeout nothing happens).
    a0 = queue("one-gpu-vm", idle_timeout="2h")
    assert [x.kind for x in plan(inputs([a0, b], devs, demand, ls, ags))] == []


def test_no_yield_before_yield_idle_or_when_a_device_can_be_lent():
    a, b, devs, ls, ags = _sharing(yield_idle="2h")
    demand = {"two-gpu-vm": QueueDemand(waiting=2)}
    assert not [x for x in plan(inputs([a, b], devs, demand, ls, ags)) if x.kind == "drain"]
    a, b, devs, ls, ags = _sharing()
    free = devs + [device("gpu-2")]
    acts = plan(inputs([a, b], free, demand, ls, ags))
    assert [(x.kind, x.device) for x in acts] == [("lend", "gpu-2")]


def test_no_yield_of_a_busy_lease_nor_to_a_queue_whose_owner_waits():
    a, b, devs, ls, _ = _sharing()
    demand = {"two-gpu-vm": QueueDemand(waiting=2)}
    busy = idle_agents("l1", 3, busy=1)
    assert not [x for x in plan(inputs([a, b], devs, demand, ls, busy)) if x.kind == "drain"]
    a, b, devs, ls, ags = _sharing()
    owners = dict(demand, **{"gpu-hosts": QueueDemand(waiting=1, max_priority=5, oldest_age=10)})
    assert not [x for x in plan(inputs([a, b], devs, owners, ls, ags))
                if x.data.get("kind") == "yield"]


def test_a_warm_lease_yields_only_to_a_queue_of_at_least_its_priority():
    demand = {"two-gpu-vm": QueueDemand(waiting=2)}
    a, b, devs, ls, ags = _sharing(a_priority=5, b_priority=0, a_min=1)
    assert not [x for x in plan(inputs([a, b], devs, demand, ls, ags)) if x.kind == "drain"]
    a, b, devs, ls, ags = _sharing(a_priority=0, b_priority=5, a_min=1)
    assert [x.data["kind"] for x in plan(inputs([a, b], devs, demand, ls, ags))
            if x.kind == "drain"] == ["yield"]
    # Above its warm level (min 0) it yields to a lower priority too.
    a, b, devs, ls, ags = _sharing(a_priority=5, b_priority=0, a_min=0)
    assert [x.data["kind"] for x in plan(inputs([a, b], devs, demand, ls, ags))
            if x.kind == "drain"] == ["yield"]


def test_a_yielding_queue_lends_for_warmth_only_after_the_others_lent_for_jobs():
    # One free device; one-gpu-vm (higher priority) wants it warm, two-gpu-vm has jobs.
    warm = [{"days": "mon-sun", "hours": "00:00-24:00", "devices": 1}]
    b = queue("two-gpu-vm", gpus=2)
    demand = {"two-gpu-vm": QueueDemand(waiting=1)}
    old = queue("one-gpu-vm", priority=5, warm=warm)
    assert [(x.queue, x.device) for x in plan(inputs([old, b], [device("gpu-1")], demand))
            if x.kind == "lend"] == [("one-gpu-vm", "gpu-1")]
    new = queue("one-gpu-vm", priority=5, warm=warm, yield_idle="5m")
    assert [(x.queue, x.device) for x in plan(inputs([new, b], [device("gpu-1")], demand))
            if x.kind == "lend"] == [("two-gpu-vm", "gpu-1")]
    # With two devices both get one: the warm lend comes last.
    two = [device("gpu-1"), device("gpu-2")]
    assert [(x.queue, x.device) for x in plan(inputs([new, b], two, demand))
            if x.kind == "lend"] == [("two-gpu-vm", "gpu-1"), ("one-gpu-vm", "gpu-2")]


# ---------------------------------------------------------------- owner cost

def test_max_share_caps_the_devices_of_a_home_pool_lent_at_once():
    devs = [device(f"gpu-{i}") for i in range(1, 5)]
    demand = {"one-gpu-vm": QueueDemand(waiting=16)}
    q = queue(max_devices=4, max_starting=4)
    assert len(lends(plan(inputs([q], devs, demand)))) == 4
    capped = queue(max_devices=4, max_starting=4, max_share=0.5)
    assert lends(plan(inputs([capped], devs, demand))) == ["gpu-1", "gpu-2"]
    # Leases of any magic queue count: one already lent to another queue.
    other = queue("two-gpu-vm", gpus=2)
    held = [device("gpu-1", agent_state="offline")] + devs[1:]
    ls = [lease("l9", "gpu-1", queue="two-gpu-vm", vms=2)]
    acts = plan(inputs([capped, other], held, demand, ls, idle_agents("l9", 0, "two-gpu-vm", busy=2)),
                explain=True)
    assert lends(acts) == ["gpu-2"]
    blocked = [x for x in acts if x.kind == "blocked"]
    assert [x.data["why"] for x in blocked] == ["max_share"]
    assert "home queue gpu-hosts has 2 of 4 devices lent (max_share 0.5: at most 2)" in blocked[0].reason


def test_max_share_counts_devices_an_uncapped_queue_lent_earlier_in_the_plan():
    devs = [device(f"gpu-{i}") for i in range(1, 5)]
    first = queue("a-first", max_devices=2, max_starting=2, priority=5)  # planned first, no cap
    capped = queue("b-capped", max_devices=4, max_starting=4, max_share=0.5)
    demand = {"a-first": QueueDemand(waiting=8), "b-capped": QueueDemand(waiting=8)}
    acts = plan(inputs([first, capped], devs, demand))
    assert [(x.queue, x.device) for x in acts if x.kind == "lend"] == [
        ("a-first", "gpu-1"), ("a-first", "gpu-2")]  # 2 of 4 lent: the cap of 0.5 is reached


def test_owner_first_lends_nothing_while_the_owners_jobs_of_higher_priority_wait():
    devs = [device("gpu-1"), device("gpu-2", home=("other",))]
    demand = {"one-gpu-vm": QueueDemand(waiting=6),
              "gpu-hosts": QueueDemand(waiting=1, max_priority=0, oldest_age=5)}
    assert lends(plan(inputs([queue(home=("gpu-hosts", "other"))], devs, demand))) == ["gpu-2"]
    urgent = queue(home=("gpu-hosts", "other"), priority=1)  # the magic queue's priority says so
    assert lends(plan(inputs([urgent], devs, demand))) == ["gpu-1", "gpu-2"]


def test_reclaim_idle_wait_gives_an_idle_lease_back_at_once():
    devs = [device("gpu-1", agent_state="offline")]
    ls = [lease("l1", "gpu-1", idle_since=MON_10 - 60)]
    owners = {"gpu-hosts": QueueDemand(waiting=1, oldest_age=30)}
    q = queue(idle_timeout="1h", reclaim={"owner_wait": "30m", "idle_wait": "0s"})
    acts = plan(inputs([q], devs, owners, ls, idle_agents("l1", 4)))
    assert [(x.kind, x.data.get("kind")) for x in acts] == [("drain", "reclaim")]
    assert "(idle_wait 0s, its VMs idle)" in acts[0].reason
    # A busy lease waits for owner_wait; without idle_wait the idle one does too.
    assert plan(inputs([q], devs, owners, ls, idle_agents("l1", 3, busy=1))) == []
    q0 = queue(idle_timeout="1h")
    assert plan(inputs([q0], devs, owners, ls, idle_agents("l1", 4))) == []


@pytest.mark.parametrize("knobs", [
    {"warm": [{"hours": "00:00-24:00", "devices": 1}]}, {"warm_learn": {}},
    {"device_fit": "demand"}, {"yield_idle": "5m"}, {"max_share": 0.5},
])
def test_each_knob_leaves_a_plan_without_its_case_unchanged(knobs):
    """A lab where no knob's case arises (demand covered by an idle lease, no owner waiting, no
    other queue): the same plan with each knob on as off."""
    devs = [device("gpu-1", agent_state="offline"), device("gpu-2"), device("gpu-3")]
    ls = [lease("l1", "gpu-1", idle_since=MON_10 - 60)]
    demand = {"one-gpu-vm": QueueDemand(waiting=2)}
    base = plan(inputs([queue(min_devices=1)], devs, demand, ls, idle_agents("l1", 4)))
    got = plan(inputs([queue(min_devices=1, **knobs)], devs, demand, ls, idle_agents("l1", 4)))
    assert got == base == []


def test_sharing_queues_split_scarce_devices_by_demand():
    """The lab's case (issue 11): two 8-GPU machines, 10 one-GPU and 3 two-GPU jobs. Before,
    one-gpu-vm (planned first, by name) took both (16 VMs for 10 jobs) and two-gpu-vm waited
    for a lease to empty; queues that share take their first device in turn."""
    devs = [device("gpu-1", gpus=8), device("gpu-2", gpus=8)]
    demand = {"one-gpu-vm": QueueDemand(waiting=10), "two-gpu-vm": QueueDemand(waiting=3)}
    old = [queue("one-gpu-vm"), queue("two-gpu-vm", gpus=2)]
    assert [(x.queue, x.device) for x in plan(inputs(old, devs, demand)) if x.kind == "lend"] \
        == [("one-gpu-vm", "gpu-1"), ("one-gpu-vm", "gpu-2")]
    new = [queue("one-gpu-vm", yield_idle="5m"), queue("two-gpu-vm", gpus=2, yield_idle="5m")]
    acts = plan(inputs(new, devs, demand, [], []), explain=True)
    assert [(x.queue, x.device) for x in acts if x.kind == "lend"] \
        == [("one-gpu-vm", "gpu-1"), ("two-gpu-vm", "gpu-2")]
    # one-gpu-vm's 2 jobs beyond its 8 VMs: explained once, after every stage
    assert [(x.queue, x.data["why"]) for x in acts if x.kind == "blocked"] \
        == [("one-gpu-vm", "no_device")]
    # With a third device the rest of one-gpu-vm's demand gets it, after two-gpu-vm's first.
    three = devs + [device("gpu-3", gpus=8)]
    assert [(x.queue, x.device) for x in plan(inputs(new, three, demand)) if x.kind == "lend"] \
        == [("one-gpu-vm", "gpu-1"), ("two-gpu-vm", "gpu-2"), ("one-gpu-vm", "gpu-3")]
