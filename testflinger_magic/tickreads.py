"""The documents one reconcile tick reads, each collection read once and shared by the tick's
repairs, its watch, the give-back check and the snapshot (Engine.tick).

Before, each repair read what it needed itself: one tick read ``magic_leases`` twelve times,
``magic_device_claims`` four times, ``agents``, ``magic_devices`` and ``magic_fences`` three
times each (benchmarks/reconcile_scale.py). A :class:`TickReads` reads each of them once, on first
use (memoised), with the query the index table (:mod:`testflinger_magic.indexes`) serves:

* ``claims()``: every ``magic_device_claims`` document (one per lent device);
* ``fences()``: every ``magic_fences`` document (one per fenced agent);
* ``devices()``: every ``magic_devices`` document (registered devices), by name;
* ``open_leases()``: the open leases (``state`` in OPEN_STATES: index ``(state, created_at)``),
  oldest first; never the history of closed leases, which grows for ever (plus one ``_id``
  read of those written by an older version, if any: :func:`with_vms`);

Each read asks only for the fields the tick uses (``*_FIELDS`` below): what a read returns is
decoded document by document (by pymongo in C, by the stand-in in Python), and the leases' VM
details and history, the daemon's, are most of their size.
* ``leases_by_id(ids)``: leases by ``_id``: the open ones from ``open_leases()``, the others
  (``failed`` leases that keep their claim, ``returned`` ones a crash left holding something)
  by one ``_id`` read of the ids not seen yet;
* ``recently_returned(horizon)``: ``returned`` leases not yet judged by the give-back check,
  returned since ``horizon`` (index ``(state, updated_at)``): the give-back check and the
  snapshot's ``agent_back`` read the same documents;
* ``agent_hosts()``: every ``magic_agent_hosts`` document (one per agent host): the watch's
  stale hosts and the snapshot's ``Inputs.stale_hosts`` read the same;
* ``agents(names)``: Testflinger ``agents`` documents (``name``, ``state``, ``job_id``,
  ``updated_at``, ``comment``) of the registered devices and the VM agents of open leases, in
  one ``$in`` read (index ``agents(name)``), plus one more read only for names outside that set.

Staleness: every state change the tick makes is a compare-and-set on the document itself, so a
read made a few milliseconds earlier in the same tick can at worst make a write match nothing
(the next tick tries again), as a read by another replica can. Still, a repair that changed
something calls :meth:`invalidate`, so what follows reads the database again: in the steady
state no repair changes anything and every collection is read once.

Not thread-safe: one tick, one thread.
"""

from __future__ import annotations

from typing import Iterable

from .lease_states import ACTIVE, AFTER_ACTIVE_STATES, OPEN_STATES, RETURNED

#: Agent document fields the tick uses (state and job for idleness, ``updated_at`` for the
#: give-back and ``last_home_use``, ``comment`` for the device agent repairs).
AGENT_FIELDS = {"name": 1, "state": 1, "job_id": 1, "updated_at": 1, "comment": 1}
#: Open lease fields the tick uses (Snapshot._lease_view, the repairs, the watch): of the VMs
#: their agent names only (``vm_names``, written at the claim with ``vms``) and of the history
#: when the lease first became active only (``active_since``, written at that transition). A
#: lease document carries every VM's MAC, disk, PCI addresses and MAAS id and a history entry
#: per transition, ~1.9 KB at 4 VMs; this is ~0.3 KB of it, all top-level fields (the
#: documents a tick returns cost their decoding, and a projection into ``vms`` or a
#: ``$elemMatch`` of ``history`` costs the server a walk of those arrays per document:
#: benchmarks/reconcile_scale.py). :func:`with_vms` gives the documents back the ``vms`` and
#: ``history`` shape their readers use.
OPEN_LEASE_FIELDS = {"device": 1, "queue": 1, "agent_host": 1, "state": 1, "generation": 1,
                     "created_at": 1, "updated_at": 1, "deadline": 1, "drain": 1,
                     "admission": 1, "idle_since": 1, "missing_vm_agents": 1,
                     "overdue_reported": 1, "device_agent_before": 1, "vm_names": 1,
                     "active_since": 1, "by_hand": 1}
