"""The shared parts of the lease steps (steps.py): ``StepContext``, ``StepResult``, ``Drivers``,
the errors (``StepError``, ``GiveBackRefused``), the MAAS status names, and the pure helpers both
bring-up (bringup.py) and tear-down (teardown.py) use: VM planning, VM-host user data
(re-exported from vmhost_userdata), the VM agent template context, and running a step's effects
in parallel.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from testflinger_magic.agent_host.config import AgentHostConfig, DeviceConfig
from testflinger_magic.agent_host import maas_status as st
from testflinger_magic.agent_host import marks
from testflinger_magic.agent_host.journal import Journal
from testflinger_magic.agent_host.maas import Interrupted
from testflinger_magic.agent_host.vmhost_userdata import vm_host_user_data  # noqa: F401

log = logging.getLogger(__name__)

# MAAS machine status names: one table with MAAS' sources (maas_status.py).
DEPLOYED = st.DEPLOYED
DEPLOYING = st.DEPLOYING
READY = st.READY
NEW = st.NEW
ALLOCATED = st.ALLOCATED
FAILED_DEPLOYMENT = st.FAILED_DEPLOYMENT
DEPLOY_FAIL = st.DEPLOY_FAIL
COMMISSION_FAIL = st.COMMISSION_FAIL
RELEASE_FAIL = st.RELEASE_FAIL
# supervisord process state names (supervisor.states.ProcessStates).
RUNNING_STATES = {"RUNNING", "STARTING"}

DEFAULT_DISK_DIR = "/var/lib/libvirt/images"


class StepError(Exception):
    """A step cannot go on; the message is what the server and operator see."""


class GiveBackRefused(StepError):
    """Restore found the device's hardware not as it was lent (a GPU gone from the bus, or left
    bound to vfio-pci): its agent must not get its queues back. Not retried (``retry``); the
    report asks the server to quarantine the device with this message (``quarantine``)."""

    retry = False
    quarantine = True


class DeviceMisconfigured(StepError):
    """A bring-up step found the device's registration wrong in a way every lend would meet
    again (its ``gpus`` promises more GPUs than the host can lend): the report asks the server
    to quarantine the device with this message (``quarantine``), so no further bare-metal
    deploy is spent on it until a person fixed the agent host's configuration."""

    quarantine = True


@dataclass
class StepResult:
    """What to report: ``to_state`` (None: no transition; unsent intent or ``vms`` then go in a
    "progress" report), message, vms to merge into ``lease.vms`` by ``index``.

    ``facts``: see the field. ``after_report``: a step (``(StepContext) -> StepResult``) the daemon runs at once on the
    lease the server answered, only when it accepted the transition report (never after a 409
    or a failed report); its own result is reported like any step's. A daemon that dies in
    between leaves the work to the next regular step of ``to_state``, so it must be that step
    (or one it also does)."""

    to_state: str | None
    message: str
    vms: list[dict] = field(default_factory=list)
    after_report: object = None
    #: Device facts the step learnt, sent with its ``ok`` report (server/devicefacts.py):
    #: the split's ``{"nvswitches": N}``.
    facts: dict = field(default_factory=dict)


@dataclass
class Drivers:
    """The drivers steps use (interfaces in docs/architecture.md, "Agent-host drivers")."""

    maas: object
    splitter: object
    agents: object
    render_agent_folder: object = None  # (template_dir, dest, context) -> Path
    remove_agent_folder: object = None  # (dest) -> None


