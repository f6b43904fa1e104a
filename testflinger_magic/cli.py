"""``testflinger-magic``: the operator command line.

``validate`` works offline; the other operator commands call the server's ``/v1/magic`` REST API
(docs/architecture.md, "Operator API"). Credentials follow testflinger-cli's conventions
(TESTFLINGER.md §4): ``--server`` then ``TESTFLINGER_SERVER``; ``--client-id``/``--secret-key``
then ``TESTFLINGER_CLIENT_ID``/``TESTFLINGER_SECRET_KEY``, exchanged for a JWT at
``POST /v1/oauth2/token`` (HTTP Basic) and sent as ``Authorization: Bearer``. Without credentials
requests go unauthenticated (Testflinger then treats the caller as an anonymous contributor,
enough for reads).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Sequence
from urllib.parse import quote

import requests

from testflinger_magic import __version__
from testflinger_magic.cli_output import (  # noqa: F401 (re-exported: cli_hosts, tests)
    LEASE_COLUMNS,
    _cell,
    _items,
    _lease_rows,
    _needs_a_person,
    _why_jobs_wait,
    render_definitions,
    table,
)
from testflinger_magic.durations import format_duration, parse_duration
from testflinger_magic.queues import DefinitionError, load_file, load_files
from testflinger_magic.webhooks import AllowList

DEFAULT_SERVER = "http://127.0.0.1:8000"
TIMEOUT = 30.0  # seconds per HTTP request


class CliError(Exception):
    """A failure to report on stderr (exit code 1)."""


# ---------------------------------------------------------------------------------------------
# HTTP client

class ApiClient:
    """Minimal client of the operator API. ``server`` is the base URL (no ``/v1``)."""

    def __init__(self, server: str, client_id: str | None = None,
                 secret_key: str | None = None, session: requests.Session | None = None):
        self.server = server.rstrip("/")
        self.client_id, self.secret_key = client_id, secret_key
        self.session = session or requests.Session()
        self._token: str | None = None

    def _url(self, path: str) -> str:
        return f"{self.server}{path}"

    def token(self) -> str | None:
        """Access token from ``POST /v1/oauth2/token`` (Basic auth), or None without
        credentials. Raises :class:`CliError` when the server refuses them."""
        if self._token or not (self.client_id and self.secret_key):
            return self._token
        resp = self._send("POST", "/v1/oauth2/token", auth=(self.client_id, self.secret_key))
        try:
            self._token = resp.json()["access_token"]
        except (ValueError, KeyError, TypeError) as exc:
            raise CliError(f"{self._url('/v1/oauth2/token')}: no access_token in the answer") \
                from exc
        return self._token

    def _send(self, method: str, path: str, **kwargs) -> requests.Response:
        url = self._url(path)
        try:
            resp = self.session.request(method, url, timeout=TIMEOUT, **kwargs)
        except requests.ConnectionError as exc:
            raise CliError(f"cannot connect to the Testflinger server at {self.server} "
                           f"({method} {url}): is it running? Set --server or "
                           "TESTFLINGER_SERVER") from exc
        except requests.RequestException as exc:
            raise CliError(f"{method} {url} failed: {exc}") from exc
        if resp.status_code == 404 and path.startswith("/v1/magic") and not _plugin_answer(resp):
            raise CliError(f"no testflinger-magic plugin at {self.server} (HTTP 404 for "
                           f"{method} {path}): is --server the Testflinger server with the "
                           "plugin mounted?")
        if resp.status_code >= 400:
            text = _error_text(method, url, resp)
            if resp.status_code in (401, 403) and not (self.client_id and self.secret_key):
                text += ("\nhint: no credentials were given; pass --client-id and --secret-key "
                         "(or set TESTFLINGER_CLIENT_ID and TESTFLINGER_SECRET_KEY)")
            raise CliError(text)
        return resp

    def call(self, method: str, path: str, body: Any = None, params: dict | None = None) -> Any:
        """Send one request and return its decoded JSON (``{}`` for an empty body). Raises
        :class:`CliError` with the server's message on HTTP >= 400 or a connection error."""
        headers = {}
        token = self.token()
        if token:
            headers["Authorization"] = f"Bearer {token}"
        resp = self._send(method, path, json=body, params=params, headers=headers)
        if not resp.content:
            return {}
        try:
            return resp.json()
        except ValueError as exc:
            raise CliError(f"{method} {self._url(path)}: the answer is not JSON") from exc


def _plugin_answer(resp: requests.Response) -> bool:
    """True when a 404 comes from the plugin (a JSON ``message`` naming what is unknown), False
    for a server without it: an HTML page (Flask) or APIFlask's generic ``Not Found``."""
    try:
        data = resp.json()
    except ValueError:
        return False
    message = data.get("message") if isinstance(data, dict) else None
    return isinstance(message, str) and message.strip().lower() not in ("", "not found")


