"""What a device's names may be (pure): one rule, used by the server's registration schema
(server/api_hosts.py ``DeviceIn``) and the daemon's config check (agent_host/config.py
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

Names are also judged against each other (:func:`vm_name_clash`, TRIAL4 finding 2): a device
named like another device's VM agent, or equal to another's but for case, is refused by the
registration schema and the engine (server/api_hosts.py ``RegisterIn``, server/hostproto.py
``_refuse_global_clashes``: names are global across agent hosts), the daemon's config check
(agent_host/config.py ``_repeated_devices``) and ``simulate`` (lab/simulate.py).
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


#: A lent VM's agent name as the claim makes it (leases.py ``_insert_lease``): ``<device>-vm<N>``,
#: N from 1 without leading zeros.
_VM_AGENT_RE = re.compile(r"^(.+)-vm([1-9][0-9]*)$")


def name_index(names) -> dict[str, list[str]]:
    """``{lower-case name: [names as written, sorted]}`` of ``names`` (an iterable of device
    ``agent_name`` strings), the form :func:`vm_name_clash` looks names up in."""
    index: dict[str, list[str]] = {}
    for n in sorted(set(names)):
        index.setdefault(n.lower(), []).append(n)
    return index


def vm_name_clash(name: str, others, where=None) -> str | None:
    """Why device ``name`` cannot be registered next to the devices ``others``, or None.

    ``others``: their ``agent_name`` strings (any iterable), or a :func:`name_index` of them (so
    a caller checking many names indexes once); an entry equal to ``name`` itself is skipped (an
    exact repeat is the caller's duplicate check: the same device re-registered, or a listed
    twice). ``where``: optional ``{other name: where it is}`` (e.g. ``"devices.3"``, ``"agent
    host h1"``) said next to the other's name. Names are global across agent hosts.

    A clash is: (a) ``name`` equals another's name but for case: MAAS hostnames are
    case-insensitive (canonical/maas ``src/maasserver/utils/dns.py``: a DNS label), so their VMs'
    MAAS machines would clash; (b) ``name`` is ``<other>-vm<N>``, N in 1..MAX_VMS_PER_DEVICE,
    any case: one of the other's VM agents (leases.py ``_insert_lease``), which would share its
    Testflinger agent name, supervisord program and agent folder (and MAAS hostname) while the
    other is lent; (c) the same the other way round: another is ``<name>-vm<N>``. Shapes: ``str``,
    ``Iterable[str] | dict[str, list[str]]``, ``Mapping[str, str] | None -> str | None``. Pure.
    """
    index = others if isinstance(others, dict) else name_index(others)
    where = where or {}

    def said(other: str) -> str:
        return f"device {other!r}" + (f" ({where[other]})" if other in where else "")

    low = name.lower()
    same = [o for o in index.get(low, ()) if o != name]
    if same:
        return (f"{name!r} differs from {said(same[0])} only in case: MAAS hostnames are "
                f"case-insensitive, so their VMs ({name}-vm1, {same[0]}-vm1, ...) would be one "
                "MAAS machine; each device needs a name of its own whatever the case")
    m = _VM_AGENT_RE.match(low)
    if m and int(m.group(2)) <= MAX_VMS_PER_DEVICE:
        for other in index.get(m.group(1), ()):
            return (f"{name!r} is the agent name of VM {m.group(2)} of {said(other)} "
                    f"({other}-vm{m.group(2)}, made while it is lent): both would be one "
                    "Testflinger agent, supervisord program, agent folder and MAAS hostname; "
                    "rename this device")
    for n in range(1, MAX_VMS_PER_DEVICE + 1):
        for other in index.get(f"{low}-vm{n}", ()):
            return (f"{name!r} would name its VM {n} {name}-vm{n} while lent, which is "
                    f"{said(other)}: both would be one Testflinger agent, supervisord program, "
                    "agent folder and MAAS hostname; rename one of them")
    return None
