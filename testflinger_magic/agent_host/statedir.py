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

``HostLock(agent_host, config_path, lock_dir)``: the same kind of ``flock``, machine-wide and
keyed by the agent host's name: ``<dir>/testflinger-magic-agent-host-<agent_host>.lock``. The
state_dir lock alone let a second daemon of one agent host start from a copy of its config with
another ``state_dir`` (second trial finding 1): both worked the same leases (one re-ran a restore
of an already returned lease, releasing its MAAS machine). ``<dir>`` is ``lock_dir`` (the
config's ``host_lock_dir``) when set, else the first writable of :data:`HOST_LOCK_DIRS`:
``/run/lock`` (FHS 3.0 §3.15.4: lock files of resources shared between programs; on systemd
systems a world-writable sticky tmpfs, so daemons of every user meet there) then ``/tmp``
(shared by every user of the machine too). The user's runtime folder (``$XDG_RUNTIME_DIR``)
is not used: it is per user, so two users' daemons of one agent host would miss each other.
The file is made 0644 and opened read-only when it belongs to another user (a ``flock`` needs
no write access), so one user's old lock file never blocks another's daemon.

Both locks see one machine only: a daemon of the same agent host on another machine is refused
by the server, from the instance id each daemon sends (agent_host/instance.py,
server/hostinstance.py).
"""

from __future__ import annotations

import fcntl
import os
import time
from pathlib import Path

LOCK_NAME = "daemon.lock"
#: where :class:`HostLock` looks, first writable folder wins (module docstring).
HOST_LOCK_DIRS = ("/run/lock", "/tmp")


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


class _FileLock:
    """What both locks share: a held ``flock`` on an open file (dropped with the file
    descriptor, so also by the kernel when the process dies, even by SIGKILL)."""

    _fd: int | None = None

    @staticmethod
    def _take(fd: int, limit: int) -> str | None:
        """Lock ``fd`` (exclusive, not waiting); None when taken, else what the holder wrote
        (its first ``limit`` bytes; ``fd`` is closed then)."""
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            try:
                return os.pread(fd, limit, 0).decode("utf-8", "replace").strip()
            finally:
                os.close(fd)
        return None

    @staticmethod
    def _stamp(fd: int, extra: str = "") -> None:
        """Write ``pid <n> since <UTC time>[ extra]`` into the held lock file."""
        os.ftruncate(fd, 0)
        os.pwrite(fd, (f"pid {os.getpid()} since "
                       f"{time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())}"
                       f"{' ' + extra if extra else ''}\n").encode(), 0)

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # drops the flock; the file stays (removing it would race)
            self._fd = None

    def __enter__(self):
        return self.acquire()

    def __exit__(self, *exc):
        self.release()


class StateLock(_FileLock):
    """An exclusive lock on ``<state_dir>/daemon.lock`` (see the module docstring).
    ``acquire()`` raises :class:`StateDirBusy`; ``release()`` drops it. A context manager."""

    def __init__(self, state_dir: str | os.PathLike):
        self.path = Path(state_dir) / LOCK_NAME
        self._fd: int | None = None

    def acquire(self) -> "StateLock":
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        holder = self._take(fd, 200)
        if holder is not None:
            raise StateDirBusy(self.path, holder)
        self._stamp(fd)
        self._fd = fd
        return self


def host_lock_dir(configured: str | None = None) -> Path:
    """The folder of :class:`HostLock`'s file: ``configured`` when set (created if missing),
    else the first of :data:`HOST_LOCK_DIRS` this user can write in. Raises ``OSError`` when
    ``configured`` cannot be created."""
    if configured:
        folder = Path(configured)
        folder.mkdir(parents=True, exist_ok=True)
        return folder
    for name in HOST_LOCK_DIRS:
        if os.path.isdir(name) and os.access(name, os.W_OK | os.X_OK):
            return Path(name)
    return Path(HOST_LOCK_DIRS[-1])


class HostBusy(RuntimeError):
    """Another daemon of the same agent host runs on this machine; ``holder`` is what it wrote
    in the lock file (``pid <n> since <time> config <path>``), or "" when unreadable."""

    def __init__(self, agent_host: str, path: Path, holder: str):
        self.agent_host, self.path, self.holder = agent_host, path, holder
        super().__init__(
            f"another agent-host daemon for agent host {agent_host!r} runs on this machine "
            f"({holder or 'pid unknown'}; lock {path}): one daemon per agent host, whatever "
            "its state_dir (stop it first, or give this one its own agent_host)")


class HostLock(_FileLock):
    """An exclusive machine-wide lock keyed by the agent host's name (module docstring).

    ``agent_host``: the config's name (config.AGENT_HOST_RE: a safe file name part);
    ``config_path``: written in the lock file for the refusal message; ``lock_dir``: the
    config's ``host_lock_dir`` or None. ``acquire()`` raises :class:`HostBusy` (or ``OSError``
    when no lock file can be opened); ``release()`` drops it. A context manager."""

    def __init__(self, agent_host: str, config_path: str = "", lock_dir: str | None = None):
        self.agent_host, self.config_path = agent_host, str(config_path)
        self.path = host_lock_dir(lock_dir) / f"testflinger-magic-agent-host-{agent_host}.lock"
        self._fd: int | None = None

    def _open(self) -> tuple[int, bool]:
        """(fd, writable). An existing file is opened without O_CREAT: in a sticky folder
        (/run/lock, /tmp) Linux' fs.protected_regular refuses O_CREAT on another user's file."""
        while True:
            for flags, writable in ((os.O_RDWR, True), (os.O_RDONLY, False)):
                try:
                    return os.open(self.path, flags), writable
                except PermissionError:
                    continue
                except FileNotFoundError:
                    break
            else:
                raise PermissionError(f"cannot open {self.path}")
            try:
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
                os.fchmod(fd, 0o644)  # whatever the umask: others must open it to lock
                return fd, True
            except FileExistsError:
                continue  # another start made it just now: open that one

    def acquire(self) -> "HostLock":
        fd, writable = self._open()
        holder = self._take(fd, 1000)
        if holder is not None:
            raise HostBusy(self.agent_host, self.path, holder)
        if writable:
            self._stamp(fd, f"config {self.config_path}")
        self._fd = fd
        return self
