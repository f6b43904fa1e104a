"""Config, journal and client of the agent-host daemon, without the lab."""

from __future__ import annotations

import os
import pwd
import shutil
import stat
from pathlib import Path

import pytest
from flask import Flask, jsonify, request

from testflinger_magic.agent_host import client as clientmod
from testflinger_magic.agent_host.config import ConfigError, load_file, load_text
from testflinger_magic.agent_host.journal import Journal
from testflinger_magic.agent_host.steps import StepError, plan_vms
from testflinger_magic.lab.httpserve import serve

EXAMPLE = os.path.join(os.path.dirname(__file__), "..", "examples", "agent-host.yaml")


def load_example(tmp_path):
    """examples/agent-host.yaml with its secret and key files created under ``tmp_path``."""
    for name in ("secret_key", "maas_api_key"):
        (tmp_path / name).write_text("a:b:c\n")
    (tmp_path / "id_ed25519.pub").write_text("ssh-ed25519 AAAA daemon\n")
    (tmp_path / "maas-rack-keys.pub").write_text("ssh-rsa AAAA root@maas-rack-1\n")
    text = open(EXAMPLE).read().replace("/var/snap/testflinger-magic-agent-host/common",
                                        str(tmp_path))
    return load_text(text, "agent-host.yaml")


def test_example_config_is_valid_once_its_secret_files_exist(tmp_path):
    cfg = load_example(tmp_path)
    assert cfg.device("gpu-host-02").supervisor_program == "gpu-host-02"
    assert cfg.timeouts.deploying == 45 * 60
    assert cfg.maas.rack_public_keys == ["ssh-rsa AAAA root@maas-rack-1"]
    assert cfg.maas.power_address_template == "qemu+ssh://ubuntu@{ip}/system"
    assert "a:b:c" not in repr(cfg) and cfg.secret_key.get_secret_value() == "a:b:c"


def test_config_errors_name_file_line_and_field(tmp_path):
    text = ("server_url: http://x\nclient_id: c\nsecret_key: s\nagent_host: h\n"
            "maas: {url: http://m, api_key: a:b:c}\nagent_configs_dir: /a\nstate_dir: /s\n"
            "devices:\n  - agent_name: d1\n    maas_system_id: x\n    gpus: -2\n"
            "poll_wait: 5q\n")
    with pytest.raises(ConfigError) as err:
        load_text(text, "ah.yaml")
    lines = str(err.value).splitlines()
    assert "ah.yaml:11: devices.0.gpus: Input should be greater than or equal to 0" in lines
    assert any(line.startswith("ah.yaml:12: poll_wait: not a duration") for line in lines)
    # The one duration limit (durations.MAX_DURATION) holds here too.
    with pytest.raises(ConfigError, match=r"ah.yaml:12: poll_wait: .*limit of 366d"):
        load_text(text.replace("poll_wait: 5q", "poll_wait: 99999999d").replace(
            "gpus: -2", "gpus: 2"), "ah.yaml")
    # A file that cannot be read has no line: "FILE: why", not "FILE:0: -: ..."
    with pytest.raises(ConfigError) as err:
        load_file(tmp_path / "missing.yaml")
    assert str(err.value) == f"{tmp_path / 'missing.yaml'}: no such file"
    with pytest.raises(ConfigError) as err:
        load_file(tmp_path)
    assert str(err.value) == f"{tmp_path}: is a directory, not an agent-host.yaml"


BASE = ("server_url: http://x\nclient_id: c\nsecret_key: s\nagent_host: h\n"
        "maas: {url: http://m, api_key: a:b:c}\nagent_configs_dir: /a\nstate_dir: /s\n"
        "devices:\n  - agent_name: d1\n    maas_system_id: x\n    gpus: 2\n")


def _issues(text: str) -> list[tuple]:
    with pytest.raises(ConfigError) as err:
        load_text(text, "ah.yaml")
    return err.value.issues


