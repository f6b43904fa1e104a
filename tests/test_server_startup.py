"""Start-up definitions (``init_app(definitions=...)``, ``$TESTFLINGER_MAGIC_QUEUES``) are applied
when new or changed, not at every process start (server/startup.py).

Trial finding: every server start re-applied the start-up file over what the operator applied
since: a removed queue came back (its lease's removed-queue drain undone) and a changed
``idle_timeout`` fell back to the file's. A restart here is a new app and plugin (``init_app``)
on the same mongomock database, as a restarted replica or a recycled gunicorn worker."""

from __future__ import annotations

import requests

from conftest import MAGIC_YAML, mini_testflinger, seed
import test_server_queue_lifecycle as lifecycle
from test_server_queue_lifecycle import TWO_QUEUES, bring_up_with_a_busy_vm, register, run
from testflinger_magic import db as tfdb
from testflinger_magic import queues
from testflinger_magic.lab.jobservice import create_app
from testflinger_magic.server import init_app, startup

#: The removed-queue tests' fixture: the plugin on the lab job service, TWO_QUEUES applied at
#: start, host-a's two devices registered.
stack = lifecycle.stack


def restart(stack, serve, definitions):
    """Stop ``stack``'s plugin and mount a new one on a new app over the same database, with
    ``definitions`` as its start-up definitions, served at a new ``stack.url``; returns the new
    plugin."""
    stack.plugin.stop()
    app = create_app(stack.db, mount_plugin=False,
                     signing_key="test-signing-key-of-32-bytes-or-more!")
    stack.plugin = init_app(app, stack.db, definitions=definitions, start_ticker=False)
    stack.url = serve(app).url
    return stack.plugin


def applied_events(db, source):
    return [e["message"] for e in db.magic_events.find({"kind": "queue.applied"})
            if e["message"].endswith(f"from {source}")]


def test_a_restart_keeps_the_queues_an_operator_removed_and_changed_since(
        stack, serve, tmp_path):
    """The trial's case: apply removes one-gpu-vm (its lease drains, removed-queue drain) and
    changes two-gpu-vm's idle_timeout; a restart with the same start-up definitions keeps both:
    the queue stays removed, its lease keeps draining, the timeout stays the operator's."""
    lease, _ = bring_up_with_a_busy_vm(stack)
    path = tmp_path / "q.yaml"
    path.write_text(TWO_QUEUES.replace("  one-gpu-vm:", "  gone-vm:", 1).replace(
        "    vm: {gpus: 2}\n", "    vm: {gpus: 2}\n    policy: {idle_timeout: 30s}\n", 1))
    assert run(stack, "apply", str(path)) == 0
    stack.plugin.tick()
    assert stack.db.magic_leases.find_one({"_id": lease["_id"]})["drain"]["kind"] == "orphan"
    before = len(applied_events(stack.db, "init_app"))

    plugin = restart(stack, serve, queues.load_text(TWO_QUEUES))
    plugin.tick()

    assert stack.db.magic_queues.find_one({"_id": "one-gpu-vm"}) is None
    assert stack.db.magic_removed_queues.find_one({"_id": "one-gpu-vm"}) is not None
    assert plugin.definition("two-gpu-vm").policy.idle_timeout == 30
    doc = stack.db.magic_leases.find_one({"_id": lease["_id"]})
    assert (doc["state"], doc["drain"]["kind"]) == ("draining", "orphan"), doc
    assert len(applied_events(stack.db, "init_app")) == before  # nothing applied at start
    r = requests.get(f"{stack.url}/v1/magic/queues", headers=stack.headers("admin"), timeout=10)
    assert r.status_code == 200, r.text
    assert {q["_id"] for q in r.json()["queues"]} == {"gone-vm", "two-gpu-vm", "nodevice"}


