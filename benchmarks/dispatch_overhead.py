#!/usr/bin/env python3
"""The plugin's cost on Testflinger's hot path: ``GET /v1/job`` polls, counted, not just timed.

Each round builds two lab job services (``testflinger_magic.lab.jobservice.create_app``) on two
fresh mongomock databases filled with the *same* data: one with the plugin mounted, one with
``mount_plugin=False`` (the Testflinger-like plain poll). Both are driven through Flask's test
client with an agent token and the ``agent_name`` cookie, as testflinger-agent polls.

Measured per side, on the same data:

* database operations by collection and kind (every collection method call is counted by a
  wrapper around the mongomock collections): reads and writes per *empty* poll (204, what every
  idle agent does every ``polling_interval``) and operations per *job-taking* poll (200);
* a deterministic instruction count for the empty poll: the number of Python line events
  (``sys.settrace``) of the request, the same on every run. Not valgrind/callgrind: running the
  interpreter under callgrind made one round take minutes and its count is dominated by the
  interpreter's start-up, which cannot be toggled per request from inside Python. The line count
  covers Flask, the plugin, mongomock and the job service (all Python); it does not weigh C code
  (JSON encoding, HMAC of the token), which both sides run alike;
* wall time per request (median of rounds), for orientation only.

Every measured poll comes after two warm-up polls with the same token, so the plugin's cache of
accepted tokens (server/tokencache.py) is warm: the steady state of an agent polling with its
token; the first poll with a new token (one per agent every 10 minutes) verifies it twice.

Databases: *fresh* (no history at all), and a *day of history*: 200 or 20,000 ``returned`` leases
(with their VM agent names) and 2,000 finished jobs, on both sides. Pollers: a registered device
agent (the plugin watches it: it has a gate) and an agent that is neither a device nor a VM agent.

Goals (benchmarks/README.md; printed beside the figures, never asserted by tests): empty poll
<= 1 extra indexed read, 0 extra writes, instruction ratio <= 1.10; job-taking poll <= 3 extra
operations; the same figures at 200 and 20,000 returned leases. The last line reads
``dispatch: extra reads per empty poll N, extra writes per empty poll M, extra ops per
job-taking poll K, instructions ratio R`` with the worst value of each over every database and
poller.
"""

from __future__ import annotations

import statistics
import sys
import threading
import time
from collections import Counter
from datetime import datetime, timedelta, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from testflinger_magic import db as dbmod  # noqa: E402
from testflinger_magic.lab import dbcount  # noqa: E402
from testflinger_magic.lab.jobservice import create_app  # noqa: E402
from testflinger_magic.server import auth  # noqa: E402

QUEUE = "gpu-hosts"
KEY = "bench-signing-key-0123456789abcdef"
ROUNDS = 3
EMPTY_POLLS = 40     # per round and side (counted); the instruction count uses the first 10
JOB_POLLS = 10       # per round and side (jobs submitted first, outside the counts)
TRACED_POLLS = 10
FINISHED_JOBS = 2000
DEVICE, OTHER = "gpu-host-01", "bench-other-agent"

#: Collection methods that read / write (pymongo's names, as mongomock implements them).
READS, WRITES = dbcount.READS, dbcount.WRITES


def history(database, leases: int) -> None:
    """A day of history: ``leases`` returned leases and FINISHED_JOBS complete jobs (none of
    either for ``leases=0``, the fresh database)."""
    now = time.time()
    if not leases:
        return
    if leases:
        database.magic_leases.insert_many([{
            "_id": f"lease-{i:012x}", "device": f"old-host-{i % 50:02d}", "queue": "one-gpu-vm",
            "agent_host": "h", "state": "returned", "generation": 7, "created_at": now - 86400,
            "updated_at": now - 3600, "admission": "open", "drain": None,
            "vms": [{"index": k, "name": f"old-host-{i % 50:02d}-vm{k + 1}",
                     "agent_name": f"old-host-{i % 50:02d}-vm{k + 1}"} for k in range(2)],
            "history": [], "intent": []} for i in range(leases)])
    t0 = datetime.now(timezone.utc) - timedelta(days=1)
    database.jobs.insert_many([{
        "job_id": f"00000000-0000-4000-8000-{i:012d}", "created_at": t0, "job_priority": 0,
        "started_at": t0, "job_data": {"job_queue": QUEUE if i % 2 else "one-gpu-vm",
                                       "exclude_agents": []},
        "result_data": {"job_state": "complete"}} for i in range(FINISHED_JOBS)])


