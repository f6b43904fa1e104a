"""Issue 9: a reconcile tick reads its inputs in a bounded number of database calls, whatever the
number of devices, leases and agents (no query inside a loop over agents).

The lab is benchmarks/reconcile_scale.py's: a mongomock database filled through the real code
(queues applied, devices registered, leases claimed and brought up by daemon reports, VM agents
posted, a third of them running a job handed out through the dispatch hook's marker). Counts are
deterministic; no time is measured here.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from testflinger_magic import reconcile as R


def _bench():
    spec = importlib.util.spec_from_file_location(
        "reconcile_scale", Path(__file__).parent.parent / "benchmarks" / "reconcile_scale.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def bench():
    return _bench()


def steady_tick_calls(bench, devices: int, queues: int):
    lab = bench.Lab(devices, queues)
    ticks = lab.settle()
    assert ticks < 30, "the lab never reached a tick that applies nothing"
    # The notifier's thread reads definitions (webhook URLs) for the settle ticks' events: let
    # it finish, or its reads land among the counted tick's on a slow machine.
    assert lab.plugin.notifier.flush(30)
    lab.db.ops.clear()
    lab.db.on = True
    applied = lab.engine.tick()
    lab.db.on = False
    assert applied == []
    return sum(lab.db.ops.values()), dict(lab.db.ops), lab


def test_a_tick_makes_the_same_database_calls_at_5x_the_devices(bench):
    small, small_ops, lab = steady_tick_calls(bench, 20, 5)
    large, large_ops, big = steady_tick_calls(bench, 100, 5)
    # The lab is not vacuous: open leases, reporting VM agents, busy and idle ones.
    inputs = big.engine.gather(read_only=True)
    assert len(inputs.leases) >= 40 and len(inputs.vm_agents) >= 100
    assert {a.busy for a in inputs.vm_agents} == {True, False}
    assert large_ops == small_ops, (small_ops, large_ops)
    assert large <= 50


def test_a_steady_tick_reads_each_collection_once(bench):
    """The repairs, the watch, the give-back check and the snapshot share one read of each
    collection (tickreads.TickReads; the jobs in one $or read, server/jobreads.py): two reads
    of magic_leases (the open leases; the returned ones not judged yet), one of every other,
    and no write."""
    calls, ops, lab = steady_tick_calls(bench, 20, 5)
    reads = {key: n for key, n in ops.items() if key[1] in bench.READS}
    assert reads.pop(("magic_leases", "find")) == 2, ops
    assert reads and set(reads.values()) == {1}, ops
    assert sum(reads.values()) + 2 == calls, ops  # nothing but those reads
    # The same with a clock that moves between its readings, as a real one does: the give-back
    # check, the snapshot and the missing-agents report share one read of the returned leases.
    ticks = iter(range(1, 10**6))
    clock = lambda: bench.NOW + next(ticks) * 1e-3  # noqa: E731
    lab.engine.clock = lab.engine.giveback.clock = clock
    lab.db.ops.clear()
    lab.db.on = True
    lab.engine.tick()
    lab.db.on = False
    assert lab.db.ops[("magic_leases", "find")] == 2, dict(lab.db.ops)


def test_gather_reads_busyness_in_one_batch(bench):
    """The VM agents' busyness comes from one marker read and one read of the jobs they name,
    not a ``find`` per agent, and says what the per-agent check says for each agent."""
    lab = bench.Lab(20, 5)
    lab.settle()
    lab.db.ops.clear()
    lab.db.on = True
    inputs = lab.engine.gather(read_only=True)
    lab.db.on = False
    assert lab.db.ops[("magic_dispatch", "find")] == 1
    assert lab.db.ops[("jobs", "find_one")] == 0 and lab.db.ops[("agents", "find_one")] == 0
    assert inputs.vm_agents
    for view in inputs.vm_agents:
        one = lab.store.agent_busy(view.name, include_pending=False, prune=False)
        assert view.busy == (one is not None), view


def test_plan_is_unchanged_by_the_batched_gather(bench):
    """A dry-run plan on the filled lab lends, drains or restores nothing it should not: every
    action names a lease or device that exists (a smoke check of the batched inputs)."""
    lab = bench.Lab(20, 5)
    lab.settle()
    inputs = lab.engine.gather(read_only=True)
    leases = {l.id for l in inputs.leases}
    devices = {d.name for d in inputs.devices}
    for action in R.plan(inputs, explain=True):
        assert action.lease_id is None or action.lease_id in leases
        assert action.device is None or action.device in devices


def test_a_kicked_tick_skips_recent_repairs_but_never_for_longer_than_tick_seconds():
    """A submission's kick goes straight to gather/plan/apply (the lend comes sooner); the
    repairs still run on the first tick, on every periodic tick, and on a kicked tick once the
    last repairs are ``tick_seconds`` old."""
    import threading

    from testflinger_magic import db as dbmod
    from testflinger_magic.server.plugin import MagicPlugin

    plugin = MagicPlugin(dbmod.connect(), tick_seconds=3600)
    seen, ticked = [], threading.Semaphore(0)
    real = plugin.engine.tick

    def tick(repair=True):
        seen.append(repair)
        out = real(repair=repair)
        ticked.release()
        return out

    plugin.engine.tick = tick
    plugin.start()
    try:
        assert ticked.acquire(timeout=30)  # the first tick: repairs
        plugin.kick()
        assert ticked.acquire(timeout=30)  # kicked, repairs fresh: skipped
        plugin._repaired_at -= 3600        # an hour later
        plugin.kick()
        assert ticked.acquire(timeout=30)  # kicked, repairs due: run
    finally:
        plugin.stop()
    assert seen[:3] == [True, False, True]


def test_a_tick_waits_while_a_quick_lend_runs(bench, monkeypatch):
    """While a quick lend is in flight (server/quicklend.py) the tick makes no database call: it
    waits before its first read, and goes on once the quick lend is done."""
    import threading

    from testflinger_magic.server import quicklend

    monkeypatch.setattr(quicklend, "YIELD_LIMIT", 600.0)
    lab = bench.Lab(20, 5)
    lab.settle()
    assert lab.plugin.notifier.flush(30)
    engine = lab.engine
    engine._quick_idle.clear()  # a quick lend is running
    lab.db.ops.clear()
    lab.db.on = True
    ticking = threading.Thread(target=engine.tick)
    ticking.start()
    ticking.join(0.5)
    assert ticking.is_alive() and not lab.db.ops  # waiting, nothing read
    engine._quick_idle.set()  # the quick lend is done
    ticking.join(60)
    lab.db.on = False
    assert not ticking.is_alive() and lab.db.ops


def test_gather_reads_no_markers_or_held_jobs_of_agents_in_a_phase(bench, monkeypatch):
    """An agent whose document shows a job phase (or ``restart``) is busy whatever its markers
    and jobs say, so the tick reads neither for it (at 1,000 devices they were a fifth of the
    documents a tick read): it asks for the markers and held jobs of the other agents only, and
    every VM agent's busyness is what the per-agent check says."""
    from testflinger_magic.gates import NOT_IDLE_STATES

    lab = bench.Lab(20, 5)
    lab.settle()
    docs = {d["name"]: d for d in lab.db.agents.find({})}
    in_phase = {name for name, d in docs.items() if d.get("state") in NOT_IDLE_STATES}
    asked: dict[str, list] = {"markers": [], "held": []}
    markers, read = lab.store.gates.markers, lab.engine.job_reads.read

    def spy_markers(names):
        names = list(names)
        asked["markers"] += names
        return markers(names)

    def spy_read(now, magic, relevant, agents, marker_jobs, possible=None):
        agents = list(agents)
        asked["held"] += agents
        return read(now, magic, relevant, agents, marker_jobs, possible)

    monkeypatch.setattr(lab.store.gates, "markers", spy_markers)
    monkeypatch.setattr(lab.engine.job_reads, "read", spy_read)
    inputs = lab.engine.gather(read_only=True)
    vms = {v.name: v for v in inputs.vm_agents}
    busy_vms = in_phase & set(vms)
    assert busy_vms and set(vms) - busy_vms  # the lab has both kinds
    assert asked["markers"] and not set(asked["markers"]) & in_phase
    assert asked["held"] and not set(asked["held"]) & in_phase
    for name, view in vms.items():
        one = lab.store.agent_busy(name, include_pending=False, prune=False)
        assert view.busy == (one is not None), view


