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
from pathlib import Path
from typing import Any, Sequence
from urllib.parse import quote

import requests

from testflinger_magic import __version__
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

def table(rows: list[dict], columns: list[str]) -> str:
    """Plain-text table: one header line, then one line per row (missing cells are '-'), or
    ``(none)`` under the header when there are no rows."""
    cells = [[_cell(r.get(c)) for c in columns] for r in rows]
    widths = [max([len(c)] + [len(row[i]) for row in cells]) for i, c in enumerate(columns)]
    out = ["  ".join(c.lstrip("_").upper().ljust(w) for c, w in zip(columns, widths)).rstrip()]
    out += ["  ".join(v.ljust(w) for v, w in zip(row, widths)).rstrip() for row in cells]
    if not cells:
        out.append("(none)")
    return "\n".join(out)


def _cell(value: Any) -> str:
    if value is None or value == "":
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return f"{value:.0f}" if value.is_integer() else f"{value:.1f}"
    if isinstance(value, (list, tuple)):
        return ",".join(_cell(v) for v in value) or "-"
    if isinstance(value, dict):
        return json.dumps(value, sort_keys=True)
    return str(value)


def _items(data: Any, key: str) -> list[dict]:
    """``data[key]`` when the server wraps a list in an object, or ``data`` if it is a list."""
    if isinstance(data, list):
        return data
    if isinstance(data, dict):
        items = data.get(key)
        return items if isinstance(items, list) else []
    return []


def _emit(args, data: Any, render) -> int:
    print(json.dumps(data, indent=2, sort_keys=True) if args.json else render(data))
    return 0


# ---------------------------------------------------------------------------------------------
# Subcommands

def cmd_validate(args) -> int:
    """Validate each FILE offline; summary per queue on stdout, issues on stderr."""
    failed = False
    for path in args.files:
        try:
            queues = load_file(path)
        except DefinitionError as exc:
            failed = True
            print(str(exc), file=sys.stderr)
            continue
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


LEASE_COLUMNS = ["_id", "queue", "device", "state", "vms", "agent_host", "age", "drain"]


def _lease_rows(leases: list[dict], now: float | None = None) -> list[dict]:
    import time
    now = time.time() if now is None else now
    rows = []
    for lease in leases:
        row = dict(lease)
        if isinstance(row.get("vms"), list):
            row["vms"] = len(row["vms"])
        created = row.get("created_at")
        row["age"] = format_duration(max(0.0, now - created)) \
            if isinstance(created, (int, float)) else None
        drain = row.get("drain")
        row["drain"] = (drain.get("reason") or "yes") if isinstance(drain, dict) else None
        rows.append(row)
    return rows


def cmd_status(args, api: ApiClient) -> int:
    data = api.call("GET", "/v1/magic/status")

    def render(d):
        # SUSPENDED: why a queue lends nothing (its definition made a lease fail); without
        # it a queue with waiting jobs and lendable devices looks merely slow.
        parts = ["QUEUES", table(_items(d, "queues"),
                                 ["name", "waiting", "vm_agents", "leases", "devices_lendable",
                                  "suspended"])]
        parts += ["", "LEASES", table(_lease_rows(_items(d, "leases")), LEASE_COLUMNS)]
        devices = [dict(x, name=x.get("name", x.get("_id"))) for x in _items(d, "devices")]
        parts += ["", "DEVICES", table(devices, ["name", "agent_host", "gpus", "home_queues",
                                                 "tags", "quarantined", "failures"])]
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
    return _emit(args, data, lambda d: f"quarantined {args.device}")


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


def cmd_agent_host_check(args) -> int:
    from testflinger_magic.agent_host import check

    args.config = args.check_config
    args.json = args.check_json or args.json
    return int(check.main(args))


def cmd_lab_up(args) -> int:
    from testflinger_magic.lab import lab
    return int(lab.main_up(args) or 0)


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
        results = sim.compare(trace, definitions, args.policy or [])
    except DefinitionError as exc:
        print(str(exc), file=sys.stderr)
        return 1
    except (sim.SimulationError, OSError) as exc:
        raise CliError(str(exc)) from exc
    for r in results:
        for warning in r.warnings:
            print(f"warning: {r.label}: {warning}", file=sys.stderr)
    if args.json:
        print(json.dumps({"trace": str(args.trace), "queues": str(args.queues),
                          "jobs": len(trace.jobs),
                          "results": [r.to_dict() for r in results]}, indent=2, sort_keys=True))
    else:
        print(f"{args.trace}: {len(trace.jobs)} jobs, "
              f"{sum(len(d.names()) for d in trace.lab.devices)} devices\n")
        print(sim.render_table(results))
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


