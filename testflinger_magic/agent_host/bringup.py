"""The bring-up steps of a lease (``claimed`` .. ``active``): fence the device agent, MAAS-deploy
the device as a VM host, wait until it is deployed and ready for passthrough VMs, split it into one
libvirt domain per VM, enrol each VM in MAAS with its agent program, and keep the VM agents of an
``active`` lease running (``check_active``). The rules every step keeps are in steps.py.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from testflinger_magic.agent_host import maas_status as st
from testflinger_magic.agent_host import marks, prewarm
from testflinger_magic.agent_host.agentfolders import AGENT_CONF, check_template_folder
from testflinger_magic.agent_host.agents import AgentProcessError
from testflinger_magic.agent_host.gpucensus import count_mismatch, shortfall, take_census
from testflinger_magic.agent_host.maas import (Interrupted, MaasConflict, MaasError, MaasInvalid,
                                               MaasNotFound)
from testflinger_magic.agent_host.release import release_to_ready
from testflinger_magic.agent_host.stepcontext import (
    ALLOCATED, COMMISSION_FAIL, DEPLOY_FAIL, DEPLOYED, DEPLOYING, FAILED_DEPLOYMENT, NEW, READY,
    DeviceMisconfigured, StepContext, StepError, StepResult, _ip_of, _parallel, agent_context,
    bridge_of, check_vm_names, plan_vms,
)
from testflinger_magic.agent_host.vmhost_userdata import user_data_for

log = logging.getLogger(__name__)


class SeriesNotUsable(StepError):
    """MAAS refused to deploy the device with the queue's ``vm_host_series``: it has no usable
    images of that series (MAAS answers HTTP 400 with a ``distro_series`` error,
    maasserver/api/machines.py ``MachineHandler.deploy``). The queue's definition, or the lab's
    image imports, are at fault, never the device: reported with ``blame = "queue"``, so the
    server suspends the queue rather than count a failure against each device it tries."""

    blame = "queue"


def fence(ctx: StepContext) -> StepResult:
    """claimed -> fenced: stop the device's testflinger-agent program (supervisord).

    The server already fenced the agent (no job is handed to it); stopping the process keeps it
    from touching the machine while it is lent.

    First, before anything is done to the device, the queue's agent template folder is checked
    (``agentfolders.check_template_folder``): a typo'd ``agent_template`` fails here with an
    ``AgentConfigError`` blamed on the queue, rather than after a whole deploy and split, at
    enrolling.
    """
    check_template_folder(_template_dir(ctx))
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
        info = release_to_ready(ctx, sid, info.status)
    series = ctx.spec.get("series") or "jammy"
    user_data = user_data_for(ctx.config)
    try:
        with ctx.journal.effect("maas.deploy", sid, {"series": series, "bridge_all": True}):
            # The machine as just read: the driver need not read it again before allocating.
            info = maas.deploy(sid, series, user_data=user_data, bridge_all=True, current=info)
    except MaasInvalid as exc:
        if "distro_series" not in exc.fields:
            raise
        raise SeriesNotUsable(
            f"MAAS cannot deploy {sid} with the queue's vm_host_series {series!r}: "
            f"{' '.join(exc.fields['distro_series'])} Import that series' images in MAAS "
            f"(Settings > Images; `maas $PROFILE boot-source-selections create`) or set the "
            f"queue's vm_host_series to a series MAAS has") from exc
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
    census = _retry(lambda: take_census(splitter, uri), ctx.remaining(f"GPU discovery on {uri}"),
                    ctx.config.maas_poll, f"GPU discovery on {uri}", ctx.stop)
    spec = ctx.lease.get("spec") or {}
    per_vm = int(spec.get("gpus_per_vm", 1) or 0)
    # What VMs of this lease's size can take: GPUs sharing an IOMMU group with each other go
    # whole to one VM of enough GPUs (gpucensus, splitplan.assign), never to a smaller one.
    gpus = census.lendable_to(per_vm)
    facts = {"device_gpus": [g.address for g in gpus]}
    # What was on the bus when the device was lent, lendable or not, and the drivers then
    # (before passthrough): the give-back compares the bus with these (verify_gpus_back). The
    # first split of the lease records them; a split run again after a restart keeps them.
    if ctx.journal.fact("host_gpus") is None:
        facts.update(host_gpus=sorted(census.present), gpu_drivers=dict(census.present))
    ctx.journal.set_facts(facts)  # one durable write
    short = shortfall(len(ctx.lease.get("vms") or []), per_vm,
                      census, ctx.device.agent_name, ctx.device.gpus)
    if short and ctx.device.gpus > len(gpus):
        # The registration promises GPUs the host cannot lend: every lend would end here.
        raise DeviceMisconfigured(short + "; quarantined until the agent host's configuration "
                                  "is fixed (then: testflinger-magic unquarantine)")
    if short:
        raise StepError(short)
    mismatch = count_mismatch(ctx.device.gpus, census, ctx.device.agent_name, per_vm)
    if mismatch:  # enough for this lend, but not what the server plans with
        log.warning("%s: %s", ctx.lease_id, mismatch)
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
    # The device's NVSwitches, kept by the server (server/devicefacts.py): a later queue of
    # several GPUs per VM then never picks it for a deploy its split would refuse.
    facts = {"nvswitches": census.nvswitches} if census.nvswitches is not None else {}
    return StepResult("enrolling", f"{len(vms)} domain(s) defined on {uri} (shut off until MAAS "
                      f"powers them on): {', '.join(v['domain'] for v in vms)}", vms,
                      facts=facts)


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
    address = libvirt URI, id = domain; first, so MAAS starts commissioning at once); allocate
    the VM agents' metrics ports; start the pre-warmed VM agent programs
    (``_start_prewarmed``, alongside the MAAS work); per VM (in parallel) wait Ready, give its
    boot interface a STATIC address, render the agent folder with that ``device_ip``; then
    add the other VMs' programs, without starting them, in one supervisord update
    (``agents.add_vm_agents``).

    An agent polls for a job right after its startup (TESTFLINGER.md §3.2-3.3): started
    before the ``active`` report it would poll while fenced and take its first job a whole
    ``polling_interval`` later. So a pre-warmed agent (prewarm.py: its command runs through
    agent_launcher.py) starts now but only imports its code and waits for its go file, which
    ``check_active`` writes; any other VM agent program is started by ``check_active``. The
    daemon runs ``check_active`` right after the server accepted the ``active`` report
    (``StepResult.after_report``) and so lifted the VM agents' fences; it
    (``agents.ensure``) watches the started programs and moves one whose metrics port was
    taken, reporting the new port in a progress report. A daemon that dies before: its next
    ``active`` check does it.

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
    template_dir = _template_dir(ctx)

    def make(vm: dict, look_first: bool) -> str:
        name = vm["name"]
        mark = marks.maas_mark(ctx.lease_id, name, ctx.config.agent_host)
        with ctx.journal.effect("maas.create", name,
                                {"mac": vm["mac"].lower(), "domain": vm["domain"],
                                 "power_address": power_address, "mark": mark}) as rec:
            sid = maas.create_vm_machine(name, vm["mac"], power_address, vm["domain"],
                                         power_pass=power_pass, description=mark,
                                         look_first=look_first)
            rec["system_id"] = sid
        return sid

    def create(vm: dict) -> str:
        name, hint = vm["name"], vm.get("maas_system_id")
        if not hint and ctx.journal.last_data("maas.create", name) is None:
            # Never tried for this lease: create at once, so MAAS starts commissioning without
            # waiting for look-ups. MAAS refuses a hostname or MAC it already has; the driver
            # then returns the machine with our MAC, or raises MaasConflict for the hostname
            # held by another MAC, which the checks below sort out (a stale machine of ours
            # is deleted, a person's is left alone).
            try:
                return make(vm, look_first=False)
            except MaasConflict:
                pass
        sid = _our_vm_machine(ctx, name, vm["mac"], hint=hint)
        return sid or make(vm, look_first=True)

    def finish(vm_sid: tuple[dict, str]) -> dict:
        vm, sid = vm_sid
        name = vm["name"]
        # Past Ready only if a VM agent already took a job (started by a daemon version that
        # started agents here; the connector redeploys the VM): its STATIC link survives that.
        info = _wait_commissioned(ctx, sid, name)
        with ctx.journal.effect("maas.static_ip", name, {"system_id": sid}) as rec:
            ip = maas.assign_static_ip(sid, current=info)  # its interface as the wait read it
            rec["ip"] = ip
        context = agent_context(ctx.config, ctx.lease, vm, sid, ip, vm["metrics_port"])
        dest = ctx.agent_dir(name)
        with ctx.journal.effect("agent.folder", name, {"dir": str(dest)}):
            ctx.drivers.render_agent_folder(template_dir, dest, context)
        return {"index": vm["index"], "maas_system_id": sid, "ip": ip,
                "metrics_port": vm["metrics_port"], "domain": vm["domain"],
                "gpus": vm.get("gpus", [])}

    # MAAS commissions a machine from its creation (Commissioning at once): the creations come
    # first, the metrics ports are chosen while MAAS commissions. The pre-warmed agents start on
    # their own thread right after, so their start-up (Python, imports: CPU on this host)
    # overlaps MAAS' commissioning rather than the creation calls.
    sids = _parallel(create, vms)
    # Ports are chosen one by one (allocate_port excludes what is already taken on the host).
    taken: list[int] = []
    for vm in vms:
        done = ctx.journal.last_data("agent.add", vm["name"]) or {}
        port = vm.get("metrics_port") or done.get("port")
        if not port:
            port = agents.allocate_port(exclude=tuple(taken), owner=vm["name"])
        vm["metrics_port"] = int(port)
        taken.append(int(port))
    programs = [(vm["name"], str(ctx.agent_dir(vm["name"])), vm["metrics_port"]) for vm in vms]
    early = [p for p in programs if prewarm.is_wrapped(agents.command_for(*p))]
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="prewarm") as pool:
        started = pool.submit(_start_prewarmed, ctx, early) if early else None
        updates = _parallel(finish, list(zip(vms, sids)))
        prewarmed = set(started.result()) if started else set()
    # The others at once (agents.add_vm_agents: one supervisord reloadConfig for the lease's
    # VMs, not one each). Added, not started (the files say autostart=false): check_active
    # starts them once the lease is active, and moves one whose port was taken meanwhile.
    rest = [p for p in programs if p[0] not in prewarmed]
    if rest:
        with contextlib.ExitStack() as stack:
            for name, agent_dir, port in rest:
                stack.enter_context(ctx.journal.effect("agent.add", name,
                                                       {"port": port, "dir": agent_dir}))
            agents.add_vm_agents(rest, start=False)
    return StepResult("active", f"{len(updates)} VM agent(s) enrolled: "
                      f"{', '.join(v['name'] for v in vms)}", updates,
                      after_report=check_active)


def _start_prewarmed(ctx: StepContext, programs: list[tuple[str, str, int]]) -> list[str]:
    """Add the pre-warmed VM agent programs ``(name, agent_dir, port)`` and start them: each
    waits for its go file (prewarm.py); returns the names started. A go file left in the folder
    (by an earlier lease whose folder outlived it) is removed first: before ``active`` none is
    this lease's. A supervisord error is logged and gives ``[]``: enroll then adds them as it
    adds any other, for ``check_active`` to start."""
    for name, agent_dir, _port in programs:
        go = prewarm.go_path(agent_dir)
        if go.exists():
            with ctx.journal.effect("agent.go_remove", name, {"file": str(go)}):
                prewarm.clear_go(agent_dir)
    try:
        with contextlib.ExitStack() as stack:
            for name, agent_dir, port in programs:
                stack.enter_context(ctx.journal.effect(
                    "agent.add", name, {"port": port, "dir": agent_dir, "prewarm": True}))
            return ctx.drivers.agents.add_prewarmed_vm_agents(programs)
    except AgentProcessError as exc:
        log.warning("%s: pre-warmed VM agents not started (%s); they start once the lease is "
                    "active", ctx.lease_id, exc)
        return []


def _wait_commissioned(ctx: StepContext, sid: str, name: str):
    """Wait for a created VM machine to be commissioned (Ready, or past it); returns its
    ``MachineInfo`` as the wait last read it.

    New is a failure: MAAS created it Commissioning, and puts it back in New when it cannot
    power the domain on (maasserver/models/node.py ``Node._start`` -> errback
    ``_start_bmc_unavailable``: "Aborting COMMISSIONING and reverting to NEW"). The power
    driver's own error (e.g. virsh's "Failed to login to virsh console.") is in the machine's
    events, so the ``StepError`` quotes them rather than waiting out the step's time."""
    try:
        return ctx.wait_maas(sid, {READY, ALLOCATED, DEPLOYING, DEPLOYED}, COMMISSION_FAIL | {NEW})
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
    """active: let the VM agents enroll added run (right after the ``active`` report,
    ``StepResult.after_report``, or at the next check if the daemon died first): write their
    go files first (``_write_go_files``: the pre-warmed ones, waiting on them, run at once),
    then start the programs not running (``agents.ensure``); and restore what a charm's
    config-changed wiped (TESTFLINGER.md §6.1, §6.4): it replaces the whole agent-configs tree
    (our VM folders go, their go files with them) and deletes every conf.d file (our programs
    go).

    Missing folders are re-rendered from the lease's vms (same context as at enrolment) and get
    their go file again, then ``agents.ensure`` re-creates the programs (a re-created
    pre-warmed one finds its go file and runs at once). If ensure had to move a metrics port
    (another program took it), the new port is reported in ``vms`` (the server merges it).
    """
    agents = ctx.drivers.agents
    check_vm_names(ctx.lease)
    vms = [vm for vm in ctx.lease.get("vms") or [] if vm.get("metrics_port")]
    # First the go files: pre-warmed agents, waiting on theirs, run at once.
    _write_go_files(ctx, vms)
    rendered = []
    for vm in vms:
        dest = ctx.agent_dir(vm["name"])
        if (dest / AGENT_CONF).exists():
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
    if rendered:
        _write_go_files(ctx, vms)
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


def _write_go_files(ctx: StepContext, vms: list[dict]) -> None:
    """Write the go file (prewarm.write_go) of every VM agent folder of ``vms`` that has its
    ``testflinger-agent.conf`` and no go file yet, journaled as one ``agent.go`` effect. Whatever
    ``agent_prewarm`` says: a program file a daemon with pre-warm on wrote may be kept with it
    off (agents.same_program), and its launcher waits for this file."""
    names = [vm["name"] for vm in vms
             if (ctx.agent_dir(vm["name"]) / AGENT_CONF).exists()
             and not prewarm.go_path(ctx.agent_dir(vm["name"])).exists()]
    if not names:
        return
    with ctx.journal.effect("agent.go", ctx.lease_id, {"names": names}):
        for name in names:
            prewarm.write_go(ctx.agent_dir(name))