def test_a_marker_of_an_agent_in_a_phase_is_pruned_once_it_is_idle_or_its_lease_closes(bench):
    """A marker whose job ended while its agent runs the next job is kept (the agent is busy;
    its markers are not read) until a tick sees the agent idle, which prunes it; the markers
    of a closed lease's VM agents go with their agent documents (LeaseStore.cleanup)."""
    lab = bench.Lab(20, 5)
    lab.settle()
    marker = next(m for m in lab.db.magic_dispatch.find({}))
    agent, job_id = marker["agent"], marker["job_id"]
    assert lab.db.agents.find_one({"name": agent})["state"] == "test"
    lab.db.jobs.update_one({"job_id": job_id}, {"$set": {"result_data.job_state": "complete"}})
    lab.engine.tick()
    assert lab.db.magic_dispatch.find_one({"_id": marker["_id"]}) is not None
    assert next(v for v in lab.engine.gather(read_only=True).vm_agents if v.name == agent).busy
    lab.db.agents.update_one({"name": agent}, {"$set": {"state": "waiting", "job_id": ""}})
    lab.engine.tick()
    assert lab.db.magic_dispatch.find_one({"_id": marker["_id"]}) is None
    # A closed lease's VM agents' markers, whatever their jobs, go at its cleanup.
    lease = lab.db.magic_leases.find_one({"state": "active"})
    names = [vm["agent_name"] for vm in lease["vms"]]
    for name in names:
        lab.store.gates.mark(name, "job-of-" + name, lease["queue"])
    lab.store.cleanup(dict(lease, state="returned"))
    assert lab.db.magic_dispatch.count_documents({"agent": {"$in": names}}) == 0


def test_the_snapshots_views_are_what_their_dataclasses_build(bench):
    """The snapshot builds its views with ``reconcile_model.view`` (no generated ``__init__``):
    each names every field, and equals, hashes and refuses writes as ``cls(**fields)`` does."""
    import dataclasses

    lab = bench.Lab(20, 5)
    lab.settle()
    inputs = lab.engine.gather(read_only=True)
    seen = set()
    for v in [*inputs.devices, *inputs.leases, *inputs.vm_agents]:
        names = [f.name for f in dataclasses.fields(v)]
        assert sorted(vars(v)) == sorted(names), (type(v).__name__, vars(v))
        again = type(v)(**{n: getattr(v, n) for n in names})
        assert v == again and repr(v) == repr(again)
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(v, names[0], None)
        seen.add(type(v).__name__)
    assert seen == {"DeviceView", "LeaseView", "VMAgentView"}
