"""The daemon's instance id (agent_host/instance.py) and the client's reading of the server's
409s (an instance refusal vs a stale report), over real HTTP for the latter."""

from __future__ import annotations

import socket

import pytest
from flask import Flask, jsonify

from testflinger_magic.agent_host import client as clientmod
from testflinger_magic.agent_host.instance import (MAX_INSTANCE, compose_instance, instance_id,
                                                   read_machine_id)
from testflinger_magic.lab.httpserve import serve


def test_instance_id_names_the_machine_and_the_state_dir(tmp_path):
    """machine-id(5) present: ``<hostname>/<first 12 chars>:<state_dir resolved>``; the same
    state_dir (spelled through a symlink or ``..`` too) gives the same id, another gives
    another."""
    mid = tmp_path / "machine-id"
    mid.write_text("3d1219c7c4c5404aaa1f6d2a48adfda4\n")
    state = tmp_path / "state"
    state.mkdir()
    (tmp_path / "link").symlink_to(state)
    got = instance_id(state, machine_id_paths=(str(mid),), hostname="lab-07")
    assert got == f"lab-07/3d1219c7c4c5:{state.resolve()}"
    for spelling in (tmp_path / "link", tmp_path / "state" / ".." / "state", str(state)):
        assert instance_id(spelling, machine_id_paths=(str(mid),), hostname="lab-07") == got
    assert instance_id(tmp_path / "state2", machine_id_paths=(str(mid),),
                       hostname="lab-07") != got
    # By default: this machine's hostname; stable between two calls (a restart).
    assert instance_id(state) == instance_id(state)
    assert instance_id(state).startswith(socket.gethostname())


def test_instance_id_without_a_machine_id_falls_back(tmp_path):
    """/etc/machine-id missing or empty: D-Bus' copy; neither: the hostname alone."""
    empty, dbus = tmp_path / "empty", tmp_path / "dbus-machine-id"
    empty.write_text("\n")
    dbus.write_text("9f00aa11bb22ccdd\n")
    paths = (str(tmp_path / "missing"), str(empty), str(dbus))
    assert read_machine_id(paths) == "9f00aa11bb22ccdd"
    assert instance_id("/srv/s", machine_id_paths=paths, hostname="h") == "h/9f00aa11bb22:/srv/s"
    assert read_machine_id((str(tmp_path / "missing"),)) is None
    assert instance_id("/srv/s", machine_id_paths=(), hostname="h") == "h:/srv/s"


def test_a_long_instance_id_is_bounded_stable_and_distinct():
    long_a, long_b = "/srv/" + "a" * 400, "/srv/" + "a" * 399 + "b"
    a = compose_instance("h", "0123456789abcdef", long_a)
    assert len(a) == MAX_INSTANCE and a.startswith("h/0123456789ab:/srv/aaa")
    assert a == compose_instance("h", "0123456789abcdef", long_a)
    assert a != compose_instance("h", "0123456789abcdef", long_b)


def test_the_client_tells_an_instance_refusal_from_a_stale_report():
    """A 409 carrying ``instance_conflict`` (server/api.py) is ``InstanceConflict`` with its
    data; any other 409 (e.g. registration refused over a device still lent) stays
    ``StaleLease``, which the daemon retries."""
    app = Flask(__name__)
    conflict = {"agent_host": "h", "instance": "other", "last_heartbeat": 1.0,
                "silent_for": 3.0, "stale_after": 120.0, "caller": "me"}

    @app.post("/v1/oauth2/token")
    def token():
        return {"access_token": "t"}

    @app.post("/v1/magic/agent-hosts/<host>/heartbeat")
    def heartbeat(host):
        return jsonify(message="agent host h is run by another daemon instance 'other'",
                       lease=None, instance_conflict=conflict), 409

    @app.post("/v1/magic/agent-hosts/<host>")
    def register(host):
        return jsonify(message="agent host h no longer lists device(s) d", lease=None), 409

    with serve(app) as handle:
        c = clientmod.MagicClient(handle.url, "cid", "secret", retries=0)
        with pytest.raises(clientmod.InstanceConflict) as err:
            c.heartbeat("h", [], instance="me")
        assert str(err.value) == ("heartbeat h: refused: agent host h is run by another daemon "
                                  "instance 'other'")
        assert err.value.data == conflict and err.value.status == 409
        with pytest.raises(clientmod.StaleLease):
            c.register("h", [], instance="me")
