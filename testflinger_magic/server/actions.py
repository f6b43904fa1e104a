"""Apply reconcile Actions with compare-and-set (:meth:`Actions.apply`).

``reconcile.plan`` decides; this only executes. Every write is a compare-and-set (through
LeaseStore or a filtered single-document update); a CAS that fails means another replica (or a
daemon report) got there first, so the action is skipped and the next tick re-plans.

:class:`Actions` is a mixin of :class:`.engine.Engine`: it uses ``self.db``, ``self.store``
(LeaseStore), ``self.clock``, ``self.metrics``, and the engine's ``_definition`` (snapshot),
``_quarantine`` and ``_record``.
"""

from __future__ import annotations

import logging
from datetime import datetime, timezone

from testflinger_magic import blame as B
from testflinger_magic import leases as L
from testflinger_magic import tfstates

from . import cancelnote
from .cancelnote import CANCEL_FRAGMENT  # noqa: F401 (re-exported)

log = logging.getLogger(__name__)

#: Drain kinds demand may cancel (reconcile.UNDRAINABLE; repeated here so the engine refuses an
#: undrain of an owner's or operator's drain even if asked).
UNDRAINABLE = frozenset({"idle", "consolidate"})

#: Words for a drain ``kind`` (reconcile's drain kinds, reconcile.py module docstring, plus the
#: server's ``operator`` and ``error``), as ``drain`` prints what a drain replaced.
DRAIN_KIND_LABELS = {
    "orphan": "removed-queue drain", "operator": "operator drain", "error": "error drain",
    "idle": "idle drain", "consolidate": "consolidation drain", "reclaim": "owner reclaim",
    "yield": "yield to another queue", "max_lease": "max_lease drain",
    "unneeded": "unneeded-lease drain"}


def drain_kind_label(kind) -> str:
    """``"removed-queue drain"`` for ``orphan``: :data:`DRAIN_KIND_LABELS`, else
    ``"<kind> drain"`` (``"drain"`` for no kind)."""
    return DRAIN_KIND_LABELS.get(kind) or (f"{kind} drain" if kind else "drain")


def replaced_drain(old: dict) -> dict:
    """What a new drain of an already draining lease replaces, from its ``drain`` document
    ``old``: ``{kind, label, reason, grace (seconds from requested_at to grace_until, or None),
    grace_until, forced}`` (stored as the new drain's ``replaced``; TRIAL2 finding 8)."""
    at, until = old.get("requested_at"), old.get("grace_until")
    grace = (float(until) - float(at)) if isinstance(at, (int, float)) and isinstance(
        until, (int, float)) else None
    return {"kind": old.get("kind"), "label": drain_kind_label(old.get("kind")),
            "reason": old.get("reason"), "grace": grace, "grace_until": until,
            "forced": bool(old.get("forced"))}



