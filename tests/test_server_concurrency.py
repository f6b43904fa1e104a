"""Two plugin replicas on one database: interleaved ticks, claims, reports and agent polls never
lend a device twice and never hand a job to a fenced agent.

Besides whole polls over HTTP, the state machine splits a poll into the steps the hook and
Testflinger's handler take (docs/architecture.md, "The dispatch handshake"): R1, the hook's gate
read; the handler's pop; the hook's after-half (marker, R2, delivery or give-back); and, later,
the agent's first post of the job (an older agent's ``job_id``). Fences, claims, a device's
registration, drains and restores land between any two of them, and ``overlapping_poll`` favours
exactly that: a whole poll of one agent with fencer steps drawn into its gaps. ``LATE`` is a
device agent the agent host registers (and deregisters) only when a rule says so, so its polls
before that read no gate (the second gate read and the claim's unattributed-job check are what
protect it)."""

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
LATE = "gpu-host-03"
NEXT = {"claimed": "fenced", "fenced": "deploying", "deploying": "splitting",
        "splitting": "enrolling", "enrolling": "active", "restoring": "returned"}
#: Fencer-side steps ``overlapping_poll`` draws into a poll's gaps.
MIDDLE = ["lend", "register", "drain", "tick", "daemon", "finish"]


def register_body(devices):
    return {"devices": [{"agent_name": d, "maas_system_id": d, "gpus": 2,
                         "home_queues": ["gpu-hosts"]} for d in devices]}


