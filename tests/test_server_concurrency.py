"""Two plugin replicas on one database: interleaved ticks, claims, reports and agent polls never
lend a device twice and never hand a job to a fenced agent.

Besides whole polls over HTTP, the state machine splits a poll into its steps (the hook's gate
read and Testflinger's pop; later the marker, the second gate read and the delivery) so fences,
claims, drains and restores land inside a poll, which is the interleaving the dispatch handshake
must survive (docs/architecture.md, "The dispatch handshake")."""

from __future__ import annotations

import threading

import requests
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from conftest import MAGIC_YAML, mini_testflinger, seed
from testflinger_magic import db as tfdb
from testflinger_magic import leases as L
from testflinger_magic import queues
from testflinger_magic.server import auth, init_app

DEVICES = ["gpu-host-01", "gpu-host-02"]
NEXT = {"claimed": "fenced", "fenced": "deploying", "deploying": "splitting",
        "splitting": "enrolling", "enrolling": "active", "restoring": "returned"}


def replicas(n=2):
    """``n`` mini Testflinger apps with the plugin, all on one fresh database."""
    database = tfdb.connect()
    seed(database, devices=DEVICES)
    apps = []
    for _ in range(n):
        app = mini_testflinger(database)
        plugin = init_app(app, database, definitions=queues.load_text(MAGIC_YAML), start_ticker=False)
        # Ticks are the state machine's own rules: a background tick started by a submission or
        # a report would change what later rules draw from, and hypothesis could not replay a
        # failure (FlakyStrategyDefinition). Real threads racing: test_racing_claims_over_http.
        plugin.kick = lambda: None
        apps.append(app)
    key = apps[0].config["JWT_SIGNING_KEY"]
    headers = {
        role: {"Authorization": f"Bearer {auth.issue_token(key, role, role)}"}
        for role in ("agent", "admin")
    }
    body = {"devices": [{"agent_name": d, "maas_system_id": d, "gpus": 2,
                         "home_queues": ["gpu-hosts"]} for d in DEVICES]}
    assert apps[0].test_client().post("/v1/magic/agent-hosts/host-a", json=body,
                                      headers=headers["agent"]).status_code == 200
    return database, apps, headers


def open_leases_per_device(database):
    counts = {}
    for lease in database.magic_leases.find({"state": {"$in": sorted(L.OPEN_STATES)}}):
        counts[lease["device"]] = counts.get(lease["device"], 0) + 1
    return counts


def holds_running_job(database, delivered, agent):
    """True if a job delivered to ``agent`` (the test's own record of 200 answers) is not
    terminal."""
    for job_id in delivered.get(agent, ()):
        job = database.jobs.find_one({"job_id": job_id})
        if job and job["result_data"]["job_state"] not in ("complete", "completed", "cancelled"):
            return True
    return False


def queues_of(agent):
    return ["one-gpu-vm"] if "-vm" in agent else ["gpu-hosts"]


