"""One daemon per agent host across machines (server/hostinstance.py), over real HTTP: the
``instance`` of register and heartbeat is a compare-and-set on the agent host document. The
same instance is accepted at once (a daemon killed and restarted on its machine); another is
refused with 409 naming the holder while the holder heartbeats, and accepted once the holder is
stale (the engine's clock moved past reconcile.STALE_HOST_AFTER), recording
``agent_host.instance_changed``; a daemon that sends no instance (older) is accepted as before
and changes nothing."""

from __future__ import annotations

import pytest
import requests

from conftest import MagicStack
from test_server_api import DEVICES
from testflinger_magic import reconcile as R

A = "lab-07/3d1219c7c4c5:/var/lib/testflinger-magic"
B = "lab-12/9f00aa11bb22:/var/lib/testflinger-magic"


class Clock:
    """The engine's settable clock (epoch seconds)."""

    def __init__(self, t: float = 1_800_000_000.0):
        self.t = t

    def __call__(self) -> float:
        return self.t


@pytest.fixture
def stack(mongo, serve):
    clock = Clock()
    s = MagicStack(mongo, serve, clock=clock)
    s.clock = clock
    yield s
    s.plugin.stop()


def register(m, instance=None, host="host-a", devices=DEVICES):
    body = {"devices": devices, "version": "0.1"}
    if instance is not None:
        body["instance"] = instance
    return requests.post(f"{m.url}/v1/magic/agent-hosts/{host}", headers=m.headers("agent"),
                         json=body, timeout=10)


def heartbeat(m, instance=None, host="host-a", leases=()):
    body = {"leases": list(leases)}
    if instance is not None:
        body["instance"] = instance
    return requests.post(f"{m.url}/v1/magic/agent-hosts/{host}/heartbeat",
                         headers=m.headers("agent"), json=body, timeout=10)


def host_doc(m, host="host-a") -> dict:
    return m.db.magic_agent_hosts.find_one({"_id": host})


def changes(m) -> list[dict]:
    return [e for e in m.plugin.events.list() if e["kind"] == "agent_host.instance_changed"]


def test_the_same_instance_is_accepted_again_at_once(stack):
    """A daemon killed with kill -9 and started again on its machine sends the same instance:
    its register and heartbeats are accepted at once; ``instance_since`` stays its first."""
    assert register(stack, A).status_code == 200
    doc = host_doc(stack)
    assert (doc["instance"], doc["instance_since"]) == (A, stack.clock.t)
    first = stack.clock.t
    stack.clock.t += 5
    r = register(stack, A)
    assert r.status_code == 200, r.text
    assert heartbeat(stack, A, leases=["l1"]).status_code == 200
    doc = host_doc(stack)
    # "l1" is no lease of this host's devices: not kept as working on (TRIAL19 F5).
    assert (doc["instance"], doc["instance_since"], doc["last_heartbeat"], doc["working_on"]) \
        == (A, first, stack.clock.t, [])
    assert changes(stack) == []
    r = requests.get(f"{stack.url}/v1/magic/agent-hosts", headers=stack.headers("admin"),
                     timeout=10)
    (listed,) = r.json()["agent_hosts"]
    assert (listed["instance"], listed["instance_since"]) == (A, first)


def test_another_instance_is_refused_while_the_holder_heartbeats(stack):
    """Daemon B (another machine) registers the host daemon A runs: 409 naming the host, A,
    how long ago A heartbeated and what to do; nothing written (not its heartbeat, not its
    devices); its heartbeats are refused the same way."""
    assert register(stack, A).status_code == 200
    stack.clock.t += 30
    assert heartbeat(stack, A).status_code == 200
    stack.clock.t += 40
    before = host_doc(stack)
    r = register(stack, B, devices=DEVICES[:1])
    assert r.status_code == 409, r.text
    body = r.json()
    message = body["message"]
    assert message.startswith(f"agent host host-a is run by another daemon instance '{A}' "
                              "(last heartbeat 40s ago), not this one"), message
    assert B in message and "Stop one of them" in message, message
    assert f"older than {R.STALE_HOST_AFTER:.0f}s" in message, message
    assert body["instance_conflict"] == {
        "agent_host": "host-a", "instance": A, "last_heartbeat": stack.clock.t - 40,
        "silent_for": 40.0, "stale_after": R.STALE_HOST_AFTER, "caller": B}
    assert host_doc(stack) == before  # the device list too: gpu-host-02 still registered
    assert stack.db.magic_devices.count_documents({"agent_host": "host-a"}) == 2
    r = heartbeat(stack, B)
    assert r.status_code == 409 and f"'{A}'" in r.json()["message"], r.text
    assert host_doc(stack) == before
    # Just at the threshold A still counts as alive (reconcile.stale_hosts: older than it).
    stack.clock.t += R.STALE_HOST_AFTER - 40
    assert register(stack, B).status_code == 409
    assert changes(stack) == []