def side(mount: bool, leases: int):
    """(counting db, test client with agent headers) on fresh data."""
    raw = dbmod.connect()
    history(raw, leases)
    database = dbcount.Counting(raw, kinds=True, this_thread=True)
    opts = {"definitions": str(ROOT / "examples" / "magic-queues.yaml"), "start_ticker": False}
    app = create_app(database, signing_key=KEY, mount_plugin=mount,
                     plugin_options=opts if mount else None)
    for thread in threading.enumerate():  # the tick that applying the queues kicked
        if thread.name == "magic-kick":
            thread.join()
    headers = {"Authorization": "Bearer " + auth.issue_token(KEY, "agents", "agent", ttl=3600)}
    client = app.test_client()
    for name in (DEVICE, OTHER):
        r = client.post(f"/v1/agents/data/{name}", headers=headers,
                        json={"state": "waiting", "queues": [QUEUE]})
        assert r.status_code == 200, r.get_data(as_text=True)
    if mount:
        plugin = app.extensions["jobservice"]["plugin"]
        raw.magic_devices.insert_one({"_id": DEVICE, "agent_host": "h", "gpus": 8,
                                      "home_queues": [QUEUE], "quarantined": False})
        plugin.store.repair_gates()  # what the tick does for a registered device
    return database, client, headers


def polls(database, client, headers, agent, n, want):
    client.set_cookie("agent_name", agent)
    database.ops.clear()
    database.on = True
    t0 = time.perf_counter()
    for _ in range(n):
        r = client.get(f"/v1/job?queue={QUEUE}", headers=headers)
        if r.status_code != want:
            raise SystemExit(f"GET /v1/job as {agent} answered {r.status_code}, expected {want}")
    seconds = (time.perf_counter() - t0) / n
    database.on = False
    return Counter(database.ops), seconds


def traced(client, headers, agent, n) -> int:
    """Python line events of ``n`` empty polls (deterministic)."""
    client.set_cookie("agent_name", agent)
    count = 0

    def tracer(frame, event, arg):
        nonlocal count
        if event == "line":
            count += 1
        return tracer

    sys.settrace(tracer)
    try:
        for _ in range(n):
            client.get(f"/v1/job?queue={QUEUE}", headers=headers)
    finally:
        sys.settrace(None)
    return count


def submit(client, n):
    for _ in range(n):
        r = client.post("/v1/job", json={"job_queue": QUEUE})
        assert r.status_code == 200, r.get_data(as_text=True)


def per_poll(ops: Counter, n: int, kind: str | None = None) -> float:
    return sum(v for (c, k, m), v in ops.items() if kind is None or k == kind) / n


def breakdown(ops: Counter, n: int) -> str:
    return ", ".join(f"{c}.{m} {v / n:g}" for (c, k, m), v in sorted(ops.items())) or "none"


def measure(leases: int, agent: str) -> dict:
    out = {"empty": {}, "job": {}, "lines": {}, "t_empty": {}, "t_job": {}}
    for _ in range(ROUNDS):
        for name, mount in (("plain", False), ("plugin", True)):
            database, client, headers = side(mount, leases)  # fresh data, both sides alike
            for _warm in range(2):
                client.set_cookie("agent_name", agent)
                client.get(f"/v1/job?queue={QUEUE}", headers=headers)
            ops, t = polls(database, client, headers, agent, EMPTY_POLLS, 204)
            out["empty"][name] = ops
            out["t_empty"].setdefault(name, []).append(t)
            out["lines"][name] = traced(client, headers, agent, TRACED_POLLS)
            submit(client, JOB_POLLS)
            ops, t = polls(database, client, headers, agent, JOB_POLLS, 200)
            out["job"][name] = ops
            out["t_job"].setdefault(name, []).append(t)
    return out


