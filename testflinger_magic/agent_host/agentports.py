"""Metrics ports of the agent programs under supervisord: read from the conf files, reserved
under a lock (the ports half of :class:`agents.AgentProcesses`, split from agents.py).

Facts honoured (canonical/testflinger, see ../shared/TESTFLINGER.md §6): the agent-host charm
(``src/supervisord.py``) reads ``-p N`` back from every ``conf.d/*.conf`` and gives a new agent
the first port in ``range(8000, 10000)`` that binds on localhost.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import re
import socket
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterable, Iterator

log = logging.getLogger(__name__)

_SECTION = re.compile(r"^\s*\[program:([^\]]+)\]")
_PORT_FLAG = re.compile(r"(?:^|\s)(?:-p|--metrics_port)(?:\s+|=)(\d+)(?=\s|$)")


def parse_program_ports(text: str) -> dict[str, int | None]:
    """Map each ``[program:x]`` in a supervisord conf text to its ``-p N`` port (None if absent).

    Like the charm's ``parse_supervisor_config_file`` but for every program in the file and for
    any command (the lab's stand-in agents are not called ``testflinger-agent``).
    """
    found: dict[str, int | None] = {}
    current = None
    for raw in text.splitlines():
        section = _SECTION.match(raw)
        if section:
            current = section.group(1).strip()
            found[current] = None
        elif raw.strip().startswith("[") and current:
            current = None
        elif current and raw.strip().startswith("command="):
            m = _PORT_FLAG.search(raw.strip()[len("command="):])
            if m:
                found[current] = int(m.group(1))
    return found


def _port_bindable(port: int) -> bool:
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", port))
        return True
    except OSError:
        return False


class PortReservations:
    """The metrics-port methods of :class:`agents.AgentProcesses` (a mixin). Uses the host's
    attributes ``conf_dir`` (Path), ``lock_path`` (Path), ``port_range`` (half-open
    ``(first, end)``) and ``reservation_ttl`` (seconds), and raises the host module's
    ``AgentProcessError`` through ``_port_error``."""

    conf_dir: Path
    lock_path: Path
    port_range: tuple[int, int]
    reservation_ttl: float

    def _port_error(self, owner: str | None, message: str) -> Exception:
        raise NotImplementedError

    # -- ports -------------------------------------------------------------------------------------
    def allocate_port(self, exclude: Iterable[int] = (), *, owner: str | None = None) -> int:
        """Reserve and return a metrics port unique on this host.

        Skips ports named by ``-p N`` in any ``conf.d/*.conf``, ports reserved in ``lock_path``
        (by earlier allocations or live VM agents), ``exclude``, and ports that cannot be bound
        on 127.0.0.1. The whole check-and-reserve runs under an exclusive ``flock`` so concurrent
        splits (threads or processes) never get the same port. ``owner`` (a VM agent name) keeps
        the reservation until :meth:`remove_vm_agent`; otherwise it lapses after ``reservation_ttl``
        unless :meth:`add_vm_agent` takes it. Raises AgentProcessError when the range is full.
        """
        with self._locked() as reservations:
            return self._pick_port(reservations, exclude, owner)

    def _pick_port(self, reservations: dict, exclude: Iterable[int] = (),
                   owner: str | None = None) -> int:
        """:meth:`allocate_port`'s choice, with the lock held (``reservations`` from it)."""
        used = set(int(p) for p in exclude) | {int(p) for p in reservations}
        used |= {p for p in self._conf_ports().values() if p is not None}
        for port in range(*self.port_range):
            if port in used or not _port_bindable(port):
                continue
            reservations[str(port)] = {"owner": owner, "at": time.time()}
            return port
        raise self._port_error(owner, f"no free port in range {self.port_range[0]}-{self.port_range[1] - 1}")

    def release_port(self, port: int) -> None:
        """Forget a reservation made by :meth:`allocate_port` (e.g. a split that was abandoned)."""
        with self._locked() as reservations:
            reservations.pop(str(int(port)), None)

    def reservation_owners(self) -> dict[str, float]:
        """``{VM agent name: epoch seconds reserved}`` of the owned metrics port reservations
        (the orphan sweep lists those whose conf file is missing)."""
        with self._locked() as reservations:
            return {str(r["owner"]): float(r.get("at") or 0.0)
                    for r in reservations.values() if r.get("owner")}

    def _conf_ports(self) -> dict[str, int | None]:
        ports: dict[str, int | None] = {}
        if self.conf_dir.is_dir():
            for path in sorted(self.conf_dir.glob("*.conf")):
                try:
                    ports.update(parse_program_ports(path.read_text(errors="replace")))
                except OSError:  # deleted under us (e.g. the charm's wipe)
                    continue
        return ports

    def _own_port(self, reservations: dict, name: str, port: int) -> None:
        """Make ``port`` the one reservation of ``name``. One it already owns is kept as it is
        (an owned reservation never lapses, so its time needs no refresh, and the file is then
        not rewritten)."""
        for p in [p for p, r in reservations.items() if r.get("owner") == name and int(p) != port]:
            del reservations[p]
        if (reservations.get(str(port)) or {}).get("owner") != name:
            reservations[str(port)] = {"owner": name, "at": time.time()}

    @contextmanager
    def _locked(self) -> Iterator[dict]:
        """Hold an exclusive flock on ``lock_path`` and yield its reservations, saved on exit.

        ``flock`` (not ``lockf``) because its locks belong to the open file, so two threads of one
        process exclude each other too.
        """
        self.lock_path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.lock_path, os.O_RDWR | os.O_CREAT, 0o600)
        with os.fdopen(fd, "r+") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            try:
                raw = f.read()
                try:
                    reservations = json.loads(raw).get("reserved", {}) if raw.strip() else {}
                except (ValueError, AttributeError):
                    log.warning("%s: unreadable port reservations, starting afresh", self.lock_path)
                    reservations = {}
                now = time.time()
                for port in [p for p, r in reservations.items()
                             if r.get("owner") is None and now - r.get("at", 0) > self.reservation_ttl]:
                    del reservations[port]
                before = json.dumps(reservations, sort_keys=True)
                yield reservations
                if json.dumps(reservations, sort_keys=True) != before:
                    f.seek(0)
                    f.truncate()
                    f.write(json.dumps({"reserved": reservations}, sort_keys=True, indent=1))
                    f.flush()
                    os.fsync(f.fileno())
            finally:
                fcntl.flock(f, fcntl.LOCK_UN)