def test_another_instance_takes_over_a_stale_holder_and_the_holder_is_then_refused(stack):
    """A's machine was swapped: once A's last heartbeat is older than the stale threshold, B is
    accepted (``instance_changed`` event naming both); A coming back is refused by B's
    fresh heartbeats."""
    assert register(stack, A).status_code == 200
    stack.clock.t += R.STALE_HOST_AFTER + 1
    # status names the silent instance: the machine to look at.
    r = requests.get(f"{stack.url}/v1/magic/status", headers=stack.headers("admin"), timeout=10)
    (stale,) = r.json()["stale_agent_hosts"]
    assert (stale["name"], stale["instance"]) == ("host-a", A)
    r = register(stack, B)
    assert r.status_code == 200, r.text
    doc = host_doc(stack)
    assert (doc["instance"], doc["instance_since"], doc["last_heartbeat"]) == \
        (B, stack.clock.t, stack.clock.t)
    (event,) = changes(stack)
    assert event["message"] == (f"agent host host-a: daemon instance '{B}' took over from "
                                f"'{A}' (silent for {R.STALE_HOST_AFTER + 1:.0f}s, past the "
                                f"{R.STALE_HOST_AFTER:.0f}s stale threshold)")
    assert event["data"]["previous_instance"] == A and event["data"]["instance"] == B
    stack.clock.t += 10
    r = heartbeat(stack, A)
    assert r.status_code == 409 and f"'{B}'" in r.json()["message"], r.text
    assert host_doc(stack)["instance"] == B
    # A heartbeat (not only a register) takes a stale host over too: B goes silent, A is back.
    stack.clock.t += R.STALE_HOST_AFTER + 1
    assert heartbeat(stack, A).status_code == 200
    assert host_doc(stack)["instance"] == A and len(changes(stack)) == 2


def test_a_daemon_without_an_instance_is_accepted_and_changes_nothing(stack):
    """An older daemon sends no instance: accepted as before (register and heartbeat), and the
    instance a newer daemon left stays; a first registration without one stores none."""
    assert register(stack, host="host-b", devices=DEVICES[1:]).status_code == 200
    assert "instance" not in host_doc(stack, "host-b")
    assert register(stack, A, devices=DEVICES[:1]).status_code == 200
    stack.clock.t += 10
    assert register(stack, devices=DEVICES[:1]).status_code == 200
    assert heartbeat(stack).status_code == 200
    doc = host_doc(stack)
    assert (doc["instance"], doc["last_heartbeat"]) == (A, stack.clock.t)
    # A host first registered by an older daemon is taken by the first that says one.
    assert register(stack, B, host="host-b", devices=DEVICES[1:]).status_code == 200
    assert host_doc(stack, "host-b")["instance"] == B and changes(stack) == []


def test_an_instance_too_long_or_empty_is_refused_naming_the_field(stack):
    for bad in ("", "x" * 301):
        r = register(stack, bad)
        assert r.status_code == 422 and "instance" in r.json()["detail"]["json"], r.text
        r = heartbeat(stack, bad)
        assert r.status_code == 422 and "instance" in r.json()["detail"]["json"], r.text
    assert stack.db.magic_agent_hosts.count_documents({}) == 0


def test_a_new_host_registered_meanwhile_by_another_instance_is_a_conflict(stack, monkeypatch):
    """Two daemons registering a new host at once: the one whose read saw no document loses
    at its upsert (the other's document matches neither its instance nor none), 409."""
    from testflinger_magic.server import hostinstance

    real_take = hostinstance.take

    def racing_take(db, host, caller, now, fields, **kw):
        found = real_take(db, host, caller, now, fields, **kw)
        if caller == B and found is None:  # B read no document; A's lands now
            db.magic_agent_hosts.insert_one({"_id": host, "instance": A, "last_heartbeat": now,
                                             "devices": []})
        return found

    monkeypatch.setattr(hostinstance, "take", racing_take)
    r = register(stack, B)
    assert r.status_code == 409, r.text
    assert "just registered by another daemon instance" in r.json()["message"]
    assert host_doc(stack)["instance"] == A