def main() -> int:
    print("GET /v1/job through the lab job service (Flask test client, mongomock): plugin vs "
          f"plain on the same fresh data, {ROUNDS} rounds")
    print("goals: empty poll <= 1 extra indexed read, 0 extra writes, instruction ratio <= 1.10; "
          "job-taking poll <= 3 extra ops; same figures at 200 and 20,000 returned leases\n")
    worst = {"reads": 0.0, "writes": 0.0, "job": 0.0, "ratio": 0.0}
    header = (f"{'database':<28}{'poller':<9}{'+reads':>7}{'+writes':>8}{'+ops/job':>9}"
              f"{'lines plain':>12}{'plugin':>9}{'ratio':>7}{'µs plain':>10}{'plugin':>8}")
    print(header)
    details = []
    for label, leases in (("fresh", 0), ("day, 200 returned leases", 200),
                          ("day, 20000 returned leases", 20000)):
        for who, agent in (("device", DEVICE), ("other", OTHER)):
            m = measure(leases, agent)
            e, j = m["empty"], m["job"]
            reads = per_poll(e["plugin"], EMPTY_POLLS, "read") - per_poll(e["plain"], EMPTY_POLLS, "read")
            writes = per_poll(e["plugin"], EMPTY_POLLS, "write") - per_poll(e["plain"], EMPTY_POLLS, "write")
            job = per_poll(j["plugin"], JOB_POLLS) - per_poll(j["plain"], JOB_POLLS)
            ratio = m["lines"]["plugin"] / m["lines"]["plain"]
            tp = statistics.median(m["t_empty"]["plain"]) * 1e6
            tq = statistics.median(m["t_empty"]["plugin"]) * 1e6
            print(f"{label:<28}{who:<9}{reads:>7g}{writes:>8g}{job:>9g}"
                  f"{m['lines']['plain'] // TRACED_POLLS:>12}{m['lines']['plugin'] // TRACED_POLLS:>9}"
                  f"{ratio:>7.3f}{tp:>10.0f}{tq:>8.0f}")
            worst["reads"] = max(worst["reads"], reads)
            worst["writes"] = max(worst["writes"], writes)
            worst["job"] = max(worst["job"], job)
            worst["ratio"] = max(worst["ratio"], ratio)
            if leases == 0:
                details.append(f"  {who}: empty poll, plain: {breakdown(e['plain'], EMPTY_POLLS)}")
                details.append(f"  {who}: empty poll, plugin: {breakdown(e['plugin'], EMPTY_POLLS)}")
                details.append(f"  {who}: job poll, plain: {breakdown(j['plain'], JOB_POLLS)}")
                details.append(f"  {who}: job poll, plugin: {breakdown(j['plugin'], JOB_POLLS)}")
    print("\noperations per poll by collection.method (fresh database):")
    print("\n".join(details))
    print("\n'lines' = Python line events per empty poll (sys.settrace; deterministic, C code not "
          "weighed); µs = median wall time per empty poll, orientation only.")
    met = (worst["reads"] <= 1 and worst["writes"] <= 0 and worst["job"] <= 3
           and worst["ratio"] <= 1.10)
    print("goals met" if met else "goals NOT met (see benchmarks/README.md)")
    print(f"dispatch: extra reads per empty poll {worst['reads']:g}, extra writes per empty poll "
          f"{worst['writes']:g}, extra ops per job-taking poll {worst['job']:g}, instructions "
          f"ratio {worst['ratio']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
