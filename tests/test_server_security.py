"""Trust boundaries of the server plugin (issue 12), over real HTTP on the ``magic`` stack.

* agent hosts are bound to the Testflinger client that first registered them: another ``agent``
  client can neither re-register them, poll their work, heartbeat for them, report on their
  leases nor take their devices; an admin rebinds or forgets a host;
* a report may set only the ``vms`` fields of the step it reports;
* webhook URLs are write-only (redacted in every read and log line);
* webhook URLs pointing inside the lab (loopback, link-local/metadata, private) are refused when
  applied and again when sent (after DNS resolution); redirects are never followed.

Each test asserts that a refused call changed nothing and leaked nothing.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import jwt
import pytest
import requests

from conftest import MAGIC_YAML
from testflinger_magic import db as dbmod
from testflinger_magic import queues
from testflinger_magic.events import EventLog, Notifier
from testflinger_magic.server import auth

DEVICES = [
    {"agent_name": "gpu-host-01", "maas_system_id": "abc123", "gpus": 2, "tags": [],
     "home_queues": ["gpu-hosts"]},
    {"agent_name": "gpu-host-02", "maas_system_id": "def456", "gpus": 2, "tags": [],
     "home_queues": ["gpu-hosts"]},
]
SECRET = "T0KEN-s3cr3t-b8a1"
HOOK = f"https://chat.example.com/hooks/{SECRET}?key={SECRET}"


def token(m, client_id, role="agent"):
    return {"Authorization": "Bearer " + auth.issue_token(m.app.config["JWT_SIGNING_KEY"],
                                                          client_id, role)}


def post(m, path, headers, body):
    return requests.post(f"{m.url}/v1/magic{path}", headers=headers, json=body, timeout=10)


def snapshot(db):
    """Everything a refused agent-host call must leave as it was."""
    return {name: sorted((dict(d) for d in db[name].find({})), key=lambda d: str(d["_id"]))
            for name in ("magic_agent_hosts", "magic_devices", "magic_leases",
                         "magic_device_claims", "magic_events")}


def lend(m, device="gpu-host-01"):
    r = post(m, "/leases", m.headers("admin"), {"device": device, "queue": "one-gpu-vm"})
    assert r.status_code == 201, r.text
    return r.json()


def report(m, lease, headers, result="ok", to_state=None, host="host-a", **extra):
    body = {"agent_host": host, "generation": lease["generation"], "state": lease["state"],
            "result": result, **extra}
    if to_state:
        body["to_state"] = to_state
    return post(m, f"/leases/{lease['_id']}/report", headers, body)


# ---------------------------------------------------------------- 1. binding

def test_first_registration_binds_the_host_to_its_client(magic):
    real, evil = token(magic, "lab-agent-host"), token(magic, "evil")
    assert post(magic, "/agent-hosts/host-a", real, {"devices": DEVICES}).status_code == 200
    assert magic.db.magic_agent_hosts.find_one({"_id": "host-a"})["client_id"] == "lab-agent-host"
    before = snapshot(magic.db)
    # The hijack of issue 12: re-register the host with no devices, then take a device.
    r = post(magic, "/agent-hosts/host-a", evil, {"devices": []})
    assert r.status_code == 403
    assert "bound to client lab-agent-host" in r.json()["message"] and "evil" in r.json()["message"]
    r = post(magic, "/agent-hosts/evil-host", evil, {"devices": DEVICES[1:]})
    assert r.status_code == 403 and "registered to agent host host-a" in r.json()["message"]
    r = requests.get(f"{magic.url}/v1/magic/agent-hosts/host-a/work", headers=evil, timeout=10)
    assert r.status_code == 403 and "bound to client" in r.json()["message"]
    r = post(magic, "/agent-hosts/host-a/heartbeat", evil, {"leases": []})
    assert r.status_code == 403
    assert snapshot(magic.db) == before  # no host, device, binding or event changed
    # The real daemon is not locked out.
    assert post(magic, "/agent-hosts/host-a", real, {"devices": DEVICES}).status_code == 200
    r = requests.get(f"{magic.url}/v1/magic/agent-hosts/host-a/work", headers=real, timeout=10)
    assert r.status_code == 200 and r.json() == {"leases": []}


def test_a_token_without_client_id_cannot_bind(magic):
    key = magic.app.config["JWT_SIGNING_KEY"]
    now = int(time.time())
    anon = jwt.encode({"sub": "access_token", "iat": now, "exp": now + 60,
                       "permissions": {"role": "agent"}}, key, algorithm="HS256")
    r = post(magic, "/agent-hosts/host-a", {"Authorization": f"Bearer {anon}"},
             {"devices": DEVICES})
    assert r.status_code == 403 and "client_id" in r.json()["message"]
    assert magic.db.magic_agent_hosts.count_documents({}) == 0
    assert magic.db.magic_devices.count_documents({}) == 0


def test_an_unbound_host_must_register_before_polling(magic):
    """A host nobody registered (or registered before bindings existed) gets 403 on work, so
    the daemon re-registers (daemon.run_forever resets on 401/403) and binds it."""
    agent = token(magic, "lab-agent-host")
    r = requests.get(f"{magic.url}/v1/magic/agent-hosts/host-z/work", headers=agent, timeout=10)
    assert r.status_code == 403 and "register" in r.json()["message"]
    # A host document from before bindings (no client_id) is bound by its next registration.
    magic.db.magic_agent_hosts.insert_one({"_id": "host-a", "devices": [], "last_heartbeat": 0})
    r = requests.get(f"{magic.url}/v1/magic/agent-hosts/host-a/work", headers=agent, timeout=10)
    assert r.status_code == 403
    assert post(magic, "/agent-hosts/host-a", agent, {"devices": DEVICES}).status_code == 200
    assert magic.db.magic_agent_hosts.find_one({"_id": "host-a"})["client_id"] == "lab-agent-host"


def test_admin_rebinds_and_forgets_hosts(magic):
    old, new = token(magic, "old-client"), token(magic, "new-client")
    assert post(magic, "/agent-hosts/host-a", old, {"devices": DEVICES[:1]}).status_code == 200
    url = f"{magic.url}/v1/magic/agent-hosts/host-a/binding"
    # Only an admin may rebind (not a manager, not the agent itself).
    for headers in (magic.headers("manager"), old, new, {}):
        r = requests.put(url, headers=headers, json={"client_id": "new-client"}, timeout=10)
        assert r.status_code == 403, r.text
    assert magic.db.magic_agent_hosts.find_one({"_id": "host-a"})["client_id"] == "old-client"
    # A client Testflinger does not know is refused (the host could not register) unless forced.
    r = requests.put(url, headers=magic.headers("admin"),
                     json={"client_id": "new-client", "reason": "host re-keyed"}, timeout=10)
    assert r.status_code == 409 and "no Testflinger client 'new-client'" in r.json()["message"]
    assert magic.db.magic_agent_hosts.find_one({"_id": "host-a"})["client_id"] == "old-client"
    # A client without the agent role could never act for the host (the agent-host routes
    # need role agent): refused naming its role (none: Testflinger's default, contributor).
    magic.db.client_permissions.insert_one({"client_id": "new-client", "role": "manager"})
    magic.db.client_permissions.insert_one({"client_id": "legacy-client"})
    for client, role in (("new-client", "manager"), ("legacy-client", "contributor")):
        r = requests.put(url, headers=magic.headers("admin"),
                         json={"client_id": client}, timeout=10)
        assert r.status_code == 409, r.text
        assert f"client '{client}' has role '{role}', not 'agent'" in r.json()["message"]
        assert "force" in r.json()["message"]
    assert magic.db.magic_agent_hosts.find_one({"_id": "host-a"})["client_id"] == "old-client"
    magic.db.client_permissions.update_one({"client_id": "new-client"},
                                           {"$set": {"role": "agent"}})
    r = requests.put(url, headers=magic.headers("admin"),
                     json={"client_id": "new-client", "reason": "host re-keyed"}, timeout=10)
    assert r.status_code == 200 and r.json()["client_id"] == "new-client"
    assert post(magic, "/agent-hosts/host-a", old, {"devices": DEVICES[:1]}).status_code == 403
    assert post(magic, "/agent-hosts/host-a", new, {"devices": DEVICES[:1]}).status_code == 200
    kinds = [e["kind"] for e in magic.plugin.events.list()]
    assert "agent_host.rebound" in kinds
    # An operator may pre-bind a host nobody registered yet.
    r = requests.put(f"{magic.url}/v1/magic/agent-hosts/host-b/binding",
                     headers=magic.headers("admin"), json={"client_id": "b-client",
                                                           "force": True}, timeout=10)
    assert r.status_code == 200
    assert post(magic, "/agent-hosts/host-b", new, {"devices": DEVICES[1:]}).status_code == 403
    assert post(magic, "/agent-hosts/host-b", token(magic, "b-client"),
                {"devices": DEVICES[1:]}).status_code == 200
    # Forgetting a host whose device holds a lease is refused; without one it frees the device.
    lease = lend(magic, "gpu-host-01")
    r = requests.delete(f"{magic.url}/v1/magic/agent-hosts/host-a",
                        headers=magic.headers("admin"), timeout=10)
    assert r.status_code == 409 and lease["_id"] in r.json()["message"]
    assert magic.db.magic_devices.find_one({"_id": "gpu-host-01"})["agent_host"] == "host-a"
    r = requests.delete(f"{magic.url}/v1/magic/agent-hosts/host-b",
                        headers=magic.headers("admin"), timeout=10)
    assert r.status_code == 200 and r.json()["devices"] == ["gpu-host-02"]
    assert magic.db.magic_agent_hosts.find_one({"_id": "host-b"}) is None
    assert magic.db.magic_devices.find_one({"_id": "gpu-host-02"}) is None
    # ...so another host may register it now.
    assert post(magic, "/agent-hosts/host-a", new, {"devices": DEVICES}).status_code == 200


# ---------------------------------------------------------------- 2. reports

def bring_up(m, headers, lease, upto):
    for to_state in ("fenced", "deploying", "splitting", "enrolling", "active"):
        vms = []
        if to_state == "enrolling":
            vms = [{"index": i, "domain": vm["name"], "gpus": [f"0000:0{i + 1}:00.0"],
                    "mac": vm["mac"], "disk": f"/d/{vm['name']}.qcow2"}
                   for i, vm in enumerate(lease["vms"])]
        if to_state == "active":
            vms = [{"index": i, "maas_system_id": f"vm{i}", "ip": f"10.0.0.{i + 10}",
                    "metrics_port": 8000 + i, "domain": vm["domain"], "gpus": vm["gpus"]}
                   for i, vm in enumerate(lease["vms"])]
        r = report(m, lease, headers, to_state=to_state, vms=vms)
        assert r.status_code == 200, r.text
        lease = r.json()
        if to_state == upto:
            return lease
    return lease


def test_a_forged_report_changes_nothing(magic):
    real, evil = token(magic, "lab-agent-host"), token(magic, "evil")
    assert post(magic, "/agent-hosts/host-a", real, {"devices": DEVICES}).status_code == 200
    assert post(magic, "/agent-hosts/evil-host", evil, {"devices": []}).status_code == 200
    lease = bring_up(magic, real, lend(magic), "active")
    before = snapshot(magic.db)
    forged = [{"index": 0, "maas_system_id": "victim-machine"}]
    for host in ("host-a", "evil-host"):
        r = report(magic, lease, evil, result="progress", host=host, vms=forged)
        assert r.status_code == 403, r.text
    r = report(magic, lease, evil, result="error", message="boom")
    assert r.status_code == 403 and "bound to client lab-agent-host" in r.json()["message"]
    assert snapshot(magic.db) == before


@pytest.mark.parametrize("upto, result, to_state, vm, field", [
    # A VM's MAAS machine, address and port come only from enrolling -> active...
    ("fenced", "progress", None, {"maas_system_id": "x"}, "maas_system_id"),
    ("splitting", "ok", "enrolling", {"maas_system_id": "x"}, "maas_system_id"),
    ("splitting", "ok", "enrolling", {"ip": "10.9.9.9"}, "ip"),
    # ...never changed while active (only a moved metrics port is)...
    ("active", "progress", None, {"maas_system_id": "other"}, "maas_system_id"),
    ("active", "progress", None, {"ip": "10.9.9.9"}, "ip"),
    ("active", "progress", None, {"domain": "other"}, "domain"),
    # ...and the split's domain, GPUs and disk only from splitting -> enrolling.
    ("enrolling", "ok", "active", {"domain": "other-domain"}, "domain"),
    ("enrolling", "ok", "active", {"disk": "/etc/shadow"}, "disk"),
    ("deploying", "progress", None, {"gpus": ["0000:09:00.0"]}, "gpus"),
    ("restoring", "error", None, {"maas_system_id": "x"}, "maas_system_id"),
])
def test_a_report_sets_only_its_steps_fields(magic, upto, result, to_state, vm, field):
    real = token(magic, "lab-agent-host")
    assert post(magic, "/agent-hosts/host-a", real, {"devices": DEVICES}).status_code == 200
    lease = lend(magic)
    if upto == "restoring":
        lease = bring_up(magic, real, lease, "fenced")
        lease = report(magic, lease, real, result="error", message="x").json()
        assert lease["state"] == "restoring"
    elif upto != "claimed":
        lease = bring_up(magic, real, lease, upto)
    before = magic.db.magic_leases.find_one({"_id": lease["_id"]})
    r = report(magic, lease, real, result=result, to_state=to_state, vms=[{"index": 0, **vm}])
    assert r.status_code == 422, r.text
    assert f"vms.0.{field}" in r.json()["detail"]["json"]
    assert magic.db.magic_leases.find_one({"_id": lease["_id"]}) == before


def test_a_report_may_repeat_a_field_it_may_not_change(magic):
    """The daemon's enrolling -> active report repeats each VM's domain and GPUs: allowed while
    equal to what the split reported."""
    real = token(magic, "lab-agent-host")
    post(magic, "/agent-hosts/host-a", real, {"devices": DEVICES})
    lease = bring_up(magic, real, lend(magic), "active")
    assert [vm["maas_system_id"] for vm in lease["vms"]] == ["vm0", "vm1"]
    r = report(magic, lease, real, result="progress",
               vms=[{"index": 1, "metrics_port": 9100, "maas_system_id": "vm1"}])
    assert r.status_code == 200 and r.json()["vms"][1]["metrics_port"] == 9100


# ---------------------------------------------------------------- 3. secrets

HOOK_YAML = MAGIC_YAML + f"      notify: ['{HOOK}']\n"


def test_webhook_urls_are_write_only(magic, caplog):
    r = requests.put(f"{magic.url}/v1/magic/queues", headers=magic.headers("admin"),
                     json={"yaml": HOOK_YAML, "source": "q.yaml"}, timeout=10)
    assert r.status_code == 200, r.text
    assert magic.plugin.definition("one-gpu-vm").policy.notify == [HOOK]  # stored as given
    post(magic, "/agent-hosts/host-a", token(magic, "h"), {"devices": DEVICES})
    lend(magic)  # an event of the queue: the notifier tries the (unreachable) hook
    magic.plugin.notifier.flush(30)
    reads = {}
    for path in ("/queues", "/status", "/plan", "/events", "/leases", "/devices", "/"):
        for role in ("contributor", "admin"):
            resp = requests.get(f"{magic.url}/v1/magic{path}", headers=magic.headers(role),
                                timeout=10)
            assert resp.status_code == 200, (path, resp.text)
            reads[(path, role)] = resp.text
    anonymous = requests.get(f"{magic.url}/v1/magic/queues", timeout=10)
    reads["anonymous"] = anonymous.text
    for key, text in reads.items():
        assert SECRET not in text, key
    (q,) = anonymous.json()["queues"]
    assert q["policy"]["notify"] == ["https://chat.example.com/…redacted"]
    logged = "\n".join(rec.getMessage() for rec in caplog.records)
    assert "chat.example.com" in logged and SECRET not in logged


def test_a_bad_webhook_url_is_not_echoed(magic):
    bad = f"ftp://user:{SECRET}@example.com/{SECRET}"
    r = requests.put(f"{magic.url}/v1/magic/queues", headers=magic.headers("admin"),
                     json={"yaml": MAGIC_YAML + f"      notify: ['{bad}']\n"}, timeout=10)
    assert r.status_code == 422 and SECRET not in r.text
    assert r.json()["issues"][0]["field"] == "magic_queues.one-gpu-vm.policy.notify.0"
    # Nor one refused for where it points (a local validate shows its author the URL; the
    # server's answer never does).
    inside = f"http://127.0.0.1:9/{SECRET}"
    r = requests.put(f"{magic.url}/v1/magic/queues", headers=magic.headers("admin"),
                     json={"yaml": MAGIC_YAML + f"      notify: ['{inside}']\n"}, timeout=10)
    assert r.status_code == 422 and SECRET not in r.text and "loopback" in r.text


# ---------------------------------------------------------------- 4. SSRF

@pytest.mark.parametrize("url, why", [
    ("http://127.0.0.1:8080/hook", "loopback"),
    ("http://169.254.169.254/latest/meta-data/", "link-local"),
    ("http://[::1]/hook", "loopback"),
    ("http://[::ffff:127.0.0.1]/hook", "loopback"),
    ("http://0.0.0.0/hook", "unspecified"),
    ("http://10.1.2.3/hook", "private"),
    ("http://[fd00:ec2::254]/hook", "private"),
    ("http://localhost:5000/hook", "localhost"),
    ("http://metadata.google.internal/computeMetadata/v1/", "metadata"),
    ("http://2130706433/hook", "loopback"),
])
def test_hostile_webhook_urls_are_refused_when_applied(magic, url, why):
    before = list(magic.db.magic_queues.find({}))
    text = MAGIC_YAML + f"      notify:\n        - https://chat.example.com/ok\n        - '{url}'\n"
    r = requests.put(f"{magic.url}/v1/magic/queues", headers=magic.headers("admin"),
                     json={"yaml": text, "source": "q.yaml"}, timeout=10)
    assert r.status_code == 422, r.text
    (issue,) = r.json()["issues"]
    assert (issue["file"], issue["line"], issue["field"]) == \
        ("q.yaml", text.count("\n"), "magic_queues.one-gpu-vm.policy.notify.1")
    assert why in issue["message"] and "allow" in issue["message"]
    assert list(magic.db.magic_queues.find({})) == before


def test_the_allow_list_admits_an_internal_chat_server():
    from testflinger_magic import webhooks

    text = MAGIC_YAML + "      notify: ['http://10.1.2.3/hook', 'http://chat.lab:8065/h']\n"
    with pytest.raises(queues.DefinitionError):
        queues.load_text(text, webhook_allow=webhooks.AllowList.parse([]))
    allow = webhooks.AllowList.parse(["10.1.0.0/16", "chat.lab"])
    (q,) = queues.load_text(text, webhook_allow=allow)
    assert q.policy.notify == ["http://10.1.2.3/hook", "http://chat.lab:8065/h"]
    with pytest.raises(ValueError, match="TESTFLINGER_MAGIC_WEBHOOK_ALLOW.*not a host"):
        webhooks.AllowList.parse(["http://x/"], source="TESTFLINGER_MAGIC_WEBHOOK_ALLOW")


class Receiver:
    """A webhook receiver on 127.0.0.1; ``redirect_to`` makes it answer 307 there; ``big``
    makes it answer with that many bytes."""

    def __init__(self, redirect_to=None, big=0):
        self.hits = []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                length = int(self.headers.get("Content-Length") or 0)
                outer.hits.append((self.path, json.loads(self.rfile.read(length) or b"{}")))
                if redirect_to:
                    self.send_response(307)
                    self.send_header("Location", redirect_to)
                    self.end_headers()
                    return
                self.send_response(200)
                self.send_header("Content-Length", str(big))
                self.end_headers()
                chunk = b"x" * 65536
                sent = 0
                try:
                    while sent < big:
                        self.wfile.write(chunk)
                        sent += len(chunk)
                except OSError:
                    pass  # the notifier stopped reading

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


def deliver(urls, allow, caplog):
    from testflinger_magic import webhooks

    notifier = Notifier(lambda q: urls, timeout=5, allow=webhooks.AllowList.parse(allow))
    log = EventLog(dbmod.connect(), lambda: 1.0, notifier=notifier)
    with caplog.at_level(logging.WARNING, logger="testflinger_magic.events"):
        log.record("lease.claimed", "q: claimed", queue="q")
        assert notifier.flush(20)
    notifier.close()
    return "\n".join(r.getMessage() for r in caplog.records)


def test_send_time_checks_resolve_names_and_never_follow_redirects(caplog):
    inside = Receiver()
    redirector = Receiver(redirect_to=inside.url + "/internal")
    try:
        port = inside.server.server_address[1]
        # A name resolving to loopback (a stored definition from before validation, or DNS
        # that changed since): refused after resolution, nothing sent.
        logged = deliver([f"http://localhost:{port}/{SECRET}"], [], caplog)
        assert inside.hits == [] and "loopback" in logged and SECRET not in logged
        # Allow-listed explicitly (the lab's way), the receiver gets it; a 307 elsewhere is
        # not followed, even to an allowed address.
        logged = deliver([redirector.url + f"/hook/{SECRET}"], ["127.0.0.1"], caplog)
        assert [p for p, _ in redirector.hits] == [f"/hook/{SECRET}"]
        assert inside.hits == []
        assert "307" in logged and "not followed" in logged and SECRET not in logged
    finally:
        inside.close()
        redirector.close()


def test_a_webhook_answer_is_read_only_up_to_the_bound():
    from testflinger_magic import webhooks

    big = Receiver(big=8 * 1024 * 1024)
    try:
        status, read = webhooks.post_json(big.url + "/h", {"kind": "k"},
                                          webhooks.AllowList.parse(["127.0.0.1"]), timeout=10)
        assert status == 200 and read <= webhooks.MAX_RESPONSE_BYTES
        with pytest.raises(webhooks.Refused, match="loopback"):
            webhooks.post_json(big.url + "/h", {}, webhooks.AllowList.parse([]), timeout=10)
    finally:
        big.close()


# ---------------------------------------------------------------- 6. input that used to 500

def test_deeply_nested_yaml_is_a_clear_422(magic):
    text = "magic_queues:\n  q: " + "[" * 5000 + "]" * 5000 + "\n"
    r = requests.put(f"{magic.url}/v1/magic/queues", headers=magic.headers("admin"),
                     json={"yaml": text, "source": "deep.yaml"}, timeout=30)
    assert r.status_code == 422, r.text[:300]
    (issue,) = r.json()["issues"]
    assert issue["file"] == "deep.yaml" and "nest" in issue["message"]


def test_a_heartbeat_names_only_its_own_hosts_leases(magic):
    """TRIAL19 F5: a heartbeat could list another host's lease, and GET /agent-hosts showed
    that host as working on it."""
    a, b = token(magic, "a-client"), token(magic, "b-client")
    assert post(magic, "/agent-hosts/host-a", a, {"devices": DEVICES[:1]}).status_code == 200
    assert post(magic, "/agent-hosts/host-b", b, {"devices": DEVICES[1:]}).status_code == 200
    r = post(magic, "/leases", magic.headers("admin"),
             {"device": "gpu-host-01", "queue": "one-gpu-vm", "reason": "t"})
    assert r.status_code == 201, r.text
    lease = r.json()["_id"]
    assert post(magic, "/agent-hosts/host-b/heartbeat", b,
                {"leases": [lease, "lease-nope"]}).status_code == 200
    assert post(magic, "/agent-hosts/host-a/heartbeat", a, {"leases": [lease]}).status_code == 200
    hosts = {h["_id"]: h for h in requests.get(f"{magic.url}/v1/magic/agent-hosts",
                                               headers=magic.headers("admin"),
                                               timeout=10).json()["agent_hosts"]}
    assert hosts["host-b"]["working_on"] == [] and hosts["host-a"]["working_on"] == [lease]
