"""``testflinger-magic demo``: the whole magic-queue cycle on the embedded lab.

It starts the lab (two 8-GPU devices serving the home queue ``gpu-hosts``, the example
``one-gpu-vm`` magic queue), submits the job files of ``examples/jobs/`` through the same HTTP calls
``testflinger-cli submit`` makes (enough that a second device must be lent, plus a home-queue job
while a device is lent), shows leases, agents and jobs as they move, waits until every job is
complete and every device has been restored and serves its home queue again, counts orphans and
writes ``demo-summary.json``. Exit status 0 only when all jobs completed and nothing is orphaned.
"""

from __future__ import annotations

import json
import logging
import sys
import tempfile
import threading
import time
from pathlib import Path

import requests
import yaml

from ..tfstates import AGENT_OFFLINE, JOB_TERMINAL
from .lab import EXAMPLES, Lab, LabError, LabOptions


class Submitter:
    """Submit jobs the way ``testflinger-cli submit`` does (TESTFLINGER.md §4.1, §4.2).

    First ``GET /v1/queues/<queue>/agents`` (the CLI exits on 404, and refuses a queue with no
    agent whose state is not ``offline``), then ``POST /v1/job`` with the job dict unchanged.
    Raises ``RuntimeError`` with the server's message when the CLI would have refused.
    """

    def __init__(self, server_url: str, token: str | None):
        self.url = server_url.rstrip("/")
        self.headers = {"Authorization": f"Bearer {token}"} if token else {}

    def submit(self, job: dict, wait_for_available_agents: bool = False) -> str:
        """POST the job after the CLI's preflight; returns the job_id.

        ``wait_for_available_agents`` behaves like the CLI flag: a queue whose agents are all
        offline (e.g. every device lent) is submitted anyway; a 404 still refuses.
        """
        queue = job["job_queue"]
        r = requests.get(f"{self.url}/v1/queues/{queue}/agents", headers=self.headers, timeout=10)
        if r.status_code == 404:
            raise RuntimeError(f"testflinger-cli would exit: {r.json().get('message', r.text)}")
        agents = r.json() if r.status_code == 200 else []
        if not any(a.get("state") != AGENT_OFFLINE for a in agents) and not wait_for_available_agents:
            raise RuntimeError(f"testflinger-cli would refuse: no online agents for queue {queue}")
        r = requests.post(f"{self.url}/v1/job", json=job, headers=self.headers, timeout=10)
        if r.status_code != 200:
            raise RuntimeError(f"POST /v1/job for {queue} failed with {r.status_code}: {r.text[:300]}")
        return r.json()["job_id"]

    def state(self, job_id: str) -> str:
        r = requests.get(f"{self.url}/v1/result/{job_id}", headers=self.headers, timeout=10)
        r.raise_for_status()
        return r.json().get("job_state", "unknown")