def build_parser() -> argparse.ArgumentParser:
    """The argparse tree; each subparser sets ``func`` and ``needs_api``."""
    parser = argparse.ArgumentParser(
        prog="testflinger-magic",
        description="Magic queues for Testflinger: define, apply and watch on-demand VM queues.")
    # Like testflinger-cli, the connection options may come before the command
    # (`testflinger-magic --server URL status`) or after it (`... status --server URL`).
    parser.add_argument("--server", dest="g_server", metavar="URL",
                        help=f"Testflinger server URL (env TESTFLINGER_SERVER; default {DEFAULT_SERVER})")
    parser.add_argument("--client-id", dest="g_client_id", help="client id (env TESTFLINGER_CLIENT_ID)")
    parser.add_argument("--secret-key", dest="g_secret_key", help="secret key (env TESTFLINGER_SECRET_KEY)")
    parser.add_argument("--json", dest="g_json", action="store_true", help="print the server's raw JSON")
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    api = argparse.ArgumentParser(add_help=False)
    api.add_argument("--server", help="Testflinger server URL (env TESTFLINGER_SERVER; "
                     f"default {DEFAULT_SERVER})")
    api.add_argument("--client-id", help="client id (env TESTFLINGER_CLIENT_ID)")
    api.add_argument("--secret-key", help="secret key (env TESTFLINGER_SECRET_KEY)")
    api.add_argument("--json", action="store_true", help="print the server's raw JSON")

    def add(name, func, help_, needs_api=True, **kw):
        p = sub.add_parser(name, help=help_, description=help_,
                           parents=[api] if needs_api else [], **kw)
        p.set_defaults(func=func, needs_api=needs_api)
        return p

    p = add("validate", cmd_validate, "check definition files offline", needs_api=False)
    p.add_argument("files", nargs="+", metavar="FILE")

    p = add("apply", cmd_apply, "validate a definition file and store it on the server")
    p.add_argument("file", metavar="FILE")
    p.add_argument("--source", help="name recorded with the definitions (default: FILE)")
    p.add_argument("--force", action="store_true", help="remove queues missing from FILE even "
                   "if jobs wait on them, cancelling those jobs (without it the server refuses)")

    add("status", cmd_status, "queues, leases and devices")
    add("plan", cmd_plan, "what the reconciler would do now, with reasons (dry run)")

    p = add("drain", cmd_drain, "stop giving a lease new jobs, then give the device back")
    p.add_argument("lease_id", metavar="LEASE_ID")
    p.add_argument("--reason", default="operator drain")
    p.add_argument("--grace", default="15m", help="time running jobs get (default %(default)s)")
    # Every drain cancels the jobs still running when --grace ends (drain with grace, then
    # force); --force only keeps new demand from cancelling the drain.
    p.add_argument("--force", action="store_true", help="never cancel this drain for new "
                   "demand (every drain cancels the jobs still running when --grace ends)")

    p = add("quarantine", cmd_quarantine, "never lend DEVICE until unquarantined")
    p.add_argument("device", metavar="DEVICE")
    p.add_argument("--reason", default="operator quarantine")

    p = add("unquarantine", cmd_unquarantine, "make DEVICE lendable again")
    p.add_argument("device", metavar="DEVICE")

    p = add("leases", cmd_leases, "list leases (open ones unless --all)")
    p.add_argument("--queue", help="only this magic queue")
    p.add_argument("--all", action="store_true", help="include returned and failed leases")

    p = add("events", cmd_events, "recent events")
    p.add_argument("--limit", type=positive_int, default=50, metavar="N",
                   help="most recent N events (default %(default)s)")

    p = add("lend", cmd_lend, "lend DEVICE to magic QUEUE by hand")
    p.add_argument("device", metavar="DEVICE")
    p.add_argument("queue", metavar="QUEUE")
    p.add_argument("--reason", default="operator lend")

    p = add("agent-host", cmd_agent_host, "run the agent-host daemon (or: agent-host check)",
            needs_api=False)
    p.add_argument("--config", metavar="FILE", help="agent-host.yaml (required to run)")
    ah = p.add_subparsers(dest="agent_host_command", metavar="SUBCOMMAND")
    chk = ah.add_parser("check", help="what a lend would do on a device and what would fail "
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
    chk.add_argument("--firmware", choices=["uefi", "bios"], default="uefi")
    chk.add_argument("--mmio64-mib", type=positive_int, metavar="MIB",
                     help="OVMF 64-bit aperture (default: sized for H200s)")
    chk.add_argument("--json", dest="check_json", action="store_true",
                     help="print one JSON object")
    chk.set_defaults(func=cmd_agent_host_check, needs_api=False)

    from testflinger_magic import cli_hosts  # noqa: PLC0415

    cli_hosts.add_parsers(sub, api)

    lab = sub.add_parser("lab", help="the embedded lab")
    lab_sub = lab.add_subparsers(dest="lab_command", required=True, metavar="LAB_COMMAND")
    p = lab_sub.add_parser("up", help="start the embedded lab (servers, MAAS simulator, daemon)")
    p.add_argument("--workdir", type=writable_dir, metavar="DIR",
                   help="lab files (default: a new temporary dir)")
    p.add_argument("--devices", type=positive_int, metavar="N", help="bare-metal GPU devices")
    p.add_argument("--gpus", type=positive_int, metavar="N", help="passthrough GPUs per device (1-8: the lab hosts are HGX boards)")
    p.add_argument("--time-scale", type=positive_float, metavar="X",
                   help="factor applied to simulated MAAS delays (0.01: 600 s take 6 s)")
    p.add_argument("--phase-seconds", type=positive_float, metavar="S",
                   help="seconds a simulated agent spends in each job phase")
    p.set_defaults(func=cmd_lab_up, needs_api=False)

    p = add("demo", cmd_demo, "run the end-to-end demo in the embedded lab", needs_api=False)
    p.add_argument("--summary", metavar="PATH",
                   help="write the JSON summary here (default demo-summary.json)")
    p.add_argument("--time-scale", type=positive_float, metavar="X",
                   help="factor applied to simulated MAAS delays (default 0.01)")
    p.add_argument("--jobs-dir", metavar="DIR", help="job files to submit (default examples/jobs)")
    p.add_argument("--workdir", type=writable_dir, metavar="DIR",
                   help="lab files, kept (default: a temporary dir, removed after success)")
    p.add_argument("--phase-seconds", type=positive_float, metavar="S",
                   help="seconds a simulated agent spends in each job phase (default 1)")
    p.add_argument("--copies", type=positive_int, metavar="N",
                   help="submissions of each job file (default 4)")
    p.add_argument("--timeout", type=positive_float, metavar="S",
                   help="give up after S seconds (default 240)")

    p = add("simulate", cmd_simulate, "replay a job trace in virtual time to compare policies",
            needs_api=False)
    p.add_argument("trace", metavar="TRACE", help="trace file (.yaml, .json or .csv; "
                   "docs/simulate.md)")
    p.add_argument("--queues", required=True, metavar="FILE", help="magic queue definitions")
    p.add_argument("--policy", action="append", metavar="KEY=VALUE[,...]",
                   help="policy overrides for one column, e.g. idle_timeout=30m,max_devices=3 "
                   "or one-gpu-vm:max_devices=1 (repeat for more columns)")
    p.add_argument("--lab", metavar="FILE", help="lab file (devices, step durations, tick) "
                   "replacing the trace's own")
    p.add_argument("--json", action="store_true", help="print the results as JSON")
    return parser


def _resolve_connection(args) -> None:
    """Command-level option, else the one before the command, else the environment, else default."""
    env = {"server": "TESTFLINGER_SERVER", "client_id": "TESTFLINGER_CLIENT_ID",
           "secret_key": "TESTFLINGER_SECRET_KEY"}
    for key, var in env.items():
        value = getattr(args, key, None) or getattr(args, f"g_{key}", None) or os.environ.get(var)
        if key == "server":
            value = value or DEFAULT_SERVER
        setattr(args, key, value)
    args.json = bool(getattr(args, "json", False) or getattr(args, "g_json", False))


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; returns the exit code (0 ok, 1 error, 2 usage, 130 Ctrl-C).

    A reader that stops early (``status | head``) closes the pipe: like other Unix tools the
    rest of the output is dropped quietly and the status is 0.
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    _resolve_connection(args)
    try:
        if args.needs_api:
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
