"""Bring-up and tear-down steps of one lease, one function per lease state.

``STEPS[state](ctx) -> StepResult`` does the work the daemon owes a lease in ``state``
(docs/architecture.md, "States"): ``claimed`` fences, ``fenced`` deploys, ``deploying`` waits for
Deployed, ``splitting`` splits, ``enrolling`` enrols the VMs and adds their agent programs
(not started), ``active`` starts them, and re-creates VM agent folders and programs a charm
wiped, ``restoring`` tears everything down.

A step's result may name a step to run at once after its report was accepted
(``StepResult.after_report``): the enroll step's is ``check_active``, so the VM agents start
only once the server has moved the lease to ``active`` and lifted their fences, and their first
job poll can take a job.

Rules every step keeps:
- it looks at what exists before acting, so running it twice (after a crash) is harmless;
- each external effect is journaled ``begin`` before / ``done`` after (journal.Journal.effect);
- tear-down finds what to undo by DISCOVERY (programs, folders, MAAS hostnames and libvirt domains
  named ``<device>-vm<N>``/carrying the lease id) as well as from the journal and the lease, so a
  SIGKILL between an effect and its journal line orphans nothing;
- errors are raised (``StepError`` or a driver error); the daemon reports them;
- every wait watches ``ctx.stop``: once the daemon is stopping it raises ``Interrupted``, which
  is not an error (the next daemon start runs the step again from the server's state).
"""

from __future__ import annotations

import logging
import shutil
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from testflinger_magic.agent_host.config import AgentHostConfig, DeviceConfig
from testflinger_magic.agent_host import maas_status as st
from testflinger_magic.agent_host import marks
from testflinger_magic.agent_host.journal import Journal
from testflinger_magic.agent_host.maas import Interrupted  # noqa: F401 - steps.Interrupted
from testflinger_magic.agent_host.maas import MaasError, MaasNotFound
from testflinger_magic.agent_host.marks import vm_name_pattern  # noqa: F401 - steps API
from testflinger_magic.agent_host.release import release_to_ready

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


@dataclass
class StepResult:
    """What to report: ``to_state`` (None: no transition; unsent intent or ``vms`` then go in a
    "progress" report), message, vms to merge into ``lease.vms`` by ``index``.

    ``after_report``: a step (``(StepContext) -> StepResult``) the daemon runs at once on the
    lease the server answered, only when it accepted the transition report (never after a 409
    or a failed report); its own result is reported like any step's. A daemon that dies in
    between leaves the work to the next regular step of ``to_state``, so it must be that step
    (or one it also does)."""

    to_state: str | None
    message: str
    vms: list[dict] = field(default_factory=list)
    after_report: object = None


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
def vm_host_user_data(ssh_public_key: str | None, rack_public_keys=()) -> str:
    """cloud-init user data that turns a freshly deployed device into a libvirt VM host.

    Installs KVM/libvirt and OVMF, turns on the IOMMU for passthrough (``intel_iommu=on
    iommu=pt``; ``amd_iommu`` is on by default), authorizes for ``qemu+ssh`` the daemon's key
    and the MAAS rack controllers' keys (MAAS powers the VMs from its rack with ``virsh``:
    provisioningserver/drivers/power/virsh.py), adds ``ubuntu`` to the libvirt and kvm groups,
    and reboots once so the kernel options take effect.

    The network is MAAS': the device is deployed with ``bridge_all``, so MAAS renders a bridge
    (``br-<ifname>``) carrying the boot interface's address in the deployed netplan; nothing here
    rewrites netplan.
    """
    keys = [k for k in [ssh_public_key, *rack_public_keys] if k]
    key_lines = "".join(f"  - {k}\n" for k in keys)
    keys_block = f"ssh_authorized_keys:\n{key_lines}" if keys else ""
    return f"""#cloud-config
package_update: true
packages: [qemu-kvm, libvirt-daemon-system, libvirt-clients, ovmf]
{keys_block}write_files:
  - path: /etc/default/grub.d/90-testflinger-magic.cfg
    content: |
      GRUB_CMDLINE_LINUX_DEFAULT="$GRUB_CMDLINE_LINUX_DEFAULT intel_iommu=on iommu=pt"
runcmd:
  - usermod -aG libvirt,kvm ubuntu
  - update-grub
power_state:
  mode: reboot
  condition: true
"""


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