def _error_text(method: str, url: str, resp: requests.Response) -> str:
    """The server's own message for a failed call, with any file:line issues under it."""
    lines = [f"{method} {url}: HTTP {resp.status_code}"]
    try:
        data = resp.json()
    except ValueError:
        data = None
    if isinstance(data, dict):
        msg = data.get("message") or data.get("detail") or data.get("error")
        if isinstance(msg, (dict, list)):
            msg = json.dumps(msg)
        issues = ["{}:{}: {}: {}".format(i.get("file", "?"), i.get("line", 0),
                                         i.get("field", "?"), i.get("message", ""))
                  for i in data.get("issues") or [] if isinstance(i, dict)]
        if issues and (not msg or "\n" in str(msg) or msg in issues):
            msg = f"{len(issues)} problem(s) in the definitions"  # the server's msg repeats them
        lines[0] += f": {msg}" if msg else f": {json.dumps(data)}"
        lines += issues
    elif resp.text.strip():
        lines[0] += f": {resp.text.strip()[:500]}"
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# Output

def _emit(args, data: Any, render) -> int:
    print(json.dumps(data, indent=2, sort_keys=True) if args.json else render(data))
    return 0


# ---------------------------------------------------------------------------------------------
# Subcommands

def cmd_validate(args) -> int:
    """Validate each FILE offline; summary per queue on stdout, issues and warnings (valid but
    likely wrong, testflinger_magic.queue_warnings; exit status unchanged) on stderr. With
    ``--json``: one object ``{"ok", "files": [{"file", "queues": {name: definition},
    "issues": [{file, line, field, message}], "warnings": [same]}]}`` on stdout."""
    if args.json:
        return _validate_json(args.files)
    from testflinger_magic import queue_warnings  # noqa: PLC0415

    failed = False
    for path in args.files:
        try:
            queues, warnings = queue_warnings.load_file(path)
        except DefinitionError as exc:
            failed = True
            print(str(exc), file=sys.stderr)
            continue
        for warning in warnings:  # likely wrong, still valid: exit status unchanged
            print(f"warning: {warning}", file=sys.stderr)
        for q in queues:
            p = q.policy
            per = "1 VM per {} GPU{}".format(q.vm.gpus, "s" if q.vm.gpus != 1 else "") \
                if q.vms_per_device == "gpus" else f"{q.vms_per_device} VMs"
            print(f"{path}: {q.name}: ok ({per}; vm {q.vm.vcpus} vCPU, {q.vm.memory_mib} MiB, "
                  f"{q.vm.disk_gib} GiB; max_devices {p.max_devices}, idle_timeout "
                  f"{format_duration(p.idle_timeout)})")
    if not failed and len(args.files) > 1:
        try:  # files meant to be used together: a queue defined twice would silently lose one
            load_files(args.files)
        except DefinitionError as exc:
            failed = True
            print(str(exc), file=sys.stderr)
    return 1 if failed else 0


def _validate_json(paths: list[str]) -> int:
    from testflinger_magic import queue_warnings  # noqa: PLC0415

    files = {str(p): {"file": str(p), "queues": {}, "issues": [], "warnings": []} for p in paths}
    for path in paths:
        try:
            queues, warnings = queue_warnings.load_file(path)
            files[str(path)]["queues"] = {q.name: q.to_yaml_dict() for q in queues}
            files[str(path)]["warnings"] = [w.to_dict() for w in warnings]
        except DefinitionError as exc:
            files[str(path)]["issues"] = [i.to_dict() for i in exc.issues]
    if len(paths) > 1 and not any(f["issues"] for f in files.values()):
        try:
            load_files(paths)
        except DefinitionError as exc:
            for issue in exc.issues:
                files.setdefault(issue.file, {"file": issue.file, "queues": {}, "issues": [],
                                              "warnings": []})
                files[issue.file]["issues"].append(issue.to_dict())
    ok = not any(f["issues"] for f in files.values())
    print(json.dumps({"ok": ok, "files": list(files.values())}, indent=2, sort_keys=True))
    return 0 if ok else 1


def cmd_apply(args, api: ApiClient) -> int:
    try:
        # Fail fast, offline, with file:line; where webhooks may point is the server's
        # allow-list, so the server alone judges that.
        queues = load_file(args.file, webhook_allow=AllowList(everything=True))
    except DefinitionError as exc:
        print(str(exc), file=sys.stderr)
        return 1
    text = Path(args.file).read_text(encoding="utf-8")
    body = {"yaml": text, "source": args.source or str(args.file)}
    if args.force:
        body["force"] = True
    data = api.call("PUT", "/v1/magic/queues", body)

    def render(d):
        applied = d.get("applied", [q.name for q in queues])
        removed = d.get("removed", [])
        out = (f"applied: {', '.join(applied) or '-'}\n"
               f"removed: {', '.join(removed) or '-'}")
        cancelled = {q: n for q, n in (d.get("cancelled") or {}).items() if n}
        if cancelled:
            out += "\ncancelled waiting jobs: " + ", ".join(
                f"{q}: {n}" for q, n in sorted(cancelled.items()))
        return out
    return _emit(args, data, render)


