"""Pre-warmed VM agents: their command line through ``agent_launcher.py``, their go files, and
where the launcher lives on an agent host.

A pre-warmed VM agent program runs ``<python> <launcher> <go-file> <original command...>``
(agent_launcher.py: it imports the agent, waits for ``<go-file>``, then runs the original
command as if started directly). The enroll step starts such programs as soon as their metrics
ports are allocated, so the agents' start-up overlaps MAAS' commissioning of the VMs; the
active check writes the go files once the server accepted the lease's ``active`` report and so
lifted the VM agents' fences (bringup.py). A command the launcher cannot run (:func:`wrap_argv`
gives None) keeps the behaviour without pre-warm: the program starts only once the lease is
``active``.

Pure: :func:`shebang_python`, :func:`wrap_argv`, :func:`unwrap_argv`, :func:`normal_argv`,
:func:`go_path`. Effects: :func:`wrap_command` (reads the script's first line),
:func:`install_launcher`, :func:`write_go`, :func:`clear_go`.

Where the launcher lives (:func:`install_launcher`): the daemon copies it at every start to
``<state_dir>/agent_launcher.py`` (mode 0644). The path is stable across snap refreshes
(``state_dir`` is under ``$SNAP_COMMON`` in the snap, never in a revision's folder or a path
naming the snap's Python version), a refresh restarts the daemon, which copies the new
revision's launcher, and programs already running keep the one they started with. The agents
run as ``supervisor.program_user`` (``ubuntu``): when that user could not read the file (a
folder on the way it cannot enter), pre-warm is off with a warning and VM agents start as
without it.

Go file: ``<agent_dir>/.testflinger-magic-go``, inside the VM agent folder: it goes with the
folder (restore, the orphan sweep, and the agent-host charm's config-changed, which replaces
the whole agent-configs tree, TESTFLINGER.md §6.1, §6.4), and the agent's user can see it
where it reads its own config.
"""

from __future__ import annotations

import logging
import os
import pwd
import re
import shlex
from pathlib import Path

from ..fileutil import atomic_write

log = logging.getLogger(__name__)

#: File name of the launcher, in the package and where the daemon installs it.
LAUNCHER_NAME = "agent_launcher.py"
#: The launcher's source: agent_launcher.py beside this module.
LAUNCHER_SOURCE = Path(__file__).with_name(LAUNCHER_NAME)
#: The go file's name inside a VM agent folder.
GO_NAME = ".testflinger-magic-go"

_PYTHON = re.compile(r"^(?:python|pypy)(?:\d+(?:\.\d+)?)?$")


def _is_python(path: str) -> bool:
    return bool(_PYTHON.match(os.path.basename(path)))


def go_path(agent_dir: Path | str) -> Path:
    """The go file of the VM agent whose folder is ``agent_dir``. Pure."""
    return Path(agent_dir) / GO_NAME


def shebang_python(first_line: str | None) -> list[str] | None:
    """The interpreter argv of a Python script's first line (``#!/venv/bin/python3`` ->
    ``["/venv/bin/python3"]``; ``#!/usr/bin/env python3`` -> ``["/usr/bin/env", "python3"]``),
    None when it is no shebang naming Python. As Linux does, everything after the interpreter
    is one argument. Pure.

    A console script whose interpreter path is too long or holds a space gets a ``/bin/sh``
    trampoline from pip (distlib's ``ScriptMaker``): not recognised, None."""
    if not first_line or not first_line.startswith("#!"):
        return None
    parts = first_line[2:].strip().split(None, 1)
    if not parts:
        return None
    interpreter, arg = parts[0], (parts[1].strip() if len(parts) > 1 else "")
    if _is_python(interpreter):
        return [interpreter, arg] if arg else [interpreter]
    if os.path.basename(interpreter) == "env" and arg and len(arg.split()) == 1 \
            and _is_python(arg):
        return [interpreter, arg]
    return None


def wrap_argv(argv: list[str], launcher: str, go_file: str,
              first_line: str | None) -> list[str] | None:
    """The pre-warmed argv of a VM agent's ``argv``, or None when the launcher cannot run it.

    - ``<python> -m <module> [args]`` -> ``<python> <launcher> <go> -m <module> [args]``
      (``<python>``: a path whose name is ``python``, ``python3``, ``python3.12``, ...);
    - ``<script> [args]``, an absolute path whose ``first_line`` is a Python shebang (a
      console script, e.g. ``/srv/testflinger-venv/bin/testflinger-agent``) ->
      ``<shebang interpreter> <launcher> <go> <script> [args]``;
    - anything else (another program, Python options before ``-m``, a relative script path
      that supervisord would look up in PATH, a script without a Python shebang): None.

    Every original argument stays, so ``-p N`` is still read from the program's command by
    the charm and by ``agentports.parse_program_ports``. Pure."""
    if not argv or not launcher or not go_file:
        return None
    if len(argv) >= 3 and _is_python(argv[0]) and argv[1] == "-m" and argv[2] \
            and not argv[2].startswith("-"):
        return [argv[0], launcher, go_file, *argv[1:]]
    if os.path.isabs(argv[0]):
        interpreter = shebang_python(first_line)
        if interpreter:
            return [*interpreter, launcher, go_file, *argv]
    return None