# -- bring-up --------------------------------------------------------------------------------------
def fence(ctx: StepContext) -> StepResult:
    """claimed -> fenced: stop the device's testflinger-agent program (supervisord).

    The server already fenced the agent (no job is handed to it); stopping the process keeps it
    from touching the machine while it is lent.
    """
    program = ctx.device.supervisor_program
    agents = ctx.drivers.agents
    if agents.state(program) in ("STOPPED", "EXITED", "FATAL"):
        return StepResult("fenced", f"device agent program {program} already stopped")
    with ctx.journal.effect("agent.stop", program):
        agents.stop(program)
    return StepResult("fenced", f"stopped device agent program {program}")


def deploy(ctx: StepContext) -> StepResult:
    """fenced -> deploying: MAAS-deploy the device as a VM host (``vm_host_user_data``).

    Already Deploying/Deployed by us (journal says so): nothing to do. Deployed by someone else
    (a home job left it so): release first, since its OS has no libvirt.
    """
    maas, sid = ctx.drivers.maas, ctx.device.maas_system_id
    info = maas.machine(sid)
    ours = "maas.deploy" in {e["action"] for e in ctx.journal.entries()}
    if info.status in (DEPLOYING, DEPLOYED) and ours:
        _record_bridge(ctx, info)
        return StepResult("deploying", f"MAAS machine {sid} already {info.status}")
    if info.status in (DEPLOYING, DEPLOYED, FAILED_DEPLOYMENT, ALLOCATED,
                       st.FAILED_RELEASING, st.FAILED_DISK_ERASING):
        # Allocated too: MAAS makes bridge_all's bridges at allocation, so allocate afresh.
        # Never Broken: an operator's mark; deploy refuses it with MAAS' conflict.
        release_to_ready(ctx, sid, info.status)
    series = ctx.spec.get("series") or "jammy"
    user_data = vm_host_user_data(ctx.config.ssh_public_key, ctx.config.maas.rack_public_keys)
    with ctx.journal.effect("maas.deploy", sid, {"series": series, "bridge_all": True}):
        info = maas.deploy(sid, series, user_data=user_data, bridge_all=True)
    bridge = _record_bridge(ctx, info)
    return StepResult("deploying", f"MAAS deploy of {sid} ({series}) started"
                      + (f", VM bridge {bridge}" if bridge else ""))


def _record_bridge(ctx: StepContext, info) -> str | None:
    """Keep the VMs' bridge (``bridge_of``) as the journal fact ``bridge``; returns it."""
    bridge = bridge_of(info, ctx.config.bridge)
    if bridge and ctx.journal.fact("bridge") != bridge:
        ctx.journal.set_fact("bridge", bridge)
    return bridge


def wait_deployed(ctx: StepContext) -> StepResult:
    """deploying -> splitting: wait for MAAS Deployed, remember the device IP, then wait until
    the host can run passthrough VMs (``_wait_host_ready``).

    MAAS says Deployed when cloud-init asks for its user data (canonical/maas
    ``src/metadataserver/api.py``), before the packages of ``vm_host_user_data`` install and
    before the reboot it asks for; so Deployed alone proves nothing about libvirt, the IOMMU,
    VFIO, OVMF or the bridge. Both waits share the step's deadline (``timeouts.deploying``).
    """
    sid = ctx.device.maas_system_id
    info = ctx.wait_maas(sid, {DEPLOYED}, DEPLOY_FAIL | {READY})
    ip = _ip_of(info)
    if not ip:
        raise StepError(f"MAAS machine {sid} is Deployed but has no IP address")
    ctx.journal.set_fact("device_ip", ip)
    uri = ctx.uri(ip)
    _wait_host_ready(ctx, uri)
    return StepResult("splitting", f"{sid} deployed at {ip}; {uri} ready for passthrough VMs")


def _vm_bridge(ctx: StepContext) -> str | None:
    """The bridge the VMs' NICs join: the one MAAS rendered at deploy (journal fact
    ``bridge``), else the configured ``bridge`` (None: the configured libvirt network)."""
    return ctx.journal.fact("bridge") or ctx.config.bridge


def _wait_host_ready(ctx: StepContext, uri: str) -> None:
    """Poll ``splitter.host_problems(uri, bridge, firmware)`` every ``maas_poll`` seconds until
    it lists nothing, within what is left of the step's deadline. Splitters without
    ``host_problems`` (a lab's script) are taken as ready. Raises ``StepError`` with the last
    problems when time runs out, ``Interrupted`` once the daemon stops."""
    check = getattr(ctx.drivers.splitter, "host_problems", None)
    if check is None:
        return
    bridge = _vm_bridge(ctx)
    firmware = ctx.spec.get("firmware") or "uefi"
    problems: list[str] = []
    while True:
        if ctx.stop.is_set():
            raise Interrupted(f"stopped while waiting for {uri} to be ready")
        problems = check(uri, bridge, firmware)
        if not problems:
            return
        left = ctx.deadline - ctx.clock()
        if left <= ctx.config.maas_poll:
            raise StepError(f"{uri} is not ready for passthrough VMs within "
                            f"timeouts.{ctx.lease.get('state')}:\n" + "\n".join(problems))
        log.info("%s: %s not ready yet: %s", ctx.lease_id, uri, "; ".join(problems))
        ctx.stop.wait(ctx.config.maas_poll)


