"""The index table: every MongoDB index the plugin's reads rely on, declared in one place.

Each reconcile tick reads its inputs in a bounded number of queries whatever the number of
devices, leases and agents (``$in`` and aggregate reads; server/snapshot.py), and each of those
reads names here the index that serves it. :func:`ensure` creates ours (``owner="magic"``) at
start-up (LeaseStore.ensure_indexes); Testflinger's own (``owner="testflinger"``, created by its
``database.create_indexes``, TESTFLINGER.md §1.4) are listed so a reader sees what serves the
queries on ``jobs`` and ``agents``, and are never created by us.

Two indexes are ours on a collection of Testflinger's. ``jobs(result_data.agent_id)`` serves a
claim's look for the jobs its device holds. ``jobs(job_data.job_queue, created_at)``
lets the "latest job of each magic queue" read (``$sort`` on those keys then ``$group``
with ``$first``) run as a DISTINCT_SCAN, one index entry per queue (MongoDB's
``$sort``+``$group``+``$first`` optimisation, SERVER-9507), instead of one sorted query per
queue. Building it on a large ``jobs`` collection runs in the background (MongoDB >= 4.2
holds an exclusive lock only at the start and end of a build).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Index:
    """One index: ``collection``, ``keys`` (``[(field, 1 | -1)]``), extra ``options`` for
    ``create_index`` (``unique``, ``expireAfterSeconds``), ``owner`` (``magic``: created by
    :func:`ensure`; ``testflinger``: Testflinger's, listed only), ``serves`` (the reads, for
    people)."""

    collection: str
    keys: tuple
    serves: str
    owner: str = "magic"
    options: dict = field(default_factory=dict)


INDEXES: tuple[Index, ...] = (
    # ----- ours
    Index("magic_leases", (("device", 1), ("state", 1)),
          "a device's open lease (LeaseStore.open_lease_for_device, lend by hand)"),
    Index("magic_leases", (("queue", 1), ("state", 1)), "leases of a queue (status, CLI)"),
    Index("magic_leases", (("queue", 1), ("created_at", -1)),
          "a queue's latest leases: latest active, latest timed out (Actions._bringup_timed_out)"),
    Index("magic_leases", (("state", 1), ("created_at", 1)),
          "open leases, oldest first (TickReads.open_leases: the tick's one read; work_for)"),
    Index("magic_leases", (("agent_host", 1),), "an agent host's leases (GET work)"),
    Index("magic_leases", (("state", 1), ("updated_at", 1)),
          "recently returned leases not yet judged (TickReads.recently_returned: the give-back "
          "check and the snapshot)"),
    Index("magic_leases", (("vms.agent_name", 1), ("admission", 1)),
          "is this VM agent's lease paused? (Gates.sync)"),
    Index("magic_fences", (("lease_id", 1),), "a lease's fences (cleanup, repairs)"),
    Index("magic_resources", (("lease_id", 1),), "a lease's MACs (cleanup)"),
    Index("magic_agent_gate", (("fenced", 1),),
          "closed gates: the tick's gate repair reads only those (Gates.repair, with paused)"),
    Index("magic_agent_gate", (("paused", 1),),
          "closed gates: the tick's gate repair reads only those (Gates.repair, with fenced)"),
    Index("magic_dispatch", (("agent", 1), ("phase", 1)),
          "the dispatch markers of agents (Gates.busy: one $in read per tick)"),
    Index("magic_dispatch", (("job_id", 1),), "a job's marker (claim's attribution check)"),
    Index("jobs", (("job_data.job_queue", 1), ("created_at", -1)),
          "latest job of each magic queue (jobreads.LatestJobs: one aggregate, DISTINCT_SCAN, "
          "at start, for a new queue and every 10 minutes)"),
    Index("jobs", (("result_data.agent_id", 1),),
          "the jobs a newer Testflinger attributes to an agent (testflinger#1253 sets "
          "result_data.agent_id at pop): a claim's busy check of its device "
          "(Gates.claim_checks), which otherwise examines every held job; sparse: a waiting "
          "job, or any job on a server before #1253, has none", options={"sparse": True}),
    Index("magic_events", (("at", 1),), "events, newest first (GET events)"),
    Index("magic_events", (("expire_at", 1),), "events expire", options={"expireAfterSeconds": 0}),
    # ----- Testflinger's (database.create_indexes), relied on, never created here
    Index("agents", (("name", 1),), "agent documents by name (TickReads.agents: one $in read)",
          owner="testflinger", options={"unique": True}),
    Index("jobs", (("job_id", 1),), "jobs named by dispatch markers (Gates.busy; a branch of "
          "the tick's $or read, jobreads.JobReads)", owner="testflinger"),
    Index("jobs", (("result_data.job_state", 1), ("job_data.job_queue", 1)),
          "waiting jobs (demand) and held jobs by agent: branches of the tick's one $or read "
          "(jobreads.JobReads)", owner="testflinger"),
    Index("jobs", (("_id", 1),), "(MongoDB's own) magic queues' jobs inserted since the last "
          "read, by ObjectId time: a branch of the tick's $or read (jobreads.LatestJobs)",
          owner="testflinger"),
)


def ensure(db, collections: tuple[str, ...] | None = None) -> list[str]:
    """Create the indexes of :data:`INDEXES` that are ours (``owner="magic"``), of the given
    ``collections`` only (None: all). Idempotent (``create_index`` of an existing index is a
    no-op). Returns the index names created or confirmed."""
    out = []
    for ix in INDEXES:
        if ix.owner != "magic" or (collections is not None and ix.collection not in collections):
            continue
        out.append(db[ix.collection].create_index(list(ix.keys), **ix.options))
    return out