#: What a lease written before ``vm_names`` and ``active_since`` existed (or made active by
#: such a server, in a rolling upgrade) is read for instead: each VM's agent name, and the
#: first ``active`` history entry (``$elemMatch`` projection: MongoDB returns the first array
#: element that matches).
LEGACY_LEASE_FIELDS = {"vms.agent_name": 1, "history": {"$elemMatch": {"state": ACTIVE}}}


def with_vms(db, leases: list[dict], before_read=None) -> list[dict]:
    """Give each of ``leases`` (documents read with ``vm_names`` and ``active_since``, e.g.
    :data:`OPEN_LEASE_FIELDS`) ``vms`` (``[{agent_name}]``) and ``history`` (``[]`` or its
    first ``active`` entry ``{state, at}``), as readers of whole lease documents find them.
    Those written before these fields existed (no ``vm_names``), or in a state after
    ``active`` with no ``active_since`` field (made active by an older server; a restore
    from bring-up writes it null), are read again for
    :data:`LEGACY_LEASE_FIELDS`: one ``_id`` read of them, none when there are none.
    ``before_read``: called before that read. Changes and returns ``leases``."""
    legacy_ids = [lease["_id"] for lease in leases if "vm_names" not in lease or (
        "active_since" not in lease and lease.get("state") in AFTER_ACTIVE_STATES)]
    legacy = {}
    if legacy_ids:
        if before_read is not None:
            before_read()
        legacy = {d["_id"]: d for d in db.magic_leases.find({"_id": {"$in": legacy_ids}},
                                                            LEGACY_LEASE_FIELDS)}
    for lease in leases:
        old = legacy.get(lease["_id"])
        if old is not None:
            lease["vms"] = old.get("vms") or []
            lease["history"] = old.get("history") or []
            continue
        lease["vms"] = [{"agent_name": name} for name in lease.get("vm_names") or ()]
        at = lease.get("active_since")
        lease["history"] = [] if at is None else [{"state": ACTIVE, "at": at}]
    return leases


#: Registered device fields the tick uses (Snapshot.gather's DeviceView, queue selection:
#: MagicQueue.matches); the rest (MAAS system id, timestamps) it never reads.
DEVICE_FIELDS = {"agent_host": 1, "gpus": 1, "tags": 1, "home_queues": 1, "quarantined": 1,
                 "failures": 1, "nvswitches": 1, "nvswitches_found": 1, "nvswitch_multi_gpu": 1,
                 "maas_refusals": 1, "maas_refused_at": 1, "maas_refused_reason": 1}
#: Fence and claim fields the tick's repairs use.
FENCE_FIELDS = {"lease_id": 1, "kind": 1}
CLAIM_FIELDS = {"lease_id": 1}
#: What names no lease or agent: ids and names are strings, so these are the falsy ones.
_NO_ID = frozenset({None, ""})