@pytest.mark.parametrize("line, field, start", [
    ("server_url: 127.0.0.1:38211", "server_url", "'127.0.0.1:38211' is not an http(s) URL"),
    ("server_url: ftp://x", "server_url", "'ftp://x' is not an http(s) URL"),
    ("server_url: http://", "server_url", "'http://' is not an http(s) URL"),
    ("agent_host: bad host/name", "agent_host", "'bad host/name': letters, digits"),
    ("heartbeat_interval: 0s", "heartbeat_interval", "must be more than 0s"),
    ("maas_poll: 0s", "maas_poll", "must be more than 0s"),
    # TRIAL13 F3: the sum's error named the file's first line and field "-".
    ("heartbeat_interval: 10m", "heartbeat_interval",
     "heartbeat_interval (600s) + poll_wait (30s) = 630s"),
    ("heartbeat_interval: 45s", "heartbeat_interval",
     "heartbeat_interval (45s) + poll_wait (30s) = 75s"),
    # TRIAL13 F3: accepted, then "MAAS ... unreachable: InvalidUrlClientError" at run time.
    ("maas: {url: maas.example.com:5240/MAAS, api_key: a:b:c}", "maas.url",
     "'maas.example.com:5240/MAAS' is not an http(s) URL"),
    # TRIAL13 F3: accepted; every deploy would overrun its deadline at once.
    ("timeouts: {deploying: 0}", "timeouts.deploying", "must be more than 0s"),
    ("timeouts: {active: 0s}", "timeouts.active", "must be more than 0s"),
])
def test_config_refuses_what_the_server_or_the_loop_cannot_use(line, field, start):
    """Trial finding 12: each was accepted, then failed at run time (an InvalidSchema traceback
    in a loop, a 404 at registration, a host reported stale, a busy loop)."""
    key = line.split(":")[0]
    text = "\n".join(l for l in BASE.splitlines() if not l.startswith(key + ":")) + "\n"
    (issue,) = _issues(text + line + "\n")
    assert issue[2] == field and issue[3].startswith(start), issue
    if field != "-":
        assert issue[1] == len(text.splitlines()) + 1, issue  # the line of the bad value


def test_config_unquoted_hex_vendor_id_is_told_to_be_quoted():
    """TRIAL13 F3: the advice was "write it in plain decimal digits", and 4318 would then be
    refused as "not a PCI vendor id like 0x10de"."""
    (issue,) = _issues(BASE + "splitter: {gpu_vendors: [0x1002]}\n")
    assert issue[1:3] == (12, "splitter.gpu_vendors.0"), issue
    assert 'quote it, "0x1002"' in issue[3] and "plain decimal" not in issue[3], issue
    assert load_text(BASE + 'splitter: {gpu_vendors: ["0x1002"]}\n').splitter.gpu_vendors \
        == ["0x1002"]


def test_config_maas_outage_zero_and_gpus_zero_stay_valid():
    """maas_outage 0 gives a restore up at its first MAAS failure (a choice, not a mistake); a
    device of 0 lendable GPUs can still serve a CPU-only queue (vm.gpus 0 with an integer
    vms_per_device: queues.MagicQueue.vms_for), so neither is refused."""
    cfg = load_text(BASE.replace("gpus: 2", "gpus: 0") + "timeouts: {maas_outage: 0}\n")
    assert cfg.timeouts.maas_outage == 0 and cfg.devices[0].gpus == 0


def test_config_gpus_bounds_are_the_servers():
    from testflinger_magic.agent_host.config import MAX_GPUS
    from testflinger_magic.server.api_hosts import DeviceIn

    (issue,) = _issues(BASE.replace("gpus: 2", f"gpus: {MAX_GPUS + 1}"))
    assert issue[1:3] == (11, "devices.0.gpus") and "less than or equal to 64" in issue[3]
    assert DeviceIn().validate({"agent_name": "d", "maas_system_id": "x", "gpus": MAX_GPUS}) \
        == {}
    assert "gpus" in DeviceIn().validate({"agent_name": "d", "maas_system_id": "x",
                                          "gpus": MAX_GPUS + 1})


