"""Writing files that must never be seen half-written, and reading the operator's input files
(definitions, agent-host.yaml, traces) with a bound."""

from __future__ import annotations

import errno
import os
import pwd
import stat
import tempfile
from pathlib import Path

#: Largest definitions file or agent-host.yaml read, bytes (1 MiB): a lab's whole queue file is
#: a few KiB and an agent-host.yaml of 256 devices (config.MAX_DEVICES_PER_HOST) about 50 KiB;
#: ``validate /dev/urandom`` must not read for ever.
MAX_INPUT_FILE = 1024 * 1024


class InputFileError(ValueError):
    """An input file that is not read: not a regular file, or larger than the bound. ``str()``
    says why, without the file's name (the caller's error names it)."""


_KINDS = ((stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
          (stat.S_ISFIFO, "a pipe (FIFO)"), (stat.S_ISSOCK, "a socket"))


def read_input_text(path: Path | str, limit: int = MAX_INPUT_FILE) -> str:
    """The UTF-8 text of the regular file ``path``, at most ``limit`` bytes.

    Raises :class:`InputFileError` for a file that is not regular (a device such as
    ``/dev/urandom``, a FIFO, a socket: refused before it is opened, so nothing blocks) or
    larger than ``limit`` (checked on its size, and again on what is read: a file that grows
    or lies about its size is read only to ``limit + 1`` bytes); ``OSError``
    (``FileNotFoundError``, ``IsADirectoryError``, ``PermissionError``...) and
    ``UnicodeDecodeError`` as ``Path.read_text`` raises them."""
    mode = os.stat(path).st_mode
    if stat.S_ISDIR(mode):
        raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), str(path))
    if not stat.S_ISREG(mode):
        kind = next((name for test, name in _KINDS if test(mode)), "not a regular file")
        raise InputFileError(f"is {kind}, not a regular file; give a file's path")
    with open(path, "rb") as f:
        data = f.read(limit + 1)
    if len(data) > limit:
        raise InputFileError(f"is larger than {_size(limit)}, the limit for this kind of "
                             "file: is it the right file?")
    return data.decode("utf-8")


def _size(n: int) -> str:
    return f"{n // (1024 * 1024)} MiB" if n % (1024 * 1024) == 0 else f"{n:,} bytes"


def atomic_write(path: Path, text: str, mode: int = 0o644, owner: str | None = None) -> None:
    """Write ``text`` to ``path`` through a temp file in the same folder, fsync, then rename.

    ``mode``: the file's permission bits (0o600 for anything that may hold a secret); ``owner``:
    a user name to chown to. The folder is created if missing. Raises ``OSError`` (and
    ``KeyError`` for an unknown ``owner``); the temp file never outlives a failure.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)  # created 0600
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, mode)
        if owner:
            pw = pwd.getpwnam(owner)
            os.chown(tmp, pw.pw_uid, pw.pw_gid)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
