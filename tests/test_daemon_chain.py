"""The daemon goes on with a lease's next bring-up step in the thread that reported the
transition (issue 9: no long-poll round trip and dispatch between steps), within the
``workers`` cap, and never after a refused report or once stopping."""

from __future__ import annotations

import threading

from testflinger_magic.agent_host import steps as steps_mod
from testflinger_magic.agent_host.config import load_text
from testflinger_magic.agent_host.daemon import Daemon


class _Server:
    """A recording client standing in for the server: every ``ok`` report moves the lease to
    its ``to_state`` at the next generation (as ``Engine.report`` does), unless ``refuse``."""

    def __init__(self, leases):
        self.leases = {d["_id"]: dict(d) for d in leases}
        self.reports, self.polls, self.refuse = [], 0, False
        self.lock = threading.Lock()

    def register(self, *args, **kwargs):
        return {}

    def heartbeat(self, *args, **kwargs):
        return {}

    def work(self, host, wait, known=None):
        with self.lock:
            self.polls += 1
            return [dict(d) for d in self.leases.values()]

    def report(self, lease_id, body):
        from testflinger_magic.agent_host.client import StaleLease

        with self.lock:
            lease = self.leases[lease_id]
            self.reports.append((lease_id, body["state"], body.get("to_state"),
                                 threading.get_ident()))
            if self.refuse:
                raise StaleLease("stale", dict(lease))
            if body["result"] == "ok":
                lease.update(state=body["to_state"], generation=lease["generation"] + 1)
            return dict(lease)


def _daemon(tmp_path, leases, devices=("gpu-host-01",), **config):
    text = ("server_url: http://127.0.0.1:9\nclient_id: x\nsecret_key: y\nagent_host: h\n"
            f"state_dir: {tmp_path}/state\nagent_configs_dir: {tmp_path}/agents\n"
            "maas: {url: 'http://127.0.0.1:9/MAAS/', api_key: 'a:b:c'}\ndevices:\n"
            + "".join(f"  - {{agent_name: {d}, maas_system_id: s{i}, gpus: 1}}\n"
                      for i, d in enumerate(devices)))
    cfg = load_text(text, "agent-host.yaml").model_copy(update=config)
    server = _Server(leases)
    return Daemon(cfg, maas=object(), splitter=object(), client=server), server


NEXT = {"claimed": "fenced", "fenced": "deploying", "deploying": "splitting",
        "splitting": "enrolling", "enrolling": "active"}


def _stand_in_steps(monkeypatch, ran, hold=None):
    """Every bring-up step a stand-in that records (lease id, state) and reports the next
    state; ``hold``: ``{(lease id, state): Event}`` a step waits for first."""
    for state, to in NEXT.items():
        def step(ctx, state=state, to=to):
            gate = (hold or {}).get((ctx.lease_id, state))
            if gate is not None:
                assert gate.wait(30)
            ran.append((ctx.lease_id, state))
            return steps_mod.StepResult(to, f"{state} done")
        monkeypatch.setitem(steps_mod.STEPS, state, step)


def test_an_accepted_transition_goes_on_with_the_next_step_in_the_same_thread(tmp_path,
                                                                               monkeypatch):
    ran = []
    _stand_in_steps(monkeypatch, ran)
    lease = {"_id": "lease-a", "device": "gpu-host-01", "state": "claimed", "generation": 0}
    daemon, server = _daemon(tmp_path, [lease])
    daemon.run_once(block=True)
    # One poll, one dispatch: the fence's thread went on through the whole bring-up, the
    # enrolment's transition to active ended it (active is not a bring-up state).
    assert server.polls == 1
    assert ran == [("lease-a", s) for s in NEXT]
    assert [(s, to) for _l, s, to, _t in server.reports] == list(NEXT.items())
    assert len({t for *_r, t in server.reports}) == 1
    daemon._pool.shutdown()


def test_a_refused_report_ends_the_thread(tmp_path, monkeypatch):
    ran = []
    _stand_in_steps(monkeypatch, ran)
    lease = {"_id": "lease-a", "device": "gpu-host-01", "state": "claimed", "generation": 0}
    daemon, server = _daemon(tmp_path, [lease])
    server.refuse = True
    daemon.run_once(block=True)
    assert ran == [("lease-a", "claimed")]
    assert [(s, to) for _l, s, to, _t in server.reports] == [("claimed", "fenced")]
    daemon._pool.shutdown()


def test_no_next_step_once_stopping(tmp_path, monkeypatch):
    ran = []
    _stand_in_steps(monkeypatch, ran)
    lease = {"_id": "lease-a", "device": "gpu-host-01", "state": "claimed", "generation": 0}
    daemon, server = _daemon(tmp_path, [lease])
    real_report = server.report

    def report_then_stop(lease_id, body):
        answer = real_report(lease_id, body)
        daemon.stop()
        return answer

    server.report = report_then_stop
    daemon.run_once(block=True)
    assert ran == [("lease-a", "claimed")]
    daemon._pool.shutdown()


def test_the_next_step_waits_for_the_poll_when_the_workers_cap_is_reached(tmp_path,
                                                                          monkeypatch):
    """workers=1: lease A holds the one bring-up slot (its deploy wait); lease B's fence
    reports ``fenced`` but its thread does not go on to the deploy. Once A's step ends, the
    poll loop dispatches B's deploy as any other step."""
    ran = []
    release_a = threading.Event()
    _stand_in_steps(monkeypatch, ran, hold={("lease-a", "deploying"): release_a})
    leases = [{"_id": "lease-a", "device": "gpu-host-01", "state": "deploying", "generation": 3},
              {"_id": "lease-b", "device": "gpu-host-02", "state": "claimed", "generation": 0}]
    daemon, server = _daemon(tmp_path, leases, devices=("gpu-host-01", "gpu-host-02"),
                             workers=1)
    try:
        daemon.run_once()
        # B's fence ran and reported; its thread ended without starting B's deploy.
        for _ in range(200):
            if ("lease-b", "claimed") in ran and "lease-b" not in daemon.in_flight():
                break
            threading.Event().wait(0.01)
        assert ("lease-b", "claimed") in ran and ("lease-b", "fenced") not in ran
        assert server.leases["lease-b"]["state"] == "fenced"
        release_a.set()
        daemon.wait_idle(30)  # A went on to the end of its bring-up, holding the slot
        assert ("lease-b", "fenced") not in ran
        daemon.run_once(block=True)  # the poll loop dispatches B's deploy; it goes on
        assert [s for lid, s in ran if lid == "lease-b"] == list(NEXT)
    finally:
        release_a.set()
        daemon._pool.shutdown()