def test_config_repeated_device_names_and_system_ids_name_the_line_and_field():
    text = BASE + ("  - agent_name: d2\n    maas_system_id: x\n    gpus: 2\n"
                   "  - agent_name: d1\n    maas_system_id: y\n    gpus: 2\n")
    issues = _issues(text)
    assert ("ah.yaml", 15, "devices.2.agent_name",
            "'d1' is already devices.0.agent_name (line 9): each device needs its own "
            "agent_name") in issues, issues
    assert ("ah.yaml", 13, "devices.1.maas_system_id",
            "'x' is already devices.0.maas_system_id (line 10): each device needs its own "
            "maas_system_id") in issues, issues
    assert len(issues) == 2, issues


def test_config_refuses_a_duplicated_key_like_the_queue_files():
    """PyYAML keeps the last of two equal keys: the first gpus would be silently ignored."""
    with pytest.raises(ConfigError) as err:
        load_text(BASE + "    gpus: 4\n", "ah.yaml")
    (issue,) = err.value.issues
    assert issue[:3] == ("ah.yaml", 12, "devices.0.gpus")
    assert "duplicated key 'gpus' (first on line 11)" in issue[3]


def test_config_deep_nesting_is_a_clear_error_not_a_recursion_error():
    with pytest.raises(ConfigError) as err:
        load_text(BASE + "tags_extra: " + "[" * 5000 + "]" * 5000 + "\n", "ah.yaml")
    (issue,) = err.value.issues
    assert issue[0] == "ah.yaml" and issue[1] == 12 and "nested deeper than" in issue[3]


def test_config_syntax_error_keeps_its_line_and_prefix():
    with pytest.raises(ConfigError) as err:
        load_text(BASE + "poll_wait: [5\n", "ah.yaml")
    (issue,) = err.value.issues
    assert issue[0] == "ah.yaml" and issue[1] >= 12 and issue[3].startswith("not valid YAML:")


def test_config_alias_bomb_is_refused():
    bomb = "a: &a [x, x, x, x, x, x, x, x, x, x]\n" + "".join(
        f"{c}: &{c} [*{p}, *{p}, *{p}, *{p}, *{p}, *{p}, *{p}, *{p}, *{p}, *{p}]\n"
        for p, c in zip("abcdefgh", "bcdefghi"))
    with pytest.raises(ConfigError, match="expand to more than"):
        load_text(bomb, "ah.yaml")


def test_restore_retries_back_off_on_a_maas_conflict_within_a_bound(tmp_path):
    """TRIAL13 F14: a 409 (MaasConflict) was retried at once, RESTORE_ATTEMPTS times in 0.3 s.
    Now it waits maas_poll doubling up to MAAS_BACKOFF_MAX, CONFLICT_ATTEMPTS tries at most."""
    from testflinger_magic.agent_host.maas import MaasConflict
    from testflinger_magic.agent_host.restoretries import (
        CONFLICT_ATTEMPTS, MAAS_BACKOFF_MAX, RESTORE_ATTEMPTS, conflict_of, next_try)
    from testflinger_magic.agent_host.steps import StepError

    try:
        try:
            raise MaasConflict("release x -> HTTP 409: Cannot release node because it is locked.")
        except MaasConflict as inner:
            raise StepError("restoring: wrapped") from inner
    except StepError as outer:
        assert isinstance(conflict_of(outer), MaasConflict)
    assert conflict_of(StepError("other")) is None

    j = Journal(tmp_path, "lease-1", "dev")
    delays = []
    for i in range(CONFLICT_ATTEMPTS):
        v = next_try(j, "restoring: MaasConflict: 409", 0.1, False, 10.0, 86400.0,
                     now=1000.0 + i, conflict=True)
        if not v.retried:
            break
        delays.append(v.delay)
        assert v.note.startswith("MAAS refused the restore (HTTP 409)"), v.note
    assert not v.retried and f"given up after {CONFLICT_ATTEMPTS} tries" in v.message, v
    assert CONFLICT_ATTEMPTS > RESTORE_ATTEMPTS
    assert delays == [10.0, 20.0, 40.0] + [MAAS_BACKOFF_MAX] * (CONFLICT_ATTEMPTS - 4)
    assert sum(delays) >= 120  # a machine locked for a minute or two does not fail the lease
    # Other failures keep their own count and are still tried at once.
    v = next_try(Journal(tmp_path, "lease-2", "dev"), "x", 0.1, False, 10.0, 86400.0)
    assert v.retried and v.delay == 0.0


