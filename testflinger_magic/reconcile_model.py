"""Reconcile's data: the inputs :func:`reconcile.plan` reads (``Inputs`` and its views), the
``Action`` it returns, its constants, and the pure helpers around them (missing VM agents, overdue
leases, stale hosts). Split from reconcile.py (pure move); reconcile re-exports every name."""

from __future__ import annotations

import math
import re
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any

from .leases import ACTIVE, BRINGUP_STATES, DRAINING, FAILED, OPEN_STATES, RESTORING

ACTION_KINDS = ("lend", "drain", "undrain", "force", "restore", "pause", "resume", "quarantine",
                "blocked")
#: Kinds that only explain (``plan(..., explain=True)``); executors must do nothing for them.
NON_ACTING = frozenset({"blocked"})
#: Drain kinds that demand may cancel (the others are the owner's or the policy's).
UNDRAINABLE = frozenset({"idle", "consolidate"})
#: Grace (seconds) for leases whose queue definition was removed.
ORPHAN_GRACE = 900.0
#: Least grace (seconds) of a ``yield`` drain: 10 h. A yield never cancels a job: a partly busy
#: lease closes admission and waits for its running jobs, so its grace must outlast any job
#: Testflinger lets run: the agent's ``global_timeout`` (default and cap 4 h, over provision and
#: test) plus a reservation (at most 6 h for clients without extended reservation)
#: (canonical/testflinger docs/reference/testflinger-agent-conf.rst and
#: docs/how-to/extended-reservation; /work/shared/TESTFLINGER.md 3.6). A drain's grace is
#: ``max(reclaim.grace, YIELD_GRACE)``; a wholly idle lease restores at once anyway.
YIELD_GRACE = 36000.0
#: An agent host whose last heartbeat is older than this (seconds; a few of the daemon's 30 s
#: heartbeat / long-poll intervals) is reported stale: its leases are not being worked.
STALE_HOST_AFTER = 120.0
#: An agent host whose last heartbeat is older than this (seconds), not yet stale, has missed
#: one: a daemon heartbeats at most ``heartbeat_interval + poll_wait`` apart, which its config
#: holds within half of STALE_HOST_AFTER (agent_host/config.py). A bring-up deadline passing
#: then is the host's silence (hung, cut off), not the device's fault (TRIAL13 F4).
QUIET_HOST_AFTER = STALE_HOST_AFTER / 2 + 15.0
#: Seconds after a lease became ``active`` during which its VMs that have no Testflinger agent
#: yet still count as "coming" (supply, and a reason not to drain for idleness). The daemon
#: starts every VM agent before reporting ``active`` and an agent posts its state within
#: seconds, so a VM still silent after this has failed to start: without a bound one dead VM
#: agent would keep an 8-GPU machine lent until ``max_lease``. The server passes it in
#: ``Inputs.vm_agent_grace`` (Engine.vm_agent_grace), so a lab or a test can shrink it.
VM_AGENT_GRACE = 120.0
#: Most seconds a lease still in bring-up is kept once no job needs it (its queue's jobs were
#: cancelled or served elsewhere), counted from its claim or the queue's last job submitted or
#: started, whichever is later; a queue's ``idle_timeout``, if shorter, is used instead. Long
#: enough for a cancel-and-resubmit not to thrash, short against a bring-up of real hardware
#: (deploy, split, enrol: ~25 min with the home machine away for nothing).
UNNEEDED_HOLD = 60.0
#: Seconds after a device agent posted ``waiting`` (its ``agents.updated_at``, the agent's own
#: post) during which it counts as about to take a job of its home queue: testflinger-agent
#: asks for a job right after posting ``waiting``, at startup and after each job
#: (TESTFLINGER.md §3.2-3.4: ``process_jobs`` then sleeps ``polling_interval``, default 10 s),
#: so a healthy agent takes a waiting job within this; one still idle after it is not counted
#: (a dead agent must not keep the owners' devices lent). An agent crash-looping under
#: supervisord dies before that post (its metrics port or config: what the give-back check,
#: server/giveback.py, relies on too), so it does not count either. Owner reclaims count such
#: devices, and devices just given back whose agent has not posted yet, as the home queue's
#: supply.
AGENT_PICKUP = 15.0