def test_a_changed_start_up_file_is_applied_at_the_next_start(tmp_path):
    """The file applies when new; not again while unchanged (a comment or the layout is no
    change); a changed value is applied at the next start, over the operator's apply, and
    says so in the events with the file's path."""
    db = tfdb.connect()
    seed(db)
    path = tmp_path / "magic-queues.yaml"
    path.write_text(MAGIC_YAML)
    source = str(path.resolve())
    plugin = init_app(mini_testflinger(db), db, definitions=path, start_ticker=False)
    assert applied_events(db, source) == [f"one-gpu-vm: definition applied from {source}"]
    record = db.magic_startup.find_one({"_id": source})
    assert (record["state"], record["queues"]) == ("applied", ["one-gpu-vm"])
    edited = MAGIC_YAML.replace("idle_timeout: 10m", "idle_timeout: 2m")
    plugin.apply(queues.load_text(edited), source="ops.yaml")  # the operator's apply
    plugin.stop()

    path.write_text("# reformatted, same values\n" + MAGIC_YAML.replace("  ", "    "))
    plugin = init_app(mini_testflinger(db), db, definitions=path, start_ticker=False)
    assert plugin.definition("one-gpu-vm").policy.idle_timeout == 120  # the operator's
    assert len(applied_events(db, source)) == 1
    plugin.stop()

    path.write_text(MAGIC_YAML.replace("max_devices: 2", "max_devices: 3"))
    plugin = init_app(mini_testflinger(db), db, definitions=path, start_ticker=False)
    q = plugin.definition("one-gpu-vm")
    assert (q.policy.max_devices, q.policy.idle_timeout) == (3, 600)  # the file's, all of it
    assert len(applied_events(db, source)) == 2
    assert db.magic_queues.find_one({"_id": "one-gpu-vm"})["source"] == source
    plugin.stop()


def test_replicas_starting_with_the_same_file_apply_it_once(tmp_path):
    """Two replicas with the same start-up file: the second start applies nothing (one
    ``queue.applied`` event); and of two processes that read the record at the same moment,
    one claims the start-up apply (compare-and-set), the other does not."""
    db = tfdb.connect()
    seed(db)
    path = tmp_path / "magic-queues.yaml"
    path.write_text(MAGIC_YAML)
    source = str(path.resolve())
    plugins = [init_app(mini_testflinger(db), db, definitions=path, start_ticker=False)
               for _ in range(2)]
    assert len(applied_events(db, source)) == 1
    seen = db.magic_startup.find_one({"_id": source})
    wins = [startup.claim(db, source, "other-digest", seen, 1.0) for _ in range(2)]
    assert sorted(wins) == [False, True]
    fresh = tfdb.connect()
    assert [startup.claim(fresh, source, "d", None, 1.0) for _ in range(2)] == [True, False]
    for p in plugins:
        p.stop()


def test_a_start_up_apply_refused_is_tried_again_at_the_next_start(mongo, serve):
    """A start-up apply that raised (here: a queue named like a registered device's home
    queue) leaves its claim unfinished; the next start with the same file applies it once
    the clash is gone, instead of taking it as applied."""
    import pytest

    from conftest import MagicStack

    clash = queues.load_text(MAGIC_YAML + (
        "  gpu-lab:\n    description: clashes\n    devices: {home_queues: [gpu-hosts]}\n"
        "    vm: {gpus: 1}\n"))
    m = MagicStack(mongo, serve)
    register(m, devices=[{"agent_name": "gpu-host-01", "maas_system_id": "abc123", "gpus": 2,
                          "home_queues": ["gpu-hosts", "gpu-lab"]}])
    m.plugin.stop()
    with pytest.raises(queues.DefinitionError, match="gpu-lab"):
        init_app(mini_testflinger(mongo), mongo, definitions=clash,
                 start_ticker=False)
    assert mongo.magic_startup.find_one({"_id": "init_app"})["state"] == "applying"
    assert mongo.magic_queues.find_one({"_id": "gpu-lab"}) is None
    register(m, devices=[{"agent_name": "gpu-host-01", "maas_system_id": "abc123", "gpus": 2,
                          "home_queues": ["gpu-hosts"]}])
    plugin = init_app(mini_testflinger(mongo), mongo, definitions=clash,
                      start_ticker=False)
    assert plugin.definition("gpu-lab") is not None
    assert mongo.magic_startup.find_one({"_id": "init_app"})["state"] == "applied"
    plugin.stop()
