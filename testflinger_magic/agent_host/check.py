"""``testflinger-magic agent-host check``: what a lend would do on a device, and what would fail,
before the first lend and without changing anything.

It reads, never writes: the Testflinger server at ``server_url`` (a token for ``client_id``
from ``POST /v1/oauth2/token``, as the daemon's first call does), MAAS (``whoami`` and the device's machine, through
``maas_libmaas.LibMaasDriver``) when a config is given, and libvirt on ``--libvirt-uri`` (a
deployed host, or a lab host file ``test:///path.xml``): the GPUs a split would lend with the
functions that go with each, their IOMMU group and NUMA node, every refused device and why, the
firmware and 64-bit MMIO plan, the bridge, the storage pool, the host's readiness
(``LibvirtSplitter.host_problems``), and with ``--config`` and ``--device`` whether the device's
``gpus`` is the number of GPUs that can be lent (``gpucensus.count_mismatch``).

Exit status 0 when a lend would succeed, 1 otherwise (2: bad configuration). ``--json`` prints
one object: ``{"ok", "instance" (the daemon instance id a daemon of this config sends,
agent_host/instance.py), "server", "gpus": [{"address", "functions", "numa_node",
"iommu_group", "driver", "host_bridges"}], "refused": [{"address", "reason"}], "host_gpus":
[...], "problems": [...], "warnings": [...], "maas": {...}, "plan": {...}, "pinning": [{"vm",
"gpus", "mode", "nodeset", "cpuset", "gpu_cells", "local", "why"}]}``: ``pinning`` is the NUMA
placement each planned VM (``--vcpus``, ``--memory-mib``) would get (``numaplace``), and a VM
not local to its GPU's cell is a warning, not a problem. The planned VMs are named as a lend
names them (``<device>-vm1``.. with ``--device``, else ``vm1``..), and the splitter's own fit
rule (``LibvirtSplitter.fit``: ``splitplan.check_fit``, e.g. the VMs' memory, all pinned by
VFIO, above the host's) failing is a problem with the splitter's message.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from testflinger_magic import vm_rules
from testflinger_magic.agent_host.config import AgentHostConfig, ConfigError, load_file
from testflinger_magic.agent_host.gpucensus import census_of, count_mismatch
from testflinger_magic.agent_host.instance import instance_id
from testflinger_magic.agent_host.pcidiscovery import DEFAULT_GPU_VENDORS, multi_gpu_problem
from testflinger_magic.agent_host.numaplace import overcommitted
from testflinger_magic.agent_host.splitplan import (
    SplitError,
    VMPlan,
    VMSpecDoesNotFit,
    default_mmio64_mib,
)
from testflinger_magic.names import vm_name

#: VM size ``check`` plans pinning for unless told (a magic queue's ``vm`` defaults,
#: queues.VMSpec).
DEFAULT_VCPUS = 8
DEFAULT_MEMORY_MIB = 32768


#: seconds the server check waits for an answer (the daemon's client waits 30 s and retries;
#: a check should say "unreachable" quickly).
SERVER_TIMEOUT = 5.0


def check_server(config: AgentHostConfig, client=None) -> tuple[dict, list[str]]:
    """The server at ``server_url`` answers and accepts ``client_id``/``secret_key``:
    ``({"url", "client_id", "token": bool}, problems)``. One ``POST /v1/oauth2/token`` with
    HTTP Basic auth (client.MagicClient.token, the daemon's own first call; Testflinger server
    ``api/v1.py::retrieve_token`` answers 401 to a wrong id or secret), no retry, a
    :data:`SERVER_TIMEOUT` s timeout. ``client``: a MagicClient to use instead (tests)."""
    from testflinger_magic.agent_host.client import AuthError, ClientError, MagicClient

    if client is None:
        client = MagicClient(config.server_url, config.client_id, config.secret_key,
                             timeout=SERVER_TIMEOUT, retries=0)
    out = {"url": config.server_url, "client_id": config.client_id, "token": False}
    try:
        client.token()
        out["token"] = True
        return out, []
    except AuthError as exc:
        return out, [f"client_id: the server at {config.server_url} refused client id "
                     f"{config.client_id!r} (wrong secret_key, or no such client: "
                     f"the daemon needs a Testflinger client with role agent): {exc}"]
    except ClientError as exc:
        if exc.status == 0 and "unreachable" in str(exc):
            return out, [f"server_url: {config.server_url} unreachable (is the Testflinger "
                         f"server up, and the URL right?): {exc}"]
        return out, [f"server_url: {config.server_url} answered the token request "
                     f"(POST /v1/oauth2/token) with an error (is it a Testflinger server?): "
                     f"{exc}"]


def check_maas(config: AgentHostConfig, device: str | None, maas=None) -> tuple[dict, list[str]]:
    """MAAS reachable, the key accepted, and the device's machine known: ``({"user", "device",
    "system_id", "status"}, problems)``. ``maas``: a driver to use (default ``LibMaasDriver`` of
    the config); only ``whoami`` and ``machine`` are called."""
    out: dict = {"url": config.maas.url}
    problems: list[str] = []
    if maas is None:
        from testflinger_magic.agent_host.maas_libmaas import LibMaasDriver

        maas = LibMaasDriver(config.maas.url, config.maas.api_key.get_secret_value())
    try:
        try:
            out["user"] = maas.whoami()
        except Exception as e:  # noqa: BLE001 - every MAAS failure is a finding here
            problems.append(f"MAAS at {config.maas.url}: {e}")
            return out, problems
        devices = [config.device(device)] if device else list(config.devices)
        out["devices"] = []
        for dev in devices:
            entry = {"device": dev.agent_name, "system_id": dev.maas_system_id}
            try:
                info = maas.machine(dev.maas_system_id)
                entry.update(status=info.status, hostname=info.hostname,
                             bridges=list(getattr(info, "bridges", ()) or ()))
            except Exception as e:  # noqa: BLE001
                problems.append(f"device {dev.agent_name}: MAAS machine "
                                f"{dev.maas_system_id}: {e}")
            out["devices"].append(entry)
    finally:
        close = getattr(maas, "close", None)
        if close:
            close()
    return out, problems


def check_local(config: AgentHostConfig) -> list[str]:
    """What on this machine would keep the daemon from working: its ``state_dir`` cannot be
    created or written (statedir.state_dir_problem; the daemon refuses to start), or
    supervisord's socket (``supervisor.url`` ``unix://``) does not exist (no device agent
    could be stopped or started, nor a VM agent added). Problems as sentences naming the
    field."""
    from testflinger_magic.agent_host.statedir import state_dir_problem

    problems = []
    problem = state_dir_problem(config.state_dir)
    if problem:
        problems.append(f"state_dir: {problem} (the daemon refuses to start)")
    url = config.supervisor.url
    if url.startswith("unix://"):
        sock = url.removeprefix("unix://")
        if not Path(sock).exists():
            problems.append(f"supervisor.url: no supervisord socket at {sock} (is supervisord "
                            "running? device and VM agents are run by it)")
    return problems


def check_host(uri: str, *, bridge: str | None, gpus_per_vm: int = 1, firmware: str = "uefi",
               mmio64_mib: int | None = None, splitter=None, config: AgentHostConfig | None = None,
               vcpus: int = DEFAULT_VCPUS, memory_mib: int = DEFAULT_MEMORY_MIB,
               device: str | None = None) -> tuple[dict, list[str]]:
    """What a split on ``uri`` would lend and why it would fail: ``(report, problems)``.
    ``report``: ``{"gpus", "refused", "nvswitches", "host_gpus", "plan": {...}, "pool": {...},
    "pinning": [...], "warnings": [...]}`` (``host_gpus``: every GPU on the bus, lendable or
    refused). ``pinning``: for each planned VM of ``vcpus`` vCPUs and ``memory_mib`` MiB, its
    GPUs and NUMA placement (``numaplace.Placement.to_dict`` plus ``"gpus"``), when the
    splitter can tell (``placement``); ``warnings``: what would work but not as well as it
    could (a VM not local to its GPU's cell, the NVSwitch opt-in set, the VM values
    ``vm_rules.gpu_vm_warnings`` names: an aperture too small for the GPUs, bios with GPUs, more
    than 8 GPUs), never a reason to fail; an ``mmio64_mib`` outside the splitter's bounds
    (``vm_rules.mmio64_problem``) is a problem.
    ``device``: the config's device on that host; its ``gpus`` must be the number of GPUs that
    can be lent (``gpucensus.count_mismatch``: the server plans VMs with it), else that is a
    problem."""
    if splitter is None:
        from testflinger_magic.agent_host.libvirt_split import LibvirtSplitter

        sc = config.splitter if config else None
        splitter = LibvirtSplitter(
            vendor_ids=tuple(sc.gpu_vendors) if sc else DEFAULT_GPU_VENDORS, bridge=bridge,
            network=sc.network if sc else None,
            **({"pool_name": sc.pool_name, "pool_path": sc.pool_path,
                "nvswitch_multi_gpu": sc.nvswitch_multi_gpu} if sc else {}))
    problems: list[str] = []
    try:
        disc = splitter.inspect(uri)
    except SplitError as e:
        return {"gpus": [], "refused": []}, [f"libvirt at {uri}: {e}"]
    problems += splitter.host_problems(uri, bridge, firmware)
    multi = multi_gpu_problem(disc, gpus_per_vm, splitter.nvswitch_multi_gpu)
    if multi:
        problems.append(multi)
    census = census_of(disc)
    per_vm = max(gpus_per_vm, 1)
    # GPUs sharing an IOMMU group only with each other go whole to one VM of enough GPUs
    # (pcidiscovery, splitplan.assign): what is lent depends on --gpus-per-vm.
    lendable = disc.lendable(per_vm)
    grouped_warnings = _grouped_warnings(census, per_vm,
                                         config.device(device).gpus
                                         if config is not None and device else None)
    if config is not None and device:
        mismatch = count_mismatch(config.device(device).gpus, census, device, per_vm)
        if mismatch:
            problems.append(mismatch)
    vms = len(lendable) // gpus_per_vm if gpus_per_vm else 0
    # The splitter's bounds (splitplan.validate_plan) and validate's warnings: one rule each.
    if mmio := vm_rules.mmio64_problem(mmio64_mib):
        problems.append(f"--mmio64-mib: {mmio}; the splitter refuses such a VM")
    vm_warnings = [f"--{'gpus-per-vm' if f == 'gpus' else f.replace('_', '-')}: {m}"
                   for f, m in vm_rules.gpu_vm_warnings(gpus_per_vm, firmware, mmio64_mib)]
    aperture = None
    if firmware == "uefi" and gpus_per_vm:
        aperture = mmio64_mib or default_mmio64_mib(gpus_per_vm)
    report = {
        "gpus": [{"address": g.address, "functions": list(g.functions),
                  "numa_node": g.numa_node, "iommu_group": g.iommu_group,
                  "driver": disc.devices[g.address].driver,
                  "host_bridges": disc.host_bridges(g.address)} for g in lendable],
        "refused": [r.to_dict() for r in disc.refused_for(per_vm)],
        "nvswitches": list(disc.nvswitches),
        "host_gpus": list(census.present),
        "plan": {"gpus_per_vm": gpus_per_vm, "vms": vms, "firmware": firmware,
                 "machine": "q35", "mmio64_mib": aperture,
                 "bridge": bridge, "network": splitter.network},
    }
    try:
        report["pool"] = splitter.pool_state(uri)
    except SplitError as e:
        problems.append(str(e))
    plans = plan_vms(vms, gpus_per_vm, vcpus, memory_mib, firmware, device,
                     getattr(splitter, "pool_path", "/check"))
    problems += _fit(splitter, uri, plans)
    problems += _held(splitter, uri, lendable)
    report["pinning"], report["warnings"] = _pinning(splitter, uri, plans)
    report["warnings"] = vm_warnings + grouped_warnings + report["warnings"]
    if splitter.nvswitch_multi_gpu:
        report["warnings"].append(NVSWITCH_WARNING)
    if disc.nvswitches and gpus_per_vm == 1:
        report["warnings"].append(ONE_GPU_NVSWITCH_WARNING)
    return report, problems


#: ``check``'s warning whenever ``splitter.nvswitch_multi_gpu`` is set (docs/operator-guide.md,
#: "NVSwitch systems"): the flag only lets such VMs be defined.
NVSWITCH_WARNING = (
    "splitter.nvswitch_multi_gpu is set: VMs with several GPUs are defined on NVSwitch hosts, "
    "but the daemon neither activates nor deactivates a Fabric Manager partition and "
    "picks GPUs by NUMA node and address, not by Fabric Manager's partition table; their GPUs "
    "talk over NVLink only if your own tooling activates the partition holding exactly those "
    "GPUs before MAAS powers the VM on (docs/operator-guide.md, 'NVSwitch systems')")


#: ``check``'s warning for one GPU per VM on a host with NVSwitches (TRIAL13 F1; operator
#: guide, "NVSwitch systems"): unverified here, and reported to need the guest driver's
#: NVLinks disabled.
ONE_GPU_NVSWITCH_WARNING = (
    "this host has NVSwitches: each VM gets one GPU without them (Fabric Manager's full "
    "passthrough with one GPU). Reports say CUDA in such a guest can stay at 'system not yet "
    "initialized' until its NVIDIA driver is loaded with NVreg_NvLinkDisable=1 (the jobs' "
    "image or setup); try one job on this hardware first (docs/operator-guide.md, 'NVSwitch "
    "systems')")


def _grouped_warnings(census, per_vm: int, configured: int | None) -> list[str]:
    """A warning per IOMMU group of several GPUs (and nothing else but their functions and
    bridges): VFIO gives a group whole to one guest (Linux ``Documentation/driver-api/
    vfio.rst``), so it is lent to one VM of at least that many GPUs and never to a smaller
    one; and, with a device's ``gpus`` (``configured``) that counts such GPUs, that a queue of
    fewer GPUs per VM borrowing it fails at split."""
    groups: dict = {}
    for g in census.grouped:
        groups.setdefault(g.iommu_group, []).append(g.address)
    out = []
    for number, members in sorted(groups.items()):
        if len(members) > per_vm:
            out.append(f"GPUs {', '.join(members)} share IOMMU group {number} only with each "
                       f"other (and their own functions): lent whole to one VM of "
                       f"{len(members)} or more GPUs, not with --gpus-per-vm {per_vm} (a group "
                       "cannot be split across VMs)")
    singles = len(census.lendable_to(1))
    if configured is not None and groups and configured > singles:
        smallest = min(len(m) for m in groups.values())
        out.append(f"the device's gpus: {configured} counts GPUs that share an IOMMU group; a "
                   f"queue of fewer than {smallest} GPUs per VM can take only {singles}, so "
                   "every lend to such a queue would fail at split: keep the device out of "
                   "those queues (their devices.exclude), or set gpus: "
                   f"{singles}")
    return out


def plan_vms(vms: int, gpus_per_vm: int, vcpus: int, memory_mib: int, firmware: str,
             device: str | None, pool_path: str) -> list[VMPlan]:
    """The ``vms`` VMs check plans for: named as a lend names them (``names.vm_name``:
    ``<device>-vm1``..) when ``device`` is given, else ``vm1``..; 1 GiB disks in ``pool_path``
    (check has no disk size: the pool's capacity is not what it checks)."""
    plans = []
    for i in range(vms):
        name = vm_name(device, i) if device else f"vm{i + 1}"
        plans.append(VMPlan(name=name, mac=f"52:54:00:00:00:{i:02x}", vcpus=vcpus,
                            memory_mib=memory_mib, disk_gib=1,
                            disk_path=f"{pool_path.rstrip('/')}/{name}.qcow2",
                            gpu_count=gpus_per_vm, firmware=firmware))
    return plans


def _fit(splitter, uri: str, plans: list[VMPlan]) -> list[str]:
    """The splitter's own fit rule (``LibvirtSplitter.fit``: ``splitplan.check_fit`` on the
    host's totals, which ``split`` applies before defining anything) as problems: the
    splitter's message when the planned VMs can never fit (e.g. their memory, all pinned by
    VFIO, above the host's). A splitter without ``fit``, or no VM: nothing."""
    if not hasattr(splitter, "fit") or not plans:
        return []
    try:
        splitter.fit(uri, plans)
    except VMSpecDoesNotFit as e:
        return [f"{e}\n(planned here: {len(plans)} VM(s) of --vcpus {plans[0].vcpus}, "
                f"--memory-mib {plans[0].memory_mib}; a split refuses such a lease)"]
    except SplitError as e:
        return [f"libvirt at {uri}: the VMs' fit could not be checked: {e}"]
    return []


def _held(splitter, uri: str, lendable: list) -> list[str]:
    """A problem when defined domains hold functions of the GPUs to lend now (the device is
    lent, or a lease left its domains): a split now would get none of those GPUs (TRIAL16 F7:
    check said "OK" with only a placement warning). Names the leases whose domains hold them
    (other domains are counted). A splitter without ``domain_holdings`` (the script splitter):
    nothing."""
    if not hasattr(splitter, "domain_holdings") or not lendable:
        return []
    try:
        holdings = splitter.domain_holdings(uri)
    except SplitError as e:
        return [f"libvirt at {uri}: the domains holding GPUs could not be listed: {e}"]
    taken: set[str] = set()
    by_lease: dict[str, int] = {}
    for lease_id, addrs in holdings.values():
        held = {g.address for g in lendable if set(g.functions) & addrs}
        if held:
            taken |= held
            key = f"of lease {lease_id}" if lease_id else "of no lease of ours"
            by_lease[key] = by_lease.get(key, 0) + 1
    if not taken:
        return []
    holders = ", ".join(f"{n} {key}" for key, n in sorted(by_lease.items()))
    return [f"{len(taken)} of the {len(lendable)} GPUs to lend are held by domains defined on "
            f"{uri} now: {holders}. The device is lent now (testflinger-magic leases) or a "
            "lease left them (testflinger-magic agent-host sweep); a lend gets those GPUs only "
            "once the domains are gone"]


def _pinning(splitter, uri: str, plans: list[VMPlan]) -> tuple[list[dict], list[str]]:
    """Each planned VM's GPUs and NUMA placement, and a warning per VM not local to its
    GPU's cell (``LibvirtSplitter.placement``; a splitter without it: nothing)."""
    if not hasattr(splitter, "placement") or not plans:
        return [], []
    try:
        planned = splitter.placement(uri, plans)
    except SplitError as e:
        return [], [f"NUMA placement not planned: {e}"]
    rows, warnings = [], []
    for name, (gpus, p) in planned.items():
        rows.append({**p.to_dict(), "gpus": [g.address for g in gpus]})
        if not p.local:
            warnings.append(f"VM {name} ({plans[0].vcpus} vCPU, {plans[0].memory_mib} MiB) "
                            "is not local to its "
                            f"GPU's NUMA cell: {p.why}")
    # A cell whose VMs' vCPUs outnumber its CPUs (numaplace rule 2 widens them only while
    # another cell has CPUs to spare): a warning, as host-wide overcommit is the operator's
    # choice (splitplan.check_fit) (TRIAL13 F12).
    if hasattr(splitter, "numa_cells"):
        try:
            cells = splitter.numa_cells(uri)
        except SplitError:
            cells = None
        warnings += [f"{w} (planned with --vcpus {plans[0].vcpus}; a lend uses the queue's "
                     "vm.vcpus)"
                     for w in overcommitted({n: p for n, (_g, p) in planned.items()},
                                            {v.name: v.vcpus for v in plans}, cells)]
    return rows, warnings


def main(args) -> int:
    """``agent-host check``; ``args``: ``config``, ``device``, ``libvirt_uri``, ``json``,
    ``gpus_per_vm``, ``firmware``, ``mmio64_mib``, ``bridge``, ``vcpus``, ``memory_mib``
    (the last two may be absent or None: :data:`DEFAULT_VCPUS`, :data:`DEFAULT_MEMORY_MIB`)."""
    config = None
    problems: list[str] = []
    out: dict = {}
    if args.config:
        try:
            config = load_file(args.config)
        except ConfigError as exc:
            print(exc, file=sys.stderr)
            return 2
        if args.device:
            try:
                config.device(args.device)
            except KeyError:
                print(f"testflinger-magic: {args.config}: no device {args.device!r} "
                      f"(have: {', '.join(d.agent_name for d in config.devices) or 'none'})",
                      file=sys.stderr)
                return 2
        out["instance"] = instance_id(config.state_dir)
        out["server"], found = check_server(config)
        problems += found
        out["maas"], found = check_maas(config, args.device)
        problems += found
        problems += check_local(config)
    if not args.libvirt_uri and not config:
        print("testflinger-magic: give --config and/or --libvirt-uri", file=sys.stderr)
        return 2
    bridge = args.bridge or (config.bridge if config else None)
    if bridge is None and args.device:
        # What a lend would use (steps.bridge_of): the bridge MAAS rendered on the deployed
        # device's boot interface (bridge_all), first in MachineInfo.bridges.
        for entry in out.get("maas", {}).get("devices", []):
            if entry.get("device") != args.device:
                continue
            if entry.get("bridges"):
                bridge = entry["bridges"][0]
            elif entry.get("status") and entry["status"] != "Deployed":
                problems.append(f"device {args.device}: its MAAS machine is {entry['status']}, "
                                "not Deployed, so MAAS has rendered no bridge yet (a lend "
                                "deploys it with bridge_all); give --bridge to check the host "
                                "anyway")
    if args.libvirt_uri:
        host, found = check_host(args.libvirt_uri, bridge=bridge, gpus_per_vm=args.gpus_per_vm,
                                 firmware=args.firmware, mmio64_mib=args.mmio64_mib,
                                 config=config, device=args.device,
                                 vcpus=getattr(args, "vcpus", None) or DEFAULT_VCPUS,
                                 memory_mib=getattr(args, "memory_mib", None)
                                 or DEFAULT_MEMORY_MIB)
        out.update(host)
        problems += found
    else:
        out.setdefault("gpus", [])
        out.setdefault("refused", [])
        problems.append("no --libvirt-uri: the host's GPUs, firmware, bridge and pool were not "
                        "checked (give the URI of the deployed host)")
    if config is not None and config.splitter.nvswitch_multi_gpu and not args.libvirt_uri:
        out.setdefault("warnings", []).append(NVSWITCH_WARNING)
    ok = not problems
    result = {"ok": ok, "gpus": out.pop("gpus", []), "refused": out.pop("refused", []),
              "problems": problems, "warnings": out.pop("warnings", []), **out}
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(render(result, args.libvirt_uri))
    return 0 if ok else 1


def render(r: dict, uri: str | None) -> str:
    """The human report of ``main``."""
    lines = []
    if r.get("instance"):
        lines.append(f"daemon instance {r['instance']} (one daemon per agent host: the server "
                     "refuses another instance while this one heartbeats)")
    server = r.get("server")
    if server:
        lines.append(f"server {server['url']}: " + (
            f"token granted to client {server['client_id']}" if server.get("token")
            else "NOT reachable or refused (see below)"))
    maas = r.get("maas")
    if maas:
        lines.append(f"MAAS {maas.get('url')}: " + (f"logged in as {maas['user']}"
                                                    if maas.get("user") else "NOT reachable"))
        for d in maas.get("devices", []):
            lines.append(f"  device {d['device']}: machine {d['system_id']} "
                         f"{d.get('status', 'UNKNOWN')}")
    if uri:
        lines.append(f"libvirt {uri}:")
        on_bus = r.get("host_gpus")
        lines.append(f"  GPUs to lend ({len(r['gpus'])}"
                     + (f" of the {len(on_bus)} on the bus" if on_bus is not None else "") + "):")
        # libvirt's test driver never reports a node device's <driver> (pcidiscovery): say
        # so rather than "-", which on a real host means no driver is bound.
        unknown = "not reported by libvirt's test driver" if uri.startswith("test:") \
            else "none bound"
        groups: dict = {}
        for g in r["gpus"]:
            groups.setdefault(g["iommu_group"], []).append(g["address"])
        for g in r["gpus"]:
            extra = [f for f in g["functions"] if f != g["address"]]
            peers = [a for a in groups[g["iommu_group"]] if a != g["address"]]
            # The kernel's numa_node is -1 when the firmware gives none (libvirt: no <numa>).
            node = g["numa_node"] if g["numa_node"] is not None else "unknown (firmware gives none)"
            lines.append(f"    {g['address']}  IOMMU group {g['iommu_group']}  NUMA node "
                         f"{node}  driver {g.get('driver') or unknown}"
                         + (f"  with {', '.join(extra)}" if extra else "")
                         + (f"  (shares its IOMMU group with {', '.join(peers)}: one VM takes "
                            "the group whole)" if peers else "")
                         + (f"  (bridge {', '.join(g['host_bridges'])} of its IOMMU group stays "
                            "on the host)" if g.get("host_bridges") else ""))
        if r["refused"]:
            lines.append(f"  refused ({len(r['refused'])}):")
            lines += [f"    {x['address']}: {x['reason']}" for x in r["refused"]]
        plan = r.get("plan") or {}
        if plan:
            aperture = (f", 64-bit MMIO aperture {plan['mmio64_mib']} MiB "
                        "(opt/ovmf/X-PciMmio64Mb)" if plan.get("mmio64_mib") else "")
            lines.append(f"  plan: {plan['vms']} VM(s) x {plan['gpus_per_vm']} GPU(s), "
                         f"{plan['firmware']} on {plan['machine']}{aperture}")
            lines.append("  VM NICs on " + (
                f"bridge {plan['bridge']}" if plan.get("bridge")
                else f"libvirt network {plan['network']}" if plan.get("network")
                else "no bridge or network (see below)"))
        for p in r.get("pinning") or []:
            pinned = (f"memory {p['mode']} on cell {p['nodeset']}, vCPUs on CPUs {p['cpuset']}"
                      if p["mode"] else "not pinned (one NUMA cell)")
            lines.append(f"  {p['vm']}: GPU {', '.join(p['gpus'])} (cell "
                         f"{','.join(map(str, p['gpu_cells'])) or 'unknown'}): {pinned}"
                         + ("" if p["local"] else "  NOT LOCAL"))
        pool = r.get("pool")
        if pool:
            state = ("active" if pool["active"] else "inactive") if pool["exists"] else \
                "missing (a lend creates it)"
            lines.append(f"  storage pool {pool['name']} at {pool['path']}: {state}")
    if r.get("warnings"):
        lines.append("WARNINGS (a lend would work, not as well as it could):")
        lines += [f"  - {w}" for w in r["warnings"]]
    if r["problems"]:
        lines.append("PROBLEMS (fix these before lending):")
        lines += ["  - " + p.replace("\n", "\n      ") for p in r["problems"]]
    else:
        lines.append("OK: a lend would succeed")
    return "\n".join(lines)
