"""The operator's actions by hand behind the REST API (``testflinger-magic lend``, ``drain``,
``quarantine``/``unquarantine``): checks, then a compare-and-set through the lease store or on
the device document. Mixed into :class:`.engine.Engine` (its ``_definition``, ``problem``,
``store``, ``events``, ``metrics``, ``_drain_doc``, ``_fence_vms`` and ``_quarantine``), so the
public methods stay where api.py, the CLI and the tests call them.
"""

from __future__ import annotations

from testflinger_magic import fabric, tfstates
from testflinger_magic import leases as L
from testflinger_magic.durations import format_duration, parse_bounded_duration

from . import keptquarantine, maasbackoff
from .actions import replaced_drain
from .errors import Conflict, Invalid, NotFound


def selection_refusal(q, device: dict) -> str | None:
    """Why queue ``q``'s ``devices`` selection does not pick ``device`` (a ``magic_devices``
    document), or None if it does (``MagicQueue.selects``): excluded by name, or named by
    none of ``agents``, ``home_queues``, ``tags``."""
    name = device.get("_id", device.get("name"))
    if name in q.devices.exclude:
        return f"{q.name}'s devices.exclude lists {name}"
    if q.selects(device):
        return None
    return (f"{q.name}'s devices selection does not pick {name} (agents "
            f"{list(q.devices.agents)}, home_queues {list(q.devices.home_queues)}, tags "
            f"{list(q.devices.tags)}; the device has home_queues "
            f"{list(device.get('home_queues') or [])}, tags {list(device.get('tags') or [])})")