def cmd_status(args, api: ApiClient) -> int:
    data = api.call("GET", "/v1/magic/status")

    def render(d):
        # SUSPENDED: why a queue lends nothing (its definition made a lease fail); without
        # it a queue with waiting jobs and lendable devices looks merely slow.
        queues = _items(d, "queues")
        parts = ["QUEUES", table(queues, ["name", "waiting", "vm_agents", "leases",
                                          "devices_lendable", "suspended"])]
        waiting = _why_jobs_wait(queues)
        if waiting:
            parts += ["", "WHY JOBS WAIT", *waiting]
        attention = _needs_a_person(d)
        if attention:
            parts += ["", "NEEDS A PERSON", *attention]
        parts += ["", "LEASES", table(_lease_rows(_items(d, "leases")),
                                      LEASE_COLUMNS + ["running_jobs"])]
        devices = [dict(x, name=x.get("name", x.get("_id")),
                        quarantined=(x.get("quarantine_reason") or "yes")
                        if x.get("quarantined") else "no")
                   for x in _items(d, "devices")]
        parts += ["", "DEVICES", table(devices, ["name", "agent_host", "gpus", "home_queues",
                                                 "tags", "failures", "quarantined"])]
        borrowed = _items(d, "borrowed")
        if borrowed:  # fairness: GPU-hours of closed leases, per magic queue and home pool
            parts += ["", "GPU-HOURS BORROWED", table(borrowed, ["queue", "home_pool",
                                                                  "gpu_hours", "leases"])]
        return "\n".join(parts)
    return _emit(args, data, render)


def cmd_plan(args, api: ApiClient) -> int:
    data = api.call("GET", "/v1/magic/plan")

    def render(d):
        actions = _items(d, "actions")
        if not actions:
            return "nothing to do"
        return table(actions, ["kind", "queue", "device", "lease_id", "reason"])
    return _emit(args, data, render)


def cmd_queues(args, api: ApiClient) -> int:
    """The applied definitions as the server holds them (``GET /v1/magic/queues``), written as
    a definitions file; webhook URLs stay redacted as the server returns them."""
    data = api.call("GET", "/v1/magic/queues")
    return _emit(args, data, lambda d: render_definitions(_items(d, "queues"), api.server))


def cmd_drain(args, api: ApiClient) -> int:
    try:
        parse_duration(args.grace)
    except ValueError as exc:
        raise CliError(f"--grace: {exc}") from exc
    body = {"reason": args.reason, "grace": args.grace, "force": args.force}
    data = api.call("POST", f"/v1/magic/leases/{quote(args.lease_id, safe='')}/drain", body)
    return _emit(args, data, lambda d: f"draining {args.lease_id}: state "
                                       f"{(d.get('lease') or d).get('state', '?')}")


def cmd_quarantine(args, api: ApiClient) -> int:
    data = api.call("POST", f"/v1/magic/devices/{quote(args.device, safe='')}/quarantine",
                    {"reason": args.reason})

    def render(d):
        previous = d.get("previous_reason") if isinstance(d, dict) else None
        if previous is None:
            return f"quarantined {args.device}: {args.reason}"
        if previous == args.reason:
            return f"{args.device} was already quarantined: {args.reason}"
        return (f"{args.device} was already quarantined ({_cell(previous)}); "
                f"reason now: {args.reason}")
    return _emit(args, data, render)


def cmd_unquarantine(args, api: ApiClient) -> int:
    data = api.call("DELETE", f"/v1/magic/devices/{quote(args.device, safe='')}/quarantine")
    return _emit(args, data, lambda d: f"unquarantined {args.device}")


def cmd_leases(args, api: ApiClient) -> int:
    params = {}
    if args.queue:
        params["queue"] = args.queue
    if not args.all:
        params["open"] = "1"
    data = api.call("GET", "/v1/magic/leases", params=params)
    return _emit(args, data, lambda d: table(_lease_rows(_items(d, "leases")), LEASE_COLUMNS))


def cmd_events(args, api: ApiClient) -> int:
    data = api.call("GET", "/v1/magic/events", params={"limit": str(args.limit)})

    def render(d):
        import time
        rows = []
        for e in _items(d, "events"):
            row = dict(e)
            at = e.get("at")
            row["at"] = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(at)) \
                if isinstance(at, (int, float)) else at
            rows.append(row)
        return table(rows, ["at", "kind", "queue", "device", "lease_id", "message"])
    return _emit(args, data, render)