class TickReads:
    """One tick's reads (see the module docstring). ``db``: Testflinger's database;
    ``before_read``: called before each read (the engine's ``yield_to_quick_lend``)."""

    def __init__(self, db, before_read=None):
        self.db = db
        self.before_read = before_read or (lambda: None)
        self._memo: dict = {}

    def invalidate(self) -> None:
        """Forget everything read (a repair changed something): later calls read again."""
        self._memo.clear()

    def _once(self, key, read):
        if key not in self._memo:
            self.before_read()
            self._memo[key] = read()
        return self._memo[key]

    def claims(self) -> list[dict]:
        """Every claim (``{_id: device, lease_id}``: :data:`CLAIM_FIELDS`)."""
        return self._once("claims", lambda: list(self.db.magic_device_claims.find(
            {}, CLAIM_FIELDS)))

    def fences(self) -> list[dict]:
        """Every fence (``{_id: agent, lease_id, kind}``: :data:`FENCE_FIELDS`)."""
        return self._once("fences", lambda: list(self.db.magic_fences.find({}, FENCE_FIELDS)))

    def devices(self) -> list[dict]:
        """Every registered device (:data:`DEVICE_FIELDS`), by name."""
        return self._once("devices", lambda: list(self.db.magic_devices.find(
            {}, DEVICE_FIELDS, sort=[("_id", 1)])))

    def agent_hosts(self) -> list[dict]:
        """Every agent host document (``_id``, ``last_heartbeat``, ``devices``, ...)."""
        return self._once("agent_hosts", lambda: list(self.db.magic_agent_hosts.find({})))

    def open_leases(self) -> list[dict]:
        """Open leases, oldest first, with :data:`OPEN_LEASE_FIELDS` only, and ``vms`` and
        ``history`` as :func:`with_vms` gives them."""
        return self._once("open", lambda: with_vms(self.db, list(self.db.magic_leases.find(
            {"state": {"$in": sorted(OPEN_STATES)}}, OPEN_LEASE_FIELDS,
            sort=[("created_at", 1)])), self.before_read))

    def leases_by_id(self, ids: Iterable[str]) -> dict[str, dict]:
        """``{id: lease}`` of those of ``ids`` that exist (open ones with
        :data:`OPEN_LEASE_FIELDS`, others whole). One read of the ids neither open nor looked up before, if any."""
        known = self._memo.setdefault("by_id", {})
        if not known:
            known.update({lease["_id"]: lease for lease in self.open_leases()})
        ids = set(ids) - _NO_ID  # set operations, not a Python loop: called with ~500 ids
        looked = self._memo.setdefault("looked_up", set())
        todo = sorted(ids - known.keys() - looked)
        if todo:
            self.before_read()
            for lease in self.db.magic_leases.find({"_id": {"$in": todo}}):
                known[lease["_id"]] = lease
            looked.update(todo)
        return {i: known[i] for i in ids if i in known}

    def recently_returned(self, horizon: float) -> list[dict]:
        """``returned`` leases with no give-back verdict yet, returned at or after ``horizon``
        (epoch seconds): ``_id``, ``device``, ``queue``, ``updated_at``, the last two
        ``history`` entries and ``missing_vm_agents``. Read once per tick: later calls get the
        first call's answer (their horizons differ by the milliseconds between the callers'
        clock readings)."""
        return self._once("returned", lambda: list(self.db.magic_leases.find(
            {"state": RETURNED, "updated_at": {"$gte": horizon}, "giveback": {"$exists": False}},
            {"device": 1, "queue": 1, "updated_at": 1, "history": {"$slice": -2},
             "missing_vm_agents": 1})))

    def agents(self, names: Iterable[str] = ()) -> dict[str, dict]:
        """``{name: agents document}`` (fields :data:`AGENT_FIELDS`) of the registered devices,
        the VM agents of open leases and ``names``; names with no document are absent."""
        docs = self._memo.get("agents")
        if docs is None:
            universe = {d["_id"] for d in self.devices()}
            universe |= {vm.get("agent_name") for lease in self.open_leases()
                         for vm in lease.get("vms") or []}
            universe.discard(None)
            docs = {}
            if universe:
                self.before_read()
                docs = {d["name"]: d for d in self.db.agents.find(
                    {"name": {"$in": sorted(universe)}}, AGENT_FIELDS)}
            self._memo["agents"] = docs
            self._memo["agents_universe"] = universe
        universe = self._memo["agents_universe"]
        extra = sorted(set(names) - universe - _NO_ID)
        if extra:
            docs.update({d["name"]: d for d in self.db.agents.find({"name": {"$in": extra}},
                                                                   AGENT_FIELDS)})
            universe.update(extra)
        return docs
