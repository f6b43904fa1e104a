"""The agent-host daemon's poll loop (issue 9): a fence never waits behind bring-up steps in
long MAAS waits, and the long-poll carries ``known=`` so a report wakes it."""

from __future__ import annotations

import threading

from daemon_lab import DaemonLab
from test_daemon_stop import wait_until
from testflinger_magic.agent_host.daemon import Daemon


def test_a_fence_never_waits_behind_a_bringup_in_a_maas_wait(tmp_path):
    lab = DaemonLab(tmp_path, devices=("gpu-host-01", "gpu-host-02"))
    daemon = Daemon(lab.config(workers=1, poll_wait=5, timeouts={"deploying": "1h"}))
    loop = threading.Thread(target=daemon.run_forever, daemon=True)
    asked: list = []
    work = daemon.client.work

    def recording_work(host, wait=0, known=None):
        asked.append(known)
        return work(host, wait, known=known)

    daemon.client.work = recording_work
    try:
        lab.maas.delays["deploying"] = 3600.0  # the first lease waits in MAAS for an hour
        daemon.register()
        loop.start()
        first = lab.lend("gpu-host-01")
        wait_until(lambda: lab.lease(first)["state"] == "deploying"
                   and first in daemon.in_flight(), "the first lease waiting for MAAS Deployed")
        second = lab.lend("gpu-host-02")
        # workers=1 is busy with the first lease's deploy wait; the fence must not queue behind
        # it (before: one pool of `workers` threads, so it waited the whole deploy).
        wait_until(lambda: lab.lease(second)["state"] == "fenced", "the second lease fenced")
        assert lab.lease(first)["state"] == "deploying"
        assert lab.procs.state("gpu-host-02") == "STOPPED"
        # After its first answer the long-poll carries known= (the server answers when its set
        # of lease:generation differs, e.g. at a report), never None again on this happy path.
        assert asked[0] is None and all(k is not None for k in asked[1:]) and len(asked) > 1
    finally:
        daemon.stop()
        loop.join(30)
        lab.stop()


def test_by_default_every_device_brings_up_at_once(tmp_path):
    """``workers`` unset: no cap below the device count, so a second lease deploys while the
    first waits in MAAS (a cap of 1 would hold it at ``fenced`` for the whole deploy)."""
    lab = DaemonLab(tmp_path, devices=("gpu-host-01", "gpu-host-02"))
    config = lab.config(poll_wait=5, timeouts={"deploying": "1h"})
    assert config.workers is None
    daemon = Daemon(config)
    loop = threading.Thread(target=daemon.run_forever, daemon=True)
    try:
        lab.maas.delays["deploying"] = 3600.0
        daemon.register()
        loop.start()
        first = lab.lend("gpu-host-01")
        wait_until(lambda: lab.lease(first)["state"] == "deploying"
                   and first in daemon.in_flight(), "the first lease waiting for MAAS Deployed")
        second = lab.lend("gpu-host-02")
        wait_until(lambda: lab.lease(second)["state"] == "deploying"
                   and second in daemon.in_flight(), "the second lease deploying as well")
    finally:
        daemon.stop()
        loop.join(30)
        lab.stop()