class TwoReplicas(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.db, self.apps, self.headers = replicas()
        self.clients = [a.test_client() for a in self.apps]
        self.vm_names = set()
        self.delivered = {}   # agent -> [job ids it received]
        self.in_flight = []   # (replica, agent, job_id, watched): popped, hook not finished

    def teardown(self):
        for app in self.apps:
            app.extensions["testflinger_magic"].notifier.close()

    @rule(i=st.integers(0, 1))
    def tick(self, i):
        self.apps[i].extensions["testflinger_magic"].tick()

    @rule(i=st.integers(0, 1), queue=st.sampled_from(["gpu-hosts", "one-gpu-vm"]))
    def submit(self, i, queue):
        assert self.clients[i].post("/v1/job", json={"job_queue": queue}).status_code == 200

    @rule(i=st.integers(0, 1), device=st.sampled_from(DEVICES))
    def lend_by_hand(self, i, device):
        r = self.clients[i].post("/v1/magic/leases", headers=self.headers["admin"],
                                 json={"device": device, "queue": "one-gpu-vm"})
        assert r.status_code in (201, 409), r.get_data(as_text=True)

    @rule(i=st.integers(0, 1), data=st.data())
    def agent_poll(self, i, data):
        names = sorted(set(DEVICES) | self.vm_names)
        agent = data.draw(st.sampled_from(names))
        fenced_before = self.db.magic_fences.find_one({"_id": agent}) is not None
        client = self.clients[i]
        client.set_cookie("agent_name", agent)
        r = client.get("/v1/job", query_string={"queue": ["gpu-hosts", "one-gpu-vm"]},
                       headers=self.headers["agent"])
        if fenced_before:
            event("poll by a fenced agent")
            assert r.status_code == 204, f"fenced agent {agent} got a job"
        if r.status_code == 200:
            job_id = r.get_json()["job_id"]
            self.delivered.setdefault(agent, []).append(job_id)
            self.db.agents.update_one({"name": agent}, {"$set": {"job_id": job_id, "state": "test"}})

    @rule(i=st.integers(0, 1), data=st.data())
    def poll_begins(self, i, data):
        """The served poll's first half: the hook's gate read, then Testflinger's pop."""
        agent = data.draw(st.sampled_from(sorted(set(DEVICES) | self.vm_names)))
        gates = self.apps[i].extensions["testflinger_magic"].store.gates
        refusal, watched = gates.admit(agent)
        if refusal is not None:
            event(f"poll refused: {refusal}")
            return
        doc = self.db.jobs.find_one_and_update(
            {"result_data.job_state": "waiting", "job_data.job_queue": {"$in": queues_of(agent)}},
            {"$set": {"result_data.job_state": "running"}}, sort=[("job_priority", -1)])
        if doc is not None:
            self.in_flight.append((i, agent, doc["job_id"], watched))

    @rule(data=st.data())
    def poll_ends(self, data):
        """The second half: marker, second gate read, delivery or give-back; then the agent
        (an older one) posts the job as its own."""
        if not self.in_flight:
            return
        i, agent, job_id, watched = self.in_flight.pop(
            data.draw(st.integers(0, len(self.in_flight) - 1)))
        gates = self.apps[i].extensions["testflinger_magic"].store.gates
        if watched and gates.hand_out(agent, job_id, queues_of(agent)[0]) is not None:
            event("job given back")
            assert self.db.jobs.find_one({"job_id": job_id})["result_data"]["job_state"] in (
                "waiting", "cancelled")
            return
        event("job delivered after a split poll")
        self.delivered.setdefault(agent, []).append(job_id)
        self.db.agents.update_one({"name": agent}, {"$set": {"job_id": job_id, "state": "test"}})

    @rule(data=st.data())
    def finish_a_job(self, data):
        running = [j for a, jobs in self.delivered.items() for j in jobs
                   if self.db.jobs.find_one({"job_id": j})["result_data"]["job_state"] == "running"]
        if not running:
            return
        job_id = data.draw(st.sampled_from(sorted(running)))
        self.db.jobs.update_one({"job_id": job_id}, {"$set": {"result_data.job_state": "complete"}})
        self.db.agents.update_many({"job_id": job_id}, {"$set": {"job_id": "", "state": "waiting"}})

    @rule(i=st.integers(0, 1), data=st.data())
    def daemon_step(self, i, data):
        r = self.clients[i].get("/v1/magic/agent-hosts/host-a/work", headers=self.headers["agent"])
        todo = [x for x in r.get_json()["leases"] if x["state"] in NEXT]
        if not todo:
            return
        lease = data.draw(st.sampled_from(todo))
        body = {"agent_host": "host-a", "generation": lease["generation"],
                "state": lease["state"], "result": "ok", "to_state": NEXT[lease["state"]]}
        r = self.clients[i].post(f"/v1/magic/leases/{lease['_id']}/report", json=body,
                                 headers=self.headers["agent"])
        assert r.status_code in (200, 409), r.get_data(as_text=True)
        event(f"report -> {r.status_code} {body['to_state']}")
        if r.status_code == 200 and r.get_json()["state"] == "active":
            for vm in r.get_json()["vms"]:
                self.vm_names.add(vm["agent_name"])
                self.clients[i].post(f"/v1/agents/data/{vm['agent_name']}",
                                     json={"state": "waiting", "queues": ["one-gpu-vm"],
                                           "job_id": ""})

    @rule(i=st.integers(0, 1))
    def drain_all(self, i):
        for lease in self.db.magic_leases.find({"state": "active"}):
            r = self.clients[i].post(f"/v1/magic/leases/{lease['_id']}/drain",
                                     headers=self.headers["admin"], json={"grace": "1h"})
            assert r.status_code in (200, 409)

    @invariant()
    def one_open_lease_per_device(self):
        assert all(n == 1 for n in open_leases_per_device(self.db).values())

    @invariant()
    def lent_device_runs_nothing(self):
        for device in open_leases_per_device(self.db):
            assert not holds_running_job(self.db, self.delivered, device)

    @invariant()
    def restoring_means_vm_agents_idle(self):
        for lease in self.db.magic_leases.find({"state": "restoring"}):
            if (lease.get("drain") or {}).get("forced"):
                continue
            for vm in lease["vms"]:
                assert not holds_running_job(self.db, self.delivered, vm["agent_name"])

    @invariant()
    def gates_agree_with_fences(self):
        fenced = {f["_id"] for f in self.db.magic_fences.find({}, {"_id": 1})}
        shut = {g["_id"] for g in self.db.magic_agent_gate.find({"fenced": True}, {"_id": 1})}
        assert fenced == shut


TestTwoReplicas = TwoReplicas.TestCase
TestTwoReplicas.settings = settings(max_examples=60, stateful_step_count=40, deadline=None,
                                    suppress_health_check=[HealthCheck.too_slow])


def test_racing_claims_over_http(mongo, serve):
    """Threads on two served replicas race hand-lends and device polls: each device ends with
    at most one lease, and a lent device never holds a job popped after its fence."""
    database, apps, headers = replicas()
    urls = [serve(app).url for app in apps]
    for _ in range(6):
        requests.post(f"{urls[0]}/v1/job", json={"job_queue": "gpu-hosts"}, timeout=10)
    results = []

    def lend(url, device):
        r = requests.post(f"{url}/v1/magic/leases", headers=headers["admin"],
                          json={"device": device, "queue": "one-gpu-vm"}, timeout=30)
        results.append(r.status_code)

    handed = {}

    def poll(url, device):
        r = requests.get(f"{url}/v1/job", params={"queue": "gpu-hosts"}, headers=headers["agent"],
                         cookies={"agent_name": device}, timeout=30)
        results.append(r.status_code)
        if r.status_code == 200:
            handed.setdefault(device, []).append(r.json()["job_id"])

    threads = [threading.Thread(target=fn, args=(urls[k % 2], d))
               for k in range(3) for d in DEVICES for fn in (lend, poll)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert set(results) <= {200, 201, 204, 409}
    counts = open_leases_per_device(database)
    assert all(n == 1 for n in counts.values())
    for device in counts:
        assert not holds_running_job(database, handed, device)
    for app in apps:
        app.extensions["testflinger_magic"].notifier.close()
