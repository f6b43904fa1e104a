"""``exclude_agents`` on a magic queue inside the REAL Testflinger server (TRIAL3 #13).

Skipped where the Testflinger server package is not installed (see test_real_testflinger.py,
whose :class:`RealStack` this uses). Testflinger's own ``job_post`` makes the check
(``database.get_agents_on_queue``); the plugin (server/excludes.py) wraps that function so the
queue's future VM agents count, and refuses a job every possible VM agent is excluded from.
"""

from __future__ import annotations

import pytest
import requests

pytest.importorskip("testflinger.application")

from test_real_testflinger import RealStack  # noqa: E402

from testflinger_magic.server import excludes  # noqa: E402


@pytest.fixture
def real(monkeypatch, serve):
    stack = RealStack(monkeypatch, serve)
    yield stack
    stack.plugin.stop()


def submit(real, exclude, queue="one-gpu-vm"):
    return requests.post(f"{real.url}/v1/job", headers=real.headers("dev"),
                         json={"job_queue": queue, "exclude_agents": exclude}, timeout=10)


def test_real_job_post_counts_the_future_vm_agents(real):
    from testflinger import database

    # Testflinger's own check, with the wrapper's help undone: the finding's 422.
    wrapped = database.get_agents_on_queue
    assert getattr(wrapped, "_magic_excludes", False)
    real.register()
    try:
        database.get_agents_on_queue = wrapped.__wrapped__
        r = submit(real, ["some-flaky-agent"])
        assert r.status_code == 422 and excludes.TF_MESSAGE in r.json()["message"]
    finally:
        database.get_agents_on_queue = wrapped
    r = submit(real, ["some-flaky-agent"])
    assert r.status_code == 200, r.text
    job = real.db.jobs.find_one({"job_id": r.json()["job_id"]})
    assert job["job_data"]["exclude_agents"] == ["some-flaky-agent"]
    # Every VM the one registered device (2 GPUs, 1 GPU per VM) can have: refused.
    r = submit(real, ["gpu-host-01-vm1", "gpu-host-01-vm2"])
    assert r.status_code == 422 and r.json()["message"].startswith(excludes.TF_MESSAGE)
    # A plain queue keeps Testflinger's check exactly.
    r = submit(real, ["gpu-host-01", "gpu-host-02"], queue="gpu-hosts")
    assert r.status_code == 422 and r.json()["message"] == excludes.TF_MESSAGE
