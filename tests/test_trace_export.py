"""``testflinger-magic trace export``: a simulate trace from a Testflinger database's jobs, filled
through the lab's Testflinger-compatible job service (real HTTP: POST /v1/job, GET /v1/job as an
agent, POST /v1/result/<id>/log/output fragments, POST /v1/result/<id>)."""

from __future__ import annotations

import datetime as dt
import json

import pytest
import requests
import yaml
from pathlib import Path

from testflinger_magic import cli
from testflinger_magic import db as dbmod
from testflinger_magic.lab import simulate as S
from testflinger_magic.lab import trace_export as TX
from testflinger_magic.queues import load_file
from conftest import MagicStack
from test_server_api import poll_job


def _iso(epoch: float) -> str:
    return dt.datetime.fromtimestamp(epoch, dt.timezone.utc).isoformat()


def _epoch(value: dt.datetime) -> float:
    return value.replace(tzinfo=dt.timezone.utc).timestamp()


def run_job(m, queue, priority, minutes, agent):
    """Submit, pop as ``agent``, post one log fragment ``minutes`` after started_at, complete."""
    r = requests.post(f"{m.url}/v1/job", json={"job_queue": queue, "job_priority": priority},
                      headers=m.headers("manager") if priority else None, timeout=10)
    assert r.status_code == 200, r.text
    job_id = r.json()["job_id"]
    if minutes is None:
        return job_id
    got = poll_job(m, agent, [queue])
    assert got.status_code == 200 and got.json()["job_id"] == job_id
    started = _epoch(m.db.jobs.find_one({"job_id": job_id})["started_at"])
    for n, at in enumerate((started + 5, started + minutes * 60)):
        r = requests.post(f"{m.url}/v1/result/{job_id}/log/output", headers=m.headers("agent"),
                          json={"fragment_number": n, "timestamp": _iso(at), "phase": "test",
                                "log_data": "ok\n"}, timeout=10)
        assert r.status_code == 200, r.text
    r = requests.post(f"{m.url}/v1/result/{job_id}", headers=m.headers("agent"),
                      json={"job_state": "complete"}, timeout=10)
    assert r.status_code == 200, r.text
    return job_id


@pytest.fixture()
def filled(mongo, serve):
    magic = MagicStack(mongo, serve, server="newer")  # the job service with logs endpoints
    magic.db.jobs.delete_many({})  # only the jobs below
    since = _epoch(dt.datetime.utcnow()) - 1
    ids = [run_job(magic, "one-gpu-vm", 0, 20, "vm-a"),
           run_job(magic, "gpu-hosts", 0, 90, "gpu-host-01"),
           run_job(magic, "one-gpu-vm", 0, None, None)]  # still waiting
    cancelled = run_job(magic, "gpu-hosts", 0, None, None)
    r = requests.post(f"{magic.url}/v1/job/{cancelled}/action", json={"action": "cancel"},
                      timeout=10)
    assert r.status_code == 200, r.text
    yield magic, since, ids
    magic.plugin.stop()


def test_export_reads_created_started_and_log_times(filled):
    m, since, ids = filled
    until = since + 3600
    trace = TX.export_trace(m.db, since, until)
    docs = {d["job_id"]: d for d in m.db.jobs.find({"job_id": {"$in": ids}})}
    sub = lambda i: round(_epoch(docs[ids[i]]["created_at"]) - since, 3)  # noqa: E731
    assert trace["jobs"] == sorted([
        {"submit": sub(0), "queue": "one-gpu-vm", "duration": 1200.0, "priority": 0},
        {"submit": sub(1), "queue": "gpu-hosts", "duration": 5400.0, "priority": 0},
        {"submit": sub(2), "queue": "one-gpu-vm", "duration": 1800.0, "priority": 0},
    ], key=lambda j: (j["submit"], j["queue"]))
    assert trace["until"] == 3600.0
    assert trace["exported"]["durations_guessed"] == 1
    assert trace["exported"]["skipped"] == {"cancelled before start": 1}
    only = TX.export_trace(m.db, since, until, ["gpu-hosts"])
    assert [j["queue"] for j in only["jobs"]] == ["gpu-hosts"]
    with pytest.raises(TX.ExportError, match="no job was created"):
        TX.export_trace(m.db, since - 7200, since - 3600)
    with pytest.raises(TX.ExportError, match="--until must be after"):
        TX.export_trace(m.db, since, since)