@dataclass(frozen=True)
class QueueDemand:
    """Jobs waiting on a queue (magic or home): ``waiting`` count, ``max_priority`` of those
    jobs, ``oldest_age`` seconds the oldest has waited, ``last_job_at`` epoch seconds of the last
    job submitted or started (None: never)."""

    waiting: int = 0
    max_priority: int = 0
    oldest_age: float = 0.0
    last_job_at: float | None = None
    #: Devices (names) none of whose VMs any of these waiting jobs may run: every one names
    #: all of the device's VM agents in ``exclude_agents`` (server/excludes.py). Such a device is
    #: not lent for the queue, and its lease's VMs are no supply for these jobs. On a home
    #: queue: the devices every waiting job names itself in ``exclude_agents`` (the device
    #: agent's name): the owner reclaim does not take such a device back for these jobs, and
    #: they do not keep it from being lent (TRIAL11 F4).
    avoid: frozenset = frozenset()
    #: VM agent names every one of these waiting jobs names in ``exclude_agents`` (e.g. each
    #: device's ``-vm1`` after a bad run there): an idle one is no supply for them (TRIAL7: it
    #: was counted, and a bring-up the job could use was stopped as unneeded).
    avoid_agents: frozenset = frozenset()


def view(cls, values: dict):
    """``cls(**values)`` for one of this module's frozen view dataclasses (:class:`DeviceView`,
    :class:`LeaseView`, :class:`VMAgentView`), without the generated ``__init__``, which sets
    each field through ``object.__setattr__`` (a frozen dataclass's way): 16 such calls made a
    DeviceView cost ~5 us, a tenth of a tick at 1,000 devices (benchmarks/reconcile_scale.py).
    The result is the same instance (equal, hashable, still frozen). ``values`` must name every
    field; like the generated ``__init__``, nothing is checked (the snapshot's views are
    compared with ``cls(**values)`` in tests/test_server_scale.py)."""
    obj = object.__new__(cls)
    obj.__dict__.update(values)
    return obj


@dataclass(frozen=True)
class DeviceView:
    """A registered device (``magic_devices``) joined with its Testflinger ``agents`` document.
    ``agent_state``/``job_id`` from ``agents``; ``last_home_use`` epoch seconds or None.
    ``agent_back``: False while the device was given back by a lease and its agent, restarted by
    the restore, has not posted since: its startup post (``waiting``, TESTFLINGER.md §3.2) is
    still to come, and would undo the ``offline`` of a claim made before it (server/giveback.py
    tells when it came)."""

    name: str
    agent_host: str
    gpus: int
    tags: tuple | list = ()
    home_queues: tuple | list = ()
    agent_state: str | None = None
    job_id: str | None = None
    quarantined: bool = False
    failures: int = 0
    last_home_use: float | None = None
    registered: bool = True
    agent_back: bool = True
    #: NVSwitches the daemon found on the device (``magic_devices.nvswitches``; 0: none or not
    #: known yet), when and how (``nvswitches_found``), and its agent host's opt-in
    #: (``nvswitch_multi_gpu``): together :func:`testflinger_magic.fabric.refuses`.
    nvswitches: int = 0
    nvswitches_found: dict | None = None
    nvswitch_multi_gpu: bool = False
    #: Why the device is not lent for now after MAAS refused its bring-up (a back-off,
    #: server/maasbackoff.py ``held_back``), or None.
    held_back: str | None = None


@dataclass(frozen=True)
class LeaseView:
    """A lease as reconcile sees it; ``vms`` is the planned VM count, ``drain`` the lease's drain
    document (``{reason, kind, requested_at, grace_until, forced}``) or None."""

    id: str
    device: str
    queue: str
    state: str
    generation: int
    created_at: float
    updated_at: float
    deadline: float | None
    vms: int
    drain: dict | None = None
    admission: str = "open"
    idle_since: float | None = None
    #: When the lease first became ``active`` (epoch seconds; None: unknown or not yet), and the
    #: planned VM agent names: together they tell which VM agents are missing (VM_AGENT_GRACE).
    active_since: float | None = None
    vm_names: tuple | list = ()
    #: An operator's lend (``lend DEVICE QUEUE``): never drained as ``unneeded`` in bring-up.
    by_hand: bool = False


@dataclass(frozen=True)
class VMAgentView:
    """A VM agent of a lease; ``busy`` = running or about to run a job (LeaseStore.agent_busy)."""

    name: str
    lease_id: str
    queue: str
    state: str | None
    job_id: str | None
    busy: bool


