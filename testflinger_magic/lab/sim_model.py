"""The simulation's model state (simulate.py): jobs, agents, devices and leases as plain records."""

from __future__ import annotations

from dataclasses import dataclass, field

from testflinger_magic import leases as L
from testflinger_magic.lab.trace import DeviceSpec, TraceJob


@dataclass
class _Job:
    spec: TraceJob
    seq: int
    magic: bool
    state: str = "waiting"  # waiting | running | done | cancelled
    started: float | None = None
    ended: float | None = None
    agent: str | None = None


@dataclass
class _Agent:
    """A device agent (``lease_id`` None) or a VM agent of ``lease_id``."""

    name: str
    queues: tuple[str, ...]
    lease_id: str | None = None
    job: _Job | None = None
    last_change: float | None = None


@dataclass
class _Device:
    spec: DeviceSpec
    name: str
    agent: _Agent
    lease_id: str | None = None  # open (or failed) lease holding the device
    quarantined: bool = False
    failures: int = 0
    #: the lease of the latest counted failure (LeaseStore.record_failure ``last_failure_lease``)
    last_failure_lease: str | None = None
    #: the lease whose failure the planner's quarantine is for (engine ``quarantine_lease``)
    quarantine_lease: str | None = None


@dataclass
class _Lease:
    id: str
    device: str
    queue: str
    vms: int
    created_at: float
    state: str = L.CLAIMED
    generation: int = 0
    moves: int = 0  # transitions so far: a daemon report for an older one is stale
    updated_at: float = 0.0
    deadline: float | None = None
    bringup_deadline: float | None = None
    drain: dict | None = None
    admission: str = "open"
    idle_since: float | None = None
    active_since: float | None = None  # first move to active (server/snapshot.py: history)
    failures_counted: bool = False
    bringup_timeout: bool = False  # restored because it hit its bring-up deadline (blame.py)
    closed_at: float | None = None
    agents: list[str] = field(default_factory=list)
    busy: int = 0
    idle_from: float | None = None  # start of the current no-VM-busy stretch (metrics)
    idle_seconds: float = 0.0
