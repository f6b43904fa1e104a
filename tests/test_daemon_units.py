"""Config, journal and client of the agent-host daemon, without the lab."""

from __future__ import annotations

import os
import stat

import pytest
from flask import Flask, jsonify, request

from testflinger_magic.agent_host import client as clientmod
from testflinger_magic.agent_host.config import ConfigError, load_file, load_text
from testflinger_magic.agent_host.journal import Journal
from testflinger_magic.agent_host.steps import StepError, plan_vms
from testflinger_magic.lab.httpserve import serve

EXAMPLE = os.path.join(os.path.dirname(__file__), "..", "examples", "agent-host.yaml")


def test_example_config_is_valid_once_its_secret_files_exist(tmp_path):
    for name in ("secret_key", "maas_api_key"):
        (tmp_path / name).write_text("a:b:c\n")
    (tmp_path / "id_ed25519.pub").write_text("ssh-ed25519 AAAA daemon\n")
    text = open(EXAMPLE).read().replace("/var/snap/testflinger-magic-agent-host/common",
                                        str(tmp_path))
    cfg = load_text(text, "agent-host.yaml")
    assert cfg.device("gpu-host-02").supervisor_program == "gpu-host-02"
    assert cfg.timeouts.deploying == 45 * 60
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
    with pytest.raises(ConfigError, match="cannot read"):
        load_file(tmp_path / "missing.yaml")


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