def _device_ip(ctx: StepContext) -> str:
    ip = ctx.journal.fact("device_ip")
    if ip:
        return ip
    info = ctx.drivers.maas.machine(ctx.device.maas_system_id)
    ip = _ip_of(info)
    if not ip:
        raise StepError(f"device {ctx.device.agent_name}: MAAS gives no IP ({info.status})")
    ctx.journal.set_fact("device_ip", ip)
    return ip


def _make_plan(p: dict, bridge: str | None = None):
    """``splitplan.VMPlan`` of a ``plan_vms`` dict, its NIC on ``bridge``."""
    from testflinger_magic.agent_host.splitplan import VMPlan

    return VMPlan(name=p["name"], mac=p["mac"], vcpus=p["vcpus"], memory_mib=p["memory_mib"],
                  disk_gib=p["disk_gib"], disk_path=p["disk_path"], gpu_count=p["gpu_count"],
                  bridge=bridge, firmware=p.get("firmware") or "uefi",
                  mmio64_mib=p.get("mmio64_mib"))


def _retry(fn, timeout: float, pause: float, what: str, stop: threading.Event | None = None):
    """Call ``fn`` until it returns or ``timeout`` seconds pass (the host may be rebooting);
    raises ``StepError`` with the last error, or ``Interrupted`` once ``stop`` is set."""
    stop = stop or threading.Event()
    end = time.monotonic() + timeout
    while True:
        if stop.is_set():
            raise Interrupted(f"stopped while retrying {what}")
        try:
            return fn()
        except Interrupted:
            raise
        except Exception as exc:  # noqa: BLE001 - drivers raise their own types
            if time.monotonic() + pause > end:
                raise StepError(f"{what}: {exc}") from exc
            log.info("%s failed (%s); retrying in %.0fs", what, exc, pause)
            stop.wait(pause)


def split(ctx: StepContext) -> StepResult:
    """splitting -> enrolling: wait until the host is ready (a daemon restarted here may find it
    rebooting), discover GPUs over libvirt, define one domain per VM on the VM bridge (MAAS's,
    journal fact ``bridge``, else the configured one). The domains stay shut off: MAAS powers
    them on to commission them at enrolment."""
    uri = ctx.uri(_device_ip(ctx))
    splitter = ctx.drivers.splitter
    _wait_host_ready(ctx, uri)
    gpus = _retry(lambda: splitter.discover(uri), ctx.remaining(f"GPU discovery on {uri}"),
                  ctx.config.maas_poll, f"GPU discovery on {uri}", ctx.stop)
    ctx.journal.set_fact("device_gpus", [g.address for g in gpus])
    # Their drivers before passthrough: give-back checks none is left on vfio-pci (verify_gpus_back).
    ctx.journal.set_fact("gpu_drivers", {g.address: g.driver for g in gpus})
    disk_dir = ctx.config.splitter.pool_path if ctx.config.splitter.kind == "libvirt" else None
    plans = plan_vms(ctx.lease, len(gpus), disk_dir)
    names = [p["name"] for p in plans]
    bridge = _vm_bridge(ctx)
    # ``macs``: what the daemon puts in each domain, its proof of the VM's MAAS machine at
    # restore (marks.journal_macs).
    with ctx.journal.effect("libvirt.split", ctx.lease_id,
                            {"uri": uri, "names": names, "bridge": bridge,
                             "macs": {p["name"]: p["mac"].lower() for p in plans}}) as rec:
        results = splitter.split(uri, ctx.lease_id, [_make_plan(p, bridge) for p in plans])
        rec["domains"] = [r.domain for r in results]
    by_name = {r.name: r for r in results}
    vms = []
    for p in plans:
        r = by_name.get(p["name"])
        if r is None:
            raise StepError(f"splitter returned no VM named {p['name']}")
        vms.append({"index": p["index"], "name": p["name"], "agent_name": p["name"],
                    "domain": r.domain, "mac": r.mac, "gpus": list(r.gpus), "disk": r.disk})
    return StepResult("enrolling", f"{len(vms)} domain(s) defined on {uri} (shut off until MAAS "
                      f"powers them on): {', '.join(v['domain'] for v in vms)}", vms)


