"""Writing files that must never be seen half-written."""

from __future__ import annotations

import os
import pwd
import tempfile
from pathlib import Path


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
