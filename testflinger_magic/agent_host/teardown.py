"""The tear-down step of a lease (``restoring`` -> ``returned``): find every VM the lease may have
left (``discover_vm_names``), remove their agents, domains and MAAS machines (each machine only
with a proof the daemon made it, marks.py), check the GPUs on the bus at split are back
(``verify_gpus_back``, else ``GiveBackRefused``), release the device and start its own agent.
The rules every step keeps are in steps.py.
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

from testflinger_magic.agent_host import marks
from testflinger_magic.agent_host.gpucensus import take_census
from testflinger_magic.agent_host.maas import MaasNotFound
from testflinger_magic.agent_host.marks import vm_name_pattern
from testflinger_magic.agent_host.release import RECOVERY_FACT, release_to_ready
from testflinger_magic.agent_host.stepcontext import (
    DEPLOY_FAIL, DEPLOYED, DEPLOYING, READY, RUNNING_STATES, GiveBackRefused, StepContext,
    StepError, StepResult, _ip_of, _parallel,
)

log = logging.getLogger(__name__)


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


def gpus_back_problems(at_split: list[str], drivers_before: dict,
                       now: dict[str, str | None]) -> list[str]:
    """Why the GPUs on the bus ``now`` (``{address: driver}`` of every GPU, lendable or
    refused: ``gpucensus.Census.present``, read after the domains are gone) are not those that
    were there when the device was lent; empty when all came back.

    ``at_split``: every GPU on the bus at split (journal fact ``host_gpus``; ``device_gpus``,
    the lendable ones, for a lease split before that fact existed); ``drivers_before``: their
    drivers then (fact ``gpu_drivers``). libvirt gives a managed hostdev back to its host driver
    when the domain is destroyed (``virHostdevReAttachPCIDevices``, libvirt
    ``src/hypervisor/virhostdev.c``); a GPU that fell off the bus (NVIDIA Xid 79) no longer
    enumerates, and one whose re-attach failed stays on ``vfio-pci``. A driver libvirt does
    not report (None) is not judged. A GPU that discovery refuses (never lent) and that is
    still on the bus is no problem: the count registered in agent-host.yaml is not compared
    (a device registered with more GPUs than can be lent fails at split, not here)."""
    problems = []
    missing = sorted(set(at_split) - set(now))
    if missing:
        problems.append(f"GPU(s) {', '.join(missing)} no longer enumerate on the host "
                        f"({len(set(at_split) & set(now))} of the {len(set(at_split))} GPU(s) "
                        "on the bus at split do)")
    before = drivers_before or {}
    stuck = sorted(a for a, drv in now.items() if drv == "vfio-pci"
                   and before.get(a) not in (None, "vfio-pci"))
    if stuck:
        problems.append(f"GPU(s) {', '.join(stuck)} still bound to vfio-pci (were "
                        f"{', '.join(sorted({before[a] for a in stuck}))})")
    return problems


def _holders(splitter, uri: str) -> str:
    """Who holds a GPU on ``uri``, in words: the domains with a ``<hostdev>`` and their lease
    (the splitter's ``domain_holdings``, libvirt's; a splitter without it: "a domain")."""
    holdings = getattr(splitter, "domain_holdings", None)
    try:
        held = {name: lease for name, (lease, devs) in holdings(uri).items() if devs} \
            if holdings is not None else {}
    except Exception:  # noqa: BLE001 - the refusal stands without the names
        held = {}
    if not held:
        return "a domain"
    return "domain(s) " + ", ".join(
        f"{name} ({'lease ' + lease if lease else 'not made by testflinger-magic'})"
        for name, lease in sorted(held.items()))


def verify_gpus_back(ctx: StepContext, uri: str) -> None:
    """Raise :class:`GiveBackRefused` when the device's GPUs are not back on the bus as they
    were when it was lent (:func:`gpus_back_problems`): before its agent gets its queues back
    (issue: verified give-back)."""
    lent = ctx.journal.fact("device_gpus")
    if lent is None:
        return  # never split (bring-up ended before): no GPU was handed to a VM
    at_split = ctx.journal.fact("host_gpus")
    now = take_census(ctx.drivers.splitter, uri).present
    problems = gpus_back_problems(lent if at_split is None else at_split,
                                  ctx.journal.fact("gpu_drivers") or {}, now)
    if problems:
        raise GiveBackRefused(f"device {ctx.device.agent_name} not given back: "
                              + "; ".join(problems) + f" ({uri}); quarantine it until a person "
                              "has looked (testflinger-magic unquarantine)")


def restore(ctx: StepContext) -> StepResult:
    """restoring -> returned: undo everything, then give the device back to its own agent.

    Order: VM agent programs and folders; the domains and volumes (while the device is still
    deployed and reachable) and a check that every GPU is free; THEN the VMs' MAAS machines;
    then the give-back check (:func:`verify_gpus_back`: every GPU on the bus at split
    enumerates again, none left on vfio-pci; else :class:`GiveBackRefused`, the device stays
    deployed, its agent stopped, and the server quarantines it); release the device and wait
    Ready (recovering a failed release as maas2 does: ``release.release_to_ready``); start the
    device agent program.

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
    defined: set[str] = set()  # the lease's domains found on the host before its restore
    split_begun = any(e["action"] == "libvirt.split" for e in ctx.journal.entries()) or any(
        vm.get("domain") for vm in ctx.lease.get("vms") or [])
    if info.status == DEPLOYING and split_begun:
        info = ctx.wait_maas(sid, {DEPLOYED}, DEPLOY_FAIL | {READY})
    # Still Deploying with no split begun: the host runs nothing of this lease (the split
    # comes after Deployed), and MAAS releases a Deploying machine (maasserver/models/node.py
    # RELEASABLE_STATUSES): released as it is, not after a deploy MAAS may never finish
    # (TRIAL13 F5: the restore waited for timeouts.restoring, then failed).
    ip = _ip_of(info) or ctx.journal.fact("device_ip")
    # Only a host we deployed runs libvirt; one a home job left Deployed does not.
    ours = any(e["action"] == "maas.deploy" for e in ctx.journal.entries()) or any(
        vm.get("domain") for vm in ctx.lease.get("vms") or [])
    if info.status == DEPLOYED and ip and ours:
        uri = ctx.uri(ip)
        defined = set(splitter.domains(uri, ctx.lease_id))
        left = defined | set(names)
        with ctx.journal.effect("libvirt.restore", ctx.lease_id, {"uri": uri, "names": sorted(left)}):
            splitter.restore(uri, ctx.lease_id, sorted(left))
        still = splitter.domains(uri, ctx.lease_id)
        if still:
            raise StepError(f"domains still defined on {uri} after restore: {', '.join(still)}")
        if not splitter.gpus_free(uri):
            # Ours are all gone (above): a domain that is not this lease's holds a GPU (an
            # operator's VM, another lease's leftover). Retrying cannot free it, and the home
            # agent must not get a device whose GPUs a VM holds: refused, quarantined with who
            # holds them (TRIAL15 F2: a plain error, retried, no quarantine event).
            raise GiveBackRefused(f"device {device} not given back: GPUs still held by "
                                  f"{_holders(splitter, uri)} ({uri}); quarantine it until a "
                                  "person has looked (testflinger-magic unquarantine)")

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
    # A lease given back before its split defined a domain made no VM (a split refused, a drain
    # during the deploy): say so, not "N VM(s) removed" of the planned names (TRIAL6; TRIAL17
    # F7: a split refused for its NVSwitches had begun, so it said "4 VM(s) removed"). A split
    # done made them all; one that failed midway, the domains found and machines created.
    if any(e["action"] == "libvirt.split" and e["phase"] == "done" for e in entries):
        made = len(names)
    else:
        made = len(defined | {e["target"] for e in entries if e["action"] == "maas.create"})
    vms = f"{made} VM(s) removed" if made else "no VM had been made"
    # A release MAAS failed and release_to_ready recovered is said, not hidden behind
    # "released" (TRIAL13 F9); the journal fact also survives a restart of this step.
    recovery = ctx.journal.fact(RECOVERY_FACT)
    released = f"{sid} {recovery}" if recovery else f"{sid} released"
    return StepResult("returned", f"{vms}, {released}, device agent {program} started")