def _template_dir(ctx: StepContext) -> Path:
    return Path(ctx.config.agent_templates_dir) / (ctx.spec.get("template") or "maas2-vm")


def _is_our_machine(ctx: StepContext, sid: str | None, name: str, mac: str):
    """MAAS machine ``sid`` (a bare id, e.g. the lease's ``maas_system_id``) as
    ``MachineInfo`` when it is the VM ``name`` with the MAC the daemon put in its domain
    (``mac``), else None: a server-given id alone never makes a machine ours."""
    if not sid:
        return None
    try:
        info = ctx.drivers.maas.machine(sid)
    except MaasNotFound:
        return None
    if info.hostname == name and mac.lower() in {m.lower() for m in info.macs}:
        return info
    log.warning("%s: MAAS machine %s (%s, MAC(s) %s) is not VM %s with MAC %s; the lease's id "
                "for it is ignored", ctx.lease_id, sid, info.hostname,
                ", ".join(info.macs) or "none", name, mac)
    return None


def _our_vm_machine(ctx: StepContext, name: str, mac: str, hint: str | None = None) -> str | None:
    """system_id of the MAAS machine named ``name`` carrying this VM's ``mac``, else None.

    ``hint``: the lease's ``maas_system_id`` for the VM, used only if that machine passes the
    same check (``_is_our_machine``). A hostname alone does not make a machine ours: an earlier
    lease of the device (or a person) may have left ``<device>-vmN`` with another MAC, whose power
    parameters point at another domain, and its address would become our agent's ``device_ip``.
    Such a machine is deleted (journaled ``maas.delete``) only when its description carries our
    mark for this VM name (``marks.maas_mark``: an earlier lease of ours made it; the device has
    one open lease, this one); one without the mark is a person's and is left alone:
    ``StepError`` naming it. Idempotent: after a crash either the stale one is still there
    (deleted again) or it is gone (None).
    """
    if _is_our_machine(ctx, hint, name, mac) is not None:
        return hint
    maas = ctx.drivers.maas
    found = maas.find_by_hostname(name)
    if not found:
        return None
    info = maas.machine(found)
    if mac.lower() in {m.lower() for m in info.macs}:
        return found
    mark = marks.parse_maas_mark(info.description)
    if not mark or mark["vm"] != name:
        raise StepError(f"MAAS machine {name} ({found}) holds VM {name}'s hostname with MAC(s) "
                        f"{', '.join(info.macs) or 'none'}, not this lease's {mac}, and carries "
                        f"no {marks.MAAS_MARK} mark: the daemon did not make it and leaves it "
                        "alone; rename or delete it in MAAS")
    log.warning("%s: MAAS machine %s (%s) of lease %s has MAC(s) %s, not this lease's %s: "
                "deleting the stale machine", ctx.lease_id, name, found, mark["lease"],
                ", ".join(info.macs) or "none", mac)
    with ctx.journal.effect("maas.delete", name, {"system_id": found, "stale_macs": list(info.macs),
                                                  "want_mac": mac, "mark": mark}):
        maas.delete(found)
    return None


def _check_domain(ctx: StepContext, vm: dict, uri_of) -> None:
    """Raise ``StepError`` unless the lease's ``vm["domain"]`` is a domain the daemon defined
    for this lease: one its ``libvirt.split`` journal record lists, else one carrying this
    lease's metadata on the host (``splitter.domains``; ``uri_of()`` gives the host's URI).
    MAAS powers the VM's machine through it: a server-given name could be another VM's."""
    recorded = set()
    for e in ctx.journal.entries():
        if e["action"] == "libvirt.split" and e["phase"] == "done":
            recorded.update(e["data"].get("domains") or [])
    if vm["domain"] in recorded:
        return
    if vm["domain"] in set(ctx.drivers.splitter.domains(uri_of(), ctx.lease_id)):
        return
    raise StepError(f"VM {vm['name']}: domain {vm['domain']!r} of the lease is not one the daemon "
                    f"defined for lease {ctx.lease_id}")