class OperatorActions:
    """Lend, drain and quarantine by hand (see the module docstring)."""

    def lend_by_hand(self, device: str, queue: str, reason: str, force: bool = False) -> dict:
        """Claim ``device`` for ``queue`` now. NotFound / Invalid / Conflict (claim refused, or
        the device's agent host is stale: :meth:`_refuse_stale_host`).

        A device the queue's ``devices`` selection excludes or does not pick
        (``MagicQueue.selects``; :func:`selection_refusal` words why) is refused (Conflict)
        unless ``force``: then it is lent and the lease's first history entry says the
        selection was overridden; the answer (the lease document) then carries ``forced``:
        the refusal overridden. A quarantine is never overridden."""
        q = self._definition(queue)
        if q is None:
            problem = self.problem(queue)
            if not problem and self._definition(device) is not None and \
                    self.db.magic_devices.find_one({"_id": queue}, {"_id": 1}) is not None:
                raise NotFound(f"{queue} is not a magic queue but a device, and {device} is a "
                               f"magic queue: the device comes first (lend {queue} {device})")
            raise NotFound(f"{queue}: {problem}" if problem else f"{queue} is not a magic queue")
        problem = self.problem(queue)
        if problem:
            raise Conflict(f"cannot lend to {queue}: {problem}")
        dev = self.db.magic_devices.find_one({"_id": device})
        if dev is None:
            raise NotFound(f"device {device} is not registered")
        if dev.get("quarantined"):
            raise Conflict(f"device {device} is quarantined: {dev.get('quarantine_reason')}")
        self._refuse_stale_host(device, dev.get("agent_host"))
        if fabric.refuses(q.vm.gpus, dev):
            # Its split would be refused (MultiGPUNeedsFabric) while its agent host does not opt
            # in: a whole deploy of the owners' machine for nothing, so no --force either
            # (TRIAL6 finding 2).
            raise Conflict(f"cannot lend {device} to {queue}: "
                           f"{fabric.blocked_text(q.vm.gpus, [dev])}")
        refusal = selection_refusal(q, dev)
        if refusal and not force:
            raise Conflict(f"cannot lend {device} to {queue}: {refusal}; use --force (API: "
                           "force: true) to lend it anyway")
        if refusal:
            reason = f"{reason} (forced: {refusal})"
        vms = q.vms_for(int(dev.get("gpus") or 0))
        if vms < 1:
            raise Invalid("device", f"{device} ({dev.get('gpus')} GPUs) cannot host a VM of {queue}")
        held = self.store.open_lease_for_device(device)
        if held is not None:  # say which lease, not what the fence did to the agent document
            raise Conflict(f"cannot lend {device}: already lent to {held['queue']} "
                           f"(lease {held['_id']}, {held['state']})")
        try:
            lease = self.store.claim(device, q, dev["agent_host"], vms, reason, by_hand=True)
        except L.ClaimRefused as exc:
            raise Conflict(f"cannot lend {device}: {exc.reason}") from None
        if self.metrics:
            self.metrics.lends.labels(queue=queue).inc()
        note = self._hand_lend_note(q)
        held_back = maasbackoff.held_back(dev, self.clock())
        if held_back:  # lent by hand anyway: say so (TRIAL14 F6)
            note = (f"{device} was held back from lending: {held_back}; lent by hand anyway "
                    f"(a deploy that goes through ends the hold). {note}")
        lease = dict(lease, note=note)
        return dict(lease, forced=refusal) if refusal else lease

    def _hand_lend_note(self, q) -> str:
        """What becomes of an operator's lease: kept through its bring-up whatever the demand
        (reconcile.drop_unneeded skips it), then given back by the idle rule, which counts from
        the queue's last job or the lease going idle (one count of the queue's waiting jobs,
        index ``jobs(result_data.job_state, job_data.job_queue)``)."""
        waiting = self.db.jobs.count_documents({"result_data.job_state": tfstates.JOB_WAITING,
                                                "job_data.job_queue": q.name})
        idle = format_duration(q.policy.idle_timeout)
        if waiting:
            return (f"{waiting} job(s) wait on {q.name}; the lease is kept through its bring-up "
                    f"and given back once idle for {idle} (idle_timeout)")
        return (f"no job waits on {q.name}: the lease is kept through its bring-up, then given "
                f"back once idle for {idle} (idle_timeout) unless jobs come; to keep devices "
                "lent without jobs, set policy.min_devices or warm")

    def _refuse_stale_host(self, device: str, host: str | None) -> None:
        """Conflict if ``host`` (``device``'s agent host) is stale (reconcile.stale_hosts: no
        heartbeat for STALE_HOST_AFTER): nobody would bring the lease up, and the next tick
        would restore it (reconcile: a bring-up on a stale host)."""
        from testflinger_magic import reconcile as R  # noqa: PLC0415

        doc = self.db.magic_agent_hosts.find_one({"_id": host}, {"last_heartbeat": 1}) \
            if host else None
        if doc is None:
            return
        beat = doc.get("last_heartbeat")
        if R.stale_hosts({host: beat}, self.clock()):
            silent = "yet" if beat is None else f"for {int(self.clock() - beat)}s"
            raise Conflict(f"cannot lend {device}: its agent host {host} sent no heartbeat "
                           f"{silent} (stale: nobody would bring the lease up); lend it once "
                           "the host's daemon runs again")

    def drain_by_hand(self, lease_id: str, reason: str, grace: str, force: bool) -> dict:
        """Operator drain: active -> draining with ``grace`` (duration text); ``force`` marks it
        forced (no undrain; cancelled at grace end). A draining lease gets the new drain doc,
        whose ``replaced`` (actions.replaced_drain: ``{kind, label, reason, grace, grace_until,
        forced}``) says which drain and grace it replaced; the returned lease carries it.

        A lease still in bring-up (claimed .. enrolling) has no job to wait for (its VM agents
        are fenced from the claim on): it goes to ``restoring`` at once, so a mistaken lend is
        undone without waiting for ``provision_timeout``. The daemon's step in flight ends by
        itself (its late report is refused: the generation moved) and the restore runs next.
        No failure is counted against the device: an operator asked. A lease already
        ``restoring`` (or closed) cannot be drained (Conflict)."""
        try:
            seconds = parse_bounded_duration(grace)
        except ValueError as exc:
            raise Invalid("grace", str(exc)) from None
        lease = self._lease_named(lease_id)
        if lease["state"] in L.BRINGUP_STATES:
            why = f"drained during bring-up: {reason}"
            try:
                new = self.store.transition(
                    lease_id, lease["state"], lease["generation"], L.RESTORING, why,
                    set_fields={"drain": self._drain_doc(lease, reason, 0.0, force)})
            except L.StaleGeneration as exc:
                raise Conflict(str(exc), exc.lease) from None
            if self.metrics:
                self.metrics.drains.labels(queue=new["queue"], kind="operator").inc()
            return self._with_warm_note(new)
        if lease["state"] not in (L.ACTIVE, L.DRAINING):
            nxt = (f"its agent host's daemon gives the device back when the restore ends; if "
                   f"that host is gone for good: testflinger-magic abandon {lease_id}"
                   if lease["state"] == L.RESTORING else "it holds nothing to give back")
            raise Conflict(f"lease {lease_id} is {lease['state']}; only open leases that are "
                           f"not already restoring can be drained: {nxt}", lease)
        drain = self._drain_doc(lease, reason, seconds, force)
        old = lease.get("drain") or {}
        if lease["state"] == L.DRAINING and old:  # says what it replaced (TRIAL2 finding 8)
            drain["replaced"] = replaced_drain(old)
        if old.get("forced_at") is not None:  # a committed force stays committed
            drain.update(forced=True, **{k: old.get(k) for k in ("forced_at", "force_until",
                                                                 "cancelled")})
        try:
            if lease["state"] == L.ACTIVE:
                new = self.store.transition(lease_id, L.ACTIVE, lease["generation"], L.DRAINING,
                                            reason, set_fields={"drain": drain})
            else:
                new = self.store.progress(lease_id, L.DRAINING, lease["generation"],
                                          set_fields={"drain": drain,
                                                      "deadline": drain["grace_until"]})
        except L.StaleGeneration as exc:
            raise Conflict(str(exc), exc.lease) from None
        self._fence_vms(new, reason)
        if self.metrics:
            self.metrics.drains.labels(queue=new["queue"], kind="operator").inc()
        return self._with_warm_note(new)

    def abandon_by_hand(self, lease_id: str, reason: str, force: bool = False,
                        by: str | None = None) -> dict:
        """Admin: close now, as ``failed``, a lease its agent host will not finish: the host's
        machine died, or a host that should never have registered (a wrong ``agent_name``,
        an untrusted agent client: TRIAL12 F1). Without it such a lease waits in
        ``restoring`` (or bring-up) for a daemon that never comes, its device claimed and
        fenced, and ``agent-hosts forget`` is refused while it holds the device.

        Only a lease no job can run on: in bring-up (its VM agents are fenced from the claim)
        or ``restoring`` (a restore begins once its VM agents are idle or their jobs were
        cancelled); an ``active`` or ``draining`` lease is refused (Conflict: drain it first,
        ``--grace 0`` cancels its jobs; abandon it once it is restoring). Refused while its
        agent host heartbeats (its daemon is working the lease: a restore will finish it)
        unless ``force``.

        Bring-up -> ``restoring`` -> ``failed`` (compare-and-set each; no failure counted
        against the device: nothing says the device failed), then the device is quarantined
        with a reason naming the lease: what the host may have left (the MAAS deploy of the
        device, the lease's VMs and their MAAS machines) is for a person to check; the
        device's claim and fence stay until then, and ``unquarantine`` releases them and
        gives the device agent back (LeaseStore.release_failed). ``by``: the admin's client
        id, for the history. Returns the failed lease with ``note``: what to do next."""
        from testflinger_magic import reconcile as R  # noqa: PLC0415

        lease = self._lease_named(lease_id)
        state = lease["state"]
        if state in (L.ACTIVE, L.DRAINING):
            raise Conflict(f"lease {lease_id} is {state}: jobs may run on its VMs; drain it "
                           f"first (testflinger-magic drain {lease_id} --grace 0 cancels them), "
                           "then abandon it once it is restoring", lease)
        if state in L.FINAL_STATES:
            tail = (f": testflinger-magic unquarantine {lease['device']} releases the device "
                    "it kept" if state == L.FAILED else "")
            raise Conflict(f"lease {lease_id} is already {state}{tail}", lease)
        host = lease.get("agent_host")
        doc = self.db.magic_agent_hosts.find_one({"_id": host}, {"last_heartbeat": 1}) \
            if host else None
        beat = (doc or {}).get("last_heartbeat")
        alive = beat is not None and not R.stale_hosts({host: beat}, self.clock())
        if alive and not force:
            ago = max(0, int(self.clock() - beat))
            raise Conflict(f"lease {lease_id}: its agent host {host} is not stale (last "
                           f"heartbeat {ago}s ago): its daemon restores the lease (a bring-up "
                           "is restored once stopped or past its deadline). If the host died, "
                           f"abandon works without --force once it is stale, in "
                           f"{max(0, int(R.STALE_HOST_AFTER) - ago)}s; --force now only if "
                           "that host must not be trusted", lease)
        who = f" by {by}" if by else ""
        why = f"abandoned{who}: {reason}"
        try:
            if state != L.RESTORING:
                lease = self.store.transition(lease_id, state, lease["generation"], L.RESTORING,
                                              why, set_fields={"failures_counted": True})
            else:
                lease = self.store.progress(lease_id, L.RESTORING, lease["generation"],
                                            set_fields={"failures_counted": True})
            lease = self.store.close(lease_id, lease["generation"], L.FAILED, why)
        except L.StaleGeneration as exc:
            raise Conflict(f"lease {lease_id} changed meanwhile ({exc}); look again", exc.lease) \
                from None
        device = lease["device"]
        self._quarantine(device, True, f"lease {lease_id} was abandoned{who} ({reason}); its "
                         f"agent host {host} may have left the device deployed in MAAS and "
                         "the lease's VMs and their MAAS machines behind: check, clean up, "
                         "then unquarantine it", queue=lease.get("queue"))
        made = [vm.get("agent_name") for vm in lease.get("vms") or [] if vm.get("maas_system_id")]
        if alive:
            # Its daemon may be in the middle of a step (TRIAL15 F1): what the lease says it
            # made is not all it may make. The daemon ends the step at its next poll and
            # removes what the lease left (agent_host sweep, without its grace).
            vms = (f"; its agent host {host} was still heartbeating: its daemon ends the "
                   "lease's step and removes the VMs, agent programs and VM machines in MAAS "
                   f"the lease left within a minute (look for MAAS machines named {device}-vm*;"
                   " testflinger-magic agent-host sweep --dry-run on that host lists those "
                   "left; not the device itself, which stays deployed if the lease had deployed "
                   "it: release it in MAAS)")
        else:
            vms = (f"; delete the MAAS machines of its VMs {', '.join(made)}" if made else
                   "; no VM of it was enrolled in MAAS")
        return dict(lease, note=(
            f"{device} stays fenced and quarantined: check it in MAAS (release it if its "
            f"agent host deployed it{vms}), "
            f"then `testflinger-magic unquarantine {device}` gives it back to its home queues"
            + (f"; to stop {host} registering devices again: testflinger-magic agent-hosts "
               f"forget {host} (after that unquarantine)" if host else "")))

    def _lease_named(self, lease_id: str) -> dict:
        """The lease ``lease_id`` (NotFound). A device's name given instead (TRIAL9: ``drain
        gpu-host-12``) is answered with its open lease's id, or that it has none."""
        try:
            return self.lease(lease_id)
        except NotFound:
            if self.db.magic_devices.find_one({"_id": lease_id}, {"_id": 1}) is None:
                raise
        held = self.store.open_lease_for_device(lease_id)
        if held is None:
            raise NotFound(f"no lease {lease_id}: that is a device, and no open lease holds it")
        raise NotFound(f"no lease {lease_id}: that is a device; its open lease is {held['_id']} "
                       f"({held.get('state')}, {held.get('queue')}): drain {held['_id']}")

    def _with_warm_note(self, lease: dict) -> dict:
        """``lease`` with a ``note`` when its queue keeps devices lent without jobs (a warm
        level: ``min_devices``, ``warm`` windows, ``warm_learn``): a drained lease below that
        level is replaced at once, perhaps by a lend of the same device and a full redeploy
        (TRIAL5 finding 11), so the operator learns how to keep a device out."""
        q = self._definition(lease.get("queue"))
        if q is None:
            return lease
        p = q.policy
        if not (p.min_devices or p.warm or p.warm_learn is not None):
            return lease
        return dict(lease, note=(
            f"{q.name} keeps devices lent without jobs (its warm level: policy.min_devices, "
            "warm or warm_learn): another lease is made at once to keep that level, perhaps "
            f"of {lease.get('device')} again; to keep {lease.get('device')} out, quarantine it "
            "(testflinger-magic quarantine)"))

    def set_quarantine(self, device: str, on: bool, reason: str) -> dict:
        """Quarantine or release a device; returns the device document (NotFound).

        Unquarantine is also how an operator says "I looked at it": if the device's latest
        lease is ``failed`` (it keeps the claim and the device fence, so the device could never
        be lent or serve its home queues again), its claim and fences are released and the
        device agent's ``agents`` document given back (LeaseStore.release_failed).

        Quarantining a device that is already quarantined records the new reason (an event
        says what it replaced). The answer adds ``previous_reason``: the reason the device was
        quarantined for before this call, or None if it was not quarantined;
        ``released_failed_lease``: the id of the failed lease an unquarantine released, or
        None; ``lifted_hold_back``: why the device was held back after MAAS refused it, a hold
        an unquarantine lifted (:mod:`.maasbackoff`), or None; and ``open_lease`` (``{_id,
        queue, state}``): the open lease that still holds the
        device, or None (a quarantine stops new lends only; the operator drains it)."""
        before = self.db.magic_devices.find_one({"_id": device})
        if before is None:
            kept = None if on else keptquarantine.lift(self.db, device)
            if kept is None:
                raise NotFound(f"device {device} is not registered")
            # Not registered, its quarantine kept from its deregistration: lifted now.
            self.events.record("device.unquarantined", f"{device}: kept quarantine lifted "
                               f"while not registered (was: {kept.get('reason')}): {reason}",
                               device=device)
            return {"_id": device, "quarantined": False, "registered": False,
                    "previous_reason": kept.get("reason"), "released_failed_lease": None,
                    "lifted_hold_back": None, "open_lease": None}
        previous = before.get("quarantine_reason") if before.get("quarantined") else None
        if on and before.get("quarantined"):
            res = self.db.magic_devices.update_one(
                {"_id": device, "quarantined": True, "quarantine_reason": previous},
                {"$set": {"quarantine_reason": reason, "quarantine_lease": None}})
            if res.modified_count and previous != reason:
                self.events.record("device.quarantined", f"{device}: still quarantined, reason "
                                   f"now: {reason} (was: {previous})", device=device)
        else:
            self._quarantine(device, on, reason)
        released = None
        lifted = maasbackoff.held_back(before, self.clock()) if not on else None
        if not on:
            maasbackoff.clear(self.db, device)  # an operator looked: lend it again now
            latest = list(self.db.magic_leases.find({"device": device}, {"state": 1},
                                                    sort=[("created_at", -1)], limit=1))
            if latest and latest[0]["state"] == L.FAILED:
                try:
                    self.store.release_failed(device)
                except L.LeaseError as exc:
                    raise Conflict(str(exc)) from None
                released = latest[0]["_id"]
        held = self.store.open_lease_for_device(device)
        return dict(self.db.magic_devices.find_one({"_id": device}), previous_reason=previous,
                    released_failed_lease=released, lifted_hold_back=lifted,
                    open_lease=None if held is None else {
                        "_id": held["_id"], "queue": held.get("queue"),
                        "state": held.get("state")})
