"""testflinger-agent processes under supervisord, and VM agent config folders.

Two halves:

* :class:`AgentProcesses` drives supervisord over XML-RPC (``unix://`` or ``http://``): stop and
  start device agents, add and remove VM agents (several at once with one ``reloadConfig``),
  re-create VM agent programs that the agent-host charm wiped, and allocate metrics ports (that
  half lives in agentports.py, :class:`agentports.PortReservations`).
* :func:`render_agent_folder` renders a VM agent template folder (``agent_configs/<name>/*.j2``)
  and validates the result against testflinger-agent's config schema; it and the other folder
  functions live in agentfolders.py and are re-exported here.

Facts honoured (canonical/testflinger, see ../shared/TESTFLINGER.md §3.1, §6):

* program file format: ``agent/charms/testflinger-agent-host-charm/templates/
  testflinger-agent.supervisord.conf.j2`` — ``[program:<agent>]``, ``startsecs=0``,
  ``redirect_stderr=true``, ``user=ubuntu``, ``command=<venv>/bin/testflinger-agent -c
  <dir>/testflinger-agent.conf -p <port>``;
* ports: the charm (``src/supervisord.py``) reads ``-p N`` back from every ``conf.d/*.conf`` and
  gives a new agent the first port in ``range(8000, 10000)`` that binds on localhost;
* the charm deletes every ``conf.d/*.conf`` and rewrites its own on config-changed (§6.4), so
  VM agent programs must be restored (:meth:`AgentProcesses.ensure`);
* the agent folder's facts (schema, ``agent_id`` = folder name): agentfolders.py.
"""

from __future__ import annotations

import logging
import pwd
import re
import time
import xmlrpc.client
from pathlib import Path
from typing import Any, Iterable

from ..fileutil import atomic_write as _atomic_write
from .agentfolders import (  # noqa: F401 - re-exported: agents.<name> as before the split
    AGENT_CONF, AGENT_SCHEMA, CONNECTOR_CONF, FOLDER_MARKER, MAAS2_REQUIRED, MAAS2_TYPES,
    AgentConfigError, remove_agent_folder, render_agent_folder, validate_agent_config,
    validate_maas2_config,
)
from .agentports import (  # noqa: F401 - re-exported: agents.<name> as before the split
    PortReservations, _port_bindable, parse_program_ports,
)
from . import prewarm
from .journal import kill_point
from .programfiles import (  # noqa: F401 - re-exported: agents.<name> as before the split
    AUTOSTART_LINE, MARKER, _sv_quote, program_conf_text, same_program,
)
from .supervisor_proc import rpc_call

log = logging.getLogger(__name__)

#: Production command, as the agent-host charm's supervisord template writes it.
DEFAULT_COMMAND_TEMPLATE = "/srv/testflinger-venv/bin/testflinger-agent -c {config} -p {port}"

# supervisor.xmlrpc.Faults codes used here.
_BAD_NAME, _ALREADY_STARTED, _NOT_RUNNING, _ALREADY_ADDED, _STILL_RUNNING = 10, 60, 70, 90, 91
_PROGRAM_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
#: supervisord states of a program that is not running and will not be by itself (BACKOFF: it
#: exited before ``startsecs``; supervisord gives up with FATAL after ``startretries``).
FAILED_STATES = ("FATAL", "BACKOFF", "EXITED")


class AgentProcessError(RuntimeError):
    """A supervisord operation failed.

    Attributes: ``program`` (name or None), ``fault_code`` and ``fault_string`` (supervisord's
    XML-RPC fault, or None when the failure was local).
    """

    def __init__(self, program: str | None, message: str, fault: xmlrpc.client.Fault | None = None):
        self.program = program
        self.fault_code = fault.faultCode if fault else None
        self.fault_string = fault.faultString if fault else None
        detail = f" (supervisord fault {fault.faultCode} {fault.faultString})" if fault else ""
        super().__init__(f"{program or 'supervisord'}: {message}{detail}")


# ---------------------------------------------------------------------------------------------
# supervisord driver (effects)
# ---------------------------------------------------------------------------------------------