class Actions:
    """Executors of reconcile actions (``_do_<kind>``); mixed into :class:`.engine.Engine`."""

    def apply(self, action) -> bool:
        """Apply one ``reconcile.Action``; True if it changed something. Non-acting kinds
        (``blocked``: an explanation) change nothing."""
        from testflinger_magic import reconcile as R  # noqa: PLC0415

        if action.kind in R.NON_ACTING:
            return False
        handler = getattr(self, f"_do_{action.kind}", None)
        if handler is None:
            log.warning("unknown action kind %r", action.kind)
            return False
        return bool(handler(action))

    def _lease_at(self, action) -> dict | None:
        """The action's lease if still at the planned generation (else None: someone moved it)."""
        lease = self.db.magic_leases.find_one({"_id": action.lease_id})
        if lease is None or (action.generation is not None
                             and lease["generation"] != action.generation):
            return None
        return lease

    def _do_lend(self, action) -> bool:
        q = self._definition(action.queue)
        dev = self.db.magic_devices.find_one({"_id": action.device})
        # Quarantined since the plan's snapshot (a quick lend's is up to seconds old): not lent.
        if q is None or dev is None or dev.get("quarantined"):
            return False
        vms = int((action.data or {}).get("vms") or q.vms_for(int(dev.get("gpus") or 0)))
        self.store.claim(action.device, q, dev["agent_host"], vms, action.reason)
        if self.metrics:
            self.metrics.lends.labels(queue=q.name).inc()
        return True

    def _drain_doc(self, lease: dict, reason: str, grace: float | None, forced: bool,
                   kind: str = "operator") -> dict:
        """The lease's ``drain`` field. ``kind`` (reconcile's drain kinds, or ``operator``/
        ``error``) decides whether demand may undrain it (only ``idle``/``consolidate``)."""
        if grace is None:
            grace = (lease.get("timeouts") or {}).get("grace") or L.DEFAULT_GRACE
        now = self.clock()
        return {"reason": reason, "kind": kind, "requested_at": now,
                "grace_until": now + float(grace), "forced": bool(forced)}

    def _do_drain(self, action) -> bool:
        """``active -> draining`` (fence the VM agents after the CAS). A lease still in
        bring-up (reconcile's ``unneeded`` drain) has no job to wait for: it goes to
        ``restoring`` at once, as an operator's drain of it does (:meth:`drain_by_hand`), with
        no failure counted; the daemon's step in flight ends by itself (its late report is
        refused: the generation moved) and the restore runs next."""
        lease = self._lease_at(action)
        if lease is None:
            return False
        data = action.data or {}
        drain = self._drain_doc(lease, action.reason, data.get("grace"), data.get("force", False),
                                data.get("kind", "operator"))
        if lease["state"] in L.BRINGUP_STATES:
            self.store.transition(lease["_id"], lease["state"], lease["generation"], L.RESTORING,
                                  f"drained during bring-up: {action.reason}",
                                  set_fields={"drain": drain})
            if self.metrics:
                self.metrics.drains.labels(queue=lease["queue"], kind=drain["kind"]).inc()
            return True
        if lease["state"] != L.ACTIVE:
            return False
        new = self.store.transition(lease["_id"], L.ACTIVE, lease["generation"], L.DRAINING,
                                    action.reason, set_fields={"drain": drain})
        # After the CAS: a failed transition must not leave an active lease fenced. A crash here
        # is repaired by restore, which fences again before checking idleness.
        self._fence_vms(new, action.reason)
        if self.metrics:
            self.metrics.drains.labels(queue=new["queue"], kind=drain["kind"]).inc()
        return True

    def _do_undrain(self, action) -> bool:
        """``draining -> active`` of an ``idle``/``consolidate`` drain demand came back for, of
        a ``reclaim`` drain no home queue needs any more (the plan says so: data ``surplus``;
        TRIAL6 finding M1), or of an ``orphan`` drain (its queue was removed) whose queue is
        defined again (data ``requeued``, and the queue's definition is stored now: one read;
        TRIAL16 F1); never of a forced drain nor of any other kind (an operator's, a yield,
        ``max_lease``), whatever is asked."""
        lease = self._lease_at(action)
        drain = (lease.get("drain") or {}) if lease else {}
        data = action.data or {}
        surplus = drain.get("kind") == "reclaim" and bool(data.get("surplus"))
        requeued = drain.get("kind") == "orphan" and bool(data.get("requeued")) and \
            self.db.magic_queues.find_one({"_id": lease["queue"]}, {"_id": 1}) is not None
        if (lease is None or lease["state"] != L.DRAINING or drain.get("forced")
                or drain.get("forced_at") is not None
                or (drain.get("kind") not in UNDRAINABLE and not surplus and not requeued)):
            return False
        new = self.store.transition(lease["_id"], L.DRAINING, lease["generation"], L.ACTIVE,
                                    action.reason, set_fields={"drain": None, "idle_since": None})
        # Only fences at or below the new generation: a drain that wins the next CAS fences
        # after it, with a higher one. A restore that lost to this undrain may fence again after
        # this; the next tick's repair_active_fences lifts that.
        self.store.lift_vm_fences(new)
        return True

    def force_wait(self, lease: dict) -> float:
        """Seconds a forced drain waits, after cancelling, for its VM agents to go idle before
        it is restored anyway: the lease's policy grace (``reclaim.grace`` at claim), else
        leases.DEFAULT_FORCE_WAIT (10 min). Agents see a cancel only every 10 s and not during
        provision (TESTFLINGER.md §3.6)."""
        return float((lease.get("timeouts") or {}).get("grace") or L.DEFAULT_FORCE_WAIT)

    def _do_force(self, action) -> bool:
        """Commit the force (CAS: ``drain.forced_at``, ``force_until``; an active lease goes to
        draining), then fence, then cancel the VM agents' jobs, then record what was cancelled
        (``drain.cancelled``). Nothing is cancelled unless the CAS won. The lease stays
        ``draining``: reconcile restores it once every VM agent is idle, or at ``force_until``.
        A force already committed (a crash before its cancel was recorded) only fences and
        cancels again (idempotent)."""
        lease = self._lease_at(action)
        if lease is None or lease["state"] not in (L.ACTIVE, L.DRAINING):
            return False
        drain = lease.get("drain") or {}
        if drain.get("forced_at") is None:
            now = self.clock()
            if not drain:
                drain = self._drain_doc(lease, action.reason, 0, True, "forced")
            drain = dict(drain, forced=True, forced_at=now,
                         force_until=now + self.force_wait(lease), cancelled=None)
            fields = {"drain": drain, "deadline": drain["force_until"]}
            if lease["state"] == L.ACTIVE:
                lease = self.store.transition(lease["_id"], L.ACTIVE, lease["generation"],
                                              L.DRAINING, action.reason, set_fields=fields)
            else:
                lease = self.store.progress(lease["_id"], L.DRAINING, lease["generation"],
                                            set_fields=fields)
        elif lease["state"] != L.DRAINING:
            return False
        self._fence_vms(lease, action.reason)
        cancelled = self._cancel_jobs(lease)
        try:
            self.store.progress(lease["_id"], L.DRAINING, lease["generation"],
                                set_fields={"drain": dict(lease["drain"], cancelled=cancelled)})
        except (L.StaleGeneration, L.LeaseNotFound):
            pass  # moved on meanwhile; if still forced without it, reconcile repeats the cancel
        if self.metrics and cancelled:
            self.metrics.cancelled.labels(queue=lease["queue"]).inc(len(cancelled))
        self._record("lease.forced",
                     f"{lease['queue']}: lease {lease['_id']} forced: {action.reason}; cancelled "
                     f"{len(cancelled)} job(s); waiting up to "
                     f"{int(lease['drain']['force_until'] - lease['drain']['forced_at'])}s for "
                     "its VM agents to stop", queue=lease["queue"], device=lease["device"],
                     lease_id=lease["_id"], data={"cancelled": cancelled})
        return True

    def _do_restore(self, action) -> bool:
        lease = self._lease_at(action)
        if lease is None:
            return False
        state = lease["state"]
        if (action.data or {}).get("force_timeout"):
            return self._restore_after_force(lease, action)
        if state in L.BRINGUP_STATES:
            # data.failure: the bring-up hit its deadline (reconcile's lifecycle rule);
            # data.host_stale: its agent host sends no heartbeat, no failure of the device.
            timed_out = bool((action.data or {}).get("failure"))
            fields = {"error": action.reason}
            if timed_out:
                fields[B.TIMEOUT_FIELD] = True
            new = self.store.transition(lease["_id"], state, lease["generation"], L.RESTORING,
                                        action.reason, set_fields=fields)
            if (action.data or {}).get("host_stale") or (action.data or {}).get("maas_down"):
                return True  # data.maas_down: MAAS unreachable from its host, no failure
            if not (timed_out and self._bringup_timed_out(new)):
                self.store.record_failure(lease["_id"], action.reason)
            return True
        if state != L.DRAINING:
            return False
        self._fence_vms(lease, action.reason)
        names = [vm["agent_name"] for vm in lease.get("vms") or []]
        busy = self.store.agents_busy(names)  # after the fence: the handshake's order
        for name in names:
            if name in busy:
                log.info("restore of %s waits: %s %s", lease["_id"], name, busy[name])
                return False
        self.store.transition(lease["_id"], L.DRAINING, lease["generation"], L.RESTORING,
                              action.reason)
        return True

    def _bringup_timed_out(self, lease: dict) -> bool:
        """After ``lease`` (already ``restoring``, marked ``bringup_timeout``) hit its bring-up
        deadline: is the queue to blame (testflinger_magic.blame)? Reads the queue's
        ``applied_at``, its latest lease that reached ``active`` and its latest
        :data:`~testflinger_magic.blame.RECENT_TIMEOUTS` timed-out leases created since both
        (three bounded queries); :func:`testflinger_magic.blame.judge_timeout` decides (the
        rule ``simulate`` applies too). If they name
        :data:`~testflinger_magic.blame.QUEUE_TIMEOUT_DEVICES` distinct devices: suspend the
        queue (``_suspend_queue``, a compare-and-set), take back the failures the earlier leases
        of the run counted (a compare-and-set on each lease's ``failures_counted``, then ``$inc
        failures -1`` on its device, never below 0, and lift the device's quarantine if that
        failure caused it: :meth:`_lift_failure_quarantine`) and return True: the caller
        counts no failure for ``lease``. False: count it against the device."""
        queue = lease["queue"]
        qdoc = self.db.magic_queues.find_one({"_id": queue}, {"applied_at": 1})
        if qdoc is None:
            return False  # queue no longer defined: nothing to suspend, the device is counted
        cutoff = float(qdoc.get("applied_at") or 0)
        ok = self.db.magic_leases.find_one({"queue": queue, "history.state": L.ACTIVE},
                                           {"created_at": 1}, sort=[("created_at", -1)])
        if ok is not None:
            cutoff = max(cutoff, float(ok.get("created_at") or 0))
        timeouts = list(self.db.magic_leases.find(
            {"queue": queue, B.TIMEOUT_FIELD: True, "created_at": {"$gte": cutoff}},
            {"device": 1, "created_at": 1, "failures_counted": 1}, sort=[("created_at", -1)],
            limit=B.RECENT_TIMEOUTS))
        verdict = B.judge_timeout(lease["_id"], timeouts, qdoc.get("applied_at"),
                                  (ok or {}).get("created_at"))
        if not verdict.queue_at_fault:
            return False
        limit = (lease.get("timeouts") or {}).get("provision_timeout")
        self._suspend_queue(lease, B.suspension_reason(queue, limit, list(verdict.devices)))
        device_of = {t["_id"]: t["device"] for t in timeouts}
        for lease_id in verdict.take_back:
            undone = self.db.magic_leases.update_one(
                {"_id": lease_id, "failures_counted": True},
                {"$set": {"failures_counted": False, "failure_undone": True}})
            if undone.modified_count:
                self.db.magic_devices.update_one(
                    {"_id": device_of[lease_id], "failures": {"$gt": 0}}, {"$inc": {"failures": -1}})
                self._lift_failure_quarantine(device_of[lease_id], lease_id, queue)
        return True

    def _lift_failure_quarantine(self, device: str, lease_id: str, queue: str) -> bool:
        """Lift ``device``'s quarantine if it is the planner's for the failure of ``lease_id``,
        just taken back because ``queue`` is at fault (``quarantine_lease``, set by
        :meth:`_do_quarantine`; CAS on it, so an operator's quarantine, or one for another
        failure or cause, stays). Records ``device.unquarantined`` naming the device, the lease
        and why. The failure count is left as the take-back made it. True if lifted."""
        res = self.db.magic_devices.update_one(
            {"_id": device, "quarantined": True, "quarantine_lease": lease_id},
            {"$set": {"quarantined": False, "quarantine_reason": None, "quarantine_lease": None}})
        if res.modified_count:
            self._record("device.unquarantined",
                         f"{device}: unquarantined: its quarantine was for the bring-up timeout of "
                         f"lease {lease_id}, a failure taken back: {queue} is at fault (bring-ups "
                         "of the queue timed out on several devices)",
                         queue=queue, device=device, lease_id=lease_id)
        return bool(res.modified_count)

    def _restore_after_force(self, lease: dict, action) -> bool:
        """A forced drain whose VM agents are still busy at ``force_until``: restore anyway
        (re-checked here on the current document), and say which agents were still busy."""
        drain = lease.get("drain") or {}
        until = drain.get("force_until")
        if (lease["state"] != L.DRAINING or drain.get("forced_at") is None or until is None
                or self.clock() < until):
            return False
        self._fence_vms(lease, action.reason)
        busy = self.store.agents_busy([vm["agent_name"] for vm in lease.get("vms") or []])
        self.store.transition(lease["_id"], L.DRAINING, lease["generation"], L.RESTORING,
                              action.reason)
        self._record("lease.force_timeout",
                     f"{lease['queue']}: lease {lease['_id']} on {lease['device']}: restored "
                     f"with {len(busy)} VM agent(s) still busy after their jobs were cancelled: "
                     + ("; ".join(f"{n}: {w}" for n, w in sorted(busy.items())) or "none"),
                     queue=lease["queue"], device=lease["device"], lease_id=lease["_id"],
                     data={"busy": sorted(busy)})
        return True

    def _do_pause(self, action) -> bool:
        return self._admission(action, "paused")

    def _do_resume(self, action) -> bool:
        return self._admission(action, "open")

    def _admission(self, action, value: str) -> bool:
        lease = self._lease_at(action)
        if lease is None or lease.get("admission", "open") == value:
            return False
        self.store.progress(lease["_id"], lease["state"], lease["generation"],
                            set_fields={"admission": value})
        # The poll reads admission from the VM agents' gates only (gates.Gates.read).
        self.store.gates.sync([vm["agent_name"] for vm in lease.get("vms") or []])
        return True

    def _do_quarantine(self, action) -> bool:
        """The planner's quarantine for the failure count: it names the device's latest counted
        failure (``last_failure_lease``, LeaseStore.record_failure) as its cause."""
        dev = self.db.magic_devices.find_one({"_id": action.device}, {"last_failure_lease": 1})
        lease_id = (dev or {}).get("last_failure_lease")
        reason = action.reason
        failed = self.db.magic_leases.find_one({"_id": lease_id}, {"error": 1}) \
            if lease_id else None
        if failed and failed.get("error"):  # the cause and its fix, not only the count
            error = str(failed["error"])
            reason += f"; last failure ({lease_id}): " + (
                error if len(error) <= 500 else error[:500] + "...")
        return self._quarantine(action.device, True, reason, lease_id=lease_id)

    def _fence_vms(self, lease: dict, reason: str) -> None:
        """Fence the lease's VM agents, stamped with the generation of ``lease`` (the document
        after the caller's CAS, where there is one; see LeaseStore.lift_vm_fences)."""
        self.store.fence_agents(lease["_id"], [vm["agent_name"] for vm in lease.get("vms") or []],
                                kind="vm", reason=reason, generation=lease["generation"])

    def _cancel_jobs(self, lease: dict) -> list[str]:
        """Cancel the non-terminal jobs of the lease's VM agents as POST /v1/job/<id>/action
        ``cancel`` does (``result_data.job_state = cancelled`` unless terminal; v1.cancel_job;
        on a newer Testflinger also ``$unset agents.job_id``). Jobs are found through the agent
        documents, the dispatch markers and ``result_data.agent_id``."""
        names = [vm["agent_name"] for vm in lease.get("vms") or []]
        job_ids = set()
        for doc in self.db.agents.find({"name": {"$in": names}}, {"job_id": 1}):
            if doc.get("job_id"):
                job_ids.add(doc["job_id"])
        for m in self.db.magic_dispatch.find({"agent": {"$in": names}, "phase": "done"}):
            if m.get("job_id"):
                job_ids.add(m["job_id"])
        job_ids.update(self.store.gates.held_by(names).values())
        cancelled, phases = [], {}
        for job_id in sorted(job_ids):
            before = self.db.jobs.find_one_and_update(
                {"job_id": job_id, "result_data.job_state": {"$nin": sorted(tfstates.JOB_TERMINAL)}},
                {"$set": {"result_data.job_state": tfstates.JOB_CANCELLED}},
                projection={"result_data.job_state": 1})
            if before is not None:
                cancelled.append(job_id)
                phases[job_id] = (before.get("result_data") or {}).get("job_state")
        if cancelled:
            self._tell_cancelled(lease, phases)
        # A newer Testflinger's cancel also unsets the agent's job_id (testflinger#1253,
        # clear_agent_job); its jobs carry result_data.agent_id, an older server's never do.
        newer = [j["job_id"] for j in self.db.jobs.find(
            {"job_id": {"$in": cancelled}, "result_data.agent_id": {"$exists": True}},
            {"job_id": 1})] if cancelled else []
        if newer:
            self.db.agents.update_many({"job_id": {"$in": newer}}, {"$unset": {"job_id": ""}})
        return cancelled

    def _tell_cancelled(self, lease: dict, phases: dict) -> None:
        """Say why in each cancelled job's output and events (:mod:`.cancelnote`): the lease,
        the magic queue, the device, the drain's reason and kind, the owner's (home) queue and
        the grace. ``phases``: ``{job_id: job_state before the cancel}``. Never raises: the
        cancel itself is done."""
        try:
            drain = lease.get("drain") or {}
            device = self.db.magic_devices.find_one({"_id": lease["device"]},
                                                    {"home_queues": 1}) or {}
            homes = ", ".join(device.get("home_queues") or []) or "its home queue"
            grace = float(drain.get("grace_until") or 0) - float(drain.get("requested_at") or 0)
            from testflinger_magic.durations import format_duration  # noqa: PLC0415

            output, detail = cancelnote.drain_note(lease, homes, format_duration(max(grace, 0)))
            now = datetime.fromtimestamp(self.clock(), timezone.utc).replace(tzinfo=None)
            cancelnote.tell(self.db, now, phases, output, detail)
        except Exception:  # noqa: BLE001 - the explanation is best effort, logged
            log.exception("lease %s: could not say why its jobs were cancelled", lease.get("_id"))
