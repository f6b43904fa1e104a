"""Tests for the testflinger-magic CLI: offline validate, and the operator commands against a
small real HTTP server (127.0.0.1, ephemeral port) that serves canned answers for the contract's
endpoints (docs/architecture.md, "Operator API") and checks the Bearer token."""

import base64
import json
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

import pytest

from testflinger_magic import cli

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "magic-queues.yaml"
CLIENT_ID, SECRET, TOKEN = "ops", "s3cret", "jwt-for-ops"

LEASE = {"_id": "lease-0123456789ab", "device": "gpu-host-01", "queue": "one-gpu-vm",
         "state": "active", "agent_host": "host-a", "created_at": 1000.0, "generation": 7,
         "vms": [{"index": 0}, {"index": 1}], "drain": None}


class FakeServer:
    """Records every request as (method, path, query, json body, headers)."""

    def __init__(self):
        self.requests: list[dict] = []
        self.routes: dict[tuple[str, str], tuple[int, object]] = {}
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _handle(self):
                url = urlsplit(self.path)
                length = int(self.headers.get("Content-Length") or 0)
                raw = self.rfile.read(length) if length else b""
                body = json.loads(raw) if raw else None
                outer.requests.append({"method": self.command, "path": url.path,
                                       "query": parse_qs(url.query), "body": body,
                                       "headers": dict(self.headers)})
                status, answer = outer.answer(self.command, url.path, self.headers)
                data = json.dumps(answer).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            do_GET = do_POST = do_PUT = do_DELETE = _handle

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever,
                                       kwargs={"poll_interval": 0.05}, daemon=True)

    def answer(self, method, path, headers):
        if (method, path) == ("POST", "/v1/oauth2/token"):
            basic = base64.b64encode(f"{CLIENT_ID}:{SECRET}".encode()).decode()
            if headers.get("Authorization") != f"Basic {basic}":
                return 401, {"message": "Invalid client id or secret"}
            return 200, {"access_token": TOKEN, "token_type": "Bearer", "expires_in": 600}
        if headers.get("Authorization") != f"Bearer {TOKEN}":
            return 403, {"message": "Forbidden: missing or bad token"}
        if (method, path) in self.routes:
            return self.routes[(method, path)]
        return 404, {"message": f"no route {method} {path}"}

    def calls(self, path_prefix="/v1/magic"):
        return [r for r in self.requests if r["path"].startswith(path_prefix)]


@pytest.fixture
def server():
    srv = FakeServer()
    srv.thread.start()
    yield srv
    srv.httpd.shutdown()
    srv.httpd.server_close()


def run(server, *argv):
    return cli.main([*argv, "--server", server.url, "--client-id", CLIENT_ID,
                     "--secret-key", SECRET])


# --- validate (offline) ----------------------------------------------------------------------