class AgentProcesses(PortReservations):
    """Start/stop agent programs and manage VM agent programs in one supervisord.

    ``supervisor_url``: ``unix:///run/supervisor.sock`` or ``http://127.0.0.1:9001``.
    ``conf_dir``: the folder supervisord includes (``/etc/supervisor/conf.d``).
    ``command_template``: formatted with ``{config}`` (``<agent_dir>/testflinger-agent.conf``),
    ``{port}``, ``{agent_dir}`` and ``{name}``; production is :data:`DEFAULT_COMMAND_TEMPLATE`.
    ``user``: the program's ``user=`` (the charm uses ``ubuntu``; None when supervisord is not root).
    ``port_range``: half-open ``(first, end)`` for metrics ports. ``lock_path``: the JSON file that
    records reserved ports, locked with ``flock`` (default ``<conf_dir>/.testflinger-magic-ports.json``,
    which supervisord's ``*.conf`` include and the charm's ``*.conf`` wipe both ignore).
    ``reservation_ttl`` (seconds): an allocated port not yet used by :meth:`add_vm_agent` is
    forgotten after this long. ``start_timeout`` (seconds): how long to wait for RUNNING.
    ``launcher``: path of agent_launcher.py as installed (prewarm.install_launcher); set, a VM
    agent whose command the launcher can run is pre-warmed (:meth:`command_for`).
    ``settle`` (seconds): how long :meth:`failing` watches a RUNNING program for a restart. The
    charm's ``startsecs=0`` makes a program RUNNING the moment it is spawned, so RUNNING alone
    does not show that an agent came up: one whose metrics port another process took exits
    at once (status 2) and supervisord restarts it over and over, RUNNING most of the time.

    Every method is idempotent. Errors raise :class:`AgentProcessError`.
    """

    def __init__(
        self,
        supervisor_url: str,
        conf_dir: Path | str,
        command_template: str = DEFAULT_COMMAND_TEMPLATE,
        *,
        user: str | None = None,
        port_range: tuple[int, int] = (8000, 10000),
        lock_path: Path | str | None = None,
        reservation_ttl: float = 6 * 3600.0,
        start_timeout: float = 30.0,
        settle: float = 1.5,
        launcher: Path | str | None = None,
    ):
        self.url = supervisor_url
        self.conf_dir = Path(conf_dir)
        self.command_template = command_template
        self.user = user
        self.port_range = port_range
        self.lock_path = Path(lock_path) if lock_path else self.conf_dir / ".testflinger-magic-ports.json"
        self.reservation_ttl = reservation_ttl
        self.start_timeout = start_timeout
        self.settle = settle
        self.launcher = str(launcher) if launcher else None

    # -- XML-RPC plumbing ------------------------------------------------------------------------
    def _rpc(self, program: str | None, method: str, *args, ok: Iterable[int] = ()) -> Any:
        """Call ``supervisor.<method>``; faults listed in ``ok`` return None, others raise."""
        try:
            return rpc_call(self.url, method, *args)
        except xmlrpc.client.Fault as fault:
            if fault.faultCode in tuple(ok):
                return None
            raise AgentProcessError(program, f"{method} failed", fault) from None
        except (OSError, xmlrpc.client.ProtocolError) as exc:
            raise AgentProcessError(
                program, f"{method}: cannot reach supervisord at {self.url}: {exc}"
            ) from None

    def _port_error(self, owner: str | None, message: str) -> Exception:
        return AgentProcessError(owner, message)

    def _conf_path(self, name: str) -> Path:
        if not _PROGRAM_NAME.match(name):
            raise AgentProcessError(name, "invalid program name (letters, digits, '.', '_', '-')")
        return self.conf_dir / f"{name}.conf"

    # -- any program (device agents included) ----------------------------------------------------
    def state(self, program: str) -> str:
        """supervisord's ``statename`` of ``program`` (``RUNNING``, ``STOPPED``, ...) or ``ABSENT``."""
        info = self._rpc(program, "getProcessInfo", program, ok=(_BAD_NAME,))
        return info["statename"] if info else "ABSENT"

    def stop(self, program: str) -> None:
        """Stop ``program`` and wait until it is down; not running is fine, unknown raises."""
        self._rpc(program, "stopProcess", program, True, ok=(_NOT_RUNNING,))

    def start(self, program: str) -> None:
        """Start ``program`` and wait for RUNNING; already running is fine, unknown raises."""
        self._rpc(program, "startProcess", program, True, ok=(_ALREADY_STARTED,))
        self._wait_running(program)

    def programs(self, prefix: str = "") -> list[str]:
        """Sorted names of the programs supervisord runs whose name starts with ``prefix``."""
        names = []
        for info in self._rpc(None, "getAllProcessInfo"):
            name = info["name"] if info["group"] == info["name"] else f"{info['group']}:{info['name']}"
            if name.startswith(prefix):
                names.append(name)
        return sorted(names)

    def ports(self) -> dict[str, int]:
        """``{program: port}`` parsed from every ``conf.d/*.conf`` (programs with a ``-p N``)."""
        return {k: v for k, v in self._conf_ports().items() if v is not None}

    # -- VM agents ---------------------------------------------------------------------------------
    def command_for(self, name: str, agent_dir: Path | str, port: int) -> str:
        """The command line of VM agent ``name`` (``command_template`` formatted), through the
        launcher waiting on ``<agent_dir>/.testflinger-magic-go`` when :attr:`launcher` is set
        and it can run it (prewarm.wrap_command)."""
        agent_dir = Path(agent_dir)
        command = self.command_template.format(
            config=agent_dir / AGENT_CONF, port=int(port), agent_dir=agent_dir, name=name
        )
        return prewarm.wrap_command(command, self.launcher, prewarm.go_path(agent_dir)) or command

    def add_prewarmed_vm_agents(self, programs: Iterable[tuple[str, Path | str, int]]
                                ) -> list[str]:
        """:meth:`add_vm_agents` ``(name, agent_dir, port)`` without starting them, then start
        those whose program file runs the launcher (pre-warmed: they wait on their go file);
        returns their names, sorted (empty: none is pre-warmed, e.g. no :attr:`launcher`). A
        kept file that runs the agent directly (``same_program``) is not started. Raises
        :class:`AgentProcessError` as :meth:`add_vm_agents`."""
        programs = list(programs)
        if not self.launcher or not programs:
            return []
        _changed, failed = self._add_many(programs, start=True, start_if=self._runs_launcher)
        if failed:
            raise failed[sorted(failed)[0]]
        return sorted(n for n, _d, _p in programs if self._runs_launcher(n))

    def _runs_launcher(self, name: str) -> bool:
        """True when ``name``'s program file runs its agent through the launcher."""
        path = self._conf_path(name)
        text = path.read_text() if path.exists() else ""
        return any(prewarm.is_wrapped(line[len("command="):].replace("%%", "%"))
                   for line in text.splitlines() if line.startswith("command="))

    def add_vm_agent(self, name: str, agent_dir: Path | str, port: int, *,
                     start: bool = True) -> bool:
        """Make VM agent ``name`` a RUNNING program: write ``<conf_dir>/<name>.conf`` (charm format,
        ``-p <port>``, ``autostart=false``), ``reloadConfig`` + ``addProcessGroup`` (or replace
        the group if its config changed), start it and wait for RUNNING.

        ``start=False``: the program is added (or replaced) but not started; one already running
        is left running. The enroll step adds VM agents so; the daemon starts them once their
        lease is ``active`` (steps.enroll, :meth:`ensure`).

        Returns True if anything had to change. Raises :class:`AgentProcessError` if the port is
        claimed by another program's conf file, if the file exists but was not written by us, or
        if the program does not reach RUNNING (the message carries its output tail).
        """
        changed, failed = self._add_many([(name, agent_dir, port)], start=start)
        if name in failed:
            raise failed[name]
        return name in changed

    def add_vm_agents(self, programs: Iterable[tuple[str, Path | str, int]], *,
                      start: bool = True) -> list[str]:
        """:meth:`add_vm_agent` for several VM agents ``(name, agent_dir, port)`` at once, as
        ``supervisorctl update`` does: every conf file is written first, then one
        ``reloadConfig`` serves them all (supervisord re-reads its whole configuration at each:
        supervisor/rpcinterface.py ``reloadConfig``), one ``addProcessGroup`` per new group, and
        with ``start`` every program is started before any is waited for. Returns the names
        that had to change, sorted. Raises :class:`AgentProcessError` as :meth:`add_vm_agent`
        does (before supervisord is touched for a conf file problem; a port used twice in
        ``programs`` is one), and for the first program that does not reach RUNNING after the
        others were started."""
        changed, failed = self._add_many(list(programs), start=start)
        if failed:
            raise failed[sorted(failed)[0]]
        return sorted(changed)

    def _add_many(self, programs: list[tuple[str, Path | str, int]], start: bool,
                  start_if=None) -> tuple[set[str], dict[str, AgentProcessError]]:
        """Write the conf files of ``programs`` and bring supervisord in line; returns the names
        changed and ``{name: error}`` of those that did not reach RUNNING (``start`` only; and
        with ``start_if(name)``, only those it is true for)."""
        if self.user:
            try:
                pwd.getpwnam(self.user)
            except KeyError:
                # supervisord would refuse the whole group ("Invalid user name") at
                # addProcessGroup; say which setting names the user instead.
                raise AgentProcessError(programs[0][0] if programs else None,
                                        f"user {self.user!r} (supervisor.program_user) does "
                                        "not exist on this host") from None
        wanted = {}
        for name, agent_dir, port in programs:
            path = self._conf_path(name)
            text = program_conf_text(name, self.command_for(name, agent_dir, port), self.user)
            wanted[name] = (path, text, int(port))
        changed = set()
        with self._locked() as reservations:
            others = {n: p for n, p in self._conf_ports().items() if n not in wanted}
            for name, (path, _text, port) in wanted.items():
                for other, other_port in others.items():
                    if other_port == port:
                        raise AgentProcessError(name, f"port {port} is already used by program {other!r}")
                twin = [n for n, (_p, _t, q) in wanted.items() if q == port and n != name]
                if twin:
                    raise AgentProcessError(name, f"port {port} is also given to program {twin[0]!r}")
                if path.exists() and not path.read_text().startswith(MARKER):
                    raise AgentProcessError(name, f"{path} exists and was not written by testflinger-magic")
            for name, (path, text, port) in wanted.items():
                current = path.read_text() if path.exists() else None
                if current is None or not same_program(current, text):
                    self.conf_dir.mkdir(parents=True, exist_ok=True)
                    _atomic_write(path, text)
                    changed.add(name)
                self._own_port(reservations, name, port)
        # Resume tests die here: the conf files and their owned reservations exist, supervisord
        # has not added the groups (restore must still remove both).
        kill_point("agent.add:conf-written")
        synced, failed = self._sync_groups(list(wanted), start=start, start_if=start_if)
        return changed | synced, failed

    def _stop_and_remove(self, name: str, attempts: int = 20) -> None:
        """Stop program ``name`` and remove its group (absent is fine). An EXITED program that
        supervisord's autorestart starts again between the stop (answered NOT_RUNNING) and the
        removal makes ``removeProcessGroup`` fail STILL_RUNNING (supervisor.xmlrpc.Faults 91):
        stop it again and retry. A program crash-looping with ``startsecs=0`` (its port taken)
        can be caught EXITED at the stop and started again at the removal several times in a
        row: 5 attempts failed once in a test run under load; 20 (about 2 s at most)."""
        for attempt in range(attempts):
            self._rpc(name, "stopProcess", name, True, ok=(_NOT_RUNNING, _BAD_NAME))
            try:
                self._rpc(name, "removeProcessGroup", name, ok=(_BAD_NAME,))
                return
            except AgentProcessError as exc:
                if exc.fault_code != _STILL_RUNNING or attempt + 1 == attempts:
                    raise
                time.sleep(0.1)

    def _sync_group(self, name: str, start: bool = True) -> bool:
        """Bring supervisord's group ``name`` in line with its conf file and, if ``start``,
        running (raises :class:`AgentProcessError` when it does not reach RUNNING)."""
        changed, failed = self._sync_groups([name], start=start)
        if name in failed:
            raise failed[name]
        return name in changed

    def _sync_groups(self, names: list[str], start: bool = True, start_if=None
                     ) -> tuple[set[str], dict[str, AgentProcessError]]:
        """Bring supervisord's groups ``names`` in line with their conf files: one
        ``reloadConfig``, a changed group replaced, a new one added; with ``start``, every one
        not RUNNING started (with ``start_if``, those it is true for), then all waited for
        together. Returns the names changed and ``{name: error}`` of those that did not reach
        RUNNING."""
        changed: set[str] = set()
        result = self._rpc(None, "reloadConfig")
        added, modified, _removed = result[0] if result else ([], [], [])
        added = set(added)
        for name in names:
            if name in modified:
                self._stop_and_remove(name)
                added.add(name)
        for name in names:
            if name in added:
                self._rpc(name, "addProcessGroup", name, ok=(_ALREADY_ADDED,))
                changed.add(name)
        if start_if is not None:
            names = [n for n in names if start_if(n)]
        if not start or not names:
            return changed, {}
        infos = self._infos()
        for name in names:
            if infos.get(name, {}).get("statename") != "RUNNING":
                # The charm's startsecs=0 makes a spawned program RUNNING inside this call.
                self._rpc(name, "startProcess", name, True, ok=(_ALREADY_STARTED,))
                changed.add(name)
        return changed, self._wait_all_running(names)

    def _infos(self) -> dict[str, dict]:
        """``{program: getProcessInfo dict}`` for every program supervisord runs."""
        infos = {}
        for info in self._rpc(None, "getAllProcessInfo"):
            name = info["name"] if info["group"] == info["name"] else f"{info['group']}:{info['name']}"
            infos[name] = info
        return infos

    def _tail(self, name: str) -> str:
        out = self._rpc(name, "tailProcessStdoutLog", name, 0, 2000, ok=(_BAD_NAME,))
        return " | ".join((out[0] if out else "").strip().splitlines()[-3:]) or "-"

    def failing(self, names: Iterable[str], settle: float | None = None) -> dict[str, str]:
        """``{program: reason}`` for those of ``names`` that are not running steadily.

        A program fails when supervisord has it in :data:`FAILED_STATES`, or when it is
        restarted (another pid or start time) while watched for ``settle`` seconds (default
        :attr:`settle`; the watch is shared by all names, and skipped when none is running).
        The latter is how an agent whose metrics port is taken looks under ``startsecs=0``:
        RUNNING, exit 2, RUNNING again. Programs supervisord does not know, and STOPPED ones
        (an operator's choice; :meth:`ensure` starts them), are not failing. Reasons carry the
        program's last output lines.
        """
        names = [n for n in names]
        if not names:
            return {}
        first = self._infos()
        wait = self.settle if settle is None else settle
        if wait > 0 and any(first.get(n, {}).get("statename") in ("RUNNING", "STARTING")
                            for n in names):
            time.sleep(wait)
        second = self._infos()
        found = {}
        for name in names:
            a, b = first.get(name), second.get(name)
            if b is None:
                continue
            if b["statename"] in FAILED_STATES or (a and a["statename"] in FAILED_STATES):
                state = b["statename"] if b["statename"] in FAILED_STATES else a["statename"]
                found[name] = f"supervisord state {state}"
            elif a and b["statename"] != "STOPPED" and (a["pid"], a["start"]) != (b["pid"], b["start"]):
                found[name] = f"restarted within {wait:g}s (pid {a['pid']} -> {b['pid']})"
            else:
                continue
            found[name] += f"; output: {self._tail(name)}"
        return found

    def start_device_agent(self, program: str, attempts: int = 3) -> int | None:
        """Start a device agent ``program`` (the charm's, at give-back) and make sure it stays
        up; returns the metrics port it runs on (None: its command has no ``-p N``).

        Like a VM agent (:meth:`start_vm_agent`), a device agent whose metrics port another
        process took while it was stopped exits at once and is restarted forever under
        ``startsecs=0``. When it fails (:meth:`failing`) while its port does not bind, it is
        moved: only the ``-p N`` of its conf file is rewritten, to a newly allocated port, and
        supervisord reloads it. The charm keeps an existing program's port when it regenerates
        conf.d (TESTFLINGER.md §6.3), so the move survives a config-changed. Raises
        :class:`AgentProcessError` (with the program's output) when it keeps failing, or fails
        for another reason.
        """
        self.start(program)
        tried: list[int] = []
        while True:
            why = self.failing([program]).get(program)
            if not why:
                return tried[-1] if tried else self._conf_ports().get(program)
            path = self._conf_path(program)
            text = path.read_text() if path.exists() else ""
            port = parse_program_ports(text).get(program)
            if port is None or _port_bindable(port) or len(tried) + 1 >= attempts:
                raise AgentProcessError(program, f"does not stay up after its start: {why}")
            tried.append(port)
            with self._locked() as reservations:
                new = self._pick_port(reservations, exclude=tried, owner=program)
                _atomic_write(path, re.sub(rf"(-p\s+){port}\b", rf"\g<1>{new}", text, count=1))
                self._own_port(reservations, program, new)
            log.warning("%s: %s; its metrics port %s is taken: moved to %s", program, why,
                        port, new)
            tried.append(new)
            self._sync_group(program)

    def start_vm_agent(self, name: str, agent_dir: Path | str, port: int,
                       attempts: int = 3) -> int:
        """:meth:`add_vm_agent`, then make sure the program stays up; returns the port it runs on.

        A program that :meth:`failing` reports (e.g. its port was taken by another process
        between :meth:`allocate_port` and its start: the agent exits "Address already in use")
        is re-added on a newly allocated port (allocation skips ports that do not bind), up to
        ``attempts`` ports in all. Raises AgentProcessError when none of them works.
        """
        return self._settled(name, agent_dir, int(port), attempts, add=True)

    def _settled(self, name: str, agent_dir: Path | str, port: int, attempts: int = 3,
                 add: bool = False, why: str | None = None) -> int:
        """Watch ``name`` (added on ``port``; first add it if ``add``) and move it to another
        port while it fails. A program that crashes at once may already be EXITED when
        add_vm_agent looks: that "did not reach RUNNING" error counts as failing too.
        ``why``: the program was already seen failing for this reason (no first watch)."""
        tried = [port]
        while True:
            if why is None:
                try:
                    if add:
                        self.add_vm_agent(name, agent_dir, port)
                    why = self.failing([name]).get(name)
                except AgentProcessError as exc:
                    if not getattr(exc, "not_running", False):
                        raise
                    why = str(exc)
            add = True
            if not why:
                return port
            if len(tried) >= attempts:
                raise AgentProcessError(name, f"keeps failing on metrics ports "
                                        f"{', '.join(map(str, tried))}: {why}")
            new = self.allocate_port(exclude=tried, owner=name)
            log.warning("%s: %s; moving it from metrics port %s to %s", name, why, port, new)
            port, why = new, None
            tried.append(new)

    def _wait_running(self, name: str) -> None:
        failed = self._wait_all_running([name])
        if name in failed:
            raise failed[name]

    def _wait_all_running(self, names: list[str]) -> dict[str, AgentProcessError]:
        """Wait up to ``start_timeout`` for ``names`` to be RUNNING, reading every program's
        state in one call per round; returns ``{name: error}`` for those that are not (FATAL,
        EXITED, ABSENT, or still starting at the end), each error carrying the program's output
        tail and ``not_running = True``."""
        deadline = time.monotonic() + self.start_timeout
        waiting = list(names)
        states: dict[str, str] = {}
        down: list[str] = []  # seen FATAL, EXITED or ABSENT: not waited for any longer
        while waiting:
            infos = self._infos()
            for name in list(waiting):
                states[name] = infos.get(name, {}).get("statename", "ABSENT")
                if states[name] == "RUNNING":
                    waiting.remove(name)
                elif states[name] in ("FATAL", "EXITED", "ABSENT"):
                    waiting.remove(name)
                    down.append(name)
            if not waiting or time.monotonic() >= deadline:
                break
            time.sleep(0.05)
        failed = {}
        for name in down + waiting:
            state = states.get(name, "ABSENT")
            tail = ""
            if state != "ABSENT":
                out = self._rpc(name, "tailProcessStdoutLog", name, 0, 2000, ok=(_BAD_NAME,))
                tail = " | ".join((out[0] if out else "").strip().splitlines()[-5:])
            err = AgentProcessError(name, f"did not reach RUNNING (state {state}); output: "
                                          f"{tail or '-'}")
            err.not_running = True  # type: ignore[attr-defined]
            failed[name] = err
        return failed

    def remove_vm_agent(self, name: str) -> None:
        """Stop VM agent ``name``, remove its process group and delete its conf file; absent is fine.

        Refuses (AgentProcessError) to touch a program whose conf file lacks our marker, so a
        device agent can never be removed by mistake.
        """
        path = self._conf_path(name)
        if path.exists() and not path.read_text().startswith(MARKER):
            raise AgentProcessError(name, f"{path} was not written by testflinger-magic; not removing")
        self._stop_and_remove(name)
        with self._locked() as reservations:
            if path.exists():
                path.unlink()
            for port in [p for p, r in reservations.items() if r.get("owner") == name]:
                del reservations[port]

    def ensure(self, expected: dict[str, tuple[Path | str, int]]) -> list[str]:
        """Re-create the VM agent programs in ``expected`` (``{name: (agent_dir, port)}``) that are
        missing, changed or not running — e.g. after the agent-host charm deleted every
        ``conf.d/*.conf`` (TESTFLINGER.md §6.4), or added but not started yet (the enroll step
        adds them with ``start=False``; a supervisord restart leaves them stopped, since their
        files say ``autostart=false``). Returns the names restored, sorted. All of them are
        started before any is watched (:meth:`failing`'s settle is shared), so none waits for
        another's watch.

        A port that another program's conf file now claims is replaced by a fresh one (see
        :meth:`ports`), and so is the port of a program :meth:`failing` reports (FATAL, BACKOFF,
        EXITED or restarting: most likely its port was taken by a process that has no conf
        file); a re-created program is watched the same way (:meth:`start_vm_agent`). Agent folders are not re-rendered here: a name whose
        ``<agent_dir>/testflinger-agent.conf`` is missing is skipped, and after the others are
        restored AgentProcessError is raised naming the skipped ones (render them first).
        """
        restored, missing = [], []
        bad = self.failing(sorted(expected))
        present = {name: (agent_dir, port) for name, (agent_dir, port) in sorted(expected.items())
                   if (Path(agent_dir) / AGENT_CONF).exists()}
        missing = sorted(set(expected) - set(present))
        # Ports: a program's conf port counts as taken unless the program is re-added here, in
        # which case its new port (chosen in name order) does.
        conf_ports = self._conf_ports()
        taken = {p: n for n, p in conf_ports.items() if p is not None and n not in present}
        plan: list[tuple[str, Path | str, int]] = []
        for name, (agent_dir, port) in present.items():
            current = conf_ports.get(name)
            if int(port) in taken:
                log.warning("%s: port %s now used by %s; allocating another", name, port, taken[int(port)])
                port = self.allocate_port(owner=name)
            elif name in bad:
                # Not the port it failed on (the conf file's, which may differ from ``port``).
                port = self.allocate_port(exclude=[p for p in (port, current) if p], owner=name)
                log.warning("%s: %s; moving it to metrics port %s", name, bad[name], port)
            taken[int(port)] = name
            plan.append((name, agent_dir, int(port)))
        # Every program is (re)started first, with one reloadConfig for all (add_vm_agents),
        # and all are watched together afterwards: each agent polls for a job from its start,
        # whatever the watch of the others.
        changed, crashed = self._add_many(plan, start=True) if plan else (set(), {})
        # ``crashed``: did not reach RUNNING (crashed at once): moved to another port below.
        started: dict[str, tuple[Path | str, int, str | None]] = {
            name: (agent_dir, port, str(crashed[name]) if name in crashed else None)
            for name, agent_dir, port in plan if name in changed or name in crashed}
        watched = self.failing(sorted(n for n, (_d, _p, why) in started.items() if why is None))
        for name, (agent_dir, port, why) in sorted(started.items()):
            why = why or watched.get(name)
            if why:
                self._settled(name, agent_dir, port, why=why)
            restored.append(name)
        if missing:
            err = AgentProcessError(
                ", ".join(missing), f"agent folder without {AGENT_CONF}; render it before ensure()"
            )
            err.restored = restored  # type: ignore[attr-defined]
            raise err
        return restored