@dataclass
class StepContext:
    """Everything a step needs: configuration, drivers, the device, the lease, its journal, and
    ``stop``, the daemon's stop event (set: waits raise ``Interrupted``)."""

    config: AgentHostConfig
    drivers: Drivers
    device: DeviceConfig
    lease: dict
    journal: Journal
    stop: threading.Event = field(default_factory=threading.Event)
    #: ``clock()`` value by which the whole step must be done; default: now + the state's
    #: timeout. Every wait of the step gets only what is left (``remaining``), so a step with
    #: several waits (restore: Deployed, then Ready) cannot take several times its timeout.
    deadline: float | None = None
    clock: object = time.monotonic

    def __post_init__(self):
        if self.deadline is None:
            self.deadline = self.clock() + self.timeout()

    @property
    def lease_id(self) -> str:
        return self.lease["_id"]

    @property
    def spec(self) -> dict:
        return self.lease.get("spec") or {}

    def timeout(self, state: str | None = None) -> float:
        return getattr(self.config.timeouts, state or self.lease["state"])

    def uri(self, ip: str) -> str:
        """The libvirt URI of the deployed device (``libvirt_uri_template``)."""
        return self.config.libvirt_uri_template.format(
            ip=ip, device=self.device.agent_name, system_id=self.device.maas_system_id)

    def power_address(self, ip: str) -> str:
        """The VM machines' virsh ``power_address`` (``maas.power_address_template``): what
        MAAS' rack controller connects to, never the daemon's own URI (MAAS refuses a query
        string; provisioningserver/drivers/power/virsh.py ``VirshSSH.login``)."""
        return self.config.maas.power_address_template.format(
            ip=ip, device=self.device.agent_name, system_id=self.device.maas_system_id)

    def agent_dir(self, name: str) -> Path:
        return Path(self.config.agent_configs_dir) / name

    def remaining(self, what: str) -> float:
        """Seconds left before the step's ``deadline``, for a wait on ``what``.

        Raises ``StepError`` when nothing is left: the step ends by itself with a clear error
        (and the daemon's own handling: bring-up -> restoring, restore -> retried) instead of
        starting a wait it cannot finish.
        """
        left = self.deadline - self.clock()
        if left <= 0:
            state = self.lease.get("state")
            raise StepError(f"{state}: step time limit ({self.timeout():.0f}s, timeouts.{state}) "
                            f"used up before {what}")
        return left

    def wait_maas(self, system_id: str, want: set[str], fail: set[str]):
        """``maas.wait_for`` with what is left of this step's time, the configured poll and
        ``stop``."""
        timeout = self.remaining(f"waiting for MAAS machine {system_id} to be "
                                 f"{'/'.join(sorted(want))}")
        return self.drivers.maas.wait_for(system_id, want, fail, timeout,
                                          self.config.maas_poll, should_stop=self.stop)


# -- pure helpers ----------------------------------------------------------------------------------
def bridge_of(info, configured: str | None) -> str | None:
    """The host bridge for the VMs' NICs: ``configured`` (``config.bridge``) when set, else the
    bridge MAAS made on the boot interface for ``bridge_all`` (``MachineInfo.bridges[0]``,
    e.g. ``br-eth0``: maasserver/models/interface.py ``get_default_bridge_name``), else None."""
    if configured:
        return configured
    bridges = tuple(getattr(info, "bridges", None) or ())
    return bridges[0] if bridges else None


def check_vm_names(lease: dict) -> None:
    """Raise ``StepError`` unless every ``lease.vms[].name`` is ``<device>-vm<N>`` for the
    lease's device (``marks.vm_name_pattern``): the daemon makes, and later removes, only VMs
    named so; a name such as the device's own would aim its folder and program at the device
    agent's."""
    device = lease.get("device") or ""
    foreign = [str(vm.get("name")) for vm in lease.get("vms") or []
               if not marks.is_vm_name(vm.get("name"), device)]
    if foreign:
        raise StepError(f"lease {lease.get('_id')}: VM name(s) {', '.join(foreign)} are not "
                        f"{device}-vm<N>; the daemon makes only VMs named so")


