"""What the embedded lab looks like (:class:`LabOptions`) and the magic queues it serves: the
example definitions with a policy shortened so a cycle fits in about a minute
(:func:`lab_definitions`, said by :func:`policy_summary` in ``lab up``'s banner). Split from
lab.py (pure move); lab.py re-exports these names."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from .. import queues as queuesmod

REPO_ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = REPO_ROOT / "examples"


@dataclasses.dataclass
class LabOptions:
    """What the lab looks like.

    ``devices``: number of bare-metal GPU devices; ``gpus``: passthrough GPUs per device;
    ``home_queue``: the devices' own queue; ``queues_file``: operator YAML of magic queues;
    ``time_scale``: factor applied to MAAS delays (0.01 = a 600 s deploy takes 6 s);
    ``phase_seconds``: how long a simulated agent spends in each job phase;
    ``idle_timeout``/``owner_wait``/``grace``: policy overrides (seconds) so the cycle fits a demo;
    ``tick_seconds``: reconcile period of the plugin; ``newer_testflinger``: the job service and
    the simulated agents behave as Testflinger after fe381ff (testflinger#1253/#1291/#1304:
    ``jobservice.create_app(newer=True)``, ``SIM_AGENT_NEWER=1``); ``maas_version``: the
    version the MAAS simulator is ("2.9.2": below 3.0 it has no node devices API;
    None: its own, maas_sim.MAAS_VERSION); ``uncommissioned``: MAAS holds no node device for
    the lab's machines (it lists none), as for machines its commissioning never recorded.
    Both rehearse the NVSwitch paths where MAAS cannot give the count (operator guide).
    """

    workdir: Path
    devices: int = 2
    gpus: int = 8
    home_queue: str = "gpu-hosts"
    queues_file: Path = EXAMPLES / "magic-queues.yaml"
    time_scale: float = 0.01
    phase_seconds: float = 1.0
    idle_timeout: float | None = 8.0
    owner_wait: float | None = 60.0
    grace: float | None = 15.0
    max_starting: int | None = 2
    tick_seconds: float = 1.0
    #: Seconds a magic queue no registered device can serve keeps its waiting jobs before they
    #: are cancelled (the engine's ``unservable_grace``; a real server's is 10 minutes).
    unservable_grace: float = 60.0
    polling_interval: int = 1
    newer_testflinger: bool = False
    maas_version: str | None = None
    uncommissioned: bool = False
    #: agent-host.yaml settings overriding the lab's (e.g. ``{"workers": 8}``; benchmarks)
    daemon_overrides: dict = dataclasses.field(default_factory=dict)

    def device_names(self) -> list[str]:
        return [f"gpu-host-{i:02d}" for i in range(1, self.devices + 1)]


def lab_definitions(opt: LabOptions) -> list:
    """The magic queues of ``opt.queues_file`` with the lab's shortened policy applied.

    The example policy is for a real lab (idle for minutes, bring-up in tens of minutes); the
    overrides of ``opt`` (seconds) make a whole cycle fit in about a minute, and
    ``provision_timeout`` shrinks with ``time_scale`` (never under 60 s). Raises
    ``queues.DefinitionError`` for a bad file.
    """
    definitions = queuesmod.load_file(opt.queues_file)
    for q in definitions:
        pol = q.policy
        pol.notify = []  # the lab never calls out of this machine
        if opt.idle_timeout is not None:
            pol.idle_timeout = opt.idle_timeout
        if opt.owner_wait is not None and pol.reclaim is not None:
            pol.reclaim.owner_wait = opt.owner_wait
        if opt.grace is not None and pol.reclaim is not None:
            pol.reclaim.grace = opt.grace
        if opt.max_starting is not None:
            pol.max_starting = min(opt.max_starting, pol.max_devices)
        # Bring-up in the lab takes seconds; keep the deadline proportionate but generous.
        pol.provision_timeout = max(60.0, pol.provision_timeout * opt.time_scale * 4)
        # VM disks are not clamped: the lab's agent-host assumes LAB_POOL_GIB for its test
        # driver pools, so a file applied with `testflinger-magic apply` splits the same.
    return definitions


def policy_summary(definitions: list) -> str:
    """One line per queue: the policy values the lab shortens, e.g.
    ``one-gpu-vm: idle_timeout 8s, max_starting 2, reclaim owner_wait 1m grace 15s,
    provision_timeout 1m``."""
    from ..durations import format_duration

    lines = []
    for q in definitions:
        pol = q.policy
        parts = [f"idle_timeout {format_duration(pol.idle_timeout)}", f"max_starting {pol.max_starting}"]
        if pol.reclaim is not None:
            parts.append(f"reclaim owner_wait {format_duration(pol.reclaim.owner_wait)} "
                         f"grace {format_duration(pol.reclaim.grace)}")
        parts.append(f"provision_timeout {format_duration(pol.provision_timeout)}")
        parts.append(f"disk {q.vm.disk_gib} GiB")
        lines.append(f"{q.name}: " + ", ".join(parts))
    return "; ".join(lines)