def test_journal_is_private_atomic_and_survives_reopen(tmp_path):
    j = Journal(tmp_path, "lease-1", "dev")
    with j.effect("maas.create", "dev-vm1", {"mac": "m"}) as rec:
        rec["system_id"] = "abc"
    j.begin("agent.add", "dev-vm1", {"port": 8001})
    path = tmp_path / "leases" / "lease-1.json"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    again = Journal(tmp_path, "lease-1")
    assert again.last_data("maas.create", "dev-vm1") == {"mac": "m", "system_id": "abc"}
    assert [e["phase"] for e in again.unsent()] == ["begin", "done", "begin"]
    again.mark_sent(2)
    assert [e["action"] for e in Journal(tmp_path, "lease-1").unsent()] == ["agent.add"]


def test_plan_vms_uses_server_names_and_refuses_too_few_gpus():
    lease = {"_id": "lease-x", "device": "d", "spec": {"gpus_per_vm": 2, "vcpus": 4},
             "vms": [{"index": 0, "name": "d-vm1", "mac": "52:54:00:00:00:01", "disk": "/p/1"}]}
    plans = plan_vms(lease, 2)
    assert [(p["name"], p["mac"], p["disk_path"], p["gpu_count"]) for p in plans] == [
        ("d-vm1", "52:54:00:00:00:01", "/p/1", 2)]
    with pytest.raises(StepError, match="need 2 GPUs; the device has 1"):
        plan_vms(lease, 1)


@pytest.fixture
def fake_server():
    """A token endpoint that expires the first token once, and a report that answers 409."""
    app = Flask(__name__)
    state = {"tokens": 0, "refused": False}

    @app.post("/v1/oauth2/token")
    def token():
        assert request.authorization.username == "cid"
        state["tokens"] += 1
        return {"access_token": f"t{state['tokens']}", "refresh_token": "r"}

    @app.post("/v1/magic/agent-hosts/<host>/heartbeat")
    def heartbeat(host):
        if request.headers["Authorization"] == "Bearer t1" and not state["refused"]:
            state["refused"] = True
            return "expired", 401
        return {}

    @app.post("/v1/magic/leases/<lid>/report")
    def report(lid):
        return jsonify(message="stale", lease={"_id": lid, "state": "restoring"}), 409

    with serve(app) as handle:
        yield handle.url, state


def test_client_refreshes_token_once_and_maps_409(fake_server):
    url, state = fake_server
    c = clientmod.MagicClient(url, "cid", "secret")
    assert c.heartbeat("h", []) == {}
    assert state["tokens"] == 2
    with pytest.raises(clientmod.StaleLease) as err:
        c.report("lease-1", {})
    assert err.value.lease["state"] == "restoring"


def test_client_unreachable_server_is_a_clear_error():
    c = clientmod.MagicClient("http://127.0.0.1:9", "cid", "s", retries=1, backoff=0.01)
    with pytest.raises(clientmod.ServerError, match="unreachable after 2 attempts"):
        c.work("h")


def test_plan_vms_refuses_a_lease_without_server_allocated_vms():
    # The daemon used to invent `<device>-vm0...` names and MACs here, disagreeing with the
    # server's `<device>-vm<N>` from 1 and its MAC uniqueness across hosts.
    with pytest.raises(StepError, match="no planned VMs"):
        plan_vms({"_id": "lease-x", "device": "d", "spec": {"gpus_per_vm": 1}, "vms": []}, 2)
    with pytest.raises(StepError, match="index 0 lack the name or MAC"):
        plan_vms({"_id": "lease-x", "device": "d", "vms": [{"index": 0, "name": "d-vm1"}]}, 2)


# -- the daemon's step runner, with a recording client and stand-in steps --------------------------
class _RecordingClient:
    def __init__(self, leases):
        self.leases, self.reports = leases, []

    def register(self, *args, **kwargs):
        return {}

    def work(self, host, wait, known=None):
        return self.leases

    def heartbeat(self, *args, **kwargs):
        self.beats = getattr(self, "beats", []) + [(args, kwargs)]
        return {}

    def report(self, lease_id, body):
        self.reports.append(body)
        return {"_id": lease_id, "state": body["state"]}


