"""The tick's gate repair (gates.Gates.repair) reads only the closed gates and counts the others
between full reads; its answers and what it leaves behind are those of a repair that reads every
gate (the first tick's), whatever crashes and other writers did in between."""

from __future__ import annotations

import random

import pytest

from testflinger_magic import db as dbmod
from testflinger_magic import gates as G
from testflinger_magic.leases import OPEN_STATES
from testflinger_magic.lab import dbcount

NAMES = [f"dev-{i}" for i in range(6)] + [f"dev-{i}-vm1" for i in range(6)]


def state(db) -> dict:
    """{gate name: (fenced, paused)}: what a poll reads."""
    return {g["_id"]: (g.get("fenced"), g.get("paused")) for g in db.magic_agent_gate.find({})}


def full_repair(db, watched, fenced, paused):
    """A repair on a fresh Gates (it reads every gate), on a copy of the gates: the answer and
    the gates it leaves; the gates are put back as they were."""
    saved = list(db.magic_agent_gate.find({}))
    out = G.Gates(db, lambda: 0.0, OPEN_STATES).repair(watched, fenced=set(fenced),
                                                        paused=set(paused))
    after = state(db)
    db.magic_agent_gate.delete_many({})
    if saved:
        db.magic_agent_gate.insert_many(saved)
    return out, after


@pytest.mark.parametrize("seed", range(30))
def test_the_lean_repair_answers_as_a_full_read(seed):
    rng = random.Random(seed)
    db = dbmod.connect()
    gates = G.Gates(db, lambda: 0.0, OPEN_STATES)
    watched = set(rng.sample(NAMES, 6))
    gates.sync(watched)
    lean_ticks = 0
    for step in range(25):
        # Within one interval, not both a gate deleted by another writer and a gate made for
        # a name the repair does not know (the count would not see it: the next test).
        step_kinds: set[str] = set()

        def sync(name):
            if gates.read(name) is None and name not in watched | gates._known:
                if "delete" in step_kinds:
                    return
                step_kinds.add("stray")
            gates.sync([name])

        for _ in range(rng.randrange(1, 4)):
            name = rng.choice(NAMES)
            kind = rng.choice(["fence_crash", "unfence_crash", "fence", "unfence", "corrupt",
                               "delete", "watch", "unwatch", "pause", "unpause"])
            if kind in ("fence_crash", "fence"):
                db.magic_fences.update_one({"_id": name}, {"$set": {"lease_id": "l"}},
                                           upsert=True)
                if kind == "fence":
                    sync(name)
            elif kind in ("unfence_crash", "unfence"):
                db.magic_fences.delete_one({"_id": name})
                if kind == "unfence":
                    sync(name)
            elif kind == "corrupt":  # a gate written by hand, or an older version
                db.magic_agent_gate.update_one({"_id": name}, {"$set": {
                    "fenced": rng.random() < 0.5}, "$inc": {"version": 1}})
            elif kind == "delete":  # another replica's repair, by a stale view
                if "stray" not in step_kinds:
                    db.magic_agent_gate.delete_one({"_id": name})
                    step_kinds.add("delete")
            elif kind == "watch":  # registered (its gate made, or not: a crash)
                watched.add(name)
                if rng.random() < 0.5:
                    gates.ensure([name])
            elif kind == "unwatch":
                watched.discard(name)
            elif kind == "pause":  # a lease's admission paused (its VM agent's gate synced)
                db.magic_leases.update_one({"_id": f"l-{name}"}, {"$set": {
                    "state": "active", "admission": "paused", "vms": [{"agent_name": name}]}},
                    upsert=True)
                if rng.random() < 0.5:
                    sync(name)
            else:
                db.magic_leases.delete_one({"_id": f"l-{name}"})
                if rng.random() < 0.5:
                    sync(name)
        fenced = {f["_id"] for f in db.magic_fences.find({})}
        paused = {lease["vms"][0]["agent_name"] for lease in db.magic_leases.find({})}
        want, want_after = full_repair(db, watched, fenced, paused)
        got = gates.repair(watched, fenced=fenced, paused=paused)
        lean_ticks += not gates._full
        assert (got, state(db)) == (want, want_after), (seed, step)
        # What the repair promises: gates agree with fences and pauses, every watched name has
        # one, and no open gate is left to a name nobody watches (but one it just re-synced:
        # dropped by the next repair).
        now = state(db)
        for name in fenced | paused:
            assert now[name] == (name in fenced, name in paused)
        assert watched <= set(now)
        assert {n for n, s in now.items() if s == (False, False)} <= watched | set(got)
    assert lean_ticks >= 5  # the lean path ran, not only full reads


def test_a_steady_repair_reads_the_closed_gates_and_counts():
    db = dbcount.Counting(dbmod.connect())
    gates = G.Gates(db, lambda: 0.0, OPEN_STATES)
    names = [f"a{i}" for i in range(50)]
    gates.sync(names)
    db.magic_fences.insert_many([{"_id": n, "lease_id": "l"} for n in names[:10]])
    gates.sync(names[:10])
    fenced = set(names[:10])
    assert gates.repair(names, fenced=fenced, paused=set()) == []  # first: a full read
    assert gates._full
    db.on = True
    assert gates.repair(names, fenced=fenced, paused=set()) == []
    db.on = False
    assert not gates._full
    assert dict(db.ops) == {("magic_agent_gate", "find"): 1,
                            ("magic_agent_gate", "count_documents"): 1}
    # Another writer's gate of a name watched from now on: found by _id, no full read.
    gates.sync(["new"])
    db.ops.clear()
    db.on = True
    assert gates.repair(names + ["new"], fenced=fenced, paused=set()) == []
    db.on = False
    assert not gates._full and db.ops[("magic_agent_gate", "find")] == 2
    # A gate deleted behind its back: the count differs, every gate is read again and the
    # missing one made.
    db.magic_agent_gate.delete_one({"_id": "a20"})
    assert gates.repair(names + ["new"], fenced=fenced, paused=set()) == []
    assert gates._full and gates.read("a20") is not None


def test_every_gate_is_read_again_after_the_full_read_interval(monkeypatch):
    """The one case the count cannot see (a known gate deleted by another replica while a gate
    nobody watches was made, in one interval) lasts until the next full read."""
    db = dbmod.connect()
    gates = G.Gates(db, lambda: 0.0, OPEN_STATES)
    gates.sync(["a", "b"])
    assert gates.repair(["a", "b"], fenced=set(), paused=set()) == [] and gates._full
    db.magic_agent_gate.delete_one({"_id": "a"})
    gates.sync(["stray"])  # same count
    assert gates.repair(["a", "b"], fenced=set(), paused=set()) == [] and not gates._full
    assert gates.read("a") is None
    now = G.time.monotonic()
    monkeypatch.setattr(G.time, "monotonic", lambda: now + G.GATES_FULL_READ + 1)
    assert gates.repair(["a", "b"], fenced=set(), paused=set()) == [] and gates._full
    assert gates.read("a") is not None and gates.read("stray") is None