def test_cli_export_writes_a_trace_simulate_replays(filled, tmp_path, monkeypatch, capsys):
    m, since, ids = filled
    monkeypatch.setattr(dbmod, "connect", lambda uri, name="testflinger_db", **kw: m.db)
    out = tmp_path / "week.yaml"
    lab = tmp_path / "lab.yaml"
    lab.write_text("lab: {devices: [{prefix: gpu-host-, count: 2, gpus: 4, "
                   "home_queues: [gpu-hosts]}]}\n", encoding="utf-8")
    rc = cli.main(["trace", "export", "--mongo", "mongodb://db.example:27017/testflinger_db",
                   "--since", _iso(since), "--until", _iso(since + 7200), "--lab", str(lab),
                   "--out", str(out)])
    assert rc == 0
    assert capsys.readouterr().out.startswith(f"{out}: 3 jobs (1 durations guessed), 1 cancelled")
    data = yaml.safe_load(out.read_text())
    assert len(data["jobs"]) == 3 and data["lab"]["devices"][0]["count"] == 2
    trace = S.load_trace(out)
    assert len(trace.jobs) == 3 and trace.until == 7200.0
    r = S.simulate(trace, load_file(Path(__file__).resolve().parent.parent / "examples"
                                    / "magic-queues.yaml"))
    assert r.done["home"] == 1 and r.jobs == 3
    rc = cli.main(["trace", "export", "--mongo", "mongodb://x", "--since", "yesterday", "--out",
                   str(tmp_path / "x.yaml")])
    assert rc != 0 and "--since 'yesterday'" in capsys.readouterr().err
    rc = cli.main(["--json", "trace", "export", "--mongo", "mongodb://x", "--since", _iso(since),
                   "--out", str(tmp_path / "t.json")])
    assert rc == 0 and json.loads(capsys.readouterr().out)["jobs"] == 3
    assert len(json.loads((tmp_path / "t.json").read_text())["jobs"]) == 3


def test_cli_export_refuses_bad_uri_and_out_before_connecting(tmp_path, monkeypatch, capsys):
    """--mongo must be a MongoDB URI and --out a .yaml/.json file in a folder that exists,
    both checked at parsing: nothing connects (exit 2)."""
    monkeypatch.setattr(dbmod, "connect", lambda *a, **k: pytest.fail("connected"))
    for argv, says in (
            (["--mongo", "notauri", "--out", str(tmp_path / "t.yaml")],
             "'notauri' is not a MongoDB URI"),
            (["--mongo", "mongodb://h/", "--out", str(tmp_path / "no" / "t.yaml")],
             "no such directory"),
            (["--mongo", "mongodb://h/", "--out", str(tmp_path / "t.txt")],
             "must end with .yaml or .yml or .json"),
            (["--mongo", "mongodb://h/", "--out", str(tmp_path)], "is a directory")):
        with pytest.raises(SystemExit) as exc:
            cli.main(["trace", "export", "--since", "2024-01-01", *argv])
        assert exc.value.code == 2
        assert says in capsys.readouterr().err


def test_cli_export_without_a_server_is_one_line_after_the_timeout(tmp_path, capsys):
    """Real pymongo against a port nobody listens on: a one-line error naming the server and
    --mongo-timeout (no traceback, no password), exit 1; a URI pymongo cannot read likewise."""
    out = tmp_path / "t.yaml"
    rc = cli.main(["trace", "export", "--mongo", "mongodb://user:pw@127.0.0.1:1/testflinger_db",
                   "--mongo-timeout", "0.5", "--since", "2024-01-01", "--out", str(out)])
    err = capsys.readouterr().err
    assert rc == 1 and len(err.strip().splitlines()) == 1, err
    assert "no MongoDB server answered at 127.0.0.1:1 within 0.5s (--mongo-timeout)" in err
    assert "pw" not in err and "Traceback" not in err and not out.exists()
    rc = cli.main(["trace", "export", "--mongo", "mongodb://a:b:c/", "--since", "2024-01-01",
                   "--out", str(out)])
    err = capsys.readouterr().err
    assert rc == 1 and "not a usable MongoDB URI" in err and "Traceback" not in err
