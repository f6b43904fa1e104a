"""The embedded lab's work directory and processes (used by :mod:`.lab` and :mod:`.demo`).

- Which processes belong to a lab: those with one of its paths on their command line
  (:func:`processes_mentioning`; supervisord puts each program in its own process group, so a
  lab cannot find them by process group), and stopping them (:func:`_terminate`).
- Whether a folder may hold a new lab (:func:`prepare_workdir`, decided by the pure
  :func:`workdir_verdict`): new, empty, or an earlier lab's, cleaned first; anything else refused.
- The window of metrics ports a lab's agents use, below Linux's ephemeral range
  (:func:`_free_port_window`).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import time
from pathlib import Path

log = logging.getLogger(__name__)


class LabError(RuntimeError):
    """A lab component failed; the message names the component."""


#: The file that marks a folder as a lab's work directory (JSON ``{"pid", "started_at",
#: "process_start"}``: the process that runs the lab, e.g. ``lab up`` or ``demo``).
MARKER = ".testflinger-magic-lab"


#: What a lab creates in its work directory (all of it is removed before a lab reuses the
#: folder): supervisord's folder (its conf.d holds the device and VM agent programs), the
#: device agents' and VM agents' folders, the libvirt test hosts, the daemon's config, state
#: and log, the agents' refresh token.
LAB_ENTRIES = ("supervisor", "device-agents", "agent-configs", "hosts", "daemon-state",
               "agent-host.yaml", "daemon.log", "refresh_token", MARKER)


def _lab_markers(workdir: Path) -> list[str]:
    """Paths that only the processes of a lab in ``workdir`` have on their command line (its
    agents' ``--token-file``, the daemon's ``--config``, supervisord's ``-c``)."""
    return [str(workdir / "refresh_token"), str(workdir / "agent-host.yaml"),
            str(workdir / "supervisor" / "supervisord.conf")]


def workdir_verdict(entries: list[str], marker: dict | None, owner_alive: bool) -> tuple[str, str]:
    """Pure: what to do with a work directory holding ``entries`` (names, top level), whose
    :data:`MARKER` reads ``marker`` (None: absent or unreadable) and whose owner process is
    alive or not. ``("use", "")`` for an empty folder, ``("clean", why)`` for a folder an
    earlier lab left behind, ``("refuse", why)`` otherwise: a running lab's folder, or a
    folder that is not a lab's (a lab would mix its files with someone else's, and cleaning
    it would delete them)."""
    if not entries:
        return "use", ""
    # A lab from before the marker existed: its supervisord folder and daemon config.
    legacy = {"supervisor", "agent-host.yaml"} <= set(entries)
    if marker is None and not legacy:
        shown = ", ".join(sorted(entries)[:5]) + (", ..." if len(entries) > 5 else "")
        return "refuse", (f"it is not empty and not a lab's work directory (it holds {shown}); "
                          "give a new or empty folder, or leave --workdir out for a "
                          "temporary one")
    if marker is not None and owner_alive:
        return "refuse", (f"a lab (pid {marker.get('pid')}) is running in it; stop that lab "
                          "first, or give another folder")
    return "clean", "an earlier lab left it behind"


def prepare_workdir(workdir: Path) -> None:
    """Make ``workdir`` ready for a new lab, or raise :class:`LabError` saying why not.

    A new or empty folder is used as it is. A folder an earlier lab left behind (its
    :data:`MARKER`, or the layout of a lab from before the marker) whose owner no longer runs
    is cleaned first: whatever of that lab still runs (supervisord, device and VM agents
    crash-looping against the dead server, the daemon) is terminated, then the lab's files
    (:data:`LAB_ENTRIES`: supervisord's conf.d with its programs, the daemon's state, the
    hosts) removed, so nothing of the old lab is started again. Anything else is refused
    (:func:`workdir_verdict`). Last, the marker is written with this process's pid."""
    import shutil

    workdir.mkdir(parents=True, exist_ok=True)
    entries = sorted(p.name for p in workdir.iterdir())
    marker = None
    try:
        marker = json.loads((workdir / MARKER).read_text())
        if not isinstance(marker, dict):
            marker = {}
    except FileNotFoundError:
        pass
    except (OSError, ValueError):
        marker = {}  # a lab's marker, unreadable: still a lab's folder
    pid = marker.get("pid") if marker else None
    # The pid with its start time: a pid reused by another process is no lab.
    owner_alive = (isinstance(pid, int) and pid != os.getpid() and _alive(pid)
                   and _process_start(pid) == marker.get("process_start"))
    verdict, why = workdir_verdict(entries, marker, owner_alive)
    if verdict == "refuse":
        raise LabError(f"work directory {workdir}: {why}")
    if verdict == "clean":
        left = processes_mentioning(_lab_markers(workdir))
        if left:
            log.warning("lab: %s: %s; terminating its processes still running: %s", workdir, why,
                        " ".join(map(str, left)))
            _terminate(left)
            left = processes_mentioning(_lab_markers(workdir))
            if left:
                raise LabError(f"work directory {workdir}: processes of an earlier lab would "
                               f"not stop: {' '.join(map(str, left))}")
        removed = [name for name in LAB_ENTRIES if (workdir / name).exists()
                   or (workdir / name).is_symlink()]
        for name in removed:
            path = workdir / name
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path)
            else:
                path.unlink()
        log.info("lab: %s: %s; removed %s", workdir, why, ", ".join(removed) or "nothing")
    (workdir / MARKER).write_text(json.dumps({"pid": os.getpid(), "started_at": time.time(),
                                              "process_start": _process_start(os.getpid())}))


