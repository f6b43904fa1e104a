"""Pre-warmed start of a VM agent: import it now, run it once its go file exists.

Usage (the command of a VM agent's supervisord program, written by the agent-host daemon,
``agent_host/prewarm.py``)::

    <python> agent_launcher.py <go-file> <console-script> [args...]
    <python> agent_launcher.py <go-file> -m <module> [args...]

runs ``<console-script> [args...]`` (or ``<python> -m <module> [args...]``) as if started
directly, except that it first imports what the agent imports and then waits until
``<go-file>`` exists. The agent-host daemon starts these programs while MAAS still
commissions the VMs, and writes the go file once the server accepted the lease's ``active``
report and so lifted the VM agents' fences. testflinger-agent polls for a job right after its
start-up posts (TESTFLINGER.md §3.2-3.3; canonical/testflinger
``agent/src/testflinger_agent/__init__.py`` ``start_agent``): started before that, its first
poll would be refused while fenced and its next one comes a whole ``polling_interval`` later;
started only then, its Python start-up and imports (requests, yaml, voluptuous,
prometheus_client, influxdb) would stand between the lifted fence and that poll. Pre-warmed,
only the wake on the go file does (inotify: at once; else a ``POLL`` seconds poll).

Semantics:

* Standalone: runs under ANY Python 3.10+ (in production the agent's own venv Python,
  ``/srv/testflinger-venv/bin/python3``) and imports only the standard library, nothing of
  testflinger-magic.
* Pre-import: the agent's code is never executed before the go file exists. The script's (or
  module's) top-level ``import`` / ``from ... import`` statements are read with ``ast`` (also
  inside top-level ``try`` / ``if`` blocks, never inside ``if __name__ == "__main__":``) and
  those modules are imported. pip's and uv's console script for testflinger-agent
  (``[project.scripts] testflinger-agent = "testflinger_agent.cmd:main"``, agent/pyproject.toml)
  is ``import re, sys; from testflinger_agent.cmd import main; if __name__ == '__main__': ...
  sys.exit(main())``, so ``testflinger_agent.cmd`` and all it imports are loaded. Executing the
  script with another ``run_name`` (``runpy``) would load the same, but would also run the body
  of a script or module without a ``__main__`` guard (a package's ``__main__.py``), i.e. start
  the agent before its go file. A module that fails to import is noted on stderr and left for
  the real run to report.
* Wait: ``os.stat(go_file)``, again whenever Linux inotify (``inotify(7)``, through ctypes
  and libc) says a file was created or moved into its folder, and at least every
  ``WATCHED_POLL`` seconds (a folder replaced under the watch, e.g. by the charm, is no longer
  watched); where inotify is not to be had (no libc symbol, or ``inotify_init1`` refused: e.g.
  ``fs.inotify.max_user_instances`` reached) every ``POLL`` seconds. A file rather than a
  signal, so it survives a daemon or supervisord restart (a restarted program whose go file
  exists runs at once). While waiting SIGTERM has its default action (supervisord's stop ends it at once) and
  SIGUSR1 is ignored: the agent-host charm sends ``supervisorctl signal USR1 all`` after
  rewriting conf.d (TESTFLINGER.md §6.4), which asks a running agent to restart to read its
  config again; one that has not read it yet has nothing to re-read. Both get back the
  dispositions the launcher inherited before the agent runs.
* Run: ``sys.argv`` and ``sys.path[0]`` as Python sets them for the original command (the
  script's real directory; the current directory for ``-m``), then
  ``runpy.run_path(script, run_name="__main__")`` or ``runpy.run_module(module,
  run_name="__main__", alter_sys=True)``; the agent's exit status (``sys.exit``) and uncaught
  exceptions pass through unchanged. Modules already imported are not imported again, which is
  the point.

Exit status 2 with a message on stderr for a bad command line, or a go file the user cannot
look for (a folder on its path it may not enter).
"""

import ast
import contextlib
import importlib
import importlib.util
import os
import runpy
import signal
import sys
import time

#: Seconds between two looks at the go file without inotify.
POLL = 0.05
#: Seconds between two looks at the go file at most while inotify watches its folder.
WATCHED_POLL = 1.0
#: inotify(7) event bits (linux/inotify.h): a file created in, or moved into, the folder.
_IN_CREATE, _IN_MOVED_TO = 0x100, 0x80