def enroll(ctx: StepContext) -> StepResult:
    """enrolling -> active: per VM (in parallel) create the MAAS machine (power type virsh:
    address = libvirt URI, id = domain), wait Ready, give its boot interface a STATIC address,
    render the agent folder with that ``device_ip``, add its program without starting it.

    The programs are started by ``check_active``, which the daemon runs right after the server
    accepted the ``active`` report (``StepResult.after_report``) and so lifted the VM agents'
    fences: an agent polls for a job right after its startup (TESTFLINGER.md §3.2-3.3), so
    started now it would poll while fenced and take its first job a whole
    ``polling_interval`` later. ``check_active`` (``agents.ensure``) watches the started
    programs and moves one whose metrics port was taken, reporting the new port in a progress
    report. A daemon that dies before starting them: its next ``active`` check does.

    VMs are not deployed here: the maas2 connector releases and deploys the VM for every job and
    requires ``device_ip`` among the machine's ``ip_addresses`` (TESTFLINGER.md §5.3-5.4). An
    AUTO address exists only while deployed and may change at the next deploy; a STATIC link
    keeps its address (MAAS API, ``link_subnet``), so the VM stays Ready with a stable IP.
    """
    power_address = ctx.power_address(_device_ip(ctx))
    power_pass = ctx.config.maas.power_pass
    power_pass = power_pass.get_secret_value() if power_pass is not None else None
    maas, agents = ctx.drivers.maas, ctx.drivers.agents
    vms = [dict(vm) for vm in ctx.lease.get("vms") or []]
    if not vms or not all(vm.get("domain") for vm in vms):
        raise StepError("lease has no split VMs to enrol (vms[].domain missing)")
    check_vm_names(ctx.lease)
    for vm in vms:
        _check_domain(ctx, vm, lambda: ctx.uri(_device_ip(ctx)))
    # Ports are chosen one by one (allocate_port excludes what is already taken on the host).
    taken: list[int] = []
    for vm in vms:
        done = ctx.journal.last_data("agent.add", vm["name"]) or {}
        port = vm.get("metrics_port") or done.get("port")
        if not port:
            port = agents.allocate_port(exclude=tuple(taken), owner=vm["name"])
        vm["metrics_port"] = int(port)
        taken.append(int(port))
    template_dir = _template_dir(ctx)

    def one(vm: dict) -> dict:
        name = vm["name"]
        sid = _our_vm_machine(ctx, name, vm["mac"], hint=vm.get("maas_system_id"))
        if not sid:
            mark = marks.maas_mark(ctx.lease_id, name, ctx.config.agent_host)
            with ctx.journal.effect("maas.create", name,
                                    {"mac": vm["mac"].lower(), "domain": vm["domain"],
                                     "power_address": power_address, "mark": mark}) as rec:
                sid = maas.create_vm_machine(name, vm["mac"], power_address, vm["domain"],
                                             power_pass=power_pass, description=mark)
                rec["system_id"] = sid
        # Past Ready only if a VM agent already took a job (started by a daemon version that
        # started agents here; the connector redeploys the VM): its STATIC link survives that.
        _wait_commissioned(ctx, sid, name)
        with ctx.journal.effect("maas.static_ip", name, {"system_id": sid}) as rec:
            ip = maas.assign_static_ip(sid)
            rec["ip"] = ip
        context = agent_context(ctx.config, ctx.lease, vm, sid, ip, vm["metrics_port"])
        dest = ctx.agent_dir(name)
        with ctx.journal.effect("agent.folder", name, {"dir": str(dest)}):
            ctx.drivers.render_agent_folder(template_dir, dest, context)
        with ctx.journal.effect("agent.add", name,
                                {"port": vm["metrics_port"], "dir": str(dest)}) as rec:
            # Added, not started (the file says autostart=false): check_active starts it once
            # the lease is active, and moves it if its port was taken meanwhile.
            agents.add_vm_agent(name, str(dest), vm["metrics_port"], start=False)
            rec["port"] = vm["metrics_port"]
        return {"index": vm["index"], "maas_system_id": sid, "ip": ip,
                "metrics_port": vm["metrics_port"], "domain": vm["domain"],
                "gpus": vm.get("gpus", [])}

    updates = _parallel(one, vms)
    return StepResult("active", f"{len(updates)} VM agent(s) enrolled: "
                      f"{', '.join(v['name'] for v in vms)}", updates,
                      after_report=check_active)


def _wait_commissioned(ctx: StepContext, sid: str, name: str) -> None:
    """Wait for a created VM machine to be commissioned (Ready, or past it).

    New is a failure: MAAS created it Commissioning, and puts it back in New when it cannot
    power the domain on (maasserver/models/node.py ``Node._start`` -> errback
    ``_start_bmc_unavailable``: "Aborting COMMISSIONING and reverting to NEW"). The power
    driver's own error (e.g. virsh's "Failed to login to virsh console.") is in the machine's
    events, so the ``StepError`` quotes them rather than waiting out the step's time."""
    try:
        ctx.wait_maas(sid, {READY, ALLOCATED, DEPLOYING, DEPLOYED}, COMMISSION_FAIL | {NEW})
    except MaasError as e:
        if e.status != NEW:
            raise
        try:
            errors = [f"{ev.get('type')}: {ev.get('description')}"
                      for ev in ctx.drivers.maas.events(sid, limit=5, level="ERROR")]
        except MaasError as ev_err:  # the events are a detail: keep the main error
            errors = [f"(events unavailable: {ev_err})"]
        raise StepError(
            f"MAAS could not power VM {name} ({sid}) on to commission it and put it back in "
            f"New: {e.status_message or 'no status message'}"
            + (f"; power errors: {'; '.join(errors)}" if errors else "")
            + f". MAAS' rack controller powers VMs with virsh at "
              f"{ctx.power_address(_device_ip(ctx))}: authorize its SSH key on the host "
              "(maas.rack_public_keys) or give maas.power_pass_file") from e