def _process_start(pid: int) -> int | None:
    """When ``pid`` started, in clock ticks after boot (``/proc/<pid>/stat`` field 22,
    proc(5) ``starttime``); None when it cannot be read."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return int(f.read().rsplit(b")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


def _terminate(pids: list[int], grace: float = 5.0) -> None:
    """SIGTERM ``pids``, SIGKILL those still alive after ``grace`` seconds."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, sig)
        end = time.monotonic() + grace
        while time.monotonic() < end:
            pids = [p for p in pids if _alive(p)]
            if not pids:
                return
            time.sleep(0.1)


def processes_mentioning(markers: list[str]) -> list[int]:
    """PIDs of this user's live processes, other than this one, whose command line contains one
    of ``markers`` (zombies excluded: already dead). Empty where /proc is missing."""
    me, uid = os.getpid(), os.getuid()
    found = []
    try:
        entries = list(os.scandir("/proc"))
    except OSError:
        return []
    for entry in entries:
        if not entry.name.isdigit() or int(entry.name) == me:
            continue
        try:
            if entry.stat().st_uid != uid:
                continue
            args = Path(entry.path, "cmdline").read_bytes().decode(errors="replace")
        except OSError:  # gone meanwhile
            continue
        if any(m in args for m in markers) and _alive(int(entry.name)):
            found.append(int(entry.name))
    return found


def process_command_lines(markers: list[str]) -> list[str]:
    """``"<pid>: <command line>"`` of each process :func:`processes_mentioning` finds (for
    messages: which lab process outlived its stop)."""
    lines = []
    for pid in processes_mentioning(markers):
        try:
            lines.append(f"{pid}: " + Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode())
        except OSError:  # gone meanwhile
            continue
    return lines


def _alive(pid: int) -> bool:
    """True while ``pid`` runs (a zombie, already dead but not reaped, counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except (OSError, IndexError):
        return False


def ephemeral_port_range(path: str = "/proc/sys/net/ipv4/ip_local_port_range") -> tuple[int, int]:
    """Linux's ephemeral port range ``(low, high)`` inclusive, from which the kernel picks the
    local port of every outgoing connection (``ip_local_port_range``, Documentation/networking/
    ip-sysctl.rst; default 32768 60999). (32768, 60999) when it cannot be read."""
    try:
        low, high = (int(x) for x in Path(path).read_text().split()[:2])
        return low, high
    except (OSError, ValueError):
        return 32768, 60999


def _free_port_window(size: int = 200) -> tuple[int, int]:
    """A ``[low, high)`` window of metrics ports for this lab's agents.

    A production agent host has one allocator (its daemon) over the charm's 8000-9999. Several
    labs on one machine (tests, a demo next to ``lab up``) would each allocate from 8000 and race
    between "bindable" and "bound"; a window starting at a random free port keeps them apart.
    The window lies below the ephemeral range (:func:`ephemeral_port_range`): a port in it can
    be taken at any moment by an outgoing connection's local port, and an agent whose metrics
    port is taken exits and is restarted over and over.
    """
    import random
    import socket

    rng = random.Random()
    top = min(ephemeral_port_range()[0], 65536) - size
    for _ in range(50):
        low = rng.randrange(10000, max(10001, top), 100)
        if low + size > ephemeral_port_range()[0]:
            continue
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", low))
            except OSError:
                continue
        return low, low + size
    return 8000, 10000