def _daemon(tmp_path, leases, **config):
    from testflinger_magic.agent_host.daemon import Daemon

    cfg = load_text(
        "server_url: http://127.0.0.1:9\nclient_id: x\nsecret_key: y\nagent_host: h\n"
        f"state_dir: {tmp_path}/state\nagent_configs_dir: {tmp_path}/agents\n"
        "maas: {url: 'http://127.0.0.1:9/MAAS/', api_key: 'a:b:c'}\n"
        "devices: [{agent_name: gpu-host-01, maas_system_id: s1, gpus: 2}]\n")
    cfg = cfg.model_copy(update=config)
    client = _RecordingClient(leases)
    return Daemon(cfg, maas=object(), splitter=object(), client=client), client


def test_corrupt_journal_is_reported_naming_the_file_and_moved_aside(tmp_path, monkeypatch):
    # Before: Journal() was built outside the try, so its error stayed in a Future nobody read:
    # no report, no log, the same silent failure at every poll.
    from testflinger_magic.agent_host import steps as steps_mod

    ran = []
    monkeypatch.setitem(steps_mod.STEPS, "claimed",
                        lambda ctx: ran.append(ctx.journal.entries()) or
                        steps_mod.StepResult("fenced", "stopped"))
    lease = {"_id": "lease-abc", "device": "gpu-host-01", "state": "claimed", "generation": 0}
    daemon, client = _daemon(tmp_path, [lease])
    path = tmp_path / "state" / "leases" / "lease-abc.json"
    path.parent.mkdir(parents=True)
    path.write_text('{"entries": [')  # a torn write
    daemon.run_once(block=True)
    [report] = client.reports
    assert report["result"] == "error" and "CorruptJournal" in report["message"]
    assert str(path) in report["message"] and ".corrupt-" in report["message"]
    assert not path.exists() and ran == []
    [aside] = path.parent.glob("lease-abc.json.corrupt-*")
    assert aside.read_text() == '{"entries": ['
    # The next step starts a fresh journal.
    daemon._last_active_check.clear()
    daemon.run_once(block=True)
    assert ran == [[]] and client.reports[-1]["result"] == "ok"
    daemon._pool.shutdown()


def test_corrupt_journal_during_restore_is_a_retried_attempt(tmp_path, monkeypatch):
    from testflinger_magic.agent_host import steps as steps_mod

    monkeypatch.setitem(steps_mod.STEPS, "restoring",
                        lambda ctx: steps_mod.StepResult("returned", "restored"))
    lease = {"_id": "lease-abc", "device": "gpu-host-01", "state": "restoring", "generation": 7}
    daemon, client = _daemon(tmp_path, [lease])
    path = tmp_path / "state" / "leases" / "lease-abc.json"
    path.parent.mkdir(parents=True)
    path.write_text("[]")  # valid JSON, not a journal
    daemon.run_once(block=True)
    assert client.reports[0]["result"] == "progress"  # not "error", which would mean failed
    assert "retrying" in client.reports[0]["message"] and str(path) in client.reports[0]["message"]
    daemon.run_once(block=True)
    assert client.reports[1]["result"] == "ok" and client.reports[1]["to_state"] == "returned"
    daemon._pool.shutdown()


def test_an_overdue_restore_is_not_reported_from_the_side(tmp_path, monkeypatch):
    # Before: _check_timeouts reported the running restore as an error (the server made the
    # lease failed at once, no retries); the restore then succeeded and its ok got a 409.
    import threading

    from testflinger_magic.agent_host import steps as steps_mod

    release = threading.Event()
    started = threading.Event()

    def slow_restore(ctx):
        started.set()
        release.wait()
        return steps_mod.StepResult("returned", "restored")

    monkeypatch.setitem(steps_mod.STEPS, "restoring", slow_restore)
    lease = {"_id": "lease-abc", "device": "gpu-host-01", "state": "restoring", "generation": 3}
    daemon, client = _daemon(tmp_path, [lease])
    daemon.run_once()
    started.wait()
    # Make the step overdue without waiting: pretend it was started long ago.
    future, t0, state, generation = daemon._inflight["lease-abc"]
    daemon._inflight["lease-abc"] = (future, t0 - 10 * daemon.config.timeouts.restoring, state,
                                     generation)
    daemon._check_timeouts()
    assert client.reports == []
    release.set()
    daemon.wait_idle()
    assert [(r["result"], r.get("to_state")) for r in client.reports] == [("ok", "returned")]
    daemon._pool.shutdown()