def cmd_lend(args, api: ApiClient) -> int:
    body = {"device": args.device, "queue": args.queue, "reason": args.reason}
    data = api.call("POST", "/v1/magic/leases", body)
    lease = data.get("lease", data) if isinstance(data, dict) else {}
    return _emit(args, data, lambda d: f"lent {args.device} to {args.queue}: lease "
                                       f"{lease.get('_id', '?')} ({lease.get('state', '?')})")


def cmd_agent_host(args) -> int:
    if not args.config:
        raise CliError("agent-host needs --config FILE (or the check subcommand)")
    from testflinger_magic.agent_host import daemon
    return int(daemon.main(args) or 0)


def cmd_agent_host_sweep(args) -> int:
    from testflinger_magic.agent_host import sweep

    args.config = args.sweep_config
    return int(sweep.main(args))


def cmd_agent_host_check(args) -> int:
    from testflinger_magic.agent_host import check

    args.config = args.check_config
    return int(check.main(args))


def cmd_lab_up(args) -> int:
    from testflinger_magic.lab import lab
    try:
        return int(lab.main_up(args) or 0)
    except lab.LabError as exc:  # a refused --workdir, a component that did not start
        raise CliError(f"lab up: {exc}") from None


def cmd_demo(args) -> int:
    from testflinger_magic.lab import demo
    return int(demo.main(args) or 0)


def cmd_simulate(args) -> int:
    """Replay TRACE in virtual time once per ``--policy`` set; a table (or JSON) of results."""
    from testflinger_magic.lab import simulate as sim

    try:
        definitions = load_file(args.queues)
        lab = sim.load_lab(args.lab) if args.lab else None
        trace = sim.load_trace(args.trace, lab=lab)
        results = sim.compare(trace, definitions, args.policy or [], args.baseline or [])
    except DefinitionError as exc:
        print(str(exc), file=sys.stderr)
        return 1
    except (sim.SimulationError, OSError) as exc:
        raise CliError(str(exc)) from exc
    from testflinger_magic.lab import baselines

    versus = baselines.comparisons(results) if args.baseline else []
    for r in results:
        for warning in r.warnings:
            print(f"warning: {r.label}: {warning}", file=sys.stderr)
    if args.json:
        print(json.dumps({"trace": str(args.trace), "queues": str(args.queues),
                          "jobs": len(trace.jobs), "comparisons": versus,
                          "results": [r.to_dict() for r in results]}, indent=2, sort_keys=True))
    else:
        print(f"{args.trace}: {len(trace.jobs)} jobs, "
              f"{sum(len(d.names()) for d in trace.lab.devices)} devices\n")
        print(sim.render_table(results))
        if versus:
            print("\n" + baselines.render_comparisons(versus))
    if args.plot:
        from testflinger_magic.lab import sim_plot

        try:
            sim_plot.plot(results, args.plot, title=f"{args.trace} ({len(trace.jobs)} jobs)")
        except ImportError as exc:
            raise CliError(f"--plot needs matplotlib (pip install 'testflinger-magic[lab]'): "
                           f"{exc}") from exc
        except OSError as exc:
            raise CliError(f"--plot {args.plot}: {exc}") from exc
    return 0


def cmd_trace_export(args) -> int:
    """A simulate trace from a Testflinger database's ``jobs`` (lab/trace_export.py)."""
    from testflinger_magic import db as dbmod
    from testflinger_magic.lab import simulate as sim
    from testflinger_magic.lab import trace_export as tx

    try:
        since = tx.parse_time(args.since, "--since")
        until = tx.parse_time(args.until, "--until") if args.until else time.time()
        lab = sim.load_lab(args.lab).model_dump(by_alias=True) if args.lab else None
        trace = tx.export_trace(dbmod.connect(args.mongo, args.db), since, until,
                                args.queue or None)
    except DefinitionError as exc:
        print(str(exc), file=sys.stderr)
        return 1
    except (tx.ExportError, OSError) as exc:
        raise CliError(str(exc)) from exc
    text = json.dumps(dict(trace, **({"lab": lab} if lab else {})), indent=1) \
        if args.out.endswith(".json") else tx.to_yaml(trace, lab)
    Path(args.out).write_text(text, encoding="utf-8")
    info = trace["exported"]
    if args.json:
        print(json.dumps(dict(info, out=args.out), sort_keys=True))
    else:
        print(f"{args.out}: {info['jobs']} jobs ({info['durations_guessed']} durations guessed)"
              + "".join(f", {n} {k}" for k, n in info["skipped"].items()))
    return 0


# ---------------------------------------------------------------------------------------------
# Parser