def check_active(ctx: StepContext) -> StepResult:
    """active: start the VM agent programs enroll added (right after the ``active`` report,
    ``StepResult.after_report``, or at the next check if the daemon died first), and restore
    what a charm's config-changed wiped (TESTFLINGER.md §6.1, §6.4): it replaces the whole
    agent-configs tree (our VM folders go) and deletes every conf.d file (our programs go).

    Missing folders are re-rendered from the lease's vms (same context as at enrolment), then
    ``agents.ensure`` re-creates the programs. If ensure had to move a metrics port (another
    program took it), the new port is reported in ``vms`` (the server merges it).
    """
    agents = ctx.drivers.agents
    check_vm_names(ctx.lease)
    vms = [vm for vm in ctx.lease.get("vms") or [] if vm.get("metrics_port")]
    rendered = []
    for vm in vms:
        dest = ctx.agent_dir(vm["name"])
        if (dest / "testflinger-agent.conf").exists():
            continue
        if not (vm.get("maas_system_id") and vm.get("ip")):
            raise StepError(f"VM {vm['name']}: agent folder {dest} is gone and the lease lacks "
                            "maas_system_id/ip to render it again")
        # The folder points an agent at a MAAS machine it deploys and releases: only the one
        # the daemon enrolled (name, MAC, address), never a bare id or address from the lease.
        info = _is_our_machine(ctx, vm["maas_system_id"], vm["name"], vm.get("mac") or "")
        if info is None or vm["ip"] not in info.ip_addresses:
            raise StepError(f"VM {vm['name']}: the lease's MAAS machine {vm['maas_system_id']} / "
                            f"address {vm['ip']} is not the machine the daemon enrolled for it; "
                            "not rendering its agent folder")
        context = agent_context(ctx.config, ctx.lease, vm, vm["maas_system_id"], vm["ip"],
                                int(vm["metrics_port"]))
        with ctx.journal.effect("agent.folder", vm["name"], {"dir": str(dest)}):
            ctx.drivers.render_agent_folder(_template_dir(ctx), dest, context)
        rendered.append(vm["name"])
    expected = {vm["name"]: (str(ctx.agent_dir(vm["name"])), int(vm["metrics_port"]))
                for vm in vms}
    restored = agents.ensure(expected) if expected else []
    ports = agents.ports() if restored else {}
    moved = [{"index": vm["index"], "metrics_port": ports[vm["name"]]} for vm in vms
             if vm["name"] in ports and ports[vm["name"]] != int(vm["metrics_port"])]
    message = (f"{len(expected)} VM agent(s) checked; folders re-rendered: "
               f"{', '.join(rendered) or 'none'}; programs restored: "
               f"{', '.join(restored) or 'none'}")
    # No transition: the daemon sends ``moved`` in a "progress" report, which merges vms.
    return StepResult(None, message + (f"; metrics ports moved: {moved}" if moved else ""), moved)


# -- tear-down -------------------------------------------------------------------------------------
def discover_vm_names(ctx: StepContext) -> list[str]:
    """Every VM name this lease may have left anywhere: lease, journal, programs, folders;
    only ``<device>-vm<N>`` names (``marks.vm_name_pattern``): any other name in the lease is
    not one the daemon gives, so nothing of it is removed (a warning names it)."""
    pattern = vm_name_pattern(ctx.device.agent_name)
    names = set()
    for vm in ctx.lease.get("vms") or []:
        if pattern.match(str(vm.get("name") or "")):
            names.add(vm["name"])
        elif vm.get("name"):
            log.warning("%s: the lease names a VM %r, not %s-vm<N>: nothing of it is removed",
                        ctx.lease_id, vm["name"], ctx.device.agent_name)
    for e in ctx.journal.entries():
        if pattern.match(e["target"]):
            names.add(e["target"])
        names.update(n for n in e["data"].get("names", []) if isinstance(n, str))
    names.update(p for p in ctx.drivers.agents.programs(prefix=f"{ctx.device.agent_name}-vm")
                 if pattern.match(p))
    root = Path(ctx.config.agent_configs_dir)
    if root.is_dir():
        names.update(p.name for p in root.iterdir() if pattern.match(p.name))
    return sorted(names)