def replicas(n=2, late=False):
    """``n`` mini Testflinger apps with the plugin, all on one fresh database (with ``late``,
    also the agents document of ``LATE``, a device not registered yet)."""
    database = tfdb.connect()
    seed(database, devices=DEVICES + ([LATE] if late else []))
    apps = []
    for _ in range(n):
        app = mini_testflinger(database)
        plugin = init_app(app, database, definitions=queues.load_text(MAGIC_YAML), start_ticker=False)
        # Ticks are the state machine's own rules: a background tick started by a submission or
        # a report would change what later rules draw from, and hypothesis could not replay a
        # failure (FlakyStrategyDefinition). Real threads racing: test_racing_claims_over_http.
        plugin.kick = lambda *a, **k: None
        apps.append(app)
    key = apps[0].config["JWT_SIGNING_KEY"]
    headers = {
        role: {"Authorization": f"Bearer {auth.issue_token(key, role, role)}"}
        for role in ("agent", "admin")
    }
    assert apps[0].test_client().post("/v1/magic/agent-hosts/host-a", json=register_body(DEVICES),
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
        self.db, self.apps, self.headers = replicas(late=True)
        self.clients = [a.test_client() for a in self.apps]
        self.vm_names = set()
        self.delivered = {}   # agent -> [job ids it received]
        self.reading = []     # (replica, agent, watched): R1 passed, handler not run yet
        self.in_flight = []   # (replica, agent, job_id, watched): popped, hook not finished
        self.unposted = []    # (agent, job_id): delivered, the agent has not posted it yet

    def teardown(self):
        for app in self.apps:
            app.extensions["testflinger_magic"].notifier.close()

    def _gates(self, i):
        return self.apps[i].extensions["testflinger_magic"].store.gates

    def _agents(self):
        """The agents that may start a poll: the devices' and the VM agents of open leases. A
        closed lease's VM agents are gone: the restore removes their programs before it
        reports ``returned`` (agent_host/teardown.py ``restore``), and a forced close leaves
        them to the daemon's sweep, after which none polls. Their names come back with the
        device's next lease."""
        open_vms = {name for lease in self.db.magic_leases.find(
            {"state": {"$in": sorted(L.OPEN_STATES)}}, {"vm_names": 1})
            for name in lease.get("vm_names") or ()}
        return sorted(set(DEVICES) | {LATE} | (self.vm_names & open_vms))

    # ---------------------------------------------------------------- the steps of one poll

    def _read_gate(self, i, agent):
        """R1 (gates.Gates.admit, as dispatch._before_job_get): True if the poll goes on."""
        refusal, watched = self._gates(i).admit(agent)
        if refusal is not None:
            event(f"poll refused: {refusal}")
            return None
        event("R1 read no gate" if not watched else "R1 open")
        return (i, agent, watched)

    def _pop(self, reading):
        """Testflinger's handler (the mini app's find_one_and_update)."""
        i, agent, watched = reading
        doc = self.db.jobs.find_one_and_update(
            {"result_data.job_state": "waiting", "job_data.job_queue": {"$in": queues_of(agent)}},
            {"$set": {"result_data.job_state": "running"}}, sort=[("job_priority", -1)])
        return None if doc is None else (i, agent, doc["job_id"], watched)

    def _end(self, flight):
        """The hook's after-half (dispatch._after_job_get), then the answer reaches the agent."""
        i, agent, job_id, watched = flight
        reason = self._gates(i).hand_out(agent, job_id, queues_of(agent)[0], watched=watched)
        if reason is not None:
            event("job given back")
            assert self.db.jobs.find_one({"job_id": job_id})["result_data"]["job_state"] in (
                "waiting", "cancelled")
            return
        event("job delivered after a split poll")
        self.delivered.setdefault(agent, []).append(job_id)
        self.unposted.append((agent, job_id))

    def _post(self, agent, job_id):
        """The agent's first post after receiving the job (an older agent posts its job_id)."""
        self.db.agents.update_one({"name": agent}, {"$set": {"job_id": job_id, "state": "test"}})

    # ---------------------------------------------------------------- fencer-side steps

    def _lend(self, i, device):
        r = self.clients[i].post("/v1/magic/leases", headers=self.headers["admin"],
                                 json={"device": device, "queue": "one-gpu-vm"})
        assert r.status_code in (201, 409) or (device == LATE and r.status_code < 500), \
            r.get_data(as_text=True)
        event(f"lend -> {r.status_code}")

    def _register(self, i, with_late=True):
        """The agent host registers its devices, with or without ``LATE`` (without: ``LATE``
        is deregistered unless lent, and the next tick drops its gate)."""
        r = self.clients[i].post("/v1/magic/agent-hosts/host-a", headers=self.headers["agent"],
                                 json=register_body(DEVICES + [LATE] * with_late))
        # 409 while a claim holds LATE (hostproto._deregister_missing).
        assert r.status_code == 200 or (not with_late and r.status_code == 409), \
            r.get_data(as_text=True)

    def _drain(self, i):
        for lease in self.db.magic_leases.find({"state": "active"}):
            r = self.clients[i].post(f"/v1/magic/leases/{lease['_id']}/drain",
                                     headers=self.headers["admin"], json={"grace": "1h"})
            assert r.status_code in (200, 409)

    def _daemon(self, i, data):
        r = self.clients[i].get("/v1/magic/agent-hosts/host-a/work", headers=self.headers["agent"])
        todo = sorted((x for x in r.get_json()["leases"] if x["state"] in NEXT),
                      key=lambda x: (x["device"], x["state"]))  # not by (random) lease id
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

    def _finish(self, data):
        # In delivery order, not by (random) job id: the draw must replay the same way.
        running = [j for a, jobs in sorted(self.delivered.items()) for j in jobs
                   if self.db.jobs.find_one({"job_id": j})["result_data"]["job_state"] == "running"
                   and (a, j) not in self.unposted]
        if not running:
            return
        job_id = data.draw(st.sampled_from(running))
        self.db.jobs.update_one({"job_id": job_id}, {"$set": {"result_data.job_state": "complete"}})
        self.db.agents.update_many({"job_id": job_id}, {"$set": {"job_id": "", "state": "waiting"}})

    def _middle(self, step, agent, data):
        i = data.draw(st.integers(0, 1))
        if step == "lend":
            device = agent if agent in DEVICES + [LATE] else data.draw(st.sampled_from(DEVICES))
            self._lend(i, device)
        elif step == "register":
            self._register(i, data.draw(st.booleans()))
        elif step == "drain":
            self._drain(i)
        elif step == "tick":
            self.apps[i].extensions["testflinger_magic"].tick()
        elif step == "daemon":
            self._daemon(i, data)
        else:
            self._finish(data)

    # ---------------------------------------------------------------- rules

    @rule(i=st.integers(0, 1))
    def tick(self, i):
        self.apps[i].extensions["testflinger_magic"].tick()

    @rule(i=st.integers(0, 1), queue=st.sampled_from(["gpu-hosts", "one-gpu-vm"]))
    def submit(self, i, queue):
        assert self.clients[i].post("/v1/job", json={"job_queue": queue}).status_code == 200

    @rule(i=st.integers(0, 1), device=st.sampled_from(DEVICES + [LATE]))
    def lend_by_hand(self, i, device):
        self._lend(i, device)

    @rule(i=st.integers(0, 1), with_late=st.booleans())
    def register_devices(self, i, with_late):
        self._register(i, with_late)

    @rule(i=st.integers(0, 1), data=st.data())
    def agent_poll(self, i, data):
        agent = data.draw(st.sampled_from(self._agents()))
        fenced_before = self.db.magic_fences.find_one({"_id": agent}) is not None
        client = self.clients[i]
        client.set_cookie("agent_name", agent)
        # A real agent polls the queues it advertises, or a subset (testflinger-agent
        # client.py ``check_jobs``: ``job_queues`` or the ``restricted_to`` ones, which
        # server api/v1.py ``agents_data_get`` takes from the agent's ``queues``), as ``_pop``.
        r = client.get("/v1/job", query_string={"queue": queues_of(agent)},
                       headers=self.headers["agent"])
        if fenced_before:
            event("poll by a fenced agent")
            assert r.status_code == 204, f"fenced agent {agent} got a job"
        if r.status_code == 200:
            job_id = r.get_json()["job_id"]
            self.delivered.setdefault(agent, []).append(job_id)
            self._post(agent, job_id)

    @rule(i=st.integers(0, 1), data=st.data())
    def poll_reads_gate(self, i, data):
        """R1 alone: the hook's gate read; the handler runs in a later rule."""
        reading = self._read_gate(i, data.draw(st.sampled_from(self._agents())))
        if reading is not None:
            self.reading.append(reading)

    @rule(data=st.data())
    def poll_pops(self, data):
        """Testflinger's handler of a poll whose R1 passed."""
        if not self.reading:
            return
        flight = self._pop(self.reading.pop(data.draw(st.integers(0, len(self.reading) - 1))))
        if flight is not None:
            self.in_flight.append(flight)

    @rule(data=st.data())
    def poll_ends(self, data):
        """The hook's after-half of a popped poll: marker, R2, delivery or give-back."""
        if not self.in_flight:
            return
        self._end(self.in_flight.pop(data.draw(st.integers(0, len(self.in_flight) - 1))))

    @rule(data=st.data())
    def agent_posts(self, data):
        if not self.unposted:
            return
        self._post(*self.unposted.pop(data.draw(st.integers(0, len(self.unposted) - 1))))

    @rule(i=st.integers(0, 1), data=st.data(),
          before=st.lists(st.sampled_from(MIDDLE), max_size=3),
          between=st.lists(st.sampled_from(MIDDLE), max_size=3),
          after=st.lists(st.sampled_from(MIDDLE), max_size=2))
    def overlapping_poll(self, i, data, before, between, after):
        """One agent's whole poll with fencer steps in its gaps: a job waits on its queue, R1,
        ``before``, the pop, ``between``, the after-half, ``after``, the agent's post."""
        agent = data.draw(st.sampled_from(self._agents()))
        assert self.clients[i].post("/v1/job", json={"job_queue": queues_of(agent)[0]}
                                    ).status_code == 200
        reading = self._read_gate(i, agent)
        if reading is None:
            return
        for step in before:
            self._middle(step, agent, data)
        flight = self._pop(reading)
        if flight is None:
            return
        for step in between:
            self._middle(step, agent, data)
        self._end(flight)
        for step in after:
            self._middle(step, agent, data)
        if (agent, flight[2]) in self.unposted:
            self.unposted.remove((agent, flight[2]))
            self._post(agent, flight[2])

    @rule(i=st.integers(0, 1), j=st.integers(0, 1), device=st.sampled_from(DEVICES + [LATE]),
          gap=st.sampled_from(["R1-pop", "pop-end", "end-post"]))
    def poll_across_a_lend(self, i, j, device, gap):
        """A device's poll with a lend of that device (after its registration, for ``LATE``)
        in one of its gaps; a job waits on its queue."""
        self._poll_across_a_lend(i, j, device, gap)

    def _poll_across_a_lend(self, i, j, device, gap):
        assert self.clients[i].post("/v1/job", json={"job_queue": "gpu-hosts"}).status_code == 200
        reading = self._read_gate(i, device)
        if reading is None:
            return

        def lend():
            if device == LATE:
                self._register(j)
            self._lend(j, device)

        if gap == "R1-pop":
            lend()
        flight = self._pop(reading)
        if flight is None:
            return
        if gap == "pop-end":
            lend()
        self._end(flight)
        if gap == "end-post":
            lend()
        if (device, flight[2]) in self.unposted:
            self.unposted.remove((device, flight[2]))
            self._post(device, flight[2])

    @rule(i=st.integers(0, 1), j=st.integers(0, 1),
          gap=st.sampled_from(["R1-pop", "pop-end", "end-post"]))
    def poll_across_a_registration(self, i, j, gap):
        """``LATE``'s poll while its agent host registers it and it is lent at once: R1 reads no
        gate (``LATE`` deregistered first, its gate dropped by a tick), the registration and the
        lend land in one gap."""
        if self.db.magic_device_claims.find_one({"_id": LATE}) is not None:
            return  # lent: its host cannot deregister it
        self._register(j, with_late=False)
        self.apps[j].extensions["testflinger_magic"].tick()
        self._poll_across_a_lend(i, j, LATE, gap)

    @rule(i=st.integers(0, 1), j=st.integers(0, 1), data=st.data(),
          gap=st.sampled_from(["R1-pop", "pop-end", "end-post"]))
    def poll_across_a_restore(self, i, j, data, gap):
        """A VM agent's poll with its lease's drain and the ticks that take it to restoring in
        one of its gaps; a job waits on its queue."""
        vms = sorted({vm["agent_name"] for lease in self.db.magic_leases.find(
            {"state": {"$in": ["active", "draining"]}}) for vm in lease["vms"]})
        if not vms:
            return
        agent = data.draw(st.sampled_from(vms))
        assert self.clients[i].post("/v1/job", json={"job_queue": "one-gpu-vm"}).status_code == 200
        reading = self._read_gate(i, agent)
        if reading is None:
            return

        def restore():
            self._drain(j)
            for k in (j, 1 - j):
                self.apps[k].extensions["testflinger_magic"].tick()

        if gap == "R1-pop":
            restore()
        flight = self._pop(reading)
        if flight is None:
            return
        if gap == "pop-end":
            restore()
        self._end(flight)
        if gap == "end-post":
            restore()
        if (agent, flight[2]) in self.unposted:
            self.unposted.remove((agent, flight[2]))
            self._post(agent, flight[2])

    @rule(data=st.data())
    def finish_a_job(self, data):
        self._finish(data)

    @rule(i=st.integers(0, 1), data=st.data())
    def daemon_step(self, i, data):
        self._daemon(i, data)

    @rule(i=st.integers(0, 1))
    def drain_all(self, i):
        self._drain(i)

    # ---------------------------------------------------------------- invariants

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

    @invariant()
    def no_job_stranded(self):
        """A running job is in a poll still in flight or was delivered (a job the hook
        answered 204 for went back to waiting)."""
        held = {j for jobs in self.delivered.values() for j in jobs}
        held |= {f[2] for f in self.in_flight}
        for job in self.db.jobs.find({"result_data.job_state": "running"}, {"job_id": 1}):
            assert job["job_id"] in held, f"job {job['job_id']} is running with no agent"


TestTwoReplicas = TwoReplicas.TestCase
# Deliberate breaks of gates.py, examples until caught over five seeds (generate phase, 40 steps):
# hand_out delivering to an agent fenced since R1: 4-15; give_back doing nothing: 6-20;
# unattributed_jobs always empty: 4-40; no second gate read for a poll that read no gate: 8-67.
TestTwoReplicas.settings = settings(max_examples=100, stateful_step_count=40, deadline=None,
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