def positive_int(text: str) -> int:
    """argparse type: an integer >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text} must be at least 1")
    return value


def positive_float(text: str) -> float:
    """argparse type: a finite number > 0 (``nan``, ``inf``, 0 and negatives are refused)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"{text} must be a finite number greater than 0")
    return value


def writable_dir(text: str) -> str:
    """argparse type: a directory that exists or can be created, and is writable (it is
    created here: the lab would create it anyway)."""
    path = Path(text).expanduser()
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as exc:
        raise argparse.ArgumentTypeError(f"{text}: not a writable directory "
                                         f"({exc.strerror or exc})") from None
    return str(path)


def nonempty(what: str):
    """argparse type: a non-blank string (an empty id would name no lease or device, and the
    server would answer for another route)."""
    def check(text: str) -> str:
        if not text.strip():
            raise argparse.ArgumentTypeError(f"{what} must not be empty")
        return text
    check.__name__ = what  # argparse names the type in some messages
    return check


#: Defaults of ``lab up`` and ``demo`` as shown in their help; tests check they are the lab's
#: (lab.LabOptions, demo.DEFAULT_*), without importing the lab here (it is heavy).
LAB_DEFAULTS = {"devices": 2, "gpus": 8, "time_scale": 0.01, "phase_seconds": 1.0}
DEMO_DEFAULTS = {"copies": 4, "timeout": 240.0, "summary": "demo-summary.json"}

#: Commands that run until stopped and print logs, not a report: ``--json`` is refused.
NO_JSON = {"agent-host": "runs the agent-host daemon until stopped (its output is its log)",
           "lab up": "runs the lab until stopped (the banner is for people; the servers it "
                     "names answer JSON)"}

GLOBAL_HELP = """\
global options (accepted before or after the command):
  --json                every command that reports prints JSON on stdout (agent-host and
                        lab up, which run until stopped, refuse it)
  --server URL          Testflinger server URL, http:// or https:// (env TESTFLINGER_SERVER;
                        default {server}); commands that call the server
  --client-id ID        client id (env TESTFLINGER_CLIENT_ID)
  --secret-key KEY      secret key (env TESTFLINGER_SECRET_KEY)
"""


