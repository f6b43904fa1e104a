#!/usr/bin/env python3
"""The plugin's cost on Testflinger's hot path: ``GET /v1/job`` polls.

Two lab job services (testflinger_magic.lab.jobservice.create_app) on their own mongomock
databases: one with the plugin mounted (the dispatch hooks run on every poll: the handshake
marker insert, the fence and admission look-ups, the after_request bookkeeping), one with
``mount_plugin=False``. Both get the same agents and jobs, driven through Flask's test client (no
sockets, so the ratio is the plugin's own work, not the network's).

Two cases: *empty* polls (204, what idle agents do every ``polling_interval`` = 10 s), and *pop*
polls that each take one job. Rounds alternate the two apps so machine noise hits both alike; the
median per-request time of the rounds is printed with the ratio plugin / plain.
Goal (benchmarks/README.md): ratio <= 2.0 for empty polls and <= 2.0 for pops.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from testflinger_magic import db as dbmod  # noqa: E402
from testflinger_magic.lab.jobservice import create_app  # noqa: E402

QUEUE = "gpu-hosts"
ROUNDS = 7
EMPTY_POLLS = 150   # per round
POPS = 60           # per round (jobs submitted first, outside the timing)


AGENT = ("agents", "bench-agent-secret-123456")


class Agent:
    """A testflinger-agent look-alike on the test client: Bearer agent token (POST
    /v1/oauth2/token, HTTP Basic) and the ``agent_name`` cookie from its first agent-data post."""

    def __init__(self, app, name: str):
        self.client = app.test_client()
        r = self.client.post("/v1/oauth2/token", auth=AGENT)
        assert r.status_code == 200, r.get_data(as_text=True)
        self.headers = {"Authorization": f"Bearer {r.get_json()['access_token']}"}
        r = self.client.post(f"/v1/agents/data/{name}", headers=self.headers,
                             json={"state": "waiting", "queues": [QUEUE]})
        assert r.status_code == 200, r.get_data(as_text=True)
        self.client.set_cookie("agent_name", name)

    def get(self, path):
        return self.client.get(path, headers=self.headers)

    def post(self, path, json):
        return self.client.post(path, json=json)


def make(mount: bool) -> Agent:
    opts = {"definitions": str(ROOT / "examples" / "magic-queues.yaml"), "start_ticker": False}
    app = create_app(dbmod.connect(), mount_plugin=mount, plugin_options=opts if mount else None,
                     clients={AGENT[0]: {"secret": AGENT[1], "role": "agent"}})
    return Agent(app, "gpu-host-01")


def submit(client, n: int) -> None:
    for _ in range(n):
        r = client.post("/v1/job", json={"job_queue": QUEUE, "test_data": {"test_cmds": "true"}})
        assert r.status_code == 200, (r.status_code, r.get_data(as_text=True))


def per_request(client, n: int, want: int) -> float:
    t0 = time.perf_counter()
    for _ in range(n):
        r = client.get(f"/v1/job?queue={QUEUE}")
        if r.status_code != want:
            raise SystemExit(f"GET /v1/job answered {r.status_code}, expected {want}")
    return (time.perf_counter() - t0) / n


def main() -> int:
    apps = {"plugin": make(True), "plain": make(False)}
    for c in apps.values():  # warm up both (imports, first-request setup)
        per_request(c, 20, 204)
    empty = {k: [] for k in apps}
    pop = {k: [] for k in apps}
    for _ in range(ROUNDS):
        for name, c in apps.items():
            empty[name].append(per_request(c, EMPTY_POLLS, 204))
        for name, c in apps.items():
            submit(c, POPS)
            pop[name].append(per_request(c, POPS, 200))
    print(f"GET /v1/job through the lab job service (Flask test client), median of {ROUNDS} rounds")
    print(f"{'case':<12}{'plain µs':>12}{'plugin µs':>12}{'ratio':>8}{'goal':>8}")
    ok = True
    for case, data in (("empty poll", empty), ("job pop", pop)):
        plain, plug = statistics.median(data["plain"]), statistics.median(data["plugin"])
        ratio = plug / plain
        ok &= ratio <= 2.0
        print(f"{case:<12}{plain * 1e6:>12.0f}{plug * 1e6:>12.0f}{ratio:>8.2f}{'<=2.00':>8}")
    print("goal met" if ok else "goal NOT met (see benchmarks/README.md)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
