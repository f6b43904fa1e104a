"""The lease store's repairs: cheap, idempotent compare-and-set fixes each reconcile tick runs
(Engine.repair) for what a crash between two writes can leave behind.

Split from :mod:`testflinger_magic.leases` (a mixin of :class:`~testflinger_magic.leases.LeaseStore`,
whose collections and helpers it uses: ``self.leases``, ``self.claims``, ``self.fences``,
``self.agents``, ``self.devices``, ``self.resources``, ``self.gates``, ``self.clock``,
``cleanup``, ``lift_vm_fences``, ``_restore_device_agent``, ``_record``).
"""

from __future__ import annotations

from . import tfstates
from .lease_states import (ACTIVE, OPEN_STATES, ORPHAN_CLAIM_AGE, RESTORING, RETURNED,
                           lent_comment)


class LeaseRepairs:
    """The repairs of :class:`~testflinger_magic.leases.LeaseStore` (see the module docstring)."""

    def repair_closed(self) -> list[str]:
        """Finish the cleanup of ``returned`` leases that still hold a claim or a fence (the
        server died, or the database failed, between close()'s CAS and :meth:`cleanup`; a
        ``returned`` lease is final, so nothing else would ever free them). Cheap: reads the
        claim and fence collections (one document per lent device / VM agent) and the leases
        they name. Returns the ids of the leases cleaned up."""
        ids = {c.get("lease_id") for c in self.claims.find({}, {"lease_id": 1})}
        ids |= {f.get("lease_id") for f in self.fences.find({}, {"lease_id": 1})}
        ids.discard(None)
        if not ids:
            return []
        done = []
        found = set()
        for lease in self.leases.find({"_id": {"$in": sorted(ids)}}, {"_id": 1, "state": 1}):
            found.add(lease["_id"])
            if lease["state"] == RETURNED:
                self.cleanup(self.leases.find_one({"_id": lease["_id"]}))
                done.append(lease["_id"])
        done.extend(self._repair_orphan_claims(ids - found))
        return done

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

    def repair_active_fences(self) -> list[str]:
        """Lift VM fences left on ``active`` leases (an undrain that lost a race with a restore or
        force on another replica, or a crash between an undrain's CAS and its unfence, or between
        the ``enrolling -> active`` report and its lift): without this the lease would keep its
        VM agents fenced for ever. Cheap: the VM fences and the leases they name. Returns the ids
        of the leases repaired."""
        ids = {f.get("lease_id") for f in self.fences.find({"kind": "vm"}, {"lease_id": 1})}
        ids.discard(None)
        if not ids:
            return []
        done = []
        for lease in self.leases.find({"_id": {"$in": sorted(ids)}, "state": ACTIVE}):
            if self.lift_vm_fences(lease):
                done.append(lease["_id"])
        return done

    def reassert_device_fences(self) -> list[str]:
        """Put back the fence state (``offline`` + :func:`lent_comment`) on the Testflinger
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

        Cheap: open leases (device, queue) and one ``agents`` query that is normally empty.
        CAS on ``state != offline``; afterwards the lease is read again and, if it was returned
        (or its claim undone) meanwhile, whose cleanup may have given the agent back before
        this write, the agent is given back again: a free device is never left offline.
        Returns the ids of the leases whose device agent was fenced again."""
        # Only leases whose claim finished its own fence (device_agent_before set): a claim in
        # progress CASes the agent from waiting itself, and must not find it offline already.
        leases = {l["device"]: l for l in self.leases.find(
            {"state": {"$in": sorted(OPEN_STATES - {RESTORING})},
             "device_agent_before": {"$ne": None}},
            {"device": 1, "queue": 1, "device_agent_before": 1})}
        if not leases:
            return []
        done = []
        for agent in self.agents.find({"name": {"$in": sorted(leases)},
                                       "state": {"$ne": tfstates.AGENT_OFFLINE}}, {"name": 1}):
            lease = leases[agent["name"]]
            res = self.agents.update_one(
                {"name": agent["name"], "state": {"$ne": tfstates.AGENT_OFFLINE}},
                {"$set": {"state": tfstates.AGENT_OFFLINE,
                          "comment": lent_comment(lease["queue"], lease["_id"])}})
            if not res.modified_count:
                continue
            now = self.leases.find_one({"_id": lease["_id"]})
            if now is None or now["state"] == RETURNED:  # returned, or a claim undone
                self._restore_device_agent(now or lease)
                continue
            done.append(lease["_id"])
        return done

    def repair_gates(self) -> list[str]:
        """Bring every dispatch gate in step with the fences and admission (a crash between a
        fence change and its gate sync), create the gates of registered devices and of the VM
        agents of leases that hold their device, drop gates nobody needs (gates.Gates.repair).
        Returns the ids of the leases whose agents' gates disagreed (an agent name when no
        lease holds it)."""
        watched = [d["_id"] for d in self.devices.find({}, {"_id": 1})]
        owner = {c["_id"]: c.get("lease_id") for c in self.claims.find({}, {"lease_id": 1})}
        for lease in self.leases.find({"$or": [{"state": {"$in": sorted(OPEN_STATES)}},
                                               {"_id": {"$in": sorted(set(owner.values()))}}]},
                                      {"vms.agent_name": 1}):
            for vm in lease.get("vms") or []:
                watched.append(vm.get("agent_name"))
                owner[vm.get("agent_name")] = lease["_id"]
        return sorted({owner.get(name) or name for name in self.gates.repair(watched)})

    def repair_device_agents(self) -> list[str]:
        """Give back device agents our lending left ``offline`` with :func:`lent_comment` when
        no lease holds them any more: the lease is ``returned`` (a crash inside close() after
        the claim went), or it never existed and no claim names it (a crash inside claim). A
        newer testflinger-agent keeps ``offline`` across restarts (testflinger#1291), so such a
        leftover would keep the machine out of its home queue for good. ``failed`` leases keep
        theirs (a person must look). CAS on the comment. Returns the lease ids repaired."""
        names = [d["_id"] for d in self.devices.find({}, {"_id": 1})]
        if not names:
            return []
        prefix = "lent to magic queue "
        stale = [a for a in self.agents.find({"name": {"$in": names},
                                              "comment": {"$regex": "^" + prefix}},
                                             {"name": 1, "comment": 1})
                 if "(lease " in (a.get("comment") or "")]
        if not stale:
            return []
        ids = {a["comment"].rsplit("(lease ", 1)[1].rstrip(")") for a in stale}
        leases = {x["_id"]: x["state"] for x in self.leases.find({"_id": {"$in": sorted(ids)}},
                                                                  {"state": 1})}
        claimed = {c.get("lease_id") for c in self.claims.find({"lease_id": {"$in": sorted(ids)}},
                                                                {"lease_id": 1})}
        done = []
        for agent in stale:
            lease_id = agent["comment"].rsplit("(lease ", 1)[1].rstrip(")")
            state = leases.get(lease_id)
            if state == RETURNED or (state is None and lease_id not in claimed):
                res = self.agents.update_one(
                    {"name": agent["name"], "comment": agent["comment"]},
                    {"$set": {"state": tfstates.AGENT_WAITING, "comment": ""}})
                if res.modified_count:
                    done.append(lease_id)
        return done
