"""Magic queues against the devices the server knows, over real HTTP (trial 2026-12-02, items 4,
5, 8, 9, 16, 25): hand lends the selection refuses, names taken by devices, apply's warnings, a
removed queue that stops taking jobs and never strands one, owners submitting while lent."""

from __future__ import annotations

import pytest
import requests

from conftest import MAGIC_YAML, MagicStack
from testflinger_magic import cli
from testflinger_magic.lab.jobservice_auth import add_client

DEVICES = [
    {"agent_name": "gpu-host-01", "maas_system_id": "abc123", "gpus": 2, "tags": ["nvidia"],
     "home_queues": ["gpu-hosts"]},
    {"agent_name": "gpu-host-02", "maas_system_id": "def456", "gpus": 2, "tags": ["nvidia"],
     "home_queues": ["gpu-hosts"]},
]

TWO_QUEUES = MAGIC_YAML + """\
  two-gpu-vm:
    description: Two GPUs per VM, never gpu-host-02
    devices: {home_queues: [gpu-hosts], exclude: [gpu-host-02]}
    vm: {gpus: 2}
  nodevice:
    description: Selects a device nobody registered
    devices: {agents: [gpu-host-99]}
"""

ADMIN, SECRET = "ops-admin", "ops-secret-of-some-length"


@pytest.fixture
def stack(mongo, serve):
    """The plugin on the lab job service (Testflinger's auth: the CLI can log in as ADMIN)."""
    s = MagicStack(mongo, serve, yaml_text=TWO_QUEUES, server="old")
    add_client(mongo, ADMIN, SECRET, "admin")
    register(s)
    yield s
    s.plugin.stop()


def register(m, host="host-a", devices=DEVICES):
    r = requests.post(f"{m.url}/v1/magic/agent-hosts/{host}", headers=m.headers("agent"),
                      json={"devices": devices, "version": "0.1"}, timeout=10)
    assert r.status_code == 200, r.text
    return r


def run(m, *argv):
    return cli.main([*argv, "--server", m.url, "--client-id", ADMIN, "--secret-key", SECRET])


def lend(m, device, queue, **extra):
    return requests.post(f"{m.url}/v1/magic/leases", headers=m.headers("admin"),
                         json={"device": device, "queue": queue, **extra}, timeout=10)


# ----- 8: a hand lend honours the devices selection -----------------------------------------
def test_lend_refuses_an_excluded_or_unselected_device_unless_forced(stack, capsys):
    r = lend(stack, "gpu-host-02", "two-gpu-vm")
    assert r.status_code == 409
    assert "two-gpu-vm's devices.exclude lists gpu-host-02" in r.json()["message"]
    assert "--force" in r.json()["message"]
    r = lend(stack, "gpu-host-01", "nodevice")
    assert r.status_code == 409
    assert "nodevice's devices selection does not pick gpu-host-01" in r.json()["message"]
    assert stack.db.magic_leases.count_documents({}) == 0
    # The CLI says the same and exits 1.
    assert run(stack, "lend", "gpu-host-02", "two-gpu-vm") == 1
    assert "devices.exclude lists gpu-host-02" in capsys.readouterr().err
    assert stack.db.magic_leases.count_documents({}) == 0
    # --force lends it, and says what it overrode (answer and the lease's history).
    assert run(stack, "lend", "gpu-host-02", "two-gpu-vm", "--force") == 0
    out = capsys.readouterr().out
    assert "lent gpu-host-02 to two-gpu-vm" in out
    assert "forced: two-gpu-vm's devices.exclude lists gpu-host-02" in out
    lease = stack.db.magic_leases.find_one({"device": "gpu-host-02"})
    assert "forced" in lease["history"][0]["reason"]
    # A selected device needs no force, and its answer says nothing was forced.
    r = lend(stack, "gpu-host-01", "one-gpu-vm")
    assert r.status_code == 201 and "forced" not in r.json()