class _FolderWatch:
    """An inotify watch of one folder for files created or moved into it (Linux, through
    ctypes). ``wait(timeout)`` returns once such an event came (True) or ``timeout`` seconds
    passed (False). ``open(folder)`` returns None where inotify cannot be had."""

    def __init__(self, fd: int):
        self.fd = fd

    @classmethod
    def open(cls, folder: str):
        try:
            import ctypes
            import ctypes.util

            libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
            fd = libc.inotify_init1(os.O_CLOEXEC | os.O_NONBLOCK)
            if fd < 0:
                return None
            if libc.inotify_add_watch(fd, os.fsencode(folder), _IN_CREATE | _IN_MOVED_TO) < 0:
                os.close(fd)
                return None
            return cls(fd)
        except (OSError, AttributeError, TypeError):  # no libc, no inotify symbols
            return None

    def wait(self, timeout: float) -> bool:
        import select

        ready, _, _ = select.select([self.fd], [], [], timeout)
        if not ready:
            return False
        try:
            os.read(self.fd, 65536)  # the events themselves do not matter: the caller looks
        except BlockingIOError:
            pass
        return True

    def close(self) -> None:
        os.close(self.fd)


def _is_main_guard(node) -> bool:
    """``if __name__ == "__main__":`` (either operand order)."""
    if not isinstance(node, ast.If) or not isinstance(node.test, ast.Compare):
        return False
    test = node.test
    if len(test.ops) != 1 or not isinstance(test.ops[0], ast.Eq):
        return False
    sides = [test.left, test.comparators[0]]
    names = [s for s in sides if isinstance(s, ast.Name) and s.id == "__name__"]
    consts = [s for s in sides if isinstance(s, ast.Constant) and s.value == "__main__"]
    return bool(names) and bool(consts)


def _statements(body):
    """Top-level statements of ``body``, descending into ``try`` and ``if`` blocks but never
    into a ``__main__`` guard."""
    for node in body:
        if _is_main_guard(node):
            continue
        if isinstance(node, ast.Try):
            for block in (node.body, node.orelse, node.finalbody):
                yield from _statements(block)
            for handler in node.handlers:
                yield from _statements(handler.body)
        elif isinstance(node, ast.If):
            yield from _statements(node.body)
            yield from _statements(node.orelse)
        else:
            yield node


