"""What a device's names may be (pure): one rule, used by the server's registration schema
(server/api.py ``DeviceIn``) and the daemon's config check (agent_host/config.py
``DeviceConfig``), so a name the server would refuse is refused at its line of agent-host.yaml.

A device's ``agent_name`` becomes, per lent VM, ``<agent_name>-vm<N>`` (leases.py, the claim),
which is at once:

* the libvirt domain name, checked at split against :data:`VM_NAME_RE`
  (agent_host/splitplan.py ``check_domains``);
* the MAAS machine's hostname the VM is enrolled with (agent_host/bringup.py ``enroll``): MAAS
  refuses a host label holding ``_``, any character but letters, digits and ``-``, a label
  starting or ending with ``-``, or longer than 63 characters, and a ``.`` splits the name into
  host and domain (canonical/maas ``src/maasserver/utils/dns.py``: ``validate_hostname`` and
  ``validate_domain_name``, the validators of ``Node.hostname``);
* the VM agent's folder ``<agent_configs_dir>/<agent_name>-vm<N>`` and its supervisord program
  (agent_host/agents.py ``<conf_dir>/<name>.conf``), so never ``/`` nor ``..``; supervisord
  refuses a program name holding a space, ``:`` or ``/`` (supervisor ``datatypes.py``
  ``process_or_group_name``).

Hence :data:`DEVICE_NAME_RE`: letters, digits and ``-``, starting with a letter or digit, at
most :data:`MAX_DEVICE_NAME` characters so that ``-vm<MAX_VMS_PER_DEVICE>`` still fits MAAS'
63-character host label. ``supervisor_program`` (the device agent's existing program, the
charm's directory name, TESTFLINGER.md §6.2) is passed to supervisord's XML-RPC
``stopProcess``/``startProcess``, where ``group:name`` names a process of a group, so it follows
:data:`PROGRAM_NAME_RE`: supervisord's own rule (no space, ``:`` or ``/``) narrowed to the VM
name characters, optionally ``<group>:`` first. ``maas_system_id`` is a path segment of every MAAS
API call (``machines/<system_id>/``): :data:`SYSTEM_ID_RE` (MAAS makes them of lower-case letters
and digits, ``node-<uuid>`` for old machines).
"""

from __future__ import annotations

import re

from testflinger_magic.queue_bounds import MAX_VMS_PER_DEVICE

#: A VM's libvirt domain name at split (agent_host/splitplan.py ``check_domains``).
VM_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.+-]{0,62}$")
#: Longest MAAS host label (canonical/maas ``validate_domain_name``: "Label is too long").
MAX_HOST_LABEL = 63
#: What the claim appends to a device's name for its VMs, at its longest (``-vm64``).
VM_SUFFIX_MAX = len(f"-vm{MAX_VMS_PER_DEVICE}")
#: Longest device ``agent_name``: its VMs' names must still fit a MAAS host label.
MAX_DEVICE_NAME = MAX_HOST_LABEL - VM_SUFFIX_MAX
#: A device's ``agent_name`` (see the module docstring).
DEVICE_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9-]{0,%d}$" % (MAX_DEVICE_NAME - 1))
#: A supervisord program, optionally ``group:`` first (see the module docstring).
PROGRAM_NAME_RE = re.compile(r"^(?:[A-Za-z0-9][A-Za-z0-9_.+-]{0,99}:)?"
                             r"[A-Za-z0-9][A-Za-z0-9_.+-]{0,99}$")
#: A MAAS system_id (see the module docstring).
MAX_SYSTEM_ID = 100
SYSTEM_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]{0,%d}$" % (MAX_SYSTEM_ID - 1))


def vm_name(device: str, index: int) -> str:
    """The name the claim gives a device's VM ``index`` (0-based): ``<device>-vm<index + 1>``
    (leases.py ``_insert_lease``; also the VM's agent name, MAAS hostname and libvirt domain).
    Shapes: ``(str, int) -> str``."""
    return f"{device}-vm{index + 1}"


def device_name_problem(value: str) -> str | None:
    """Why ``value`` cannot be a device's ``agent_name``, or None. Shapes: ``str -> str``."""
    if DEVICE_NAME_RE.match(value):
        return None
    if len(value) > MAX_DEVICE_NAME:
        return (f"{len(value)} characters; at most {MAX_DEVICE_NAME}, so its VMs' names "
                f"(<name>-vm1..-vm{MAX_VMS_PER_DEVICE}) fit a MAAS hostname "
                f"({MAX_HOST_LABEL} characters)")
    return (f"{value!r}: letters, digits and '-' only, starting with a letter or digit (its VMs "
            "are named <name>-vmN: a MAAS hostname, a libvirt domain and a folder under "
            "agent_configs_dir)")


def program_name_problem(value: str) -> str | None:
    """Why ``value`` cannot be a ``supervisor_program``, or None."""
    if PROGRAM_NAME_RE.match(value):
        return None
    return (f"{value!r}: a supervisord program name, optionally group:name: letters, digits, "
            "'_', '.', '+' and '-', starting with a letter or digit, at most 100 characters "
            "each (supervisord refuses a space, ':' or '/' in a name)")


def system_id_problem(value: str) -> str | None:
    """Why ``value`` cannot be a ``maas_system_id``, or None."""
    if SYSTEM_ID_RE.match(value):
        return None
    return (f"{value!r}: a MAAS system_id: letters, digits, '_' and '-', starting with a "
            f"letter or digit, at most {MAX_SYSTEM_ID} characters (it is a path segment of "
            "MAAS API calls)")