@dataclass(frozen=True)
class Inputs:
    """Everything :func:`plan` looks at (times in seconds). ``demand`` is keyed by queue name
    (magic and home).
    ``suspended``: ``{queue name: reason}`` of queues that must not lend (their definition is at
    fault until applied again)."""

    definitions: list
    devices: list[DeviceView]
    demand: dict[str, QueueDemand]
    leases: list[LeaseView]
    vm_agents: list[VMAgentView]
    now: float
    suspended: dict[str, str] = field(default_factory=dict)
    vm_agent_grace: float = VM_AGENT_GRACE
    #: Epoch seconds of ``now`` for calendar rules (``policy.warm`` windows, the day kind of
    #: ``policy.warm_learn``); None: ``now`` is epoch time already (the server). The simulator,
    #: whose clock starts at 0, passes its trace's start (a Monday 00:00 UTC) + ``now``.
    wall: float | None = None
    #: ``{magic queue: [submission times, sorted]}`` (seconds, on the clock of ``now``) of the jobs
    #: submitted within the queue's ``policy.warm_learn.lookback``; only queues with
    #: ``warm_learn`` are read (a queue missing here has no history: no learnt warm level).
    arrivals: dict[str, list] = field(default_factory=dict)
    #: ``{agent host: seconds since its last heartbeat (None: never)}`` of the hosts
    #: :func:`stale_hosts` reports (no heartbeat for ``STALE_HOST_AFTER``): their devices are
    #: not lent, and their leases still in bring-up are restored (nobody works them).
    stale_hosts: dict[str, float | None] = field(default_factory=dict)
    #: ``{agent host: seconds since MAAS stopped answering it}`` of the hosts whose daemon's
    #: heartbeat says MAAS is unreachable (``maas_unreachable_since``): like a stale host for
    #: lending only (none of its devices is lent; a bring-up past its deadline is restored
    #: with no failure counted), its leases are still worked.
    maas_down_hosts: dict[str, float] = field(default_factory=dict)
    #: ``{agent host: seconds since its last heartbeat}`` of the hosts silent for more than
    #: :data:`QUIET_HOST_AFTER` and not yet stale (:func:`quiet_hosts`): a bring-up there whose
    #: deadline passes is restored with no failure counted.
    quiet_hosts: dict[str, float] = field(default_factory=dict)
    #: ``[{agent, job_id, job_state, lease_id, queue}]``: jobs left in a phase by a VM agent
    #: that restarted (:func:`testflinger_magic.stalejob.orphaned`); the engine cancels them
    #: (:mod:`testflinger_magic.server.orphanjobs`). :func:`plan` does not look at them.
    orphans: list = field(default_factory=list)
    #: ``{magic queue: epoch seconds}``: since when each queue has been marked unservable (its
    #: waiting jobs can run nowhere: :mod:`testflinger_magic.unservable`); :func:`plan` does not
    #: look at it.
    unservable: dict = field(default_factory=dict)


@dataclass(frozen=True)
class Action:
    """One decision. ``kind`` in :data:`ACTION_KINDS`; ``reason`` is for people; ``generation``
    is the lease generation the decision was made on (for the engine's CAS)."""

    kind: str
    reason: str
    queue: str | None = None
    device: str | None = None
    lease_id: str | None = None
    generation: int | None = None
    data: dict[str, Any] = field(default_factory=dict)


_NO_DEMAND = QueueDemand()


def _dur(seconds: float) -> str:
    seconds = int(round(seconds))
    if seconds % 3600 == 0 and seconds:
        return f"{seconds // 3600}h"
    if seconds % 60 == 0 and seconds:
        return f"{seconds // 60}m"
    return f"{seconds}s"


#: What an operator does about a suspended queue (appended once to a suspension reason).
REAPPLY_ADVICE = "fix the definition and apply it again"


def with_reapply_advice(reason: str) -> str:
    """``reason`` (why a queue's lending is suspended) followed by :data:`REAPPLY_ADVICE`,
    unless the reason already says to apply the definition again (the agent host's
    ``VMSpecDoesNotFit`` message does): the advice is given once."""
    reason = str(reason).rstrip().rstrip(":;,.")
    if "apply it again" in reason or "apply the definition again" in reason:
        return reason
    return f"{reason}; {REAPPLY_ADVICE}"


_REAPPLY_RE = re.compile(r"[;,.]?\s*fix the (?:queue )?definition and apply it\s+again")


def without_reapply_advice(reason: str) -> str:
    """``reason`` less any "fix the (queue) definition and apply it again" clause (the agent
    host's ``VMSpecDoesNotFit`` message has one; :data:`REAPPLY_ADVICE`): the words a test
    engineer is shown, who cannot apply a definition."""
    return _REAPPLY_RE.sub("", str(reason)).strip()