def _remove_folder(ctx: StepContext, dest: Path) -> None:
    if ctx.drivers.remove_agent_folder is not None:
        ctx.drivers.remove_agent_folder(dest)
    else:
        shutil.rmtree(dest, ignore_errors=True)


def gpus_back_problems(registered: int, lent: list[str], drivers_before: dict,
                       now: list) -> list[str]:
    """Why the GPUs ``now`` on the host (``splitplan.GPU`` list from discovery after the
    domains are gone) are not those the device was lent with; empty when all came back.

    ``registered``: the device's GPU count (agent-host.yaml ``gpus``); ``lent``: the addresses
    discovery found at split (journal fact ``device_gpus``); ``drivers_before``: their drivers
    then (fact ``gpu_drivers``). libvirt gives a managed hostdev back to its host driver when
    the domain is destroyed (``virHostdevReAttachPCIDevices``, libvirt
    ``src/hypervisor/virhostdev.c``); a GPU that fell off the bus (NVIDIA Xid 79) no longer
    enumerates, and one whose re-attach failed stays on ``vfio-pci``. A driver libvirt does
    not report (None) is not judged."""
    present = {g.address: g for g in now}
    problems = []
    missing = sorted(set(lent) - set(present))
    if missing:
        problems.append(f"GPU(s) {', '.join(missing)} no longer enumerate on the host")
    if len(present) < registered:
        problems.append(f"{len(present)} GPU(s) enumerate, the device is registered with "
                        f"{registered}")
    stuck = sorted(a for a, g in present.items() if g.driver == "vfio-pci"
                   and (drivers_before or {}).get(a) not in (None, "vfio-pci"))
    if stuck:
        problems.append(f"GPU(s) {', '.join(stuck)} still bound to vfio-pci (were "
                        f"{', '.join(sorted({drivers_before[a] for a in stuck}))})")
    return problems


def verify_gpus_back(ctx: StepContext, uri: str) -> None:
    """Raise :class:`GiveBackRefused` when the device's GPUs are not back as they were lent
    (:func:`gpus_back_problems`): before its agent gets its queues back (issue: verified
    give-back)."""
    lent = ctx.journal.fact("device_gpus")
    if lent is None:
        return  # never split (bring-up ended before): no GPU was handed to a VM
    now = ctx.drivers.splitter.discover(uri)
    problems = gpus_back_problems(ctx.device.gpus, lent, ctx.journal.fact("gpu_drivers") or {},
                                  now)
    if problems:
        raise GiveBackRefused(f"device {ctx.device.agent_name} not given back: "
                              + "; ".join(problems) + f" ({uri}); quarantine it until a person "
                              "has looked (testflinger-magic unquarantine)")


