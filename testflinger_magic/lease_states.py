"""Lease states, the legal transitions, deadlines and the lease errors (pure; no database).

Split from :mod:`testflinger_magic.leases`, which re-exports every name here (import them from
there). See docs/architecture.md "Lease document".
"""

from __future__ import annotations

from types import SimpleNamespace

# --------------------------------------------------------------------------- states (pure)

CLAIMED, FENCED, DEPLOYING, SPLITTING, ENROLLING = "claimed", "fenced", "deploying", "splitting", "enrolling"
ACTIVE, DRAINING, RESTORING, RETURNED, FAILED = "active", "draining", "restoring", "returned", "failed"

STATES = (CLAIMED, FENCED, DEPLOYING, SPLITTING, ENROLLING, ACTIVE, DRAINING, RESTORING, RETURNED, FAILED)
FINAL_STATES = frozenset({RETURNED, FAILED})
#: States of a lease that still holds its device (``failed`` also keeps the claim, see close()).
OPEN_STATES = frozenset(STATES) - FINAL_STATES
#: Bring-up states: one deadline (policy.provision_timeout) covers all of them together.
BRINGUP_STATES = frozenset({CLAIMED, FENCED, DEPLOYING, SPLITTING, ENROLLING})
#: States in which the agent-host daemon has a step to run.
DAEMON_STATES = BRINGUP_STATES | {RESTORING}

TRANSITIONS: dict[str, frozenset[str]] = {
    CLAIMED: frozenset({FENCED, RESTORING}),
    FENCED: frozenset({DEPLOYING, RESTORING}),
    DEPLOYING: frozenset({SPLITTING, RESTORING}),
    SPLITTING: frozenset({ENROLLING, RESTORING}),
    ENROLLING: frozenset({ACTIVE, RESTORING}),
    ACTIVE: frozenset({DRAINING}),
    DRAINING: frozenset({ACTIVE, RESTORING}),
    RESTORING: frozenset({RETURNED, FAILED}),
    RETURNED: frozenset(),
    FAILED: frozenset(),
}

#: Seconds a restore may take before the lease is reported overdue.
RESTORE_TIMEOUT = 1800.0
#: Defaults when a policy lacks a field (seconds).
DEFAULT_PROVISION_TIMEOUT = 2700.0
DEFAULT_GRACE = 900.0
#: After a forced drain cancelled its jobs, how long (seconds) the lease stays ``draining`` at
#: most, waiting for every VM agent to notice the cancel, when the lease's policy has no grace.
#: Agents look for a cancel only every 10 s and never during provision (TESTFLINGER.md §3.6), so
#: tearing the VMs down at once would kill a job mid-provision.
DEFAULT_FORCE_WAIT = 600.0

VM_DISK_DIR = "/var/lib/libvirt/images"


#: States whose lease has ``active_since`` written (LeaseStore.transition): when it first
#: became active, or null for a restore from bring-up.
AFTER_ACTIVE_STATES = frozenset({ACTIVE, DRAINING, RESTORING})


def first_active(lease: dict) -> float | None:
    """When ``lease`` (a lease document) first became active: its ``active_since`` (set by
    LeaseStore.transition since that field exists), else the ``at`` of its first ``history``
    entry in state ``active`` (every transition appends one), else None."""
    if lease.get("active_since") is not None:
        return lease["active_since"]
    for entry in lease.get("history") or ():
        if entry.get("state") == ACTIVE:
            return entry.get("at")
    return None


def is_legal(from_state: str, to_state: str) -> bool:
    """True if ``from_state -> to_state`` is in :data:`TRANSITIONS`."""
    return to_state in TRANSITIONS.get(from_state, ())