def test_an_overdue_bringup_step_is_still_reported(tmp_path, monkeypatch):
    import threading

    from testflinger_magic.agent_host import steps as steps_mod

    release = threading.Event()
    monkeypatch.setitem(steps_mod.STEPS, "deploying",
                        lambda ctx: release.wait() and steps_mod.StepResult("splitting", "ok"))
    lease = {"_id": "lease-abc", "device": "gpu-host-01", "state": "deploying", "generation": 2}
    daemon, client = _daemon(tmp_path, [lease])
    daemon.run_once()
    future, t0, state, generation = daemon._inflight["lease-abc"]
    daemon._inflight["lease-abc"] = (future, t0 - 10 * daemon.config.timeouts.deploying, state,
                                     generation)
    daemon._check_timeouts()
    assert [r["result"] for r in client.reports] == ["error"]
    assert "timed out" in client.reports[0]["message"]
    release.set()
    daemon.wait_idle()
    daemon._pool.shutdown()


class _FakeClock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


class _SlowMaas:
    """MAAS whose waits use all the time they are given (on a fake clock), then succeed."""

    def __init__(self, clock, status):
        self.clock, self.status, self.waits = clock, status, []

    def machine(self, sid):
        from testflinger_magic.agent_host.maas import MachineInfo

        return MachineInfo(sid, "gpu-host-01", self.status, ("10.0.0.5",), "ipmi")

    def wait_for(self, sid, want, fail, timeout, poll, should_stop=None):
        self.waits.append((sorted(want), timeout))
        self.clock.now += timeout
        self.status = sorted(want)[0]
        return self.machine(sid)

    def release(self, sid):
        self.status = "Releasing"

    def find_by_hostname(self, name):
        return None


class _IdleAgents:
    def programs(self, prefix=""):
        return []

    def remove_vm_agent(self, name):
        pass

    def state(self, program):
        return "RUNNING"


def test_restore_waits_share_one_deadline(tmp_path):
    # Before: each MAAS wait in restore got the whole timeouts.restoring, so a restore could take
    # a multiple of it. Now the second wait gets what the first left, and none is left here.
    from testflinger_magic.agent_host import steps as steps_mod

    daemon, _client = _daemon(tmp_path, [])
    clock = _FakeClock()
    maas = _SlowMaas(clock, "Deploying")
    drivers = steps_mod.Drivers(maas=maas, splitter=None, agents=_IdleAgents())
    lease = {"_id": "lease-abc", "device": "gpu-host-01", "state": "restoring", "vms": []}
    journal = Journal(tmp_path / "state", "lease-abc")
    # A split began (the restore waits for a deploy still running only then: teardown.py).
    journal.done("libvirt.split", "lease-abc", {})
    ctx = steps_mod.StepContext(daemon.config, drivers, daemon.config.device("gpu-host-01"), lease,
                                journal, clock=clock)
    with pytest.raises(StepError, match=r"time limit \(3600s, timeouts.restoring\) used up "
                                        r"before waiting for MAAS machine s1 to be Ready"):
        steps_mod.restore(ctx)
    assert maas.waits == [(["Deployed"], 3600.0)]
    daemon._pool.shutdown()


