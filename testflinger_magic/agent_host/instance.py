"""The daemon's instance id: which machine and ``state_dir`` a daemon of an agent host runs from.

Two daemons configured with one ``agent_host`` on two machines both worked the same leases (one
re-ran the restore of a returned lease: it released the MAAS machine and restarted the device
agent). On one machine the flocks of statedir.py refuse the second; across machines only the
server sees both, so every register and heartbeat carries this id (docs/api.md) and the server
refuses (409) a second instance while the one it knows still heartbeats
(server/hostinstance.py).

The id is ``"<hostname>/<machine id, first 12 chars>:<state_dir resolved>"``, e.g.
``"lab-07/3d1219c7c4c5:/var/lib/testflinger-magic"``: readable, so an operator recognises the
machine in the refusal, and stable across restarts of the same machine and ``state_dir``, so a
daemon killed with ``kill -9`` and started again at once is the same instance and accepted at
once. The machine id is systemd's ``/etc/machine-id`` (machine-id(5): 32 lower-case hex
digits, unique per installation, stable across boots), else D-Bus' ``/var/lib/dbus/machine-id``
(the same format, the file systemd's replaces), else nothing (the hostname alone names the
machine then: ``"<hostname>:<state_dir>"``).
"""

from __future__ import annotations

import hashlib
import os
import socket

#: Where the machine id is read, first readable non-empty file wins (module docstring).
MACHINE_ID_PATHS = ("/etc/machine-id", "/var/lib/dbus/machine-id")
#: Longest id the server accepts (server/api_hosts.py RegisterIn.instance, HeartbeatIn.instance).
MAX_INSTANCE = 300
#: Characters of the machine id kept in the id (48 bits: enough to tell a lab's machines apart).
MACHINE_ID_CHARS = 12


def read_machine_id(paths=MACHINE_ID_PATHS) -> str | None:
    """The machine id: the first line of the first of ``paths`` that can be read and is not
    empty, stripped; None when none can (a container without one)."""
    for path in paths:
        try:
            with open(path, encoding="ascii", errors="replace") as f:
                line = f.readline().strip()
        except OSError:
            continue
        if line:
            return line
    return None


def compose_instance(hostname: str, machine_id: str | None, state_dir: str) -> str:
    """The instance id of ``hostname`` + ``machine_id`` (None: unknown) + ``state_dir`` (an
    absolute path, already resolved): ``"<hostname>/<machine_id[:12]>:<state_dir>"``, or
    ``"<hostname>:<state_dir>"`` without a machine id. Pure. At most :data:`MAX_INSTANCE`
    characters: a longer one keeps its head and ends with ``~`` and 12 hex digits of the whole
    id's SHA-256, so it stays stable and distinct."""
    machine = f"{hostname or 'unknown-host'}"
    if machine_id:
        machine += f"/{machine_id[:MACHINE_ID_CHARS]}"
    full = f"{machine}:{state_dir}"
    if len(full) <= MAX_INSTANCE:
        return full
    digest = hashlib.sha256(full.encode("utf-8", "replace")).hexdigest()[:12]
    return f"{full[:MAX_INSTANCE - 13]}~{digest}"


def instance_id(state_dir: str | os.PathLike, *, machine_id_paths=MACHINE_ID_PATHS,
                hostname: str | None = None) -> str:
    """This daemon's instance id (module docstring) for ``state_dir``: the machine id read
    from ``machine_id_paths`` (:func:`read_machine_id`), ``hostname`` (default
    ``socket.gethostname()``) and ``state_dir`` resolved (``os.path.realpath``: symlinks and
    ``..`` removed, so two spellings of one folder give one id). Reads files, changes
    nothing, raises nothing."""
    return compose_instance(hostname if hostname is not None else socket.gethostname(),
                            read_machine_id(machine_id_paths),
                            os.path.realpath(os.fspath(state_dir)))
