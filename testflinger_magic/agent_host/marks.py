"""The marks the daemon gives what it makes, and the proofs it asks for before undoing (pure).

The daemon deletes, releases or destroys only what it can prove it made (issue 12 item 2); a
bare id the server sends (``lease.vms[].maas_system_id``, ``name``, ``domain``...) is never
proof. What counts as proof, per kind:

- VM name: ``<device>-vm<N>`` for a device of this host's configuration (``vm_name_pattern``);
  any other name (``gpu-host-01`` itself, ``../x``, another host's device) is not ours, so its
  agent folder (``<agent_configs_dir>/<name>``) and supervisord program are never touched.
- MAAS machine: hostname is the VM's name AND either its description carries our mark for this
  lease (``maas_mark``, given at create: MAAS' admin create form takes ``description``,
  maasserver/forms/__init__.py ``AdminMachineForm``) or one of its MACs is a MAC the daemon
  itself put in this lease's VM (its journal, :func:`journal_macs`). MAAS keeps a MAC on one
  machine only, so a MAC the daemon gave is the machine the daemon enrolled.
- libvirt domain: our ``<magic:lease id=...>`` metadata (``splitplan.LEASE_NS``); its volumes
  only inside the splitter's pool directory (``libvirt_split``).
- supervisord program: its conf.d file starts with ``agents.MARKER``.
- agent folder: ``<agent_configs_dir>/<device>-vm<N>`` holding ``agents.FOLDER_MARKER`` or a
  ``testflinger-agent.conf`` (``agents.remove_agent_folder``).
"""

from __future__ import annotations

import re

#: First word of the description the daemon gives every MAAS machine it creates.
MAAS_MARK = "testflinger-magic"
_MARK_RE = re.compile(r"^testflinger-magic lease=(?P<lease>\S+) vm=(?P<vm>\S+)"
                      r"(?: agent-host=(?P<host>\S+))?")


def vm_name_pattern(device: str) -> re.Pattern:
    """Names of the VMs of ``device``: ``<device>-vm<N>`` (docs/architecture.md lease.vms)."""
    return re.compile(rf"^{re.escape(device)}-vm\d+$")


def is_vm_name(name, device: str) -> bool:
    """True when ``name`` is a string naming a VM of ``device`` (``<device>-vm<N>``)."""
    return isinstance(name, str) and bool(vm_name_pattern(device).match(name))


def device_of(name: str, devices) -> str | None:
    """The device among ``devices`` whose VM ``name`` is, or None."""
    for device in devices:
        if is_vm_name(name, device):
            return device
    return None


def maas_mark(lease_id: str, vm: str, agent_host: str = "") -> str:
    """The description of a VM's MAAS machine: ``testflinger-magic lease=<id> vm=<name>
    agent-host=<host>``."""
    text = f"{MAAS_MARK} lease={lease_id} vm={vm}"
    return f"{text} agent-host={agent_host}" if agent_host else text


def parse_maas_mark(description: str | None) -> dict | None:
    """``{"lease", "vm", "host"}`` of a description ``maas_mark`` made, else None."""
    m = _MARK_RE.match(description or "")
    return m.groupdict() if m else None


def maas_machine_proof(info, name: str, lease_id: str, macs) -> str | None:
    """Why MAAS machine ``info`` (``maas.MachineInfo``) is the VM ``name`` this lease's daemon
    made, or None when nothing proves it. ``macs``: the MACs the daemon gave this VM (lower
    case; :func:`journal_macs`)."""
    if info.hostname != name:
        return None
    mark = parse_maas_mark(getattr(info, "description", ""))
    if mark and mark["lease"] == lease_id and mark["vm"] == name:
        return f"description marks it as lease {lease_id}'s {name}"
    shared = sorted({m.lower() for m in info.macs} & {m.lower() for m in macs})
    if shared:
        return f"it carries MAC {shared[0]} the daemon gave {name}"
    return None


def journal_macs(entries, name: str) -> set[str]:
    """MACs the daemon recorded for VM ``name`` in a lease's journal entries: the MAC it
    created the MAAS machine with (``maas.create`` data ``mac``) and put in its domain
    (``libvirt.split`` data ``macs``)."""
    out = set()
    for e in entries:
        data = e.get("data") or {}
        if e.get("action") == "maas.create" and e.get("target") == name and data.get("mac"):
            out.add(str(data["mac"]).lower())
        if e.get("action") == "libvirt.split":
            mac = (data.get("macs") or {}).get(name)
            if mac:
                out.add(str(mac).lower())
    return out