def test_vm_agents_run_as_the_charm_runs_its_agents(tmp_path):
    """Issue 7 item 9: the agent-host charm's supervisord template runs each agent as ``ubuntu``
    with ``HOME=/home/ubuntu`` (TESTFLINGER.md §6.2), and its tf-* scripts read
    ``/srv/agent-configs/<config-dir>/$agent_id/default.yaml`` (§6.5)."""
    from testflinger_magic.agent_host.agents import AgentProcessError, program_conf_text
    from testflinger_magic.agent_host.daemon import default_drivers

    cfg = load_example(tmp_path)
    assert cfg.supervisor.program_user == "ubuntu"
    parts = cfg.agent_configs_dir.split("/")
    assert parts[:3] == ["", "srv", "agent-configs"] and len(parts) == 4 and parts[3]
    drivers = default_drivers(cfg, maas=object(), splitter=object())
    assert drivers.agents.user == "ubuntu"
    conf = program_conf_text("gpu-host-01-vm1", "agent -p 8001", drivers.agents.user)
    assert "user=ubuntu" in conf.splitlines()
    assert 'HOME="/home/ubuntu"' in conf and 'USER="ubuntu"' in conf

    cfg.supervisor.program_user = "no-such-user-tfm"
    agents = default_drivers(cfg, maas=object(), splitter=object()).agents
    with pytest.raises(AgentProcessError, match="supervisor.program_user"):
        agents.add_vm_agent("gpu-host-01-vm1", tmp_path / "vm1", 8001)
    assert not (agents.conf_dir / "gpu-host-01-vm1.conf").exists()


def test_script_splitter_config_as_documented():
    """docs/script-splitter.md's agent-host.yaml form is accepted and reaches the splitter."""
    from testflinger_magic.agent_host.daemon import default_drivers

    doc = open(os.path.join(os.path.dirname(__file__), "..", "docs", "script-splitter.md")).read()
    assert "splitter: {kind: script, command: [/usr/local/bin/lab-split], timeout: 30m}" in doc
    text = ("server_url: http://x\nclient_id: c\nsecret_key: s\nagent_host: h\n"
            f"maas: {{url: http://m, api_key: a:b:c}}\nagent_configs_dir: /a\nstate_dir: /s\n"
            "splitter: {kind: script, command: [/usr/local/bin/lab-split], timeout: 30m}\n")
    cfg = load_text(text, "ah.yaml")
    assert cfg.splitter.timeout == 1800.0
    splitter = default_drivers(cfg, maas=object(), agents=object()).splitter
    assert splitter.timeout == 1800.0 and splitter.command == ["/usr/local/bin/lab-split"]


@pytest.mark.skipif(os.geteuid() != 0, reason="chown to another user needs root (CI runs as root)")
def test_vm_agent_folders_are_readable_by_the_program_user(tmp_path):
    """The snap's daemon runs as root and renders VM agent folders 0750 with 0600 files (they
    may carry credentials); supervisord runs the agent as ``supervisor.program_user`` (the
    charm's ``ubuntu``, TESTFLINGER.md §6.2). The folder and its files must be that user's, or
    the agent cannot read its own config (and a pre-warmed one cannot see its go file)."""
    import subprocess
    import tempfile

    from testflinger_magic.agent_host.agents import AgentConfigError
    from testflinger_magic.agent_host.daemon import default_drivers, folder_owner
    from tests.test_agents import TEMPLATE, context

    cfg = load_example(tmp_path)
    cfg.supervisor.program_user = "nobody"
    render = default_drivers(cfg, maas=object(), splitter=object(),
                             agents=object()).render_agent_folder
    base = Path(tempfile.mkdtemp(prefix="tfm-owner-"))  # enterable by nobody, unlike tmp_path
    try:
        base.chmod(0o755)
        dest = render(TEMPLATE, base / "gpu-01-vm0", context())
        nobody = pwd.getpwnam("nobody")
        assert (dest.stat().st_uid, dest.stat().st_mode & 0o777) == (nobody.pw_uid, 0o750)
        conf = dest / "testflinger-agent.conf"
        assert conf.stat().st_uid == nobody.pw_uid and conf.stat().st_mode & 0o777 == 0o600
        read = subprocess.run(["cat", str(conf)], user="nobody", capture_output=True, text=True)
        assert read.returncode == 0 and 'agent_id: "gpu-01-vm0"' in read.stdout

        assert folder_owner(None) is None and folder_owner("root") is None
        cfg.supervisor.program_user = "no-such-user-tfm"
        render = default_drivers(cfg, maas=object(), splitter=object(),
                                 agents=object()).render_agent_folder
        with pytest.raises(AgentConfigError, match="no-such-user-tfm.*supervisor.program_user"):
            render(TEMPLATE, base / "gpu-01-vm1", context(agent_id="gpu-01-vm1"))
        assert not (base / "gpu-01-vm1").exists()
    finally:
        shutil.rmtree(base)