def test_validate_example_as_installed_command():
    proc = subprocess.run([sys.executable, "-m", "testflinger_magic.cli", "validate",
                           str(EXAMPLE)], capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert any(": one-gpu-vm: ok" in line for line in lines)
    assert any(": two-gpu-vm: ok" in line for line in lines)
    assert proc.stderr == ""


def test_validate_reports_every_issue(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text(EXAMPLE.read_text().replace("vcpus: 8", "vcpus: eight")
                   .replace("max_starting: 1 ", "max_starting: 5 ", 1))
    assert cli.main(["validate", str(EXAMPLE), str(bad)]) == 1
    out, err = capsys.readouterr()
    assert "one-gpu-vm: ok" in out  # the good file is still summarised
    errors = err.splitlines()
    assert len(errors) == 2
    assert all(e.startswith(f"{bad}:") for e in errors)
    text = bad.read_text().splitlines()
    vcpu_line = next(i + 1 for i, t in enumerate(text) if "vcpus: eight" in t)
    assert f"{bad}:{vcpu_line}: magic_queues.one-gpu-vm.vm.vcpus: " in err
    assert "magic_queues.one-gpu-vm.policy.max_starting" in err


def test_validate_warns_of_a_provision_timeout_too_short_for_a_bring_up(tmp_path, capsys):
    """Issue 10 item 4: a warning (exit 0), with file, line and field, in text and JSON."""
    from testflinger_magic.queue_warnings import MIN_PROVISION_TIMEOUT

    assert MIN_PROVISION_TIMEOUT == 40 * 60  # 30m deploy + 10m split and VM commissioning
    short = tmp_path / "short.yaml"
    text = EXAMPLE.read_text()
    assert "provision_timeout: 45m " in text
    short.write_text(text.replace("provision_timeout: 45m ", "provision_timeout: 10m ", 1))
    line = next(i + 1 for i, t in enumerate(short.read_text().splitlines())
                if "provision_timeout: 10m" in t)
    assert cli.main(["validate", str(short)]) == 0
    out, err = capsys.readouterr()
    assert "one-gpu-vm: ok" in out
    (warning,) = err.splitlines()
    assert warning.startswith(f"warning: {short}:{line}: magic_queues.one-gpu-vm.policy."
                              "provision_timeout: 10m is below the 40m a bring-up can take")
    assert cli.main(["validate", str(short), "--json"]) == 0
    (entry,) = json.loads(capsys.readouterr().out)["files"]
    (w,) = entry["warnings"]
    assert (w["line"], w["field"]) == (line, "magic_queues.one-gpu-vm.policy.provision_timeout")
    # The example's 45m gives no warning.
    assert cli.main(["validate", str(EXAMPLE)]) == 0
    assert capsys.readouterr().err == ""


def test_validate_shows_the_author_their_own_bad_webhook_url(tmp_path, capsys):
    """Trial finding 22: a local validate names the URL as written (the server's answers and
    reads redact it: test_server_security)."""
    bad = tmp_path / "hook.yaml"
    text = EXAMPLE.read_text()
    assert "notify: []" in text
    bad.write_text(text.replace("notify: []", "notify: [ftp://example.com/x]", 1))
    assert cli.main(["validate", str(bad)]) == 1
    err = capsys.readouterr().err
    assert "not an http(s) URL with a host: ftp://example.com/x" in err and "redacted" not in err


def test_validate_says_how_many_vms_and_when_they_get_no_gpu(tmp_path, capsys):
    """TRIAL9 F2: ``vm.gpus: 0`` (CPU-only VMs, valid with a number of VMs) said only "2 VMs";
    ``vms_per_device: 1`` said "1 VMs (fewer on a device with under 1 GPUs: 1 per VM)"."""
    path = tmp_path / "q.yaml"
    text = EXAMPLE.read_text()
    old = "    vms_per_device: gpus"
    assert old in text and "    vm:\n      gpus: 1\n" in text
    for per, gpus, says in ((2, 0, "one-gpu-vm: ok (2 VMs without a GPU (vm.gpus 0: CPU-only);"),
                            (1, 1, "one-gpu-vm: ok (1 VM; "),
                            (1, 8, "one-gpu-vm: ok (1 VM (none on a device with under 8 GPUs);"),
                            (3, 2, "one-gpu-vm: ok (3 VMs (fewer on a device with under 6 GPUs: "
                                   "2 per VM);")):
        path.write_text(text.replace(old, f"    vms_per_device: {per}", 1)
                        .replace("    vm:\n      gpus: 1\n", f"    vm:\n      gpus: {gpus}\n", 1))
        assert cli.main(["validate", str(path)]) == 0, per
        assert says in capsys.readouterr().out, per


def test_validate_missing_file(tmp_path, capsys):
    assert cli.main(["validate", str(tmp_path / "none.yaml")]) == 1
    assert "none.yaml" in capsys.readouterr().err


# --- server commands -------------------------------------------------------------------------

def test_apply_sends_yaml_with_token(server, capsys):
    server.routes[("PUT", "/v1/magic/queues")] = (200, {"applied": ["one-gpu-vm", "two-gpu-vm"],
                                                        "removed": ["old-queue"]})
    assert run(server, "apply", str(EXAMPLE)) == 0
    (call,) = server.calls()
    assert call["body"] == {"yaml": EXAMPLE.read_text(), "source": str(EXAMPLE)}
    assert call["headers"]["Authorization"] == f"Bearer {TOKEN}"
    out = capsys.readouterr().out
    assert "one-gpu-vm, two-gpu-vm" in out and "old-queue" in out


def test_apply_prints_the_warnings_validate_gives(server, tmp_path, capsys):
    """apply shows validate's warnings (stderr, exit 0) and lists them under ``warnings`` in
    --json; the file is still applied."""
    server.routes[("PUT", "/v1/magic/queues")] = (200, {"applied": ["one-gpu-vm", "two-gpu-vm"],
                                                        "removed": []})
    short = tmp_path / "short.yaml"
    short.write_text(EXAMPLE.read_text().replace("provision_timeout: 45m ",
                                                 "provision_timeout: 10m ", 1))
    assert run(server, "apply", str(short)) == 0
    out, err = capsys.readouterr()
    assert "applied: one-gpu-vm, two-gpu-vm" in out
    (warning,) = err.splitlines()
    assert warning.startswith(f"warning: {short}:") and \
        "provision_timeout: 10m is below the 40m a bring-up can take" in warning
    assert run(server, "apply", str(short), "--json") == 0
    out, err = capsys.readouterr()
    data = json.loads(out)
    (w,) = data["warnings"]
    assert w["field"] == "magic_queues.one-gpu-vm.policy.provision_timeout"
    assert data["applied"] == ["one-gpu-vm", "two-gpu-vm"] and "warning:" in err
    assert len(server.calls()) == 2


def test_apply_prints_the_servers_agent_template_warnings(server, capsys):
    """TRIAL (2026-12-02) 1: the server warns of a queue whose agent_template no registered
    agent host has; apply prints it on stderr (exit 0: applied)."""
    text = ("one-gpu-vm: agent_template 'does-not-exist' is on no registered agent host "
            "(host-a: maas2-vm); its bring-ups will fail and suspend the queue")
    server.routes[("PUT", "/v1/magic/queues")] = (200, {"applied": ["one-gpu-vm"], "removed": [],
                                                        "agent_template_warnings": [text]})
    assert run(server, "apply", str(EXAMPLE)) == 0
    out, err = capsys.readouterr()
    assert "applied: one-gpu-vm" in out and f"warning: {text}" in err.splitlines()


def test_apply_says_an_unchanged_queue_stays_suspended(server, capsys):
    """TRIAL2 finding 5: the server keeps an unchanged queue's suspension and says so; apply
    prints it with the way out, and --unsuspend asks the server to lift it."""
    server.routes[("PUT", "/v1/magic/queues")] = (200, {
        "applied": ["one-gpu-vm"], "removed": [], "unchanged": ["one-gpu-vm"],
        "still_suspended": [{"queue": "one-gpu-vm", "reason": "claimed: no template nosuch"}]})
    assert run(server, "apply", str(EXAMPLE)) == 0
    out = capsys.readouterr().out
    assert ("still suspended: one-gpu-vm (definition unchanged): claimed: no template nosuch; "
            "change its definition, or apply --unsuspend once the cause is fixed") in out
    assert "unsuspend" not in server.calls()[0]["body"]
    assert run(server, "apply", str(EXAMPLE), "--unsuspend") == 0
    assert server.calls()[-1]["body"]["unsuspend"] is True


def test_apply_says_which_queues_were_unchanged_and_what_open_leases_keep(server, capsys):
    """TRIAL5 finding 2: ``applied`` lists the queues the server wrote, the unchanged ones
    apart, and a changed queue's open leases that keep the old VM spec are named with what
    they keep and how to apply it now."""
    server.routes[("PUT", "/v1/magic/queues")] = (200, {
        "applied": ["one-gpu-vm", "two-gpu-vm"], "removed": [], "unchanged": ["two-gpu-vm"],
        "keeping_old": [{"queue": "one-gpu-vm", "fields": ["vm.memory_mib", "policy.max_lease"],
                         "leases": [{"lease_id": "lease-1", "device": "gpu-host-01",
                                     "state": "active"}]}]})
    assert run(server, "apply", str(EXAMPLE)) == 0
    out = capsys.readouterr().out
    assert "applied: one-gpu-vm (unchanged: two-gpu-vm)" in out
    assert ("keeping the old definition: one-gpu-vm: lease-1 (active on gpu-host-01) keep "
            "vm.memory_mib, policy.max_lease until returned; new leases get the new values "
            "(drain these to apply them now)") in out
    server.routes[("PUT", "/v1/magic/queues")] = (200, {
        "applied": ["one-gpu-vm"], "removed": [], "unchanged": [],
        "keeping_old": [{"queue": "one-gpu-vm", "fields": [], "deselected": ["lease-1"],
                         "leases": [{"lease_id": "lease-1", "device": "gpu-host-01",
                                     "state": "active"}]}]})
    assert run(server, "apply", str(EXAMPLE)) == 0
    out = capsys.readouterr().out
    assert "keeping the old definition" not in out
    assert ("no longer selected: one-gpu-vm: gpu-host-01 (lease lease-1, active) keeps serving "
            "the queue until drained: `testflinger-magic drain lease-1`") in out
    # TRIAL9 F4: a queue holding more open leases than its new max_devices.
    server.routes[("PUT", "/v1/magic/queues")] = (200, {
        "applied": ["one-gpu-vm"], "removed": [], "unchanged": [],
        "keeping_old": [{"queue": "one-gpu-vm", "fields": ["vms_per_device"], "deselected": [],
                         "over_max_devices": 1,
                         "leases": [{"lease_id": f"lease-{i}", "device": f"gpu-host-0{i}",
                                     "state": "active"} for i in (1, 2)]}]})
    assert run(server, "apply", str(EXAMPLE)) == 0
    out = capsys.readouterr().out
    assert "keep vms_per_device until returned" in out
    assert ("over max_devices: one-gpu-vm holds 2 open leases, max_devices is now 1: nothing "
            "more is lent to it until it holds fewer; the leases it holds return as they go "
            "idle (idle_timeout), or drain 1 of them now: `testflinger-magic drain lease-1`, "
            "`testflinger-magic drain lease-2`") in out
    # TRIAL16 F5: a lease already draining is not suggested again, and counts as going.
    server.routes[("PUT", "/v1/magic/queues")] = (200, {
        "applied": ["one-gpu-vm"], "removed": [], "unchanged": [],
        "keeping_old": [{"queue": "one-gpu-vm", "fields": [], "deselected": [],
                         "over_max_devices": 1,
                         "leases": [{"lease_id": "lease-1", "device": "gpu-host-01",
                                     "state": "draining"},
                                    {"lease_id": "lease-2", "device": "gpu-host-02",
                                     "state": "active"}]}]})
    assert run(server, "apply", str(EXAMPLE)) == 0
    out = capsys.readouterr().out
    assert ("over max_devices: one-gpu-vm holds 2 open leases, max_devices is now 1: nothing "
            "more is lent to it until it holds fewer; 1 of them already drains (lease-1); "
            "nothing more to drain for it") in out, out
    assert "drain lease-1`" not in out
    # TRIAL9 F6: only the leases whose copied values differ (keeps) are named.
    server.routes[("PUT", "/v1/magic/queues")] = (200, {
        "applied": ["one-gpu-vm"], "removed": [], "unchanged": [],
        "keeping_old": [{"queue": "one-gpu-vm", "fields": ["vm.vcpus"], "deselected": [],
                         "over_max_devices": None,
                         "leases": [{"lease_id": "lease-1", "device": "gpu-host-01",
                                     "state": "active", "keeps": ["vm.vcpus"]},
                                    {"lease_id": "lease-2", "device": "gpu-host-02",
                                     "state": "active", "keeps": []}]}]})
    assert run(server, "apply", str(EXAMPLE)) == 0
    out = capsys.readouterr().out
    assert "keeping the old definition: one-gpu-vm: lease-1 (active on gpu-host-01) keep " \
           "vm.vcpus until returned" in out and "gpu-host-02" not in out


def test_apply_invalid_file_never_calls_server(server, tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("magic_queues: {}\n")
    assert run(server, "apply", str(bad)) == 1
    assert server.requests == []
    assert f"{bad}:1: magic_queues:" in capsys.readouterr().err


def test_apply_server_issues_are_printed(server, capsys):
    issue = {"file": "lab", "line": 3, "field": "magic_queues.x", "message": "taken"}
    server.routes[("PUT", "/v1/magic/queues")] = (422, {"message": "invalid definitions",
                                                        "issues": [issue]})
    assert run(server, "apply", str(EXAMPLE)) == 1
    err = capsys.readouterr().err
    assert "HTTP 422: invalid definitions" in err and "lab:3: magic_queues.x: taken" in err


def test_apply_server_message_repeating_issues_is_not_doubled(server, capsys):
    issue = {"file": "lab", "line": 3, "field": "magic_queues.x", "message": "taken"}
    server.routes[("PUT", "/v1/magic/queues")] = (422, {"message": "lab:3: magic_queues.x: taken",
                                                        "issues": [issue]})
    assert run(server, "apply", str(EXAMPLE)) == 1
    err = capsys.readouterr().err
    assert err.count("lab:3: magic_queues.x: taken") == 1 and "HTTP 422" in err


def test_status_tables_and_json(server, capsys):
    status = {"queues": [{"name": "one-gpu-vm", "waiting": 3, "vm_agents": 4, "leases": 1,
                          "devices_lendable": 2}],
              "leases": [LEASE],
              "devices": [{"_id": "gpu-host-01", "agent_host": "host-a", "gpus": 4,
                           "quarantined": False, "failures": 0}]}
    server.routes[("GET", "/v1/magic/status")] = (200, status)
    assert run(server, "status") == 0
    out = capsys.readouterr().out
    queue_row = next(line for line in out.splitlines() if line.startswith("one-gpu-vm"))
    assert queue_row.split() == ["one-gpu-vm", "3", "4", "1", "2", "-"]
    lease_row = next(line for line in out.splitlines() if line.startswith(LEASE["_id"]))
    assert lease_row.split()[:5] == [LEASE["_id"], "one-gpu-vm", "gpu-host-01", "active", "2"]
    assert "gpu-host-01" in out.split("DEVICES", 1)[1]

    assert run(server, "status", "--json") == 0
    assert json.loads(capsys.readouterr().out) == status


def test_plan(server, capsys):
    actions = [{"kind": "lend", "reason": "3 jobs waiting, no VM agent", "queue": "one-gpu-vm",
                "device": "gpu-host-01", "lease_id": None}]
    server.routes[("GET", "/v1/magic/plan")] = (200, {"actions": actions})
    assert run(server, "plan") == 0
    out = capsys.readouterr().out
    assert "3 jobs waiting, no VM agent" in out and "lend" in out
    server.routes[("GET", "/v1/magic/plan")] = (200, {"actions": []})
    assert run(server, "plan") == 0
    assert "nothing to do" in capsys.readouterr().out


def test_drain(server, capsys):
    path = f"/v1/magic/leases/{LEASE['_id']}/drain"
    server.routes[("POST", path)] = (200, dict(LEASE, state="draining"))
    assert run(server, "drain", LEASE["_id"], "--reason", "bios update", "--grace", "5m",
               "--force") == 0
    (call,) = server.calls()
    assert call["path"] == path
    assert call["body"] == {"reason": "bios update", "grace": "5m", "force": True}
    assert "draining" in capsys.readouterr().out


def test_drain_of_a_warm_queues_lease_says_how_to_keep_the_device_out(server, capsys):
    """TRIAL5 finding 11: the answer's note (the warm level lends again at once) is printed."""
    note = ("one-gpu-vm keeps devices lent without jobs (its warm level: policy.min_devices, "
            "warm or warm_learn): another lease is made at once")
    server.routes[("POST", f"/v1/magic/leases/{LEASE['_id']}/drain")] = (
        200, dict(LEASE, state="draining", note=note))
    assert run(server, "drain", LEASE["_id"]) == 0
    assert note in capsys.readouterr().out


def test_drain_bad_grace_is_local_error(server, capsys):
    assert run(server, "drain", LEASE["_id"], "--grace", "soon") == 1
    assert server.calls() == []
    assert "--grace" in capsys.readouterr().err


@pytest.mark.parametrize("grace, says", [
    ("99999999999999999999d", "longer than the limit of 366d"),
    ("367d", "longer than the limit of 366d"),
    ("-5m", "must not be negative"),
])
def test_drain_grace_has_the_definitions_limit_and_no_sign(server, capsys, grace, says):
    """The limit of every duration (durations.MAX_DURATION) holds for --grace too; a negative
    one (argparse would read "-5m" as an option) is refused saying so."""
    assert run(server, "drain", LEASE["_id"], "--grace", grace) == 1
    assert server.calls() == []
    err = capsys.readouterr().err
    assert "--grace" in err and says in err


@pytest.mark.parametrize("argv", [
    ["drain", "lease-1"], ["lend", "gpu-host-01", "one-gpu-vm"], ["quarantine", "gpu-host-01"],
    ["agent-hosts", "rebind", "host-a", "agent"], ["agent-hosts", "forget", "host-a"],
])
def test_reasons_are_bounded_by_the_servers_limit(server, capsys, argv):
    """Every --reason is at most events.MAX_REASON characters (the server's 422 limit) and not
    empty; refused before calling the server."""
    from testflinger_magic.events import MAX_REASON

    for reason, says in (("r" * (MAX_REASON + 1), f"at most {MAX_REASON} characters"),
                         ("", "must not be empty")):
        with pytest.raises(SystemExit) as exc:
            run(server, *argv, "--reason", reason)
        assert exc.value.code == 2
        err = capsys.readouterr().err
        assert "--reason" in err and says in err
    assert server.calls() == []


def test_server_validation_detail_names_the_field(server, capsys):
    """A 422 in apiflask's format names the field in ``detail``: the CLI prints it."""
    server.routes[("POST", "/v1/magic/leases/lease-x/drain")] = (
        422, {"message": "Validation error", "detail": {"json": {"grace": ["too long"]}}})
    assert run(server, "drain", "lease-x") == 1
    err = capsys.readouterr().err
    assert "HTTP 422: Validation error" in err and "grace: too long" in err


def test_drain_conflict_prints_server_message(server, capsys):
    server.routes[("POST", "/v1/magic/leases/lease-x/drain")] = (
        409, {"message": "lease lease-x is restoring", "lease": LEASE})
    assert run(server, "drain", "lease-x") == 1
    assert "HTTP 409: lease lease-x is restoring" in capsys.readouterr().err


def test_quarantine_and_unquarantine(server, capsys):
    path = "/v1/magic/devices/gpu-host-01/quarantine"
    server.routes[("POST", path)] = (200, {"_id": "gpu-host-01", "quarantined": True})
    server.routes[("DELETE", path)] = (200, {"_id": "gpu-host-01", "quarantined": False})
    assert run(server, "quarantine", "gpu-host-01", "--reason", "fan noise") == 0
    assert run(server, "unquarantine", "gpu-host-01") == 0
    calls = server.calls()
    assert [(c["method"], c["path"]) for c in calls] == [("POST", path), ("DELETE", path)]
    assert calls[0]["body"] == {"reason": "fan noise"}
    out = capsys.readouterr().out
    assert "quarantined gpu-host-01" in out and "unquarantined gpu-host-01" in out


def test_quarantine_of_a_lent_device_says_how_to_give_it_back_now(server, capsys):
    """TRIAL5 finding 4: the answer's open_lease is printed with the drain to run."""
    path = "/v1/magic/devices/gpu-host-01/quarantine"
    server.routes[("POST", path)] = (200, {"_id": "gpu-host-01", "quarantined": True,
                                           "previous_reason": None, "open_lease": {
                                               "_id": "lease-9", "queue": "one-gpu-vm",
                                               "state": "deploying"}})
    assert run(server, "quarantine", "gpu-host-01", "--reason", "PSU alarm") == 0
    out = capsys.readouterr().out
    assert "quarantined gpu-host-01: PSU alarm" in out
    assert ("gpu-host-01 still holds lease lease-9 (one-gpu-vm, deploying): from the next tick "
            "no new job starts there (a bring-up is stopped), running jobs finish, then it is "
            "given back; `testflinger-magic drain lease-9` gives the device back now") in out


def test_forget_nvswitches(server, capsys):
    path = "/v1/magic/devices/gpu-host-01/nvswitches"
    server.routes[("DELETE", path)] = (200, {"device": "gpu-host-01",
                                             "previous": {"nvswitches": 4}})
    assert run(server, "forget-nvswitches", "gpu-host-01") == 0
    assert [(c["method"], c["path"]) for c in server.calls()] == [("DELETE", path)]
    assert "forgot gpu-host-01's 4 NVSwitch(es)" in capsys.readouterr().out
    server.routes[("DELETE", path)] = (200, {"device": "gpu-host-01",
                                             "previous": {"nvswitches": None}})
    assert run(server, "forget-nvswitches", "gpu-host-01") == 0
    assert "nothing to forget" in capsys.readouterr().out


def test_leases_filters(server, capsys):
    server.routes[("GET", "/v1/magic/leases")] = (200, {"leases": [LEASE]})
    assert run(server, "leases", "--queue", "one-gpu-vm") == 0
    assert run(server, "leases", "--all") == 0
    first, second = server.calls()
    assert first["query"] == {"queue": ["one-gpu-vm"], "open": ["1"]}
    assert second["query"] == {}
    assert LEASE["_id"] in capsys.readouterr().out


def test_events(server, capsys):
    events = [{"at": 1700000000.0, "kind": "lend", "queue": "one-gpu-vm",
               "device": "gpu-host-01", "lease_id": LEASE["_id"], "message": "lent for 3 jobs"}]
    server.routes[("GET", "/v1/magic/events")] = (200, {"events": events})
    assert run(server, "events", "--limit", "5") == 0
    assert server.calls()[0]["query"] == {"limit": ["5"]}
    assert "lent for 3 jobs" in capsys.readouterr().out


def test_lend(server, capsys):
    server.routes[("POST", "/v1/magic/leases")] = (200, dict(LEASE, state="claimed"))
    assert run(server, "lend", "gpu-host-01", "one-gpu-vm", "--reason", "demo") == 0
    assert server.calls()[0]["body"] == {"device": "gpu-host-01", "queue": "one-gpu-vm",
                                         "reason": "demo"}
    out = capsys.readouterr().out
    assert LEASE["_id"] in out and "claimed, 2 VMs" in out  # the VM count used (finding 14)
    assert "no job waits" not in out  # an answer without a note: nothing more


def test_lend_prints_what_becomes_of_the_lease(server, capsys):
    """TRIAL5 finding 3: the answer's note (no job waits: kept through its bring-up, then the
    idle rule) is printed."""
    note = ("no job waits on one-gpu-vm: the lease is kept through its bring-up, then given "
            "back once idle for 10m (idle_timeout) unless jobs come")
    server.routes[("POST", "/v1/magic/leases")] = (201, dict(LEASE, state="claimed", note=note))
    assert run(server, "lend", "gpu-host-01", "one-gpu-vm") == 0
    assert note in capsys.readouterr().out


def test_bad_credentials(server, capsys):
    code = cli.main(["status", "--server", server.url, "--client-id", CLIENT_ID,
                     "--secret-key", "wrong"])
    assert code == 1
    assert "HTTP 401: Invalid client id or secret" in capsys.readouterr().err
    assert server.calls() == []


def test_without_credentials_no_authorization_header(server, capsys, monkeypatch):
    monkeypatch.delenv("TESTFLINGER_CLIENT_ID", raising=False)
    monkeypatch.delenv("TESTFLINGER_SECRET_KEY", raising=False)
    assert cli.main(["status", "--server", server.url]) == 1  # the fake wants a token
    (call,) = server.calls()
    assert "Authorization" not in call["headers"]
    assert "HTTP 403" in capsys.readouterr().err


def test_environment_defaults(server, capsys, monkeypatch):
    monkeypatch.setenv("TESTFLINGER_SERVER", server.url)
    monkeypatch.setenv("TESTFLINGER_CLIENT_ID", CLIENT_ID)
    monkeypatch.setenv("TESTFLINGER_SECRET_KEY", SECRET)
    server.routes[("GET", "/v1/magic/plan")] = (200, {"actions": []})
    assert cli.main(["plan", "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == {"actions": []}


def test_connection_refused_names_url(capsys):
    import socket
    with socket.socket() as s:  # a port that was free a moment ago: nothing listens on it
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    assert cli.main(["status", "--server", url]) == 1
    err = capsys.readouterr().err
    assert "cannot connect" in err and url in err


def test_delegating_subcommands_import_lazily(monkeypatch):
    """agent-host/lab/demo call the other modules' entry points with the parsed args."""
    import types
    seen = {}
    fake_daemon = types.SimpleNamespace(main=lambda a: seen.setdefault("daemon", a) and 0)
    fake_lab = types.SimpleNamespace(main_up=lambda a: seen.setdefault("lab", a) and 3)
    fake_demo = types.SimpleNamespace(main=lambda a: seen.setdefault("demo", a) and 0)
    import testflinger_magic.agent_host as ah
    import testflinger_magic.lab as lab_pkg
    monkeypatch.setitem(sys.modules, "testflinger_magic.agent_host.daemon", fake_daemon)
    monkeypatch.setattr(ah, "daemon", fake_daemon, raising=False)
    monkeypatch.setitem(sys.modules, "testflinger_magic.lab.labup", fake_lab)
    monkeypatch.setattr(lab_pkg, "labup", fake_lab, raising=False)
    monkeypatch.setitem(sys.modules, "testflinger_magic.lab.demo", fake_demo)
    monkeypatch.setattr(lab_pkg, "demo", fake_demo, raising=False)

    assert cli.main(["agent-host", "--config", "host.yaml"]) == 0
    assert seen["daemon"].config == "host.yaml"
    assert cli.main(["lab", "up", "--devices", "3", "--time-scale", "0.5"]) == 3
    assert seen["lab"].devices == 3 and seen["lab"].time_scale == 0.5
    assert cli.main(["demo", "--summary", "s.json", "--time-scale", "60"]) == 0
    assert seen["demo"].summary == "s.json" and seen["demo"].time_scale == 60.0


def test_against_the_real_plugin_when_present(capsys):
    """apply/status/plan/events against the lab job service with the real server plugin mounted
    (skipped while those modules are not there)."""
    jobservice = pytest.importorskip("testflinger_magic.lab.jobservice")
    httpserve = pytest.importorskip("testflinger_magic.lab.httpserve")
    pytest.importorskip("testflinger_magic.server")
    app = jobservice.create_app(clients={"op": {"secret": "pw", "role": "admin"}},
                                plugin_options={"tick_seconds": 3600})
    handle = httpserve.serve(app)
    plugin = app.extensions.get("testflinger_magic")
    try:
        base = ["--server", handle.url, "--client-id", "op", "--secret-key", "pw"]
        assert cli.main(["apply", *base, str(EXAMPLE)]) == 0
        assert "one-gpu-vm, two-gpu-vm" in capsys.readouterr().out
        assert cli.main(["status", *base, "--json"]) == 0
        names = {q["name"] for q in json.loads(capsys.readouterr().out)["queues"]}
        assert {"one-gpu-vm", "two-gpu-vm"} <= names
        assert cli.main(["plan", *base]) == 0
        capsys.readouterr()
        assert cli.main(["quarantine", *base, "no-such-device"]) == 1
        assert "no-such-device" in capsys.readouterr().err
    finally:
        if plugin is not None and hasattr(plugin, "stop"):
            plugin.stop()
        handle.stop()


# --- usability: errors, empty output, pipes, options ------------------------------------------

def test_empty_tables_say_none(server, capsys):
    server.routes[("GET", "/v1/magic/status")] = (200, {"queues": [], "leases": [], "devices": []})
    assert run(server, "status") == 0
    out = capsys.readouterr().out.splitlines()
    for header in ("QUEUES", "LEASES", "DEVICES"):
        i = out.index(header)
        assert out[i + 2] == "(none)", out  # title, column header, then (none)
    server.routes[("GET", "/v1/magic/leases")] = (200, {"leases": []})
    assert run(server, "leases") == 0
    assert capsys.readouterr().out.splitlines()[1:] == ["(none)"]


def test_drain_without_credentials_hints_at_them(server, capsys, monkeypatch):
    monkeypatch.delenv("TESTFLINGER_CLIENT_ID", raising=False)
    monkeypatch.delenv("TESTFLINGER_SECRET_KEY", raising=False)
    assert cli.main(["drain", LEASE["_id"], "--server", server.url]) == 1
    err = capsys.readouterr().err
    assert "HTTP 403" in err and "--client-id" in err and "--secret-key" in err
    # With (wrong) credentials the hint would mislead: it is not given.
    assert cli.main(["drain", LEASE["_id"], "--server", server.url, "--client-id", CLIENT_ID,
                     "--secret-key", "wrong"]) == 1
    assert "hint" not in capsys.readouterr().err


class _PlainHttp:
    """A web server without the plugin: every path is Flask-style HTML 404 (or APIFlask JSON)."""

    def __init__(self, json_body: bool):
        from http.server import BaseHTTPRequestHandler

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_GET(self):
                if json_body:
                    data = json.dumps({"detail": {}, "message": "Not Found"}).encode()
                    self.send_response(404)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                else:
                    self.send_error(404)  # an HTML page

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05},
                         daemon=True).start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.mark.parametrize("json_body", [False, True], ids=["html", "apiflask-json"])
def test_server_without_plugin_is_named_not_dumped(json_body, capsys):
    plain = _PlainHttp(json_body)
    try:
        assert cli.main(["status", "--server", plain.url]) == 1
    finally:
        plain.close()
    err = capsys.readouterr().err
    assert f"no testflinger-magic plugin at {plain.url} (HTTP 404" in err
    assert "<html" not in err.lower() and len(err.splitlines()) == 1


def test_plugin_404_keeps_its_own_message(server, capsys):
    path = "/v1/magic/leases/nope/drain"
    server.routes[("POST", path)] = (404, {"message": "no lease nope"})
    assert run(server, "drain", "nope") == 1
    err = capsys.readouterr().err
    assert "no lease nope" in err and "no testflinger-magic plugin" not in err


def test_closed_pipe_is_quiet(server):
    many = [dict(LEASE, _id=f"lease-{i:012d}") for i in range(3000)]  # far more than a pipe holds
    server.routes[("GET", "/v1/magic/status")] = (200, {"queues": [], "leases": many,
                                                       "devices": []})
    proc = subprocess.Popen([sys.executable, "-m", "testflinger_magic.cli", "--server", server.url,
                             "--client-id", CLIENT_ID, "--secret-key", SECRET, "status", "--json"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=ROOT)
    assert proc.stdout.readline().strip() == b"{"  # like `| head -1`: read a line, then go
    proc.stdout.close()
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=60) == 0, err
    assert err == ""


def test_version(capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["--version"])
    assert exc.value.code == 0
    assert capsys.readouterr().out.strip() == f"testflinger-magic {cli.__version__}"


@pytest.mark.parametrize("argv, message", [
    (["events", "--limit", "0"], "--limit: 0 must be at least 1"),
    (["events", "--limit", "-1"], "--limit: -1 must be at least 1"),
    (["demo", "--time-scale", "0"], "--time-scale: 0 must be a finite number greater than 0"),
    (["demo", "--time-scale", "-1"], "--time-scale: -1 must be a finite number"),
    (["demo", "--time-scale", "nan"], "--time-scale: nan must be a finite number"),
    (["demo", "--time-scale", "inf"], "--time-scale: inf must be a finite number"),
    (["demo", "--phase-seconds", "x"], "--phase-seconds: 'x' is not a number"),
    (["demo", "--copies", "0"], "--copies: 0 must be at least 1"),
    (["demo", "--copies", "-1"], "--copies: -1 must be at least 1"),
    (["demo", "--timeout", "0"], "--timeout: 0 must be a finite number greater than 0"),
    (["demo", "--workdir", "/proc/forbidden"], "--workdir: /proc/forbidden: not a writable"),
    (["lab", "up", "--devices", "0"], "--devices: 0 must be at least 1"),
    (["lab", "up", "--gpus", "-2"], "--gpus: -2 must be at least 1"),
    (["lab", "up", "--gpus", "9"], "--gpus: 9 must be at most 8 (the lab hosts are HGX boards)"),
    (["lab", "up", "--devices", "99999999999999"], "--devices: 99999999999999 must be at most 64"),
    (["lab", "up", "--devices", "65"], "--devices: 65 must be at most 64"),
    (["lab", "up", "--time-scale", "inf"], "--time-scale: inf must be a finite number"),
])
def test_bad_options_are_usage_errors(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_status_shows_a_suspended_queue(server, capsys):
    status = {"queues": [{"name": "one-gpu-vm", "waiting": 3, "vm_agents": 0, "leases": 0,
                          "devices_lendable": 2, "suspended": "VM spec does not fit"}],
              "leases": [], "devices": []}
    server.routes[("GET", "/v1/magic/status")] = (200, status)
    assert run(server, "status") == 0
    out = capsys.readouterr().out
    assert "SUSPENDED" in out.splitlines()[1]
    row = next(line for line in out.splitlines() if line.startswith("one-gpu-vm"))
    assert row.endswith("VM spec does not fit")
    # TRIAL2 finding 9: it lends none of its 2 devices: not "2" beside SUSPENDED.
    assert row.split()[1:6] == ["3", "0", "0", "0", "(suspended)"], row


def test_apply_force_sends_force_and_prints_cancelled(server, capsys):
    server.routes[("PUT", "/v1/magic/queues")] = (200, {"applied": ["one-gpu-vm"],
                                                        "removed": ["old-queue"],
                                                        "cancelled": {"old-queue": 3}})
    assert run(server, "apply", "--force", str(EXAMPLE)) == 0
    (call,) = server.calls()
    assert call["body"] == {"yaml": EXAMPLE.read_text(), "source": str(EXAMPLE), "force": True}
    assert "cancelled waiting jobs: old-queue: 3" in capsys.readouterr().out


def test_apply_refused_for_waiting_jobs_prints_the_message(server, capsys):
    msg = "refusing to remove magic queue(s) with waiting jobs: old-queue (2 waiting jobs)"
    server.routes[("PUT", "/v1/magic/queues")] = (409, {"message": msg, "queues": [
        {"name": "old-queue", "waiting": 2}]})
    assert run(server, "apply", str(EXAMPLE)) != 0
    assert "old-queue (2 waiting jobs)" in capsys.readouterr().err


def test_drain_help_says_every_drain_cancels_at_grace_end(capsys):
    with pytest.raises(SystemExit):
        cli.main(["drain", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "every drain cancels the jobs still running when --grace ends" in out
    assert "cancel running jobs after --grace and never" not in out


def test_agent_hosts_list_rebind_and_forget_against_the_plugin(capsys):
    """``agent-hosts`` against the lab job service with the plugin: an admin sees each host's
    bound client, rebinds it, and forgets a host with no lease; a manager may not rebind."""
    from testflinger_magic.lab import httpserve, jobservice
    from testflinger_magic.server import auth

    app = jobservice.create_app(clients={"op": {"secret": "pw", "role": "admin"},
                                         "mgr": {"secret": "pw", "role": "manager"}},
                                plugin_options={"start_ticker": False})
    handle = httpserve.serve(app)
    plugin = app.extensions["testflinger_magic"]
    try:
        agent = auth.issue_token(app.config["JWT_SIGNING_KEY"], "host-a-client", "agent")
        client = app.test_client()
        r = client.post("/v1/magic/agent-hosts/host-a", headers={"Authorization": f"Bearer {agent}"},
                        json={"devices": [{"agent_name": "gpu-host-01", "maas_system_id": "x",
                                           "gpus": 2}], "instance": "lab-07/3d1219c7c4c5:/s"})
        assert r.status_code == 200, r.get_data(as_text=True)
        base = ["--server", handle.url, "--client-id", "op", "--secret-key", "pw"]
        assert cli.main(["agent-hosts", "list", *base]) == 0
        out = capsys.readouterr().out
        assert "host-a" in out and "host-a-client" in out and "gpu-host-01" in out
        assert "INSTANCE" in out.upper() and "lab-07/3d1219c7c4c5:/s" in out, out
        # A client Testflinger does not know: refused, nothing changed; --force binds it.
        assert cli.main(["agent-hosts", "rebind", *base, "host-a", "new-client",
                         "--reason", "re-keyed"]) == 1
        err = capsys.readouterr().err
        assert "HTTP 409: no Testflinger client 'new-client' is known" in err and "--force" in err
        assert plugin.db.magic_agent_hosts.find_one({"_id": "host-a"})["client_id"] == \
            "host-a-client"
        # A known client without the agent role (the daemon could never act): refused too.
        assert cli.main(["agent-hosts", "rebind", *base, "host-a", "mgr"]) == 1
        err = capsys.readouterr().err
        assert "HTTP 409: Testflinger client 'mgr' has role 'manager', not 'agent'" in err
        assert plugin.db.magic_agent_hosts.find_one({"_id": "host-a"})["client_id"] == \
            "host-a-client"
        assert cli.main(["agent-hosts", "rebind", *base, "host-a", "new-client",
                         "--reason", "re-keyed", "--force"]) == 0
        # Its registered, heartbeating daemon is told it is locked out (TRIAL19 F4).
        assert capsys.readouterr().out.strip() == (
            "agent host host-a bound to client new-client (was host-a-client); its running "
            "daemon (client host-a-client) is refused from now on: restart it with client "
            "new-client's credentials now (until the host goes stale, after 2 minutes without "
            "a heartbeat, its devices may still be lent and wait for it)")
        events = len(plugin.events.list())
        assert cli.main(["agent-hosts", "rebind", *base, "host-a", "new-client",
                         "--force"]) == 0
        assert capsys.readouterr().out.strip() == \
            "agent host host-a is already bound to client new-client; nothing changed"
        assert len(plugin.events.list()) == events
        assert plugin.db.magic_agent_hosts.find_one({"_id": "host-a"})["client_id"] == "new-client"
        manager = ["--server", handle.url, "--client-id", "mgr", "--secret-key", "pw"]
        assert cli.main(["agent-hosts", "rebind", *manager, "host-a", "mine"]) == 1
        assert "admin" in capsys.readouterr().err
        assert cli.main(["agent-hosts", "forget", *base, "host-a"]) == 0
        assert "devices deregistered: gpu-host-01" in capsys.readouterr().out
        assert plugin.db.magic_devices.count_documents({}) == 0
    finally:
        plugin.stop()
        handle.stop()


# --- one rule for the global options (issue 10 items 13 and 14) ------------------------------

def _leaf_parsers(parser=None, path=()):
    """Every command's parser with its command words, e.g. (("agent-hosts", "list"), p)."""
    import argparse

    parser = parser or cli.build_parser()
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                inner = [a for a in sub._actions if isinstance(a, argparse._SubParsersAction)]
                if not inner or sub.get_default("func") is not None:
                    yield path + (name,), sub
                yield from _leaf_parsers(sub, path + (name,)) if inner else ()


def test_every_option_has_help_and_shows_its_default():
    import argparse

    parsers = [((), cli.build_parser())] + list(_leaf_parsers())
    assert len(parsers) > 15
    for words, parser in parsers:
        for action in parser._actions:
            if isinstance(action, (argparse._HelpAction, argparse._SubParsersAction,
                                   argparse._VersionAction)):
                continue
            where = f"{' '.join(words) or 'testflinger-magic'} {action.dest}"
            assert action.help, f"{where}: no help"
            if action.metavar is not None:
                assert not action.metavar.startswith("G_"), where
            shows_default = action.default in (None, False, argparse.SUPPRESS) or \
                "default" in action.help or action.required
            assert shows_default, f"{where}: default {action.default!r} not shown"
        assert parser.description or not words, f"{' '.join(words)}: no description"


def test_top_level_help_has_plain_metavars_and_states_the_rule(capsys):
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    out = capsys.readouterr().out
    assert "G_CLIENT_ID" not in out and "G_SECRET_KEY" not in out
    assert "--client-id ID" in out and "accepted before or after the command" in out


def test_lab_up_help_has_a_description_and_the_lab_defaults(capsys):
    from testflinger_magic.lab import demo, lab

    with pytest.raises(SystemExit):
        cli.main(["lab", "up", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "Start the embedded lab" in out
    opt = lab.LabOptions(workdir=Path("."))
    assert cli.LAB_DEFAULTS == {k: getattr(opt, k) for k in cli.LAB_DEFAULTS}
    from testflinger_magic.cli_parser import LAB_LIMITS
    from testflinger_magic.lab import hosts

    assert LAB_LIMITS["gpus"] == hosts.MAX_GPUS  # --gpus' bound is what a lab host can hold
    assert cli.DEMO_DEFAULTS == {"copies": demo.DEFAULT_COPIES, "timeout": demo.DEFAULT_TIMEOUT,
                                 "summary": demo.DEFAULT_SUMMARY}
    for text in ("(default 2)", "(default 8)", "(default 0.01)", "(default 1)"):
        assert text in out


API_COMMANDS = [
    (["status"], ("GET", "/v1/magic/status"), {"queues": [], "leases": [], "devices": []}),
    (["plan"], ("GET", "/v1/magic/plan"), {"actions": []}),
    (["queues"], ("GET", "/v1/magic/queues"), {"queues": []}),
    (["leases"], ("GET", "/v1/magic/leases"), {"leases": []}),
    (["events"], ("GET", "/v1/magic/events"), {"events": []}),
    (["apply", str(EXAMPLE)], ("PUT", "/v1/magic/queues"), {"applied": ["one-gpu-vm"]}),
    (["drain", "lease-1"], ("POST", "/v1/magic/leases/lease-1/drain"), {"state": "draining"}),
    (["quarantine", "gpu-host-01"], ("POST", "/v1/magic/devices/gpu-host-01/quarantine"),
     {"_id": "gpu-host-01", "previous_reason": None}),
    (["unquarantine", "gpu-host-01"], ("DELETE", "/v1/magic/devices/gpu-host-01/quarantine"),
     {"_id": "gpu-host-01"}),
    (["lend", "gpu-host-01", "one-gpu-vm"], ("POST", "/v1/magic/leases"), {"_id": "lease-1"}),
    (["agent-hosts", "list"], ("GET", "/v1/magic/agent-hosts"), {"agent_hosts": []}),
    (["agent-hosts", "rebind", "host-a", "c2"], ("PUT", "/v1/magic/agent-hosts/host-a/binding"),
     {"client_id": "c2"}),
    (["agent-hosts", "forget", "host-a"], ("DELETE", "/v1/magic/agent-hosts/host-a"),
     {"devices": []}),
]


@pytest.mark.parametrize("argv, route, answer", API_COMMANDS,
                         ids=[" ".join(a[:2]) for a, _, _ in API_COMMANDS])
@pytest.mark.parametrize("before", [True, False], ids=["json-before", "json-after"])
def test_every_server_command_honours_json_before_or_after(server, capsys, argv, route, answer,
                                                           before):
    server.routes[route] = (200, answer)
    conn = ["--server", server.url, "--client-id", CLIENT_ID, "--secret-key", SECRET]
    full = ["--json", *conn, *argv] if before else [*argv, *conn, "--json"]
    assert cli.main(full) == 0, capsys.readouterr().err
    shown = json.loads(capsys.readouterr().out)
    if argv[0] == "apply":  # apply adds validate's warnings (none for the example)
        assert shown.pop("warnings") == []
    assert shown == answer
    assert server.calls()[-1]["method"] == route[0]


@pytest.mark.parametrize("before", [True, False])
def test_validate_honours_json_before_or_after(capsys, tmp_path, before):
    argv = ["validate", str(EXAMPLE)]
    assert cli.main(["--json", *argv] if before else [*argv, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["ok"] is True and data["files"][0]["issues"] == []
    assert data["files"][0]["queues"]["one-gpu-vm"]["policy"]["idle_timeout"] == "10m"
    bad = tmp_path / "bad.yaml"
    bad.write_text("magic_queues:\n  q:\n    description: x\n    devices: {}\n    nope: 1\n")
    assert cli.main(["validate", str(bad), "--json"]) == 1
    (entry,) = json.loads(capsys.readouterr().out)["files"]
    assert entry["file"] == str(bad) and any(i["field"].endswith("nope") for i in entry["issues"])


def test_simulate_honours_json_before_the_command(capsys):
    trace = ROOT / "examples" / "traces" / "small.csv"
    assert cli.main(["--json", "simulate", str(trace), "--queues", str(EXAMPLE)]) == 0
    assert "results" in json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("argv", [["agent-host", "--config", "x.yaml"], ["lab", "up"]])
def test_commands_that_run_until_stopped_refuse_json(argv, capsys):
    for full in (["--json", *argv], [*argv, "--json"]):
        with pytest.raises(SystemExit) as exc:
            cli.main(full)
        assert exc.value.code == 2
        assert "has no JSON output" in capsys.readouterr().err
    # Refused, so not offered in the command's help either.
    with pytest.raises(SystemExit):
        cli.main([argv[0], argv[1] if argv[0] == "lab" else "--help", "--help"])
    out = capsys.readouterr().out
    assert "usage:" in out and "--json" not in out


@pytest.mark.parametrize("argv, message", [
    (["drain", ""], "LEASE_ID must not be empty"),
    (["drain", "  "], "LEASE_ID must not be empty"),
    (["quarantine", ""], "DEVICE must not be empty"),
    (["unquarantine", ""], "DEVICE must not be empty"),
    (["lend", "", "one-gpu-vm"], "DEVICE must not be empty"),
    (["lend", "gpu-host-01", ""], "QUEUE must not be empty"),
    (["agent-hosts", "forget", ""], "HOST must not be empty"),
    (["agent-hosts", "rebind", "host-a", ""], "CLIENT_ID must not be empty"),
])
def test_empty_ids_are_usage_errors(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(argv)
    assert exc.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["--server", "", "status"], "argument --server: must not be empty"),
    (["status", "--server", " "], "argument --server: must not be empty"),
    (["status", "--client-id", ""], "argument --client-id: must not be empty"),
    (["validate", ""], "argument FILE: FILE must not be empty"),
    (["validate", "examples/magic-queues.yaml", ""], "FILE must not be empty"),
    (["apply", ""], "FILE must not be empty"),
    (["lab", "up", "--workdir", ""], "argument --workdir: must not be empty"),
    (["demo", "--summary", ""], "argument --summary: must not be empty"),
    (["simulate", "t.csv", "--queues", ""], "argument --queues: must not be empty"),
    (["trace", "export", "--mongo", "", "--since", "2024-01-01", "--out", "x.yaml"],
     "argument --mongo: must not be empty"),
    (["agent-host", "check", "--config", ""], "argument --config: must not be empty"),
])
def test_empty_values_are_refused_everywhere(argv, message, capsys, monkeypatch):
    """An empty value never silently means the default (--server ''), the current directory
    (validate '', --workdir '') or anything else: every option or argument taking a value
    refuses it at parsing (usage error, exit 2)."""
    monkeypatch.delenv("TESTFLINGER_SERVER", raising=False)
    with pytest.raises(SystemExit) as exc:
        cli.main(argv)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("url", ["127.0.0.1:8000", "localhost", "ftp://x", "http://"])
def test_server_url_without_http_scheme_is_a_clear_error(url, capsys, monkeypatch):
    monkeypatch.delenv("TESTFLINGER_SERVER", raising=False)
    assert cli.main(["status", "--server", url]) == 1
    err = capsys.readouterr().err
    assert "must start with http:// or https://" in err or "must be http:// or https://" in err
    assert "No connection adapters" not in err


def test_drain_grace_zero_is_accepted(server, capsys):
    server.routes[("POST", "/v1/magic/leases/lease-1/drain")] = (200, {"state": "draining"})
    assert run(server, "drain", "lease-1", "--grace", "0") == 0
    assert server.calls()[-1]["body"]["grace"] == "0"


# --- what the operator reads (items 10, 11, 16) -----------------------------------------------

def test_status_says_why_jobs_wait_with_quarantine_reasons_running_jobs_and_grace(server, capsys):
    import time

    reason = "one-gpu-vm: 3 waiting jobs, 0 idle or starting VMs; no device can be lent: " \
             "1 quarantined, 0 idle"
    status = {"queues": [{"name": "one-gpu-vm", "waiting": 3, "vm_agents": 0, "leases": 1,
                          "devices_lendable": 0, "suspended": None,
                          "blocked": {"why": "no_device", "reason": reason},
                          "quarantined": [{"device": "gpu-host-02",
                                           "reason": "PSU\nreplaced; burn-in pending"}]}],
              "leases": [dict(LEASE, state="draining",
                              drain={"reason": "bios update", "grace_until": time.time() + 600},
                              running_jobs=[{"agent": "gpu-host-01-vm0", "job_id": "job-9"},
                                            {"agent": "gpu-host-01-vm1", "job_id":
                                             "ce7b9dae-3045-4a0e-9c1d-2f6b1b2c3d4e"}])],
              "devices": [{"_id": "gpu-host-02", "agent_host": "host-a", "gpus": 4,
                           "quarantined": True, "failures": 0,
                           "quarantine_reason": "PSU\nreplaced; burn-in pending"}]}
    server.routes[("GET", "/v1/magic/status")] = (200, status)
    assert run(server, "status") == 0
    out = capsys.readouterr().out
    section = out.split("WHY JOBS WAIT\n", 1)[1].split("\n\n", 1)[0].splitlines()
    assert section == [reason, "  gpu-host-02 quarantined: PSU; replaced; burn-in pending"]
    lease_row = next(line for line in out.splitlines() if line.startswith(LEASE["_id"]))
    assert "bios update (grace until " in lease_row and "left)" in lease_row
    # Short for a terminal (TRIAL5 finding 10): a UUID's first 8 characters, the VM's suffix.
    assert lease_row.endswith("job-9@vm0,ce7b9dae@vm1")
    device_row = next(line for line in out.split("DEVICES", 1)[1].splitlines()
                      if line.startswith("gpu-host-02"))
    assert device_row.endswith("PSU; replaced; burn-in pending")


def test_a_multi_line_cell_keeps_one_row_per_line():
    from testflinger_magic.cli_output import table

    text = table([{"a": "x", "b": "first\nsecond\n"}, {"a": "y", "b": "z"}], ["a", "b"])
    assert text.splitlines() == ["A  B", "x  first; second", "y  z"]


def test_quarantine_says_when_the_reason_was_replaced(server, capsys):
    path = "/v1/magic/devices/gpu-host-01/quarantine"
    server.routes[("POST", path)] = (200, {"_id": "gpu-host-01", "previous_reason": None})
    assert run(server, "quarantine", "gpu-host-01", "--reason", "fan") == 0
    assert capsys.readouterr().out.strip() == "quarantined gpu-host-01: fan"
    server.routes[("POST", path)] = (200, {"_id": "gpu-host-01", "previous_reason": "fan"})
    assert run(server, "quarantine", "gpu-host-01", "--reason", "PSU") == 0
    assert capsys.readouterr().out.strip() == \
        "gpu-host-01 was already quarantined (fan); reason now: PSU"


def test_queues_shows_the_applied_definitions_against_the_plugin(capsys, tmp_path):
    """``queues`` prints what the server holds as a definitions file (notify URLs redacted as
    the server answers them), and --json the server's own answer."""
    import yaml

    from testflinger_magic import queues as queues_mod
    from testflinger_magic.lab import httpserve, jobservice
    from testflinger_magic.webhooks import AllowList

    text = EXAMPLE.read_text().replace(
        "      notify: []\n", "      notify: [https://hooks.example.com/T0/secret-token]\n", 1)
    assert "secret-token" in text
    app = jobservice.create_app(clients={"op": {"secret": "pw", "role": "admin"}},
                                plugin_options={"start_ticker": False})
    handle = httpserve.serve(app)
    plugin = app.extensions["testflinger_magic"]
    try:
        plugin.apply(queues_mod.load_text(text, webhook_allow=AllowList(everything=True)))
        base = ["--server", handle.url, "--client-id", "op", "--secret-key", "pw"]
        assert cli.main(["queues", *base]) == 0
        out = capsys.readouterr().out
        assert "secret-token" not in out and "redacted" in out
        shown = yaml.safe_load(out)["magic_queues"]
        assert set(shown) == {"one-gpu-vm", "two-gpu-vm"}
        assert shown["one-gpu-vm"]["policy"]["idle_timeout"] == "10m"
        assert cli.main(["queues", *base, "--json"]) == 0
        names = [q["_id"] for q in json.loads(capsys.readouterr().out)["queues"]]
        assert sorted(names) == ["one-gpu-vm", "two-gpu-vm"]
        # The output re-applied as it is would replace the real URL with the placeholder:
        # validate, apply and the API refuse it, naming the field.
        copied = tmp_path / "copied.yaml"
        copied.write_text(out)
        assert cli.main(["validate", str(copied)]) == 1
        err = capsys.readouterr().err
        assert "magic_queues.one-gpu-vm.policy.notify.0" in err
        assert "put the real webhook URL back" in err
        assert cli.main(["apply", str(copied), *base]) == 1
        assert "put the real webhook URL back" in capsys.readouterr().err
        import requests
        token = requests.post(handle.url + "/v1/oauth2/token", auth=("op", "pw"),
                              timeout=10).json()["access_token"]
        resp = requests.put(handle.url + "/v1/magic/queues", json={"yaml": out},
                            headers={"Authorization": f"Bearer {token}"}, timeout=10)
        assert resp.status_code == 422
        assert any(i["field"] == "magic_queues.one-gpu-vm.policy.notify.0"
                   and "real webhook URL" in i["message"] for i in resp.json()["issues"])
        assert any(q.policy.notify == ["https://hooks.example.com/T0/secret-token"]
            for q in plugin.definitions())
    finally:
        plugin.stop()
        handle.stop()


def test_lab_up_banner_says_the_policy_is_shortened(monkeypatch, tmp_path, capsys):
    """The banner (lab.main_up) with a stand-in Lab: it names the shortened policy and the
    command that shows the applied definitions."""
    import types

    from testflinger_magic.lab import labup as lab

    opt = lab.LabOptions(workdir=tmp_path)

    class FakeLab:
        def __init__(self, options):
            self.opt = options
            self.server_url = "http://127.0.0.1:1"
            self.clients = {"lab-user": {"secret": "u"}, "lab-admin": {"secret": "a"}}
            self.definitions = lab.lab_definitions(opt)

        def start(self):
            return self

        def stop(self):
            pass

    class Event:
        def set(self):
            pass

        def wait(self, timeout=None):
            return True

    monkeypatch.setattr(lab, "Lab", FakeLab)
    monkeypatch.setattr(lab, "threading", types.SimpleNamespace(Event=Event))
    monkeypatch.setattr(lab, "signal", types.SimpleNamespace(signal=lambda *a: None,
                                                             SIGINT=2, SIGTERM=15, SIGHUP=1))
    assert cli.main(["lab", "up", "--workdir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "testflinger-magic --server http://127.0.0.1:1 queues" in out
    assert "the lab shortens the example's policy" in out and "idle_timeout 8s" in out
    assert "no registered device can serve are cancelled, told why, after 1m (a real server: 10m)" \
        in out


@pytest.mark.parametrize("sig, code", [("SIGINT", 130), ("SIGTERM", 143)])
def test_lab_up_interrupted_while_starting_stops_at_once_without_a_banner(
        monkeypatch, tmp_path, capsys, sig, code):
    """Ctrl-C (or SIGTERM) while the lab starts: the start unwinds at once (the stand-in Lab's
    start gets the real signal), the lab is stopped, no banner, exit 128+N like demo."""
    import os
    import signal

    from testflinger_magic.lab import labup as lab

    calls = []

    class FakeLab:
        def __init__(self, options):
            self.server_url = "http://127.0.0.1:1"

        def start(self):
            calls.append("start")
            os.kill(os.getpid(), getattr(signal, sig))
            calls.append("went on starting")  # never: the handler raises
            return self

        def stop(self):
            calls.append("stop")

    monkeypatch.setattr(lab, "Lab", FakeLab)
    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        assert cli.main(["lab", "up", "--workdir", str(tmp_path / "w")]) == code
    finally:
        for s, handler in before.items():
            signal.signal(s, handler)
    out, err = capsys.readouterr()
    assert calls == ["start", "stop"]
    assert "Lab is up" not in out and f"interrupted by {sig} while starting" in err
    assert {s: signal.getsignal(s) for s in before} == before  # handlers given back


def test_lab_banner_submits_the_example_job_by_an_absolute_path(monkeypatch, tmp_path, capsys):
    """Trial finding 24: the banner's submit line works from any directory."""
    import shlex
    import signal
    import types

    from testflinger_magic.lab import labup as lab

    class FakeLab:
        def __init__(self, options):
            self.opt = options
            self.server_url = "http://127.0.0.1:1"
            self.clients = {"lab-user": {"secret": "u"}, "lab-admin": {"secret": "a"}}
            self.definitions = []

        def start(self):
            return self

        def stop(self):
            pass

    class UpAndDown:  # the banner is printed, then the wait for Ctrl-C returns at once
        def wait(self, timeout=None):
            return True

        def set(self):
            pass

    monkeypatch.setattr(lab, "Lab", FakeLab)
    monkeypatch.setattr(lab, "threading", types.SimpleNamespace(Event=UpAndDown))
    monkeypatch.chdir(tmp_path)
    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        assert cli.main(["lab", "up", "--workdir", str(tmp_path / "w")]) == 0
    finally:
        for s, handler in before.items():
            signal.signal(s, handler)
    (line,) = [x for x in capsys.readouterr().out.splitlines() if " submit " in x]
    job = shlex.split(line)[-1]
    assert Path(job).is_absolute() and Path(job).is_file() and job.endswith("gpu-smoke.yaml")


def test_status_text_shows_what_needs_a_person(server, capsys):
    status = {"queues": [], "leases": [], "devices": [],
              "invalid_queues": [{"name": "old-q", "reason": "vm.gpus: bad"}],
              "overdue_leases": [{"lease_id": "lease-9", "device": "gpu-host-01",
                                  "queue": "one-gpu-vm", "state": "restoring",
                                  "agent_host": "host-a", "overdue_for": 600.0}],
              "stale_agent_hosts": [{"name": "host-b", "silent_for": 180.0,
                                     "devices": ["gpu-host-03"],
                                     "instance": "lab-07/3d1219c7c4c5:/var/lib/tfm"}]}
    server.routes[("GET", "/v1/magic/status")] = (200, status)
    assert run(server, "status") == 0
    section = capsys.readouterr().out.split("NEEDS A PERSON\n", 1)[1].split("\n\n", 1)[0]
    assert section.splitlines() == [
        "queue old-q: stored definition ignored: vm.gpus: bad; apply it again",
        "lease lease-9 on gpu-host-01 (one-gpu-vm) still restoring 10m past its deadline "
        "(agent host host-a)",
        "agent host host-b: no heartbeat for 3m (daemon instance "
        "lab-07/3d1219c7c4c5:/var/lib/tfm) (devices: gpu-host-03)"]


def test_status_needs_a_person_for_failed_leases_and_stale_hosts_leases(server, capsys):
    """TRIAL (2026-12-02) 3, 11, 23: a failed lease holding its device is listed with its
    error and what to do; a stale host names the leases nobody works; a bound host that never
    registered says so rather than "no heartbeat for ever"."""
    import time

    status = {"queues": [], "leases": [], "devices": [],
              "failed_leases": [{"lease_id": "lease-f", "device": "gpu-host-02",
                                 "queue": "one-gpu-vm", "agent_host": "host-a",
                                 "error": "restoring: MaasUnreachable: connection refused",
                                 "failed_at": time.time() - 125, "quarantined": False}],
              "stale_agent_hosts": [
                  {"name": "host-b", "silent_for": 180.0, "devices": ["gpu-host-03"],
                   "registered": True, "leases": [{"lease_id": "lease-r", "device": "gpu-host-03",
                                                   "queue": "one-gpu-vm", "state": "restoring"}]},
                  {"name": "new-host-x", "silent_for": None, "devices": [],
                   "registered": False, "leases": []}]}
    server.routes[("GET", "/v1/magic/status")] = (200, status)
    assert run(server, "status") == 0
    section = capsys.readouterr().out.split("NEEDS A PERSON\n", 1)[1].split("\n\n", 1)[0]
    assert section.splitlines() == [
        "lease lease-f on gpu-host-02 (one-gpu-vm) failed 2m5s ago: restoring: "
        "MaasUnreachable: connection refused; gpu-host-02 stays out of its home queues, its "
        "agent maybe stopped: check the machine (MAAS) and agent host host-a, then "
        "`testflinger-magic unquarantine gpu-host-02` releases the lease",
        "agent host host-b: no heartbeat for 3m (devices: gpu-host-03); its leases are not "
        "being worked: lease-r restoring on gpu-host-03 (one-gpu-vm)",
        "agent host new-host-x: never sent a heartbeat (bound, never registered: start its "
        "daemon, or `testflinger-magic agent-hosts forget new-host-x`) (devices: -)"]


def test_status_why_jobs_wait_for_a_slow_bringup_and_for_lent_home_devices(server, capsys):
    """TRIAL (2026-12-02) 17: the daemon's last progress message says why a bring-up is slow;
    a home queue's waiting job says its devices are lent and when the reclaim comes."""
    import time

    now = time.time()
    bringing = dict(LEASE, state="deploying", created_at=now - 60,
                    history=[{"state": "claimed", "at": now - 60},
                             {"state": "deploying", "at": now - 50}],
                    progress_note={"state": "deploying", "at": now - 5,
                                   "message": "MAAS unreachable since 02:10:00"})
    status = {"queues": [{"name": "one-gpu-vm", "waiting": 3, "vm_agents": 0, "leases": 1,
                          "devices_lendable": 0, "suspended": None, "blocked": None}],
              "leases": [bringing], "devices": [],
              "home_waits": [{"queue": "gpu-hosts", "waiting": 1, "oldest_age": 20.0, "lent": [
                  {"device": "gpu-host-02", "lease_id": "lease-a", "queue": "one-gpu-vm",
                   "state": "active", "owner_wait": 60.0, "reclaim_in": 40.0},
                  {"device": "gpu-host-03", "lease_id": "lease-f", "queue": "one-gpu-vm",
                   "state": "failed", "owner_wait": 60.0, "reclaim_in": None}]}]}
    server.routes[("GET", "/v1/magic/status")] = (200, status)
    assert run(server, "status") == 0
    section = capsys.readouterr().out.split("WHY JOBS WAIT\n", 1)[1].split("\n\n", 1)[0]
    assert section.splitlines() == [
        f"one-gpu-vm: 3 waiting, lease {LEASE['_id']} on gpu-host-01 still deploying for 50s: "
        "agent host says (5s ago): MAAS unreachable since 02:10:00",
        "gpu-hosts (home queue): 1 waiting, the oldest for 20s; gpu-host-02 lent to "
        "one-gpu-vm (lease lease-a active; reclaimed when the oldest job has waited owner_wait "
        "1m: in 40s); gpu-host-03 lent to one-gpu-vm (lease lease-f failed: never reclaimed, "
        "see NEEDS A PERSON)"]


def test_status_home_waits_name_a_stale_agent_host_and_devices_that_stay_lent(server, capsys):
    """TRIAL2 findings 2 and 3: a lent device whose agent host is stale is not said to be
    reclaimed or on its way back; only the devices the owner reclaim takes are said to be
    reclaimed, the others stay lent."""
    status = {"queues": [], "leases": [], "devices": [],
              "home_waits": [{"queue": "gpu-hosts", "waiting": 1, "oldest_age": 5.0, "lent": [
                  {"device": "gpu-host-01", "lease_id": "lease-a", "queue": "one-gpu-vm",
                   "state": "active", "owner_wait": 60.0, "reclaim_in": 55.0, "reclaimed": True,
                   "agent_host": "h1", "agent_host_stale_for": None},
                  {"device": "gpu-host-02", "lease_id": "lease-b", "queue": "one-gpu-vm",
                   "state": "active", "owner_wait": 60.0, "reclaim_in": None,
                   "reclaimed": False, "agent_host": "h1", "agent_host_stale_for": None},
                  {"device": "gpu-host-03", "lease_id": "lease-c", "queue": "one-gpu-vm",
                   "state": "restoring", "owner_wait": 60.0, "reclaim_in": None,
                   "reclaimed": None, "agent_host": "h2", "agent_host_stale_for": 180.0}]}]}
    server.routes[("GET", "/v1/magic/status")] = (200, status)
    assert run(server, "status") == 0
    section = capsys.readouterr().out.split("WHY JOBS WAIT\n", 1)[1].split("\n\n", 1)[0]
    assert section.splitlines() == [
        "gpu-hosts (home queue): 1 waiting, the oldest for 5s; gpu-host-01 lent to one-gpu-vm "
        "(lease lease-a active; reclaimed when the oldest job has waited owner_wait 1m: in "
        "55s); gpu-host-02 lent to one-gpu-vm (lease lease-b active; stays lent: the owner "
        "reclaim takes one device per waiting job); gpu-host-03 lent to one-gpu-vm (lease "
        "lease-c restoring; its agent host h2 is stale (no heartbeat for 3m): not coming back "
        "until its daemon runs again)"]


def test_unquarantine_of_a_failed_lease_says_what_remains_to_check(server, capsys):
    """TRIAL (2026-12-02) 10: the device agent may still be stopped after a failed restore;
    the message says what happens next and what to check, not that the device is back."""
    server.routes[("DELETE", "/v1/magic/devices/gpu-host-01/quarantine")] = (200, {
        "_id": "gpu-host-01", "agent_host": "host-a", "quarantined": False,
        "previous_reason": "3 failures", "released_failed_lease": "lease-f"})
    assert run(server, "unquarantine", "gpu-host-01") == 0
    out = capsys.readouterr().out
    assert out.startswith("unquarantined gpu-host-01 (was: 3 failures); released its failed "
                          "lease lease-f: gpu-host-01 may be lent again and serves its home "
                          "queues once its testflinger-agent runs and posts waiting")
    assert "`supervisorctl status` on host-a" in out and "can be lent and serve" not in out


def test_drain_cell_shows_the_grace_only_while_draining():
    """A returned (or restoring) lease's drain keeps its reason, not a grace countdown."""
    from testflinger_magic.cli_output import _lease_rows as lease_rows

    drain = {"reason": "bios update", "grace_until": 1000.0}
    rows = {r["state"]: r["drain"] for r in lease_rows(
        [{"_id": s, "state": s, "drain": drain} for s in ("draining", "restoring", "returned")],
        now=900.0)}
    assert rows["draining"].startswith("bios update (grace until ") and "left)" in rows["draining"]
    assert rows["restoring"] == rows["returned"] == "bios update"


def test_a_closed_lease_age_is_its_lifetime_not_time_since():
    from testflinger_magic.cli_output import _lease_rows as lease_rows

    leases = [{"_id": "a", "state": "returned", "created_at": 1000.0, "updated_at": 1600.0},
              {"_id": "b", "state": "active", "created_at": 1000.0, "updated_at": 1600.0}]
    ages = {r["_id"]: r["age"] for r in lease_rows(leases, now=1000.0 + 86400)}
    assert ages["b"] == lease_rows([{"state": "active", "created_at": 0.0}], now=86400.0)[0]["age"]
    lived = lease_rows([{"state": "active", "created_at": 0.0}], now=600.0)[0]["age"]
    assert ages["a"] == f"{lived} (lived)"


def test_trial_leftovers_say_what_happened_against_the_plugin(capsys, tmp_path):
    """Issue 10's trial leftovers, against the lab job service with the plugin: unquarantine of
    a device that is not quarantined says so (exit 0, as quarantine of a quarantined one);
    leases --queue of an unknown queue is an error naming it (exit 1), a known queue with no
    lease prints (none); validate of a missing file names it without a line."""
    from testflinger_magic import queues as queues_mod
    from testflinger_magic.lab import httpserve, jobservice
    from testflinger_magic.server import auth

    app = jobservice.create_app(clients={"op": {"secret": "pw", "role": "admin"}},
                                plugin_options={"start_ticker": False})
    handle = httpserve.serve(app)
    plugin = app.extensions["testflinger_magic"]
    try:
        plugin.apply(queues_mod.load_file(EXAMPLE))
        agent = auth.issue_token(app.config["JWT_SIGNING_KEY"], "host-a-client", "agent")
        r = app.test_client().post(
            "/v1/magic/agent-hosts/host-a", headers={"Authorization": f"Bearer {agent}"},
            json={"devices": [{"agent_name": "gpu-host-01", "maas_system_id": "x", "gpus": 2,
                               "home_queues": ["gpu-hosts"]}]})
        assert r.status_code == 200, r.get_data(as_text=True)
        base = ["--server", handle.url, "--client-id", "op", "--secret-key", "pw"]
        assert cli.main(["unquarantine", *base, "gpu-host-01"]) == 0
        assert capsys.readouterr().out.strip() == \
            "gpu-host-01 was not quarantined; nothing to lift"
        assert cli.main(["quarantine", *base, "gpu-host-01", "--reason", "fan"]) == 0
        capsys.readouterr()
        assert cli.main(["unquarantine", *base, "gpu-host-01"]) == 0
        assert capsys.readouterr().out.strip() == "unquarantined gpu-host-01 (was: fan)"

        assert cli.main(["leases", *base, "--queue", "nosuch"]) == 1
        err = capsys.readouterr().err
        assert "HTTP 404: 'nosuch' is not a magic queue" in err
        assert cli.main(["leases", *base, "--queue", "one-gpu-vm"]) == 0
        assert "(none)" in capsys.readouterr().out
    finally:
        plugin.stop()
        handle.stop()
    missing = tmp_path / "nope.yaml"
    assert cli.main(["validate", str(missing)]) == 1
    assert capsys.readouterr().err.strip() == f"{missing}: no such file (missing)"
    assert cli.main(["validate", str(tmp_path)]) == 1
    assert capsys.readouterr().err.strip() == f"{tmp_path}: is a directory, not a definition file"


def test_drain_of_a_lease_in_bring_up_says_it_is_restored_at_once(server, capsys):
    """A trial surprise: draining a lease still bringing up printed "draining X: state
    restoring"; it says what happened instead."""
    path = f"/v1/magic/leases/{LEASE['_id']}/drain"
    server.routes[("POST", path)] = (200, dict(LEASE, state="restoring"))
    assert run(server, "drain", LEASE["_id"]) == 0
    assert capsys.readouterr().out.strip() == (
        f"{LEASE['_id']} was still bringing up (no job ran on it): restoring now, the device "
        "goes back to its home queue")


def test_lab_up_banner_names_testflinger_magic_by_its_path_when_it_is_not_on_path(monkeypatch):
    """TRIAL16 F6: the banner's `testflinger-magic ...` lines did not run as printed when the
    README's `.venv/bin/testflinger-magic lab up` was used (nothing puts .venv/bin on PATH)."""
    import shutil
    import sys
    from pathlib import Path

    from testflinger_magic.lab import labup

    monkeypatch.setattr(shutil, "which", lambda name: None)
    beside = Path(sys.executable).parent / "testflinger-magic"
    assert labup.magic_command() == (str(beside) if beside.exists() else "testflinger-magic")
    monkeypatch.setattr(shutil, "which", lambda name: f"/usr/bin/{name}")
    assert labup.magic_command() == "testflinger-magic"