def _plural(n: int, word: str) -> str:
    return f"{n} {word}" + ("" if n == 1 else "s")


def _device_dict(d: DeviceView) -> dict:
    return {"_id": d.name, "name": d.name, "gpus": d.gpus, "tags": list(d.tags),
            "home_queues": list(d.home_queues), "nvswitches": d.nvswitches,
            "nvswitches_found": d.nvswitches_found, "nvswitch_multi_gpu": d.nvswitch_multi_gpu}


def overdue_leases(leases: list[LeaseView], now: float) -> list[LeaseView]:
    """Leases in ``restoring`` past their deadline: the agent host is not finishing the restore
    (it is down, or it no longer drives the device). Nothing in the plan moves them, so a
    person must be told (status, event, metric)."""
    return [l for l in leases
            if l.state == RESTORING and l.deadline is not None and now >= l.deadline]


def busy_at_home(agent_state: str | None, job_id: str | None) -> bool:
    """True if a device's own agent is busy at home, so the device is not lent now: its state
    is not ``waiting`` (a phase, ``offline``, ``maintenance``; None: it never posted) or it
    names a job. One rule for the planner (``busy``), ``status``' ``devices_lendable`` and the
    preflight's capacity entry (server/devicecount.py)."""
    return agent_state != "waiting" or bool(job_id)


def _agents_overdue(lease: LeaseView, now: float, grace: float) -> bool:
    """True if ``lease`` (active or draining) has been active for at least ``grace`` seconds,
    so its VMs without an agent are missing rather than still starting."""
    return (lease.state in (ACTIVE, DRAINING) and lease.active_since is not None
            and now - lease.active_since >= grace)


_NO_NAMES: frozenset = frozenset()


def missing_vm_agents(inputs: Inputs) -> dict[str, list[str]]:
    """``{lease id: [VM agent names]}`` of active/draining leases past ``vm_agent_grace`` whose
    planned VM agents never registered with the server (no Testflinger ``agents`` document).
    The server reports each set once (event ``vm_agent.missing``) and in status: such a VM
    takes no job, and the lease is judged idle on the agents that did register."""
    now, grace = inputs.now, inputs.vm_agent_grace
    # _agents_overdue, inlined (~500 leases at 1,000 devices, every tick).
    overdue = [l for l in inputs.leases if l.active_since is not None
               and (l.state == ACTIVE or l.state == DRAINING) and now - l.active_since >= grace]
    if not overdue:
        return {}
    registered: dict[str, set[str]] = {}
    for a in inputs.vm_agents:
        found = registered.get(a.lease_id)
        if found is None:
            registered[a.lease_id] = {a.name}
        else:
            found.add(a.name)
    out = {}
    for l in overdue:
        have = registered.get(l.id, _NO_NAMES)
        if have.issuperset(l.vm_names):
            continue
        names = sorted(n for n in l.vm_names if n not in have)
        if names:
            out[l.id] = names
    return out


def stale_hosts(last_heartbeats: dict[str, float | None], now: float,
                after: float = STALE_HOST_AFTER) -> list[str]:
    """Agent host names whose last heartbeat (epoch seconds, None = never) is older than
    ``after`` seconds, sorted."""
    return sorted(h for h, at in last_heartbeats.items() if at is None or now - at > after)


def quiet_hosts(last_heartbeats: dict[str, float | None], now: float,
                after: float = QUIET_HOST_AFTER,
                stale_after: float = STALE_HOST_AFTER) -> dict[str, float]:
    """``{agent host: seconds since its last heartbeat}`` of those silent for more than
    ``after`` seconds but not ``stale_after`` (the stale ones are :func:`stale_hosts`')."""
    return {h: now - at for h, at in last_heartbeats.items()
            if at is not None and after < now - at <= stale_after}


def maas_down_hosts(unreachable_since: dict[str, float | None], stale: Collection[str],
                    now: float) -> dict[str, float]:
    """``{agent host: seconds MAAS has not answered it}`` of the hosts whose daemon's heartbeat
    says MAAS does not answer (``unreachable_since``: ``{host: epoch seconds or None}``, the
    hosts' ``maas_unreachable_since``), those in ``stale`` (no heartbeat: nobody knows) left
    out: ``Inputs.maas_down_hosts``, and the preflight's and ``status``' MAAS-down count."""
    return {h: max(0.0, now - since) for h, since in unreachable_since.items()
            if since is not None and h not in stale}