def unwrap_argv(argv: list[str]) -> list[str] | None:
    """The original argv of a pre-warmed one (:func:`wrap_argv`'s inverse), None when ``argv``
    does not run the launcher (no argument named :data:`LAUNCHER_NAME` followed by a go file
    and a command). Pure."""
    for i, arg in enumerate(argv):
        if os.path.basename(arg) == LAUNCHER_NAME and i >= 1 and len(argv) >= i + 3:
            rest = argv[i + 2:]
            return argv[:i] + rest if rest[0] == "-m" else rest
    return None


def normal_argv(command: str) -> list[str] | str:
    """``command`` as supervisord runs it (``shlex.split``: supervisor/options.py
    ``ProcessConfig.get_execv_args``), unwrapped when pre-warmed; the text itself when it does
    not split. Two commands with equal results run the same agent. Pure."""
    try:
        argv = shlex.split(command)
    except ValueError:
        return command
    return unwrap_argv(argv) or argv


def is_wrapped(command: str) -> bool:
    """True when ``command`` (a supervisord ``command=`` value) runs the launcher. Pure."""
    try:
        return unwrap_argv(shlex.split(command)) is not None
    except ValueError:
        return False


def _first_line(path: str) -> str | None:
    try:
        with open(path, "rb") as f:
            return f.readline(512).decode("utf-8", errors="replace")
    except OSError:
        return None


def wrap_command(command: str, launcher: str | None, go_file: Path | str) -> str | None:
    """:func:`wrap_argv` of a command line (``shlex``), reading the script's first line; the
    pre-warmed command line, or None (no ``launcher``, or not wrappable)."""
    if not launcher:
        return None
    try:
        argv = shlex.split(command)
    except ValueError:
        return None
    first = _first_line(argv[0]) if argv and os.path.isabs(argv[0]) else None
    wrapped = wrap_argv(argv, launcher, str(go_file), first)
    return shlex.join(wrapped) if wrapped else None


def _enterable_by(path: Path, user: pwd.struct_passwd, groups: set[int], bit: int) -> bool:
    """Whether ``user`` has permission ``bit`` (4 read, 1 search) on ``path`` by its mode bits
    (owner, group, others; ACLs are not read)."""
    st = path.stat()
    if st.st_uid == user.pw_uid:
        return bool(st.st_mode & (bit << 6))
    if st.st_gid in groups:
        return bool(st.st_mode & (bit << 3))
    return bool(st.st_mode & bit)


def unreadable_reason(path: Path, user: str | None) -> str | None:
    """Why ``user`` could not read ``path`` (a folder on the way it cannot enter, or the file
    itself), None when it can (or ``user`` is None / root / the daemon's own user)."""
    if not user:
        return None
    try:
        pw = pwd.getpwnam(user)
    except KeyError:
        return f"user {user} does not exist"
    if pw.pw_uid in (0, os.geteuid()):
        return None
    groups = {pw.pw_gid} | set(os.getgrouplist(user, pw.pw_gid))
    path = Path(path).resolve()
    for folder in reversed(path.parents):
        if not _enterable_by(folder, pw, groups, 1):
            return f"{user} cannot enter {folder}"
    if not _enterable_by(path, pw, groups, 4):
        return f"{user} cannot read {path}"
    return None


def install_launcher(state_dir: Path | str, user: str | None = None) -> Path | None:
    """Copy the launcher to ``<state_dir>/agent_launcher.py`` (mode 0644; rewritten only when
    it differs) and return its path; None, with a warning, when it cannot be written or
    ``user`` (the VM agents' ``program_user``) could not read it: VM agents then start as
    without pre-warm."""
    dest = Path(state_dir) / LAUNCHER_NAME
    try:
        text = LAUNCHER_SOURCE.read_text()
        if not dest.exists() or dest.read_text() != text or dest.stat().st_mode & 0o777 != 0o644:
            atomic_write(dest, text, 0o644)
        why = unreadable_reason(dest, user)
    except OSError as exc:
        why = f"cannot install it: {exc}"
    if why:
        log.warning("VM agent pre-warm is off: %s (launcher %s); VM agents start once their "
                    "lease is active", why, dest)
        return None
    return dest


def write_go(agent_dir: Path | str) -> bool:
    """Create the go file of the VM agent folder ``agent_dir`` (mode 0644); True when it was
    missing. Idempotent."""
    path = go_path(agent_dir)
    if path.exists():
        return False
    path.touch(mode=0o644, exist_ok=True)
    return True


def clear_go(agent_dir: Path | str) -> bool:
    """Remove the go file of ``agent_dir`` if present; True when there was one."""
    try:
        go_path(agent_dir).unlink()
        return True
    except FileNotFoundError:
        return False
