"""The daemon's ``state_dir`` at start: usable (created if missing, writable) and held by one
daemon only.

``state_dir_problem(path) -> str | None``: why ``state_dir`` cannot hold the lease journals
(journal.py) and the pre-warm launcher (prewarm.py), None when it can; it creates the folder
(parents too) and writes and removes a probe file. ``agent-host check`` reports the
problem; the daemon refuses to start with it (before it registers: a daemon that registers and
then cannot write a journal fails every lease lent to it, counting a failure on each device).

``StateLock(path)``: an exclusive ``flock`` on ``<state_dir>/daemon.lock`` for the daemon's
lifetime, holding the holder's pid and start time. Two daemons on one ``state_dir`` (one agent
host) would run the same leases' steps at once and undo each other's work (the trial's "is
'Ready'" / "does not stay up" race); the second is refused naming the first's pid. The lock
goes with the process (the kernel drops a ``flock`` when its file is closed, SIGKILL included),
so a crashed daemon never blocks the next start.
"""

from __future__ import annotations

import fcntl
import os
import time
from pathlib import Path

LOCK_NAME = "daemon.lock"


def state_dir_problem(path: str | os.PathLike) -> str | None:
    """Create ``path`` if missing and check a file can be written in it; the problem (naming
    the folder and the OS error) or None. The mode is the umask's, as before this check: the
    VM agents' user must reach ``<state_dir>/agent_launcher.py`` (prewarm.py); the journals
    in it are 0600 files themselves."""
    folder = Path(path)
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        return f"cannot create {folder}: {exc.strerror or exc}"
    if not folder.is_dir():
        return f"{folder} is not a directory"
    probe = folder / f".write-probe-{os.getpid()}"
    try:
        probe.write_text("ok")
        probe.unlink()
    except OSError as exc:
        return f"cannot write in {folder}: {exc.strerror or exc}"
    return None


class StateDirBusy(RuntimeError):
    """Another process holds ``<state_dir>/daemon.lock``; ``holder`` is what it wrote there
    (``pid <n> since <time>``), or "" when unreadable."""

    def __init__(self, path: Path, holder: str):
        self.path, self.holder = path, holder
        super().__init__(f"another agent-host daemon ({holder or 'pid unknown'}) holds {path}: "
                         "one daemon per agent host and state_dir (stop it first, or give this "
                         "one its own agent_host and state_dir)")


class StateLock:
    """An exclusive lock on ``<state_dir>/daemon.lock`` (see the module docstring).
    ``acquire()`` raises :class:`StateDirBusy`; ``release()`` drops it. A context manager."""

    def __init__(self, state_dir: str | os.PathLike):
        self.path = Path(state_dir) / LOCK_NAME
        self._fd: int | None = None

    def acquire(self) -> "StateLock":
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            try:
                holder = os.pread(fd, 200, 0).decode("utf-8", "replace").strip()
            finally:
                os.close(fd)
            raise StateDirBusy(self.path, holder) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, (f"pid {os.getpid()} since "
                       f"{time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())}\n").encode(), 0)
        self._fd = fd
        return self

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # drops the flock
            self._fd = None

    def __enter__(self):
        return self.acquire()

    def __exit__(self, *exc):
        self.release()