def build_parser() -> argparse.ArgumentParser:
    """The argparse tree; each command's parser sets ``func``, ``needs_api`` and ``cmd``.

    One rule for the global options: ``--json`` and the connection options (``--server``,
    ``--client-id``, ``--secret-key``) are accepted before the command or after it, like
    testflinger-cli's (``testflinger-magic --json status`` = ``testflinger-magic status
    --json``). The command's own value wins over the one before it. ``--json`` is offered by
    every command; the connection options by the commands that call the server.
    """
    parser = argparse.ArgumentParser(
        prog="testflinger-magic",
        description="Magic queues for Testflinger: define, apply and watch on-demand VM queues.",
        epilog=GLOBAL_HELP.format(server=DEFAULT_SERVER),
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--server", metavar="URL",
                        help="Testflinger server URL, http:// or https:// (env "
                        f"TESTFLINGER_SERVER; default {DEFAULT_SERVER})")
    parser.add_argument("--client-id", metavar="ID", help="client id (env TESTFLINGER_CLIENT_ID)")
    parser.add_argument("--secret-key", metavar="KEY",
                        help="secret key (env TESTFLINGER_SECRET_KEY)")
    parser.add_argument("--json", action="store_true",
                        help="print JSON on stdout (every command that reports)")
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    # The same options after the command. SUPPRESS: not given there, the value before the
    # command (or the default) stays.
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--json", action="store_true", default=argparse.SUPPRESS,
                        help="print JSON on stdout")
    api = argparse.ArgumentParser(add_help=False, parents=[common])
    api.add_argument("--server", metavar="URL", default=argparse.SUPPRESS,
                     help="Testflinger server URL, http:// or https:// (env TESTFLINGER_SERVER; "
                     f"default {DEFAULT_SERVER})")
    api.add_argument("--client-id", metavar="ID", default=argparse.SUPPRESS,
                     help="client id (env TESTFLINGER_CLIENT_ID)")
    api.add_argument("--secret-key", metavar="KEY", default=argparse.SUPPRESS,
                     help="secret key (env TESTFLINGER_SECRET_KEY)")

    def add(name, func, help_, needs_api=True, description=None, **kw):
        p = sub.add_parser(name, help=help_, description=description or help_,
                           parents=[api] if needs_api else [common], **kw)
        p.set_defaults(func=func, needs_api=needs_api, cmd=name)
        return p

    p = add("validate", cmd_validate, "check definition files offline", needs_api=False)
    p.add_argument("files", nargs="+", metavar="FILE", help="definition files (YAML)")

    p = add("apply", cmd_apply, "validate a definition file and store it on the server")
    p.add_argument("file", metavar="FILE", help="definition file (YAML)")
    p.add_argument("--source", help="name recorded with the definitions (default: FILE)")
    p.add_argument("--force", action="store_true", help="remove queues missing from FILE even "
                   "if jobs wait on them, cancelling those jobs (without it the server refuses)")

    add("queues", cmd_queues, "the magic queue definitions applied on the server",
        description="The magic queue definitions the server holds now, written as a "
        "definitions file (policy.notify URLs are redacted by the server).")
    add("status", cmd_status, "queues (and why their jobs wait), leases and devices")
    add("plan", cmd_plan, "what the reconciler would do now, with reasons (dry run)")

    p = add("drain", cmd_drain, "stop giving a lease new jobs, then give the device back")
    p.add_argument("lease_id", metavar="LEASE_ID", type=nonempty("LEASE_ID"),
                   help="the lease (testflinger-magic leases)")
    p.add_argument("--reason", default="operator drain",
                   help="why, recorded with the lease and its events (default: %(default)s)")
    p.add_argument("--grace", default="15m", help="time running jobs get before they are "
                   "cancelled, e.g. 30s, 15m, 2h; 0 cancels them at once (default %(default)s)")
    # Every drain cancels the jobs still running when --grace ends (drain with grace, then
    # force); --force only keeps new demand from cancelling the drain.
    p.add_argument("--force", action="store_true", help="never cancel this drain for new "
                   "demand (every drain cancels the jobs still running when --grace ends)")

    p = add("quarantine", cmd_quarantine, "never lend DEVICE until unquarantined")
    p.add_argument("device", metavar="DEVICE", type=nonempty("DEVICE"),
                   help="device agent name")
    p.add_argument("--reason", default="operator quarantine",
                   help="why, shown by status (a quarantined device gets the new reason; "
                   "default: %(default)s)")

    p = add("unquarantine", cmd_unquarantine, "make DEVICE lendable again")
    p.add_argument("device", metavar="DEVICE", type=nonempty("DEVICE"),
                   help="device agent name")

    p = add("leases", cmd_leases, "list leases (open ones unless --all)")
    p.add_argument("--queue", type=nonempty("--queue"), help="only this magic queue")
    p.add_argument("--all", action="store_true", help="include returned and failed leases")

    p = add("events", cmd_events, "recent events")
    p.add_argument("--limit", type=positive_int, default=50, metavar="N",
                   help="most recent N events (default %(default)s)")

    p = add("lend", cmd_lend, "lend DEVICE to magic QUEUE by hand")
    p.add_argument("device", metavar="DEVICE", type=nonempty("DEVICE"), help="device agent name")
    p.add_argument("queue", metavar="QUEUE", type=nonempty("QUEUE"), help="magic queue")
    p.add_argument("--reason", default="operator lend",
                   help="why, recorded with the lease (default: %(default)s)")

    p = add("agent-host", cmd_agent_host, "run the agent-host daemon (or: agent-host check)",
            needs_api=False)
    p.add_argument("--config", metavar="FILE", help="agent-host.yaml (required to run)")
    ah = p.add_subparsers(dest="agent_host_command", metavar="SUBCOMMAND")
    chk = ah.add_parser("check", parents=[common],
                        help="what a lend would do on a device and what would fail "
                        "(reads MAAS and libvirt, changes nothing; exit 0: a lend would succeed)",
                        description="Read-only pre-flight for an agent host: MAAS reachable and "
                        "the devices' machines known (--config); on a libvirt URI the GPUs a "
                        "split would lend with their functions, IOMMU group and NUMA node, "
                        "every refused device and why, the firmware/MMIO plan, bridge, pool "
                        "and readiness. Exit 0 when a lend would succeed, 1 otherwise.")
    chk.add_argument("--config", dest="check_config", metavar="FILE", help="agent-host.yaml")
    chk.add_argument("--device", metavar="NAME", help="only this device of the config")
    chk.add_argument("--libvirt-uri", metavar="URI",
                     help="the deployed host (qemu+ssh://ubuntu@HOST/system) or test:///FILE")
    chk.add_argument("--bridge", help="bridge the VMs join (default: the config's)")
    chk.add_argument("--gpus-per-vm", type=int, default=1, metavar="N",
                     help="GPUs per VM to plan for (default %(default)s)")
    chk.add_argument("--firmware", choices=["uefi", "bios"], default="uefi",
                     help="VM firmware to plan for (default %(default)s)")
    chk.add_argument("--mmio64-mib", type=positive_int, metavar="MIB",
                     help="OVMF 64-bit aperture (default: sized for H200s)")
    chk.set_defaults(func=cmd_agent_host_check, needs_api=False, cmd="agent-host check")
    swp = ah.add_parser("sweep", parents=[common],
                        help="remove what carries our marks but no open lease owns (MAAS VM "
                        "machines, libvirt domains, VM agent programs and folders)",
                        description="The daemon's orphan sweep, once: lists the VM agent "
                        "programs and folders, libvirt domains and MAAS machines carrying "
                        "testflinger-magic's marks for this host's devices, asks the server for "
                        "the open leases, and removes what none owns once past sweep_grace "
                        "(docs/operator-guide.md, 'Orphan sweep'). Exit 1 when a removal failed "
                        "or the server could not be asked.")
    swp.add_argument("--config", dest="sweep_config", metavar="FILE", required=True,
                     help="agent-host.yaml")
    swp.add_argument("--dry-run", action="store_true",
                     help="show what would be removed; change nothing")
    swp.set_defaults(func=cmd_agent_host_sweep, needs_api=False, cmd="agent-host sweep")

    from testflinger_magic import cli_hosts  # noqa: PLC0415

    cli_hosts.add_parsers(sub, api)

    lab = sub.add_parser("lab", help="the embedded lab", description="The embedded lab: the "
                         "Testflinger-compatible job service with the plugin, the MAAS "
                         "simulator, libvirt test-driver hosts, simulated agents and the "
                         "agent-host daemon, on this machine.")
    lab_sub = lab.add_subparsers(dest="lab_command", required=True, metavar="LAB_COMMAND")
    d = LAB_DEFAULTS
    p = lab_sub.add_parser("up", parents=[common],
                           help="start the embedded lab (servers, MAAS simulator, daemon)",
                           description="Start the embedded lab and keep it running until "
                           "Ctrl-C: a Testflinger-compatible server with the plugin and the "
                           "example magic queues applied (their policy shortened so a cycle "
                           "takes about a minute), the MAAS simulator, device agents and the "
                           "agent-host daemon. Prints the server URL and the credentials to "
                           "use with testflinger-cli and testflinger-magic.")
    p.add_argument("--workdir", type=writable_dir, metavar="DIR",
                   help="lab files, kept: a new or empty folder, or an earlier lab's (cleaned "
                   "first; any other folder is refused) (default: a new temporary dir, removed "
                   "when the lab stops)")
    p.add_argument("--devices", type=positive_int, metavar="N",
                   help=f"bare-metal GPU devices (default {d['devices']})")
    p.add_argument("--gpus", type=positive_int, metavar="N",
                   help="passthrough GPUs per device, 1-8: the lab hosts are HGX boards "
                   f"(default {d['gpus']})")
    p.add_argument("--time-scale", type=positive_float, metavar="X",
                   help="factor applied to simulated MAAS delays, 0.01: a 600 s deploy takes "
                   f"6 s (default {d['time_scale']})")
    p.add_argument("--phase-seconds", type=positive_float, metavar="S",
                   help="seconds a simulated agent spends in each job phase "
                   f"(default {d['phase_seconds']:g})")
    p.set_defaults(func=cmd_lab_up, needs_api=False, cmd="lab up")

    d = DEMO_DEFAULTS
    p = add("demo", cmd_demo, "run the end-to-end demo in the embedded lab", needs_api=False,
            description="Run the whole magic-queue cycle in the embedded lab: submit the job "
            "files, lend, split, run, drain, restore, check the home queue is served again; "
            "print a summary (with --json: progress on stderr, the summary as JSON on stdout).")
    p.add_argument("--summary", metavar="PATH",
                   help=f"write the JSON summary here (default {d['summary']})")
    p.add_argument("--time-scale", type=positive_float, metavar="X",
                   help="factor applied to simulated MAAS delays "
                   f"(default {LAB_DEFAULTS['time_scale']})")
    p.add_argument("--jobs-dir", metavar="DIR", help="job files to submit (default examples/jobs)")
    p.add_argument("--workdir", type=writable_dir, metavar="DIR",
                   help="lab files, kept: a new or empty folder, or an earlier lab's (cleaned first) "
                   "(default: a temporary dir, removed after success)")
    p.add_argument("--phase-seconds", type=positive_float, metavar="S",
                   help="seconds a simulated agent spends in each job phase "
                   f"(default {LAB_DEFAULTS['phase_seconds']:g})")
    p.add_argument("--copies", type=positive_int, metavar="N",
                   help=f"submissions of each job file (default {d['copies']})")
    p.add_argument("--timeout", type=positive_float, metavar="S",
                   help=f"give up after S seconds (default {d['timeout']:g})")

    p = add("simulate", cmd_simulate, "replay a job trace in virtual time to compare policies",
            needs_api=False)
    p.add_argument("trace", metavar="TRACE", help="trace file (.yaml, .json or .csv; "
                   "docs/simulate.md)")
    p.add_argument("--queues", required=True, metavar="FILE", help="magic queue definitions")
    p.add_argument("--policy", action="append", metavar="KEY=VALUE[,...]",
                   help="policy overrides for one column, e.g. idle_timeout=30m,max_devices=3 "
                   "or one-gpu-vm:max_devices=1 (repeat for more columns; '' is a column of "
                   "the definitions as they are; default: that column alone)")
    p.add_argument("--lab", metavar="FILE", help="lab file (devices, step durations, tick) "
                   "replacing the trace's own (default: the trace's)")
    p.add_argument("--baseline", action="append", metavar="none|static:N[:QUEUE]",
                   help="a column without magic queues: 'none' (no lending) or 'static:N[:QUEUE]' "
                   "(N devices split for QUEUE for good); ends with 'vs static:N' lines "
                   "(repeatable)")
    p.add_argument("--plot", metavar="FILE.png", help="also draw, per column, waiting jobs, "
                   "devices lent and waits over time")

    tr = sub.add_parser("trace", help="job traces for simulate",
                        description="Job traces for simulate (docs/simulate.md).")
    tr_sub = tr.add_subparsers(dest="trace_command", required=True, metavar="TRACE_COMMAND")
    p = tr_sub.add_parser("export", parents=[common], help="build a trace from a Testflinger "
                          "database's jobs over a time range",
                          description="Build a simulate trace from the jobs created in "
                          "[--since, --until) in a Testflinger MongoDB (created/started times, "
                          "priority; durations from the jobs' log fragments).")
    p.add_argument("--mongo", required=True, metavar="URI", help="MongoDB URI of Testflinger's "
                   "database (mongodb://host:27017/testflinger_db)")
    p.add_argument("--db", default="testflinger_db", metavar="NAME",
                   help="database name when the URI names none (default testflinger_db)")
    p.add_argument("--since", required=True, metavar="TIME", help="ISO 8601, UTC unless a zone "
                   "is given (2024-05-06 or 2024-05-06T09:00)")
    p.add_argument("--until", metavar="TIME", help="ISO 8601 (default: now)")
    p.add_argument("--queue", action="append", metavar="Q", help="only this queue (repeatable)")
    p.add_argument("--lab", metavar="FILE", help="lab file to embed in the trace")
    p.add_argument("--out", required=True, metavar="FILE", help="trace to write (.yaml or .json)")
    p.set_defaults(func=cmd_trace_export, needs_api=False, cmd="trace export")

    return parser


