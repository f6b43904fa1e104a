"""VM agent program files in supervisord's conf.d (pure): their text in the agent-host charm's
format, and when an existing file counts as the wanted one (split from agents.py; re-exported
there as ``agents.<name>``).

Facts honoured (canonical/testflinger, TESTFLINGER.md §6.2): the charm's
``templates/testflinger-agent.supervisord.conf.j2`` writes ``[program:<agent>]``,
``startsecs=0``, ``redirect_stderr=true``, ``user=ubuntu`` and ``command=<venv>/bin/
testflinger-agent -c <dir>/testflinger-agent.conf -p <port>``.
"""

from __future__ import annotations

import pwd

from .prewarm import normal_argv

#: First line of every program file the daemon writes; files without it are never removed.
MARKER = "; testflinger-magic vm-agent: managed by the agent-host daemon, do not edit"
#: Line of every VM agent program file: the daemon starts the program (see program_conf_text).
AUTOSTART_LINE = "autostart=false"


def _sv_quote(value: str) -> str:
    """Quote a value for a supervisord ``environment=`` entry; ``%`` is interpolation there."""
    return '"' + value.replace("%", "%%").replace('"', '\\"') + '"'


def program_conf_text(name: str, command: str, user: str | None = None) -> str:
    """Return the ``conf.d/<name>.conf`` text for a VM agent program (charm format + marker).

    ``command`` is the full command line; it must carry ``-p <port>`` so the charm's and our own
    port discovery see the port (a pre-warmed command keeps it: prewarm.wrap_argv). ``user``
    adds ``user=`` and the charm's USER/HOME environment.

    One line differs from the charm's template: ``autostart=false``. The daemon starts a VM
    agent itself: a pre-warmed one (prewarm.py) during enrolment, waiting on its go file
    until the lease is ``active``; any other only once the lease is ``active`` and the server
    lifted its fence, so that the agent's first job poll (right after its startup,
    TESTFLINGER.md §3.2-3.3) can take a job. supervisord's ``addProcessGroup`` would otherwise
    start it at once (``autostart`` defaults to true: supervisor/process.py
    ``Subprocess.transition``), while still fenced, and its next poll would come a whole
    ``polling_interval`` later. After a supervisord restart the daemon's next ``active`` check
    (:meth:`agents.AgentProcesses.ensure`) starts them again.
    """
    env = {"PYTHONIOENCODING": "utf-8"}
    lines = [MARKER, f"[program:{name}]", AUTOSTART_LINE, "startsecs=0", "redirect_stderr=true"]
    if user:
        try:
            home = pwd.getpwnam(user).pw_dir
        except KeyError:
            home = f"/home/{user}"
        env = {"USER": user, "HOME": home, **env}
    lines.append("environment=" + ",".join(f"{k}={_sv_quote(v)}" for k, v in env.items()))
    if user:
        lines.append(f"user={user}")
    lines.append("command=" + command.replace("%", "%%"))
    return "\n".join(lines) + "\n"


def _normal(text: str) -> list:
    """The lines that matter of a program file: without :data:`AUTOSTART_LINE`, the command as
    the argv it runs, pre-warm undone (prewarm.normal_argv)."""
    out: list = []
    for line in text.splitlines():
        if line.strip() == AUTOSTART_LINE:
            continue
        if line.startswith("command="):
            out.append(("command", normal_argv(line[len("command="):].replace("%%", "%"))))
        else:
            out.append(line)
    return out


def same_program(current: str, wanted: str) -> bool:
    """True when conf texts ``current`` and ``wanted`` differ at most by :data:`AUTOSTART_LINE`
    and by pre-warm (one runs the agent through the launcher, the other directly; the same
    agent either way).

    Such a file is kept as it is: rewriting it would make supervisord's ``reloadConfig`` see
    the group modified, and replacing the group restarts an agent that may be running a job
    (a file written before VM agents carried ``autostart=false``, or by a daemon with
    pre-warm on while it is now off, or the other way round). A pre-warmed program kept with
    pre-warm off still runs: the active check writes go files whatever the setting. Pure."""
    return _normal(current) == _normal(wanted)