class Progress:
    """Prints what a person wants to follow: lease state changes, agents appearing, jobs moving."""

    def __init__(self, lab: Lab, out=sys.stdout):
        self.lab = lab
        self.out = out
        self.t0 = time.monotonic()
        self.lease_state: dict[str, str] = {}
        self.agent_state: dict[str, str] = {}
        self.job_state: dict[str, str] = {}
        self.job_names: dict[str, str] = {}
        self.lock = threading.Lock()

    def say(self, text: str) -> None:
        with self.lock:
            print(f"[{time.monotonic() - self.t0:6.1f}s] {text}", file=self.out, flush=True)

    def poll(self, submitter: Submitter, job_ids: list[str]) -> None:
        db = self.lab.db
        for lease in db["magic_leases"].find({}, sort=[("created_at", 1)]):
            old = self.lease_state.get(lease["_id"])
            if old != lease["state"]:
                self.lease_state[lease["_id"]] = lease["state"]
                why = (lease.get("history") or [{}])[-1].get("reason", "")
                self.say(f"lease {lease['_id']} {lease['device']} -> {lease['queue']}: "
                         f"{old or 'new'} -> {lease['state']}" + (f"  ({why})" if why else ""))
        for agent in db["agents"].find({}, sort=[("name", 1)]):
            name, state = agent["name"], agent.get("state", "?")
            if self.agent_state.get(name) != state:
                if name not in self.agent_state:
                    self.say(f"agent {name} appeared on {','.join(agent.get('queues', []))} ({state})")
                elif state in ("waiting", "offline") or self.agent_state.get(name) in ("waiting", "offline"):
                    self.say(f"agent {name}: {self.agent_state[name]} -> {state}"
                             + (f"  ({agent['comment']})" if agent.get("comment") else ""))
                self.agent_state[name] = state
        seen = {a["name"] for a in db["agents"].find({}, {"name": 1})}
        for name in [n for n in self.agent_state if n not in seen]:
            self.say(f"agent {name} removed")
            del self.agent_state[name]
        running_on = {a.get("job_id"): a["name"] for a in db["agents"].find({"job_id": {"$nin": ["", None]}})}
        for job_id in job_ids:
            state = submitter.state(job_id)
            if self.job_state.get(job_id) != state:
                self.job_state[job_id] = state
                where = f" on {running_on[job_id]}" if job_id in running_on else ""
                self.say(f"job {job_id[:8]} {self.job_names.get(job_id, '')}: {state}{where}")


def load_jobs(jobs_dir: Path) -> list[tuple[str, dict]]:
    """The job files of ``jobs_dir`` as ``[(file name, job dict)]``, sorted by name."""
    jobs = []
    for path in sorted(Path(jobs_dir).glob("*.y*ml")):
        job = yaml.safe_load(path.read_text())
        if not isinstance(job, dict) or "job_queue" not in job:
            raise ValueError(f"{path}: not a Testflinger job (no job_queue)")
        jobs.append((path.name, job))
    if not jobs:
        raise ValueError(f"{jobs_dir}: no job files (*.yaml)")
    return jobs


def run_demo(opt: LabOptions, *, jobs_dir: Path, copies: int, timeout: float, out=sys.stdout) -> dict:
    """Run the scenario and return the summary dict (see module docstring)."""
    started = time.monotonic()
    jobs = load_jobs(jobs_dir)
    summary: dict = {"jobs_submitted": 0, "jobs_completed": 0, "leases": [], "orphans": {}, "errors": []}
    with Lab(opt) as lab:
        progress = Progress(lab, out)
        progress.say(f"lab up: Testflinger server {lab.server_url}, MAAS {lab.maas_url}, "
                     f"{opt.devices} devices x {opt.gpus} GPUs on home queue {opt.home_queue}")
        sub = Submitter(lab.server_url, lab.token("lab-user"))
        progress.poll(sub, [])  # the lab as it starts: device agents waiting on the home queue
        magic = [(n, j) for n, j in jobs if j["job_queue"] != opt.home_queue]
        home = [(n, j) for n, j in jobs if j["job_queue"] == opt.home_queue]
        job_ids: list[str] = []

        def submit(name, job, wait=False):
            job_id = sub.submit(job, wait_for_available_agents=wait)
            job_ids.append(job_id)
            progress.job_names[job_id] = job.get("name", name)
            progress.say(f"submitted {name} to {job['job_queue']}: job {job_id[:8]}")

        for _ in range(copies):
            for name, job in magic:
                submit(name, job)
        home_sent = not home
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            progress.poll(sub, job_ids)
            if not home_sent and lab.db["magic_leases"].count_documents({"state": "active"}):
                # A job for the devices' own queue while they are lent: like
                # `testflinger-cli submit --wait-for-available-agents`, it waits for a device.
                for name, job in home:
                    submit(name, job, wait=True)
                home_sent = True
            done = home_sent and all(progress.job_state.get(j) in JOB_TERMINAL for j in job_ids)
            open_leases = lab.db["magic_leases"].count_documents({"state": {"$nin": ["returned", "failed"]}})
            devices_back = all(
                (lab.agent_doc(d) or {}).get("state") not in (None, AGENT_OFFLINE) for d in opt.device_names()
            )
            if done and open_leases == 0 and lab.db["magic_leases"].count_documents({}) and devices_back:
                break
            time.sleep(0.5)
        else:
            summary["errors"].append(f"timed out after {timeout:.0f}s")
        progress.poll(sub, job_ids)
        summary["jobs_submitted"] = len(job_ids)
        summary["jobs_completed"] = sum(1 for j in job_ids if progress.job_state.get(j) == "complete")
        for lease in lab.db["magic_leases"].find({}, sort=[("created_at", 1)]):
            summary["leases"].append({
                "id": lease["_id"],
                "device": lease["device"],
                "queue": lease["queue"],
                "states": [h["state"] for h in lease.get("history", [])],
                "vms": len(lease.get("vms", [])),
            })
        summary["orphans"] = lab.orphans()
        summary["home_queue_served_after_return"] = _home_served(lab, opt, sub, progress)
    summary["wall_seconds"] = round(time.monotonic() - started, 1)
    return summary