def imported_modules(source: str, filename: str, package: str = "") -> list:
    """``[(module, [names from it])]`` the top-level imports of ``source`` name, in order.

    ``package``: the package relative imports are resolved against (empty: relative imports
    are skipped). A source that does not parse gives ``[]`` (the real run reports it)."""
    try:
        tree = ast.parse(source, filename)
    except (SyntaxError, ValueError):
        return []
    found = []
    for node in _statements(tree.body):
        if isinstance(node, ast.Import):
            found.extend((alias.name, []) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            name = node.module or ""
            if node.level:
                if not package:
                    continue
                try:
                    name = importlib.util.resolve_name("." * node.level + name, package)
                except (ImportError, ValueError):
                    continue
            if name:
                found.append((name, [a.name for a in node.names if a.name != "*"]))
    return found


def preimport(source: str, filename: str, package: str = "") -> None:
    """Import the modules ``source``'s top-level imports name (see ``imported_modules``); a
    ``from m import x`` also imports ``m.x`` when ``x`` is a submodule not yet loaded."""
    for module, names in imported_modules(source, filename, package):
        try:
            loaded = importlib.import_module(module)
        except (Exception, SystemExit) as exc:  # noqa: BLE001 - the real run reports it
            print(f"agent_launcher: pre-import of {module} failed ({exc!r}); the agent will "
                  "meet it again when it runs", file=sys.stderr)
            continue
        for name in names:
            if hasattr(loaded, name):
                continue
            try:
                importlib.import_module(f"{module}.{name}")
            except (Exception, SystemExit):  # noqa: BLE001 - not a submodule: an attribute
                pass


def wait_for(go_file: str, poll: float = POLL, watch: bool = True) -> None:
    """Return once ``go_file`` exists, looking again when inotify reports a file created in
    its folder, at least every ``WATCHED_POLL`` seconds (``watch`` False, or no inotify: every
    ``poll`` seconds). SIGTERM keeps its default action and SIGUSR1 is ignored meanwhile
    (module docstring); both dispositions are restored before returning. A go file this user
    cannot look for (no permission on its folder) ends the process with status 2 and the
    reason on stderr: supervisord shows it failing, where waiting would hide it."""
    before = {}
    for sig, how in ((signal.SIGTERM, signal.SIG_DFL), (signal.SIGUSR1, signal.SIG_IGN)):
        before[sig] = signal.signal(sig, how)
    # Watched before the first look: a go file written in between wakes the wait.
    folder = _FolderWatch.open(os.path.dirname(go_file) or ".") if watch else None
    try:
        while True:
            try:
                os.stat(go_file)
                return
            except (FileNotFoundError, NotADirectoryError):
                if folder is not None:
                    folder.wait(WATCHED_POLL)
                else:
                    time.sleep(poll)
            except OSError as exc:
                # E.g. EACCES: this user cannot enter the agent folder. It would never see its
                # go file: say why and exit rather than wait for ever.
                print(f"agent_launcher: cannot look for the go file {go_file}: {exc}",
                      file=sys.stderr)
                sys.exit(2)
    finally:
        if folder is not None:
            folder.close()
        for sig, how in before.items():
            signal.signal(sig, how if how is not None else signal.SIG_DFL)


def _module_source(module: str):
    """``(spec name, source, origin)`` of what ``python -m module`` runs (a package's
    ``__main__``), or None when it cannot be found (the real run reports that)."""
    try:
        spec = importlib.util.find_spec(module)
        if spec is not None and spec.submodule_search_locations is not None:
            spec = importlib.util.find_spec(module + ".__main__")
        if spec is None or spec.loader is None or not hasattr(spec.loader, "get_source"):
            return None
        return spec.name, spec.loader.get_source(spec.name) or "", spec.origin or module
    except (Exception, SystemExit):  # noqa: BLE001 - the real run reports it
        return None


def _usage(message: str) -> None:
    """Print ``message`` and the usage to stderr and exit with status 2."""
    print(f"agent_launcher: {message}\nusage: python agent_launcher.py GO_FILE SCRIPT [ARGS...]"
          "\n       python agent_launcher.py GO_FILE -m MODULE [ARGS...]", file=sys.stderr)
    sys.exit(2)


@contextlib.contextmanager
def _usr1_ignored():
    """SIGUSR1 ignored from before the pre-import until the go file is there (the charm's
    ``supervisorctl signal USR1 all`` may come while the agent's modules import; :func:`wait_for`
    ignores it while it waits), then the handler it had, for the agent's own."""
    before = signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGUSR1, before)


def main(argv=None) -> None:
    """Pre-import, wait for the go file, run the agent (see the module docstring). Never
    returns normally when the agent calls ``sys.exit``; its exceptions propagate."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if len(argv) < 2:
        _usage("a go file and a command are needed")
    go_file, command = argv[0], argv[1:]
    if command[0] == "-m":
        if len(command) < 2 or not command[1]:
            _usage("-m needs a module name")
        module, args = command[1], command[2:]
        # python -m: sys.path[0] is the current directory, sys.argv[0] "-m" while the module
        # is looked up, then its file (runpy sets it).
        sys.path[0] = os.getcwd()
        sys.argv = ["-m", *args]
        found = _module_source(module)
        with _usr1_ignored():
            if found is not None:
                name, source, origin = found
                sys.argv = [origin, *args]
                preimport(source, origin, name.rpartition(".")[0])
            wait_for(go_file)
        sys.argv = ["-m", *args]
        runpy.run_module(module, run_name="__main__", alter_sys=True)
        return
    script, args = command[0], command[1:]
    # python script: sys.path[0] is the script's directory, symlinks resolved.
    sys.path[0] = os.path.dirname(os.path.realpath(script))
    sys.argv = [script, *args]
    try:
        with open(script, encoding="utf-8", errors="replace") as f:
            source = f.read()
    except OSError:
        source = ""  # the real run reports it
    with _usr1_ignored():
        preimport(source, script, "")
        wait_for(go_file)
    sys.argv = [script, *args]
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