def deadline_for(state: str, policy, now: float, *, bringup_deadline: float | None = None,
                 drain: dict | None = None, created_at: float | None = None) -> float | None:
    """Deadline (epoch seconds) of a lease entering ``state`` at ``now``, or None.

    ``policy``: an object with ``provision_timeout``, ``max_lease`` (seconds, 0/None = none) and
    ``reclaim.grace`` (a queue's ``policy``, or the snapshot kept in the lease's ``timeouts``).
    Bring-up states share one deadline: ``bringup_deadline`` (the running one) if given, else
    ``now + provision_timeout``. ``draining``: ``drain["grace_until"]`` or ``now + grace``.
    ``restoring``: ``now + RESTORE_TIMEOUT``. ``active``: ``created_at + max_lease`` or None.
    Final states: None.
    """
    if state in BRINGUP_STATES:
        if bringup_deadline is not None:
            return bringup_deadline
        return now + float(getattr(policy, "provision_timeout", None) or DEFAULT_PROVISION_TIMEOUT)
    if state == DRAINING:
        if drain and drain.get("grace_until") is not None:
            return float(drain["grace_until"])
        reclaim = getattr(policy, "reclaim", None)
        return now + float(getattr(reclaim, "grace", None) or DEFAULT_GRACE)
    if state == RESTORING:
        return now + RESTORE_TIMEOUT
    if state == ACTIVE:
        max_lease = getattr(policy, "max_lease", None)
        if max_lease:
            return (created_at if created_at is not None else now) + float(max_lease)
        return None
    return None


def _policy_of_lease(lease: dict):
    """The policy snapshot stored at claim, as an object :func:`deadline_for` accepts."""
    t = lease.get("timeouts") or {}
    return SimpleNamespace(provision_timeout=t.get("provision_timeout"), max_lease=t.get("max_lease"),
                           reclaim=SimpleNamespace(grace=t.get("grace")))


# --------------------------------------------------------------------------- errors


class LeaseError(Exception):
    """Base class of lease store errors."""


class LeaseNotFound(LeaseError):
    """No lease with that id."""


class IllegalTransition(LeaseError):
    """The requested state change is not in :data:`TRANSITIONS`."""


class StaleGeneration(LeaseError):
    """The lease is not in the (state, generation) the caller acted on; ``.lease`` is the current
    document (the HTTP layer answers 409 with it)."""

    def __init__(self, message: str, lease: dict):
        super().__init__(message)
        self.lease = lease


class ClaimRefused(LeaseError):
    """The device cannot be lent now; ``.reason`` says why. Nothing was left behind."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


# --------------------------------------------------------------------------- claims and comments


#: Seconds after which a claim lock or fence whose lease document does not exist is an orphan of
#: a process that died inside :meth:`LeaseStore.claim` (a live claim takes milliseconds).
ORPHAN_CLAIM_AGE = 60.0

#: Seconds after its close (the ``returned`` history entry) before a ``returned`` lease that
#: still holds a claim or fence counts as an interrupted close (LeaseStore.repair_closed):
#: close() frees them right after its compare-and-set, on the same thread, within milliseconds;
#: a tick that meets the lease before then is racing a close in progress (issue 10 item 18).
CLOSE_CLEANUP_AGE = ORPHAN_CLAIM_AGE

#: Seconds after a lease became ``active`` (its last ``active`` history entry) before VM fences
#: it still holds count as left behind (LeaseStore.repair_active_fences): the ``enrolling ->
#: active`` report and an undrain lift them right after their compare-and-set, on the same
#: thread, within milliseconds; a tick that meets the lease before then is racing that lift
#: (issue 10 item 18). Small, since a real leftover keeps the VM agents from jobs until then.
ACTIVE_LIFT_AGE = 10.0


#: The Testflinger state a lent device agent's ``agents`` document shows (with
#: :func:`lent_comment`): ``maintenance``, not ``offline``. testflinger-cli's pre-submit check
#: counts an agent online when its state is not ``offline`` (``check_online_agents_available``,
#: TESTFLINGER.md §4.2), so with ``offline`` an owner could not submit to the home queue of a
#: device that is lent (all its agents offline: "No online agents available"), and the reclaim
#: that job would trigger (``reclaim.owner_wait``) never came; ``queue-status`` counts
#: ``maintenance`` as Busy (§4.3), which is true. The agent takes no job in either state
#: (``agent.py::check_offline``, §3.7), and newer agents keep either across a restart
#: (testflinger#1291, §9); the ``GET /v1/job`` fence stays the authority (docs/architecture.md).
LENT_AGENT_STATE = "maintenance"
#: States in which a device agent's document does not show it free (a lent one: ours; or an
#: older lease's ``offline``, from before :data:`LENT_AGENT_STATE` was ``maintenance``).
NOT_FREE_AGENT_STATES = ("offline", "maintenance")


def lent_comment(queue: str, lease_id: str) -> str:
    """The Testflinger agent comment that marks a device agent as ours while lent."""
    return f"lent to magic queue {queue} (lease {lease_id})"