def plan_vms(lease: dict, gpu_count: int, disk_dir: str | None = None) -> list[dict]:
    """Plan the lease's VMs: dicts with VMPlan's fields (but ``bridge``) plus ``index``.

    The server allocates every VM at claim (``leases.claim``: name ``<device>-vm<N>`` from 1,
    a MAC unique across every host sharing the MAAS, a disk path), and only the server can keep
    names and MACs unique, so the daemon never invents them: a lease without ``vms``, or a VM
    without name or MAC, is a ``StepError``. ``disk_dir``: the storage pool directory the disks
    go to (the file name stays the server's); None: the server's path as is. ``firmware``
    (``uefi``/``bios``, default ``uefi``) and ``mmio64_mib`` (None: sized for the GPUs,
    ``splitplan.default_mmio64_mib``) come from the lease spec (the queue's ``vm``). Raises
    ``StepError`` too when the host has too few GPUs for ``spec.gpus_per_vm`` each.
    """
    spec = lease.get("spec") or {}
    per_vm = int(spec.get("gpus_per_vm", 1) or 0)
    vms = lease.get("vms") or []
    if not vms:
        raise StepError(f"lease {lease.get('_id')} has no planned VMs (lease.vms is empty); "
                        "the server allocates them at claim")
    missing = [str(vm.get("index", i)) for i, vm in enumerate(vms)
               if not (vm.get("name") and vm.get("mac"))]
    if missing:
        raise StepError(f"lease {lease.get('_id')}: VM(s) at index {', '.join(missing)} lack the "
                        "name or MAC the server allocates at claim")
    check_vm_names(lease)
    if per_vm * len(vms) > gpu_count:
        raise StepError(f"{len(vms)} VM(s) x {per_vm} GPU(s) need {per_vm * len(vms)} GPUs; "
                        f"the device has {gpu_count} free")
    mmio = spec.get("mmio64_mib")
    plans = []
    for i, vm in enumerate(vms):
        name = vm["name"]
        disk = vm.get("disk") or f"{DEFAULT_DISK_DIR}/{name}.qcow2"
        if disk_dir:
            disk = f"{disk_dir.rstrip('/')}/{disk.rsplit('/', 1)[-1]}"
        plans.append({
            "index": vm.get("index", i), "name": name, "mac": vm["mac"],
            "vcpus": int(spec.get("vcpus", 2)), "memory_mib": int(spec.get("memory_mib", 4096)),
            "disk_gib": int(spec.get("disk_gib", 20)), "disk_path": disk, "gpu_count": per_vm,
            "firmware": spec.get("firmware") or "uefi",
            "mmio64_mib": int(mmio) if mmio is not None else None,
        })
    return plans


def agent_context(config: AgentHostConfig, lease: dict, vm: dict, system_id: str, ip: str,
                  port: int) -> dict:
    """Values for the VM agent template (agent_configs/<template>/*.j2).

    ``agent_id`` is the VM name: tf-cmd-scripts find ``default.yaml`` under ``$agent_id``
    (TESTFLINGER.md §6.5); ``node_id``/``device_ip``/``maas_user`` are maas2's keys (§5.3).
    """
    spec = lease.get("spec") or {}
    return {
        "agent_id": vm["name"], "agent_name": vm["name"], "node_id": system_id,
        "maas_system_id": system_id, "device_ip": ip, "maas_user": config.maas_user,
        "queue": lease["queue"], "job_queues": [lease["queue"]],
        "server_address": config.server_url, "provision_type": spec.get("provision_type", "maas2"),
        "series": spec.get("series", "jammy"), "lease_id": lease["_id"], "device": lease["device"],
        "metrics_port": port, "gpus": vm.get("gpus", []),
        "agent_dir": str(Path(config.agent_configs_dir) / vm["name"]),
        "queue_description": spec.get("description") or f"testflinger-magic queue {lease['queue']}",
        "polling_interval": config.agent_polling_interval,
        "base_dir": config.agent_base_dir or config.agent_configs_dir,
    }


def _parallel(fn, items: list, workers: int = 8) -> list:
    """``[fn(x) for x in items]`` on a thread pool; the first error is raised after all end."""
    if len(items) <= 1:
        return [fn(x) for x in items]
    with ThreadPoolExecutor(max_workers=min(workers, len(items))) as pool:
        futures = [pool.submit(fn, x) for x in items]
        errors = [f.exception() for f in futures if f.exception() is not None]
        if errors:
            # A real failure outranks an interruption: it must be reported.
            errors.sort(key=lambda e: isinstance(e, Interrupted))
            raise errors[0]
        return [f.result() for f in futures]


def _ip_of(info) -> str:
    ips = list(getattr(info, "ip_addresses", None) or [])
    return ips[0] if ips else ""
