"""The lease store's repairs: cheap, idempotent compare-and-set fixes each reconcile tick runs
(Engine.repair) for what a crash between two writes can leave behind.

Split from :mod:`testflinger_magic.leases` (a mixin of :class:`~testflinger_magic.leases.LeaseStore`,
whose collections and helpers it uses: ``self.leases``, ``self.claims``, ``self.fences``,
``self.agents``, ``self.devices``, ``self.resources``, ``self.gates``, ``self.clock``,
``cleanup``, ``lift_vm_fences``, ``_restore_device_agent``, ``_record``).

Each repair takes the tick's :class:`~testflinger_magic.tickreads.TickReads` (``reads``; None: a
fresh one, so a repair called alone reads what it needs itself), so the repairs of one tick
share one read of each collection instead of reading ``magic_leases`` a dozen times.
"""

from __future__ import annotations

from . import tfstates
from .lease_states import LENT_AGENT_STATE, NOT_FREE_AGENT_STATES
from .lease_states import (ACTIVE, ACTIVE_LIFT_AGE, CLOSE_CLEANUP_AGE, DRAINING, FAILED,
                           ORPHAN_CLAIM_AGE, RESTORING, RETURNED, lent_comment)
from .tickreads import TickReads


class LeaseRepairs:
    """The repairs of :class:`~testflinger_magic.leases.LeaseStore` (see the module docstring)."""

    def repair_closed(self, reads: TickReads | None = None) -> list[str]:
        """Finish the cleanup of ``returned`` leases that still hold a claim or a fence (the
        server died, or the database failed, between close()'s CAS and :meth:`cleanup`; a
        ``returned`` lease is final, so nothing else would ever free them). Cheap: reads the
        claim and fence collections (one document per lent device / VM agent) and the leases
        they name. Returns the ids of the leases cleaned up.

        Only a close that really was interrupted is repaired (and so reported): the tick's
        shared reads (``reads``) are taken one after the other, and a close in progress (the
        daemon's report, or another replica) may run between them, or be running now. So each
        candidate is read again first (:meth:`_interrupted_close`): the lease fresh, and its
        claim and fences fresh; a lease returned less than
        :data:`~testflinger_magic.lease_states.CLOSE_CLEANUP_AGE` s ago is left to its close,
        and one that holds nothing any more was cleaned up by its close meanwhile."""
        reads = reads or TickReads(self.db)
        ids = {c.get("lease_id") for c in reads.claims()}
        ids |= {f.get("lease_id") for f in reads.fences()}
        ids.discard(None)
        if not ids:
            return []
        done = []
        found = reads.leases_by_id(ids)
        for lease_id in sorted(found):
            if found[lease_id]["state"] != RETURNED:
                continue
            lease = self._interrupted_close(lease_id)
            if lease is not None:
                self.cleanup(lease)
                done.append(lease_id)
        done.extend(self._repair_orphan_claims(ids - set(found)))
        return done

    def _interrupted_close(self, lease_id: str) -> dict | None:
        """The ``returned`` lease ``lease_id`` (read now) if its close was interrupted: it was
        returned at least :data:`CLOSE_CLEANUP_AGE` s ago (its last ``returned`` history entry,
        else ``updated_at``) and a claim or fence still names it (read now); else None (a close
        in progress, or one that finished since the tick's read). Three point reads, only for
        returned leases the tick saw holding something."""
        lease = self.leases.find_one({"_id": lease_id})
        if lease is None or lease.get("state") != RETURNED:
            return None
        if _returned_at(lease) > self.clock() - CLOSE_CLEANUP_AGE:
            return None  # a close in progress frees them itself, within milliseconds
        if (self.claims.find_one({"_id": lease["device"], "lease_id": lease_id}, {"_id": 1}) is None
                and self.fences.find_one({"lease_id": lease_id}, {"_id": 1}) is None):
            return None  # its close finished after the tick's read
        return lease

    def _repair_orphan_claims(self, lease_ids: set) -> list[str]:
        """Free what a claim that never produced a lease holds: the process died inside
        :meth:`claim` (between the claim lock and the lease insert, or while undoing a refused
        claim). Only claims older than :data:`ORPHAN_CLAIM_AGE` s, so a claim in progress on
        another replica is never touched; every delete names the lease id (CAS)."""
        done = []
        cutoff = self.clock() - ORPHAN_CLAIM_AGE
        for lease_id in sorted(lease_ids):
            if self.leases.find_one({"_id": lease_id}, {"_id": 1}) is not None:
                continue  # written meanwhile
            claims = list(self.claims.find({"lease_id": lease_id}))
            if any(c.get("at", 0) > cutoff for c in claims):
                continue
            fences = list(self.fences.find({"lease_id": lease_id}))
            if not claims and any(f.get("since", 0) > cutoff for f in fences):
                continue
            for claim in claims:
                # The device agent document, if the claim got as far as marking it ours.
                self.agents.update_one(
                    {"name": claim["_id"], "comment": lent_comment(claim.get("queue", ""), lease_id)},
                    {"$set": {"state": tfstates.AGENT_WAITING, "comment": ""}})
            self.fences.delete_many({"lease_id": lease_id})
            self.gates.sync([c["_id"] for c in claims] + [f["_id"] for f in fences])
            self.resources.delete_many({"lease_id": lease_id})
            for claim in claims:
                self.claims.delete_one({"_id": claim["_id"], "lease_id": lease_id})
            self._record("claim.repaired", f"claim {lease_id} of "
                         f"{', '.join(c['_id'] for c in claims) or 'no device'} had no lease "
                         "(a server died inside a claim); freed", lease_id=lease_id)
            done.append(lease_id)
        return done

    def repair_active_fences(self, reads: TickReads | None = None) -> list[str]:
        """Lift VM fences left on ``active`` leases (an undrain that lost a race with a restore or
        force on another replica, or a crash between an undrain's CAS and its unfence, or between
        the ``enrolling -> active`` report and its lift): without this the lease would keep its
        VM agents fenced for ever. Cheap: the VM fences and the leases they name. Returns the ids
        of the leases repaired.

        Only fences really left behind are lifted (and so reported): each candidate lease is
        read again first, and one that became ``active`` less than
        :data:`~testflinger_magic.lease_states.ACTIVE_LIFT_AGE` s ago is left to the code that
        made it active (the report or undrain lifts its fences itself, right after its CAS;
        the tick's shared read may fall between the two, issue 10 item 18)."""
        reads = reads or TickReads(self.db)
        ids = {f.get("lease_id") for f in reads.fences() if f.get("kind") == "vm"}
        ids.discard(None)
        if not ids:
            return []
        done = []
        cutoff = self.clock() - ACTIVE_LIFT_AGE
        for lease_id, seen in sorted(reads.leases_by_id(ids).items()):
            if seen["state"] != ACTIVE:
                continue
            lease = self.leases.find_one({"_id": lease_id})  # fresh: one point read per candidate
            if lease is None or lease["state"] != ACTIVE or _entered_at(lease, ACTIVE) > cutoff:
                continue
            if self.lift_vm_fences(lease):
                done.append(lease_id)
        return done

    def reassert_device_fences(self, reads: TickReads | None = None) -> list[str]:
        """Put back the fence state (:data:`LENT_AGENT_STATE` + :func:`lent_comment`) on the Testflinger
        ``agents`` document of every device lent by a lease that does not give it back yet,
        where it is no longer so.

        The device agent program is stopped from ``fenced`` until the restore starts it again,
        so while a lease holds its device nothing but a fault (an operator or supervisord
        starting the program by hand, someone posting its state) makes its document show it
        free: the 204 fence still keeps jobs off, but Testflinger's agent list and the home
        queue's preflight would show a lent machine as free for the whole lease.

        ``restoring`` leases are left alone: their restore starts the device agent before it
        reports ``returned`` (agent_host/steps.py ``restore``), and the agent's startup post
        (``waiting``, empty comment: TESTFLINGER.md §3.2) is the give-back under way, not a
        fault; the device stays fenced until the close. (Fencing it again there was the
        ``lease.repaired`` warning of every normal return, issue 10 item 18.) Nor does a quick
        re-lend meet that post: the planner lends a returned device again only once its agent
        has posted (``reconcile.DeviceView.agent_back``).

        Cheap: the tick's open leases and agent documents (:class:`TickReads`).
        Also ``offline`` with our comment (the agent itself turns ``maintenance`` into
        ``offline`` when its poll races the claim; an older lease's ``offline``) goes back to
        :data:`LENT_AGENT_STATE`. CAS on a state other than ``offline``/``maintenance``
        (:data:`NOT_FREE_AGENT_STATES`), or ``offline`` with our comment: an operator's
        ``offline`` or ``maintenance`` with another comment is left as it is;
        afterwards the lease is read again and, if it was returned
        (or its claim undone) meanwhile, whose cleanup may have given the agent back before
        this write, the agent is given back again: a free device is never left fenced.
        Returns the ids of the leases whose device agent was fenced again after it showed
        free (not those whose agent only turned our ``maintenance`` into ``offline``: the
        agent's normal behaviour, no fault to report)."""
        # Only leases whose claim finished its own fence (device_agent_before set): a claim in
        # progress CASes the agent from waiting itself, and must not find it fenced already.
        # The agents are read after the leases (TickReads.agents reads the open leases first).
        reads = reads or TickReads(self.db)
        leases = {l["device"]: l for l in reads.open_leases()
                  if l["state"] != RESTORING and l.get("device_agent_before") is not None}
        if not leases:
            return []
        done = []
        docs = reads.agents(leases)
        for name in sorted(leases):
            agent = docs.get(name)
            lease = leases.get(name)
            comment = lent_comment(lease["queue"], lease["_id"])
            # Ours turned offline: testflinger-agent posts ``offline`` (same comment) when its
            # process_jobs finds ``maintenance`` (agent.py check_offline/offline_agent, a poll
            # racing the claim; TESTFLINGER.md §3.7): put ``maintenance`` back, or the home
            # queue's pre-submit check would fail again (LENT_AGENT_STATE).
            ours_offline = {"state": tfstates.AGENT_OFFLINE, "comment": comment}
            if agent is None or (agent.get("state") in NOT_FREE_AGENT_STATES and not (
                    agent.get("state") == ours_offline["state"]
                    and agent.get("comment") == comment)):
                continue
            res = self.agents.update_one(
                {"name": agent["name"], "$or": [
                    {"state": {"$nin": list(NOT_FREE_AGENT_STATES)}}, ours_offline]},
                {"$set": {"state": LENT_AGENT_STATE, "comment": comment}})
            if not res.modified_count:
                continue
            now = self.leases.find_one({"_id": lease["_id"]})
            if now is None or now["state"] == RETURNED:  # returned, or a claim undone
                self._restore_device_agent(now or lease)
                continue
            if agent.get("state") != tfstates.AGENT_OFFLINE:  # the agent's own offline: no fault
                done.append(lease["_id"])
        return done

    def recancel_overwritten(self, reads: TickReads | None = None) -> list[str]:
        """Cancel again the jobs a forced drain cancelled that are live again. testflinger-agent's
        later posts overwrite a cancel, as the server's ``add_job_results`` is unguarded: a
        cancel during ``allocate`` is followed by the agent's ``job_state: allocated``
        (TESTFLINGER.md §1.6, §3). The agent, which looks for a cancel every 10 s, then never
        sees it and runs its ``reserve`` phase, up to hours, while the owner waits until the
        drain's ``force_until`` restores the lease anyway (TRIAL8). A job that ended
        (``complete``) is left as it is.

        Reads: the tick's open leases, then, only when a forced drain recorded cancelled jobs,
        one read of those that are not terminal (index ``jobs(job_id)``). Each cancel is a CAS
        on the state read. Returns the ids of the leases whose jobs were cancelled again."""
        reads = reads or TickReads(self.db)
        lease_of: dict[str, str] = {}
        for lease in reads.open_leases():
            drain = lease.get("drain") or {}
            if lease["state"] == DRAINING and drain.get("forced_at") is not None:
                for job_id in drain.get("cancelled") or []:
                    lease_of[job_id] = lease["_id"]
        if not lease_of:
            return []
        again = set()
        for job in self.db.jobs.find(
                {"job_id": {"$in": sorted(lease_of)},
                 "result_data.job_state": {"$nin": sorted(tfstates.JOB_TERMINAL)}},
                {"job_id": 1, "result_data.job_state": 1}):
            state = (job.get("result_data") or {}).get("job_state")
            res = self.db.jobs.update_one(
                {"job_id": job["job_id"], "result_data.job_state": state},
                {"$set": {"result_data.job_state": tfstates.JOB_CANCELLED}})
            if res.modified_count:
                again.add(lease_of[job["job_id"]])
        return sorted(again)

    def repair_gates(self, reads: TickReads | None = None) -> list[str]:
        """Bring every dispatch gate in step with the fences and admission (a crash between a
        fence change and its gate sync), create the gates of registered devices and of the VM
        agents of leases that hold their device, drop gates nobody needs (gates.Gates.repair).
        Returns the ids of the leases whose agents' gates disagreed (an agent name when no
        lease holds it)."""
        reads = reads or TickReads(self.db)
        watched = [d["_id"] for d in reads.devices()]
        owner = {c["_id"]: c.get("lease_id") for c in reads.claims()}
        holding = {lease["_id"]: lease for lease in reads.open_leases()}
        holding.update(reads.leases_by_id(owner.values()))
        paused = set()
        for lease in reads.open_leases():
            if lease.get("admission") == "paused":
                paused.update(vm.get("agent_name") for vm in lease.get("vms") or [])
        for lease_id, lease in holding.items():
            for vm in lease.get("vms") or []:
                watched.append(vm.get("agent_name"))
                owner[vm.get("agent_name")] = lease_id
        fenced = {f["_id"] for f in reads.fences()}

        def closing(names: set[str]) -> set[str]:
            # A close in progress (issue 10 item 18): between its fence delete and its gate
            # sync (cleanup), the gates disagree with the fences. Those of a lease closed less
            # than CLOSE_CLEANUP_AGE s ago (read now) are left to its close; a close that
            # really was interrupted is finished by repair_closed, then gates synced here.
            ids = {owner[n] for n in names if owner.get(n)}
            if not ids:
                return set()
            cutoff = self.clock() - CLOSE_CLEANUP_AGE
            recent = {x["_id"] for x in self.leases.find({"_id": {"$in": sorted(ids)}})
                      if x.get("state") in (RETURNED, FAILED)
                      and _entered_at(x, x["state"]) > cutoff}
            return {n for n in names if owner.get(n) in recent}

        return sorted({owner.get(name) or name
                       for name in self.gates.repair(watched, fenced=fenced, paused=paused,
                                                     leave=closing)})

    def repair_device_agents(self, reads: TickReads | None = None) -> list[str]:
        """Give back device agents our lending left ``maintenance`` (or, before that, ``offline``)
        with :func:`lent_comment` when
        no lease holds them any more: the lease is ``returned`` (a crash inside close() after
        the claim went), or it never existed and no claim names it (a crash inside claim). A
        newer testflinger-agent keeps ``offline``/``maintenance`` across restarts (testflinger#1291), so such a
        leftover would keep the machine out of its home queue for good. ``failed`` leases keep
        theirs (a person must look). CAS on the comment. A lease returned less than
        :data:`~testflinger_magic.lease_states.CLOSE_CLEANUP_AGE` s ago is left to its close
        (in progress: its cleanup gives the agent back). Returns the lease ids repaired."""
        reads = reads or TickReads(self.db)
        names = [d["_id"] for d in reads.devices()]
        if not names:
            return []
        prefix = "lent to magic queue "
        docs = reads.agents(names)
        stale = []  # (agents document, the lease id its comment names)
        for n in names:
            agent = docs.get(n)
            if agent is not None and str(agent.get("comment") or "").startswith(prefix) \
                    and "(lease " in agent["comment"]:
                stale.append((agent, agent["comment"].rsplit("(lease ", 1)[1].rstrip(")")))
        if not stale:
            return []
        ids = {lease_id for _, lease_id in stale}
        found = reads.leases_by_id(ids)
        leases = {i: x["state"] for i, x in found.items()}
        claimed = {c.get("lease_id") for c in reads.claims()} & ids
        cutoff = self.clock() - CLOSE_CLEANUP_AGE
        done = []
        for agent, lease_id in stale:
            state = leases.get(lease_id)
            if state == RETURNED and _returned_at(found[lease_id]) > cutoff:
                continue  # a close in progress gives the agent back itself (cleanup)
            if state == RETURNED or (state is None and lease_id not in claimed):
                res = self.agents.update_one(
                    {"name": agent["name"], "comment": agent["comment"]},
                    {"$set": {"state": tfstates.AGENT_WAITING, "comment": ""}})
                if res.modified_count:
                    done.append(lease_id)
        return done


def _returned_at(lease: dict) -> float:
    """When ``lease`` (a ``returned`` lease document) was closed: its last ``returned`` history
    entry's ``at`` (epoch seconds), else its ``updated_at`` (0 if neither)."""
    return _entered_at(lease, RETURNED)


def _entered_at(lease: dict, state: str) -> float:
    """When ``lease`` last entered ``state``: its last history entry of that state's ``at``
    (epoch seconds), else its ``updated_at`` (0 if neither)."""
    at = next((h.get("at") for h in reversed(lease.get("history") or [])
               if h.get("state") == state), None)
    return float(at if at is not None else lease.get("updated_at") or 0)