def server_url(text: str) -> str:
    """``--server``/``TESTFLINGER_SERVER`` checked: an http:// or https:// URL with a host,
    as testflinger-cli requires. Raises :class:`CliError` naming the value otherwise."""
    from urllib.parse import urlsplit

    parts = urlsplit(text.strip())
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise CliError(f"--server {text!r}: the Testflinger server URL must start with http:// "
                       f"or https:// (like testflinger-cli), e.g. http://{text.strip() or 'HOST'}"
                       if "://" not in text else
                       f"--server {text!r}: the Testflinger server URL must be http:// or "
                       "https:// with a host")
    return text.strip()


def _resolve_connection(args) -> None:
    """The option (after or before the command), else the environment, else the default."""
    env = {"server": "TESTFLINGER_SERVER", "client_id": "TESTFLINGER_CLIENT_ID",
           "secret_key": "TESTFLINGER_SECRET_KEY"}
    for key, var in env.items():
        value = getattr(args, key, None) or os.environ.get(var)
        if key == "server":
            value = value or DEFAULT_SERVER
        setattr(args, key, value)
    args.json = bool(getattr(args, "json", False))


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; returns the exit code (0 ok, 1 error, 2 usage, 130 Ctrl-C).

    A reader that stops early (``status | head``) closes the pipe: like other Unix tools the
    rest of the output is dropped quietly and the status is 0.
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    _resolve_connection(args)
    cmd = getattr(args, "cmd", None)
    if args.json and cmd in NO_JSON:
        parser.error(f"--json: {cmd} {NO_JSON[cmd]}; it has no JSON output")
    try:
        if args.needs_api:
            args.server = server_url(args.server)
            client = ApiClient(args.server, args.client_id, args.secret_key)
            code = args.func(args, client)
        else:
            code = args.func(args)
        sys.stdout.flush()  # a closed pipe shows here, not at interpreter exit
        return code
    except CliError as exc:
        print(f"testflinger-magic: {exc}", file=sys.stderr)
        return 1
    except BrokenPipeError:
        _drop_stdout()
        return 0
    except KeyboardInterrupt:
        return 130


def _drop_stdout() -> None:
    """Point stdout at /dev/null so the interpreter's final flush does not fail again."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError):  # no real file descriptor (tests capture stdout)
        pass


if __name__ == "__main__":
    sys.exit(main())