def test_client_leaves_out_optional_fields_an_older_server_refuses():
    """An agent host upgraded before its server: the older server's schemas (marshmallow, as
    the plugin's api.py) refuse ``templates`` at registration and ``maas_unreachable_since`` in
    a heartbeat as unknown fields (422), and both refuse ``instance`` (the daemon's instance
    id, server/hostinstance.py). The daemon must still register and heartbeat: it resends once
    without them and stops sending them; a 422 about a required field stays an error."""
    from apiflask import APIFlask, Schema
    from apiflask.fields import Float, List, String

    class OldRegisterIn(Schema):  # api_hosts.RegisterIn before the templates field
        devices = List(String(), required=True)
        version = String()

    class OldHeartbeatIn(Schema):  # api_hosts.HeartbeatIn before maas_unreachable_since
        leases = List(String(), required=True)

    app = APIFlask(__name__)
    seen = []

    @app.post("/v1/oauth2/token")
    def token():
        return {"access_token": "t", "refresh_token": "r"}

    @app.post("/v1/magic/agent-hosts/<host>")
    @app.input(OldRegisterIn, location="json")
    def register(host, json_data):
        seen.append(("register", sorted(json_data)))
        return {"agent_host": host, "devices": json_data["devices"]}

    @app.post("/v1/magic/agent-hosts/<host>/heartbeat")
    @app.input(OldHeartbeatIn, location="json")
    def heartbeat(host, json_data):
        seen.append(("heartbeat", sorted(json_data)))
        return {}

    with serve(app) as handle:
        c = clientmod.MagicClient(handle.url, "cid", "secret")
        assert c.register("h", ["d1"], templates=["maas2-vm"], instance="m/abc:/s") == \
            {"agent_host": "h", "devices": ["d1"]}
        assert c.heartbeat("h", ["l1"], maas_unreachable_since=1.0, instance="m/abc:/s") == {}
        assert c.heartbeat("h", ["l1"], maas_unreachable_since=2.0, instance="m/abc:/s") == {}
        with pytest.raises(clientmod.ServerError, match="HTTP 422.*devices"):
            c._body(c._post_optional("/v1/magic/agent-hosts/h", {"version": "x"}, ("templates",)),
                    "register h")
    # One refused try each, then never sent again to this server.
    assert seen == [("register", ["devices", "version"]), ("heartbeat", ["leases"]),
                    ("heartbeat", ["leases"])]
    assert c._unknown == {"templates", "maas_unreachable_since", "instance"}


def test_client_reports_a_bring_up_quarantine_to_an_older_server_without_it():
    """A server before TRIAL5 finding 9 quarantines on a restore's error report only (422
    naming ``quarantine`` otherwise, server/hostproto.py): the daemon's bring-up error asking
    for quarantine is sent again without it (the failure still counts); a restore's is sent
    as is."""
    from apiflask import APIFlask
    from flask import request

    app = APIFlask(__name__)
    seen = []

    @app.post("/v1/oauth2/token")
    def token():
        return {"access_token": "t", "refresh_token": "r"}

    @app.post("/v1/magic/leases/<lease_id>/report")
    def report(lease_id):
        body = request.get_json()
        seen.append(sorted(body))
        if body.get("quarantine") and body["state"] != "restoring":
            return {"detail": {"json": {"quarantine": [
                "only an error report of a restore may quarantine"]}}}, 422
        return {"_id": lease_id, "state": "restoring"}

    with serve(app) as handle:
        c = clientmod.MagicClient(handle.url, "cid", "secret")
        base = {"agent_host": "h", "generation": 3, "result": "error", "message": "m",
                "quarantine": True}
        assert c.report("l1", {**base, "state": "splitting"})["state"] == "restoring"
        assert c.report("l1", {**base, "state": "restoring"})["state"] == "restoring"
    assert seen == [["agent_host", "generation", "message", "quarantine", "result", "state"],
                    ["agent_host", "generation", "message", "result", "state"],
                    ["agent_host", "generation", "message", "quarantine", "result", "state"]]