def _home_served(lab: Lab, opt: LabOptions, sub: Submitter, progress: Progress) -> bool:
    """After every lease is returned, a home-queue job must run on a device agent again."""
    job = {"job_queue": opt.home_queue, "name": "post-return-check", "test_data": {"test_cmds": "true"}}
    job_id = sub.submit(job)
    progress.job_names[job_id] = "post-return-check"
    end = time.monotonic() + 60
    while time.monotonic() < end:
        if sub.state(job_id) == "complete":
            progress.say(f"home queue {opt.home_queue} served again by its device agents (job {job_id[:8]})")
            return True
        time.sleep(0.5)
    return False


def main(args) -> int:
    """Entry point of ``testflinger-magic demo``; returns the exit status."""
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    summary_path = Path(getattr(args, "summary", None) or "demo-summary.json")
    workdir = Path(getattr(args, "workdir", None) or tempfile.mkdtemp(prefix="tf-magic-demo-"))
    opt = LabOptions(workdir=workdir)
    if getattr(args, "time_scale", None):
        opt.time_scale = args.time_scale
    if getattr(args, "phase_seconds", None):
        opt.phase_seconds = args.phase_seconds
    jobs_dir = Path(getattr(args, "jobs_dir", None) or EXAMPLES / "jobs")
    copies = int(getattr(args, "copies", None) or 4)
    timeout = float(getattr(args, "timeout", None) or 240)
    try:
        summary = run_demo(opt, jobs_dir=jobs_dir, copies=copies, timeout=timeout)
    except (LabError, RuntimeError, ValueError) as exc:
        print(f"demo failed: {exc}", file=sys.stderr)
        print(f"(lab files and daemon.log are in {workdir})", file=sys.stderr)
        return 1
    summary_path.write_text(json.dumps(summary, indent=2) + "\n")
    orphans = summary["orphans"]
    ok = (
        summary["jobs_completed"] == summary["jobs_submitted"] > 0
        and not any(orphans.values())
        and not summary["errors"]
        and summary["home_queue_served_after_return"]
    )
    print()
    print("Summary")
    print(f"  jobs: {summary['jobs_completed']}/{summary['jobs_submitted']} complete")
    for lease in summary["leases"]:
        print(f"  lease {lease['id']}: {lease['device']} -> {lease['queue']} ({lease['vms']} VMs): "
              + " -> ".join(lease["states"]))
    print("  orphans: " + ", ".join(f"{k}={v}" for k, v in orphans.items()))
    for err in summary["errors"]:
        print(f"  error: {err}")
    print(f"  wall time: {summary['wall_seconds']}s; summary written to {summary_path}")
    print("  result: " + ("OK" if ok else "FAILED") + f"   (lab files in {workdir})")
    return 0 if ok else 1