def restore(ctx: StepContext) -> StepResult:
    """restoring -> returned: undo everything, then give the device back to its own agent.

    Order: VM agent programs and folders; the domains and volumes (while the device is still
    deployed and reachable) and a check that every GPU is free; THEN the VMs' MAAS machines;
    then the give-back check (:func:`verify_gpus_back`: every GPU lent enumerates again, none
    left on vfio-pci; else :class:`GiveBackRefused`, the device stays deployed, its agent
    stopped, and the server quarantines it); release the device and wait Ready (recovering a failed release as maas2 does:
    ``release.release_to_ready``); start the device agent program.

    Domains go before their MAAS machines: a VM that reboots after its machine is deleted
    PXE-boots, and MAAS enlists it as a New machine holding its MAC, which the next lease's
    create of that MAC would then find. A device no longer Deployed (released by someone, or
    never deployed by us) has no libvirt: its domains went with it, and only the MAAS machines
    are deleted.

    Its MAAS waits share one budget, ``timeouts.restoring`` (``ctx.deadline``): the daemon never
    times a restore out from the side (reporting an error while this thread still works would
    make the lease ``failed`` at once and refuse this step's late success, leaving the device
    claimed, fenced and its agent running), so the only report comes from here: ``returned``,
    or an error the daemon retries ``RESTORE_ATTEMPTS`` times.
    """
    maas, agents, splitter = ctx.drivers.maas, ctx.drivers.agents, ctx.drivers.splitter
    sid, device = ctx.device.maas_system_id, ctx.device.agent_name
    names = discover_vm_names(ctx)

    def unenrol_agent(name: str) -> None:
        # Always, not only for programs supervisord lists: a crash inside add_vm_agent after
        # its conf.d file was written but before addProcessGroup leaves a file supervisord does
        # not run yet (the next reload would start it) and an owned port reservation (owned
        # ones never lapse). remove_vm_agent tolerates an absent program and file and drops the
        # name's reservations.
        with ctx.journal.effect("agent.remove", name):
            agents.remove_vm_agent(name)
        dest = ctx.agent_dir(name)
        if dest.exists():
            with ctx.journal.effect("agent.rmdir", name, {"dir": str(dest)}):
                _remove_folder(ctx, dest)

    entries = ctx.journal.entries()

    def delete_machines(name: str) -> None:
        # Candidates: the lease's id for the VM (a bare id from the server) and the machine
        # named so; each is deleted only with a proof the daemon made it (marks).
        known = {vm.get("maas_system_id") for vm in ctx.lease.get("vms") or []
                 if vm.get("name") == name and isinstance(vm.get("maas_system_id"), str)}
        found = maas.find_by_hostname(name)
        macs = marks.journal_macs(entries, name)
        for vm_sid in sorted(known | ({found} if found else set())):
            try:
                info = maas.machine(vm_sid)
            except MaasNotFound:
                continue
            proof = marks.maas_machine_proof(info, name, ctx.lease_id, macs)
            if proof is None:
                # Journaled so the server's copy of the intent names it too.
                log.warning("%s: MAAS machine %s (%s, MAC(s) %s) is not VM %s the daemon made "
                            "for this lease: left alone", ctx.lease_id, vm_sid, info.hostname,
                            ", ".join(info.macs) or "none", name)
                ctx.journal.done("maas.keep", name, {
                    "system_id": vm_sid, "hostname": info.hostname,
                    "reason": "no proof the daemon made it (hostname, mark or MAC)"})
                continue
            with ctx.journal.effect("maas.delete", name, {"system_id": vm_sid, "proof": proof}):
                maas.delete(vm_sid)

    _parallel(unenrol_agent, names)

    info = maas.machine(sid)
    if info.status == DEPLOYING:
        info = ctx.wait_maas(sid, {DEPLOYED}, DEPLOY_FAIL | {READY})
    ip = _ip_of(info) or ctx.journal.fact("device_ip")
    # Only a host we deployed runs libvirt; one a home job left Deployed does not.
    ours = any(e["action"] == "maas.deploy" for e in ctx.journal.entries()) or any(
        vm.get("domain") for vm in ctx.lease.get("vms") or [])
    if info.status == DEPLOYED and ip and ours:
        uri = ctx.uri(ip)
        left = set(splitter.domains(uri, ctx.lease_id)) | set(names)
        with ctx.journal.effect("libvirt.restore", ctx.lease_id, {"uri": uri, "names": sorted(left)}):
            splitter.restore(uri, ctx.lease_id, sorted(left))
        still = splitter.domains(uri, ctx.lease_id)
        if still:
            raise StepError(f"domains still defined on {uri} after restore: {', '.join(still)}")
        if not splitter.gpus_free(uri):
            raise StepError(f"GPUs of {device} are not all back on the host ({uri})")

    _parallel(delete_machines, names)
    if info.status == DEPLOYED and ip and ours:
        # Every VM is gone by now; only the device itself is kept from its agent if this fails.
        verify_gpus_back(ctx, ctx.uri(ip))

    if info.status != READY:
        release_to_ready(ctx, sid, info.status)
    program = ctx.device.supervisor_program
    started = any(e["action"] == "agent.start" and e["phase"] == "done"
                  for e in ctx.journal.entries())
    if not started and agents.state(program) in RUNNING_STATES:
        # Never stopped (drained before the fence step ran) or started by someone else: restart
        # it, so it posts its state now; that post is the give-back's sign of life
        # (server/giveback.py), which an agent running since before the claim never sends.
        with ctx.journal.effect("agent.stop", program, {"restart": True}):
            agents.stop(program)
    with ctx.journal.effect("agent.start", program) as rec:
        # Started and watched: one whose metrics port was taken while it was lent is moved to
        # a free port rather than left crash-looping (agents.start_device_agent).
        rec["port"] = agents.start_device_agent(program)
    return StepResult("returned", f"{len(names)} VM(s) removed, {sid} released, "
                      f"device agent {program} started")


#: The step the daemon runs for a lease in each state.
STEPS = {
    "claimed": fence,
    "fenced": deploy,
    "deploying": wait_deployed,
    "splitting": split,
    "enrolling": enroll,
    "active": check_active,
    "restoring": restore,
}
