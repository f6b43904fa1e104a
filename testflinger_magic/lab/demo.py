"""``testflinger-magic demo``: the whole magic-queue cycle on the embedded lab.

It starts the lab (two 8-GPU devices serving the home queue ``gpu-hosts``, the example
``one-gpu-vm`` magic queue), submits the job files of ``examples/jobs/`` through the same HTTP calls
``testflinger-cli submit`` makes (enough that a second device must be lent, plus a home-queue job
while a device is lent), shows leases, agents and jobs as they move, waits until every job is
complete and every device has been restored and serves its home queue again, counts orphans and
writes ``demo-summary.json``. Exit status 0 only when all jobs completed, every VM agent of a
lent device appeared on the server, and nothing is orphaned.

Whatever happens (a timeout, a refused submission, SIGINT or SIGTERM) the lab is stopped, the
Summary printed and the JSON written with an ``errors`` list; the lab files are kept on failure
(and a temporary work directory removed after success).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path

import requests
import yaml

from ..queues import DefinitionError
from ..tfstates import AGENT_MAINTENANCE, AGENT_OFFLINE, JOB_TERMINAL
from .lab import EXAMPLES, Lab, LabError, LabOptions, lab_definitions, policy_summary

#: Agent states whose changes the progress shows (a lent device agent is ``maintenance``:
#: leases.LENT_AGENT_STATE).
SHOWN_STATES = ("waiting", AGENT_OFFLINE, AGENT_MAINTENANCE)

#: Defaults of ``testflinger-magic demo``: submissions of each job file, give-up time (s).
DEFAULT_COPIES = 4
DEFAULT_TIMEOUT = 240.0
DEFAULT_SUMMARY = "demo-summary.json"
#: Seconds the post-return check waits for a home-queue job to complete on a device agent.
HOME_CHECK_SECONDS = 60.0


class DemoInterrupted(KeyboardInterrupt):
    """SIGTERM (or another signal) ended the demo; it unwinds like Ctrl-C so the lab stops."""

    def __init__(self, signum: int):
        super().__init__(f"signal {signum}")
        self.signum = signum


#: Signals the demo's handler received (cmd_demo). The handler raises DemoInterrupted in the
#: main thread, but a handler that runs while the interpreter is inside a ``__del__``, a
#: weakref or GC callback has its exception swallowed ("Exception ignored in ..."): the
#: scenario's loop then raises it itself (:func:`interrupt_if_signalled`). Seen once: a
#: SIGTERM after the first claim and the demo ran on to its end, exit 0.
SIGNALLED: list[int] = []


def interrupt_if_signalled() -> None:
    """Raise DemoInterrupted if the demo's handler received a signal (:data:`SIGNALLED`)."""
    if SIGNALLED:
        raise DemoInterrupted(SIGNALLED[0])


class Submitter:
    """Submit jobs the way ``testflinger-cli submit`` does (TESTFLINGER.md §4.1, §4.2).

    First ``GET /v1/queues/<queue>/agents`` (the CLI exits on 404, and refuses a queue with no
    agent whose state is not ``offline`` and whose name the job's ``exclude_agents`` does not
    list: testflinger-cli fe381ff ``check_online_agents_available``), then ``POST /v1/job``
    with the job dict unchanged. Raises ``RuntimeError`` with the server's message when the
    CLI would have refused.
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
        excluded = job.get("exclude_agents") or []
        if not any(a.get("state") != AGENT_OFFLINE and a.get("name") not in excluded
                   for a in agents) and not wait_for_available_agents:
            raise RuntimeError(f"testflinger-cli would refuse: no online agents for queue {queue}"
                               + (" that the job does not exclude" if excluded else ""))
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

    def __init__(self, lab: Lab | None, out=sys.stdout):
        self.lab = lab  # set before poll() when the lab is started after the first say()
        self.out = out
        self.t0 = time.monotonic()
        self.lease_state: dict[str, str] = {}
        # History entries already shown per lease: every transition is printed with its
        # reason, also those that happened between two polls (the claim's reason included).
        self.lease_shown: dict[str, int] = {}
        self.agent_state: dict[str, str] = {}
        # Agents already shown: an agent's first post has no queues yet (as with the real
        # testflinger-agent), so it is announced once its queues are known.
        self.agent_shown: set[str] = set()
        # Every agent name the server ever had (VM agents are removed when their lease ends),
        # for the summary's check that each lent device's VM agents did register.
        self.agents_seen: set[str] = set()
        self.job_state: dict[str, str] = {}
        self.job_names: dict[str, str] = {}
        self.lock = threading.Lock()

    def say(self, text: str) -> None:
        with self.lock:
            print(f"[{time.monotonic() - self.t0:6.1f}s] {text}", file=self.out, flush=True)

    def show_lease(self, lease: dict) -> None:
        """Print the lease's transitions not shown yet, each with its reason (``new ->
        claimed  (why it was lent)``), from its history: a poll that first sees the lease
        ``fenced`` still shows why it was claimed."""
        history = lease.get("history") or []
        shown = self.lease_shown.get(lease["_id"], 0)
        for i in range(shown, len(history)):
            old = history[i - 1].get("state") if i else "new"
            why = history[i].get("reason", "")
            self.say(f"lease {lease['_id']} {lease['device']} -> {lease['queue']}: "
                     f"{old} -> {history[i].get('state')}" + (f"  ({why})" if why else ""))
        self.lease_shown[lease["_id"]] = len(history)
        self.lease_state[lease["_id"]] = lease["state"]

    def poll(self, submitter: Submitter, job_ids: list[str]) -> None:
        db = self.lab.db
        for lease in db["magic_leases"].find({}, sort=[("created_at", 1)]):
            self.show_lease(lease)
        for agent in db["agents"].find({}, sort=[("name", 1)]):
            name, state = agent["name"], agent.get("state", "?")
            queues = ",".join(agent.get("queues") or [])
            if name not in self.agent_shown:
                if queues:
                    self.say(f"agent {name} appeared on {queues} ({state})")
                    self.agent_shown.add(name)
            elif self.agent_state.get(name) != state and (
                    state in SHOWN_STATES or self.agent_state.get(name) in SHOWN_STATES):
                self.say(f"agent {name}: {self.agent_state[name]} -> {state}"
                         + (f"  ({agent['comment']})" if agent.get("comment") else ""))
            self.agent_state[name] = state
            self.agents_seen.add(name)
        seen = {a["name"] for a in db["agents"].find({}, {"name": 1})}
        for name in [n for n in self.agent_state if n not in seen]:
            if name in self.agent_shown:
                self.say(f"agent {name} removed")
            self.agent_shown.discard(name)
            del self.agent_state[name]
        running_on = {a.get("job_id"): a["name"] for a in db["agents"].find({"job_id": {"$nin": ["", None]}})}
        for job_id in job_ids:
            state = submitter.state(job_id)
            if self.job_state.get(job_id) != state:
                self.job_state[job_id] = state
                where = f" on {running_on[job_id]}" if job_id in running_on else ""
                self.say(f"job {job_id[:8]} {self.job_names.get(job_id, '')}: {state}{where}")


def submit_file(sub: Submitter, name: str, job: dict, wait: bool = False) -> str:
    """Submit the job of file ``name``; a refusal (RuntimeError) names the file."""
    try:
        return sub.submit(job, wait_for_available_agents=wait)
    except RuntimeError as exc:
        raise RuntimeError(f"job file {name}: {exc}") from None


def load_jobs(jobs_dir: Path) -> list[tuple[str, dict]]:
    """The job files of ``jobs_dir`` as ``[(file name, job dict)]``, sorted by name."""
    jobs = []
    for path in sorted(Path(jobs_dir).glob("*.y*ml")):
        try:
            job = yaml.safe_load(path.read_text())
        except yaml.YAMLError as exc:
            raise ValueError(f"{path}: not valid YAML: {exc}") from None
        if not isinstance(job, dict) or "job_queue" not in job:
            raise ValueError(f"{path}: not a Testflinger job (no job_queue)")
        jobs.append((path.name, job))
    if not jobs:
        raise ValueError(f"{jobs_dir}: no job files (*.yaml)")
    return jobs


def run_demo(opt: LabOptions, *, jobs_dir: Path, copies: int, timeout: float, out=None) -> dict:
    """Run the scenario and return the summary dict (see module docstring).

    ``copies`` (>= 1): submissions of each magic-queue job file; ``timeout`` (seconds, > 0): how
    long to wait for every job to complete and every device to be back. Keys: ``jobs_submitted``,
    ``jobs_completed``, ``leases`` (``id``, ``device``, ``queue``, ``states``, ``vms``),
    ``orphans``, ``home_queue_served_after_return``, ``errors`` (strings; empty on success),
    ``interrupted`` (signal number, or None) and ``wall_seconds``. The lab is stopped before it
    returns. Failures of the scenario (timeout, a refused submission, the lab not starting, an
    interrupt) are recorded in ``errors``, not raised; ``ValueError`` for bad job files and
    ``queues.DefinitionError`` for a bad queues file, both before anything starts.
    """
    started = time.monotonic()
    jobs = load_jobs(jobs_dir)
    summary: dict = {"jobs_submitted": 0, "jobs_completed": 0, "leases": [], "orphans": {},
                     "home_queue_served_after_return": False, "errors": [], "interrupted": None}
    progress = Progress(None, out or sys.stdout)
    progress.say("demo policy, shortened from the example so a cycle fits in about a minute: "
                 + policy_summary(lab_definitions(opt)))
    try:
        with Lab(opt) as lab:
            progress.lab = lab
            _scenario(lab, opt, jobs, copies, timeout, progress, summary)
    except LabError as exc:
        summary["errors"].append(str(exc))
    except KeyboardInterrupt as exc:  # Ctrl-C, or SIGTERM via DemoInterrupted; the lab is stopped
        signum = getattr(exc, "signum", signal.SIGINT)
        summary["interrupted"] = int(signum)
        summary["errors"].append(f"interrupted by {signal.Signals(signum).name}")
    summary["wall_seconds"] = round(time.monotonic() - started, 1)
    return summary


def _scenario(lab: Lab, opt: LabOptions, jobs: list, copies: int, timeout: float,
              progress: Progress, summary: dict) -> None:
    """Submit, follow and check (fills ``summary``); errors of the scenario go to ``errors``."""
    progress.say(f"lab up: Testflinger server {lab.server_url}, MAAS {lab.maas_url}, "
                 f"{opt.devices} devices x {opt.gpus} GPUs on home queue {opt.home_queue}")
    sub = Submitter(lab.server_url, lab.token("lab-user"))
    magic = [(n, j) for n, j in jobs if j["job_queue"] != opt.home_queue]
    home = [(n, j) for n, j in jobs if j["job_queue"] == opt.home_queue]
    job_ids: list[str] = []

    def submit(name, job, wait=False):
        job_id = submit_file(sub, name, job, wait)
        job_ids.append(job_id)
        progress.job_names[job_id] = job.get("name", name)
        progress.say(f"submitted {name} to {job['job_queue']}: job {job_id[:8]}")

    def devices_not_back() -> list[str]:
        return [d for d in opt.device_names()
                if (lab.agent_doc(d) or {}).get("state")
                in (None, AGENT_OFFLINE, AGENT_MAINTENANCE)]

    try:
        progress.poll(sub, [])  # the lab as it starts: device agents waiting on the home queue
        for _ in range(copies):
            for name, job in magic:
                submit(name, job)
        home_sent = not home
        deadline = time.monotonic() + timeout
        while True:
            progress.poll(sub, job_ids)
            if not home_sent and lab.db["magic_leases"].count_documents({"state": "active"}):
                # A job for the devices' own queue while they are lent: it waits for a device
                # (a lent device agent shows maintenance, so the plain CLI check passes too,
                # leases.LENT_AGENT_STATE; the flag keeps the demo safe from the agent's own
                # offline before the next tick sets maintenance back).
                for name, job in home:
                    submit(name, job, wait=True)
                home_sent = True
            done = home_sent and all(progress.job_state.get(j) in JOB_TERMINAL for j in job_ids)
            open_leases = lab.db["magic_leases"].count_documents({"state": {"$nin": ["returned", "failed"]}})
            any_lease = lab.db["magic_leases"].count_documents({})
            # Returned leases not yet judged by the give-back check (server/giveback.py: the
            # next tick after the device agent posts its state).
            unjudged = lab.db["magic_leases"].count_documents(
                {"state": "returned", "giveback": {"$exists": False}})
            if done and open_leases == 0 and any_lease and not devices_not_back() \
                    and not unjudged:
                break
            if time.monotonic() >= deadline:
                complete = sum(1 for j in job_ids if progress.job_state.get(j) in JOB_TERMINAL)
                away = devices_not_back()
                summary["errors"].append(
                    f"timed out after {timeout:g}s (--timeout): {complete}/{len(job_ids)} jobs "
                    f"finished, {open_leases} lease(s) not returned"
                    + (f", not back on {opt.home_queue}: {', '.join(away)}" if away else ""))
                break
            time.sleep(0.5)
            interrupt_if_signalled()
        progress.poll(sub, job_ids)
    except (RuntimeError, requests.RequestException) as exc:
        summary["errors"].append(f"scenario stopped: {exc}")
    except KeyboardInterrupt:
        # Ctrl-C/SIGTERM: report what happened up to here (jobs, leases and their states) while
        # the lab still runs; run_demo records the interrupt itself once the lab is stopped.
        _record_progress(lab, job_ids, progress, summary, interrupted=True)
        raise
    problems = _record_progress(lab, job_ids, progress, summary)
    summary["errors"].extend(problems)
    # What the server knows of each device's NVSwitches (server/devicefacts.py): the lab's HGX
    # hosts' 4, listed by the simulated MAAS' commissioning and carried by the daemon's
    # registration (or, from an older MAAS, learnt at split), which keep them out of
    # two-gpu-vm (testflinger_magic/fabric.py).
    docs = list(lab.db["magic_devices"].find({}, {"nvswitches": 1, "nvswitches_found": 1}))
    summary["nvswitches"] = {d["_id"]: d.get("nvswitches") for d in docs}
    summary["nvswitches_source"] = {d["_id"]: (d.get("nvswitches_found") or {}).get("source")
                                    or "split" for d in docs if d.get("nvswitches")}
    summary["orphans"] = lab.orphans()
    away = devices_not_back()
    if away:
        summary["errors"].append(f"post-return check skipped: {', '.join(away)} not back on "
                                 f"{opt.home_queue}")
    else:
        served, problem = _home_served(opt, sub, progress, lent=bool(summary["leases"]))
        summary["home_queue_served_after_return"] = served
        if problem:
            summary["errors"].append(problem)


def _record_progress(lab: Lab, job_ids: list[str], progress: Progress, summary: dict,
                     interrupted: bool = False) -> list[str]:
    """Fill ``jobs_submitted``, ``jobs_completed`` and ``leases`` from what the lab shows now;
    return the problems the leases show (none are judged after an interrupt: the leases were
    cut short on purpose)."""
    summary["jobs_submitted"] = len(job_ids)
    summary["jobs_completed"] = sum(1 for j in job_ids if progress.job_state.get(j) == "complete")
    leases, problems = lease_summaries(
        lab.db["magic_leases"].find({}, sort=[("created_at", 1)]), progress.agents_seen)
    summary["leases"] = leases
    return [] if interrupted else problems


def lease_summaries(leases, agents_seen: set[str]) -> tuple[list[dict], list[str]]:
    """The summary's ``leases`` entries and the errors they show.

    Each entry has ``vm_agents``: ``expected`` (the lease's VM names) and ``seen`` (those the
    server had as agents at some poll). A lease that reached ``active`` while one of its VM
    agents never appeared is an error: that VM took no job although the device was lent (a
    VM agent that could not start keeps the device away from its home queue until the owner
    reclaims it), and all jobs completing on the other VMs must not hide it.
    """
    entries, errors = [], []
    for lease in leases:
        states = [h["state"] for h in lease.get("history", [])]
        expected = [vm["name"] for vm in lease.get("vms") or [] if vm.get("name")]
        seen = [n for n in expected if n in agents_seen]
        entries.append({
            "id": lease["_id"],
            "device": lease["device"],
            "queue": lease["queue"],
            "states": states,
            "vms": len(lease.get("vms", [])),
            "vm_agents": {"expected": expected, "seen": seen},
            # server/giveback.py: "verified" once the device agent posted after the return
            "giveback": (lease.get("giveback") or {}).get("state"),
        })
        if (lease.get("giveback") or {}).get("state") == "overdue":
            errors.append(f"lease {lease['_id']} ({lease['device']}): its device agent was not "
                          "seen after the return (give-back check); the device is quarantined")
        missing = [n for n in expected if n not in agents_seen]
        if "active" in states and missing:
            errors.append(f"lease {lease['_id']} ({lease['device']} -> {lease['queue']}): VM "
                          f"agent(s) never appeared on the server: {', '.join(missing)} "
                          f"({len(seen)}/{len(expected)} seen)")
    return entries, errors


def _home_served(opt: LabOptions, sub: Submitter, progress: Progress,
                 lent: bool = True) -> tuple[bool, str]:
    """After every lease is returned, a home-queue job must run on a device agent again
    (``lent``: a device was lent at all; without a lease the line says so, not "again").

    Returns ``(served, problem)``; ``problem`` is "" when served. Never raises for a refusal
    or an HTTP error: they are the problem.
    """
    job = {"job_queue": opt.home_queue, "name": "post-return-check", "test_data": {"test_cmds": "true"}}
    try:
        job_id = sub.submit(job, wait_for_available_agents=True)
        progress.job_names[job_id] = "post-return-check"
        end = time.monotonic() + HOME_CHECK_SECONDS
        state = "unknown"
        while time.monotonic() < end:
            state = sub.state(job_id)
            if state == "complete":
                progress.say(f"home queue {opt.home_queue} served again by its device agents "
                             f"(job {job_id[:8]})" if lent else
                             f"home queue {opt.home_queue} served by its device agents (job "
                             f"{job_id[:8]}); no device was lent")
                return True, ""
            time.sleep(0.5)
    except (RuntimeError, requests.RequestException) as exc:
        return False, f"post-return check on {opt.home_queue}: {exc}"
    return False, (f"post-return check: home-queue job {job_id[:8]} still {state} after "
                   f"{HOME_CHECK_SECONDS:g}s")


def check_summary_path(path: Path) -> str | None:
    """Create the folder of the summary file; the problem as a sentence, or None when ``path``
    can be written (checked before the demo starts, so a long run is not lost at the end)."""
    try:
        if path.is_dir():
            return f"--summary {path}: is a directory"
        path.parent.mkdir(parents=True, exist_ok=True)
        if not os.access(path.parent, os.W_OK | os.X_OK) or (path.exists() and not os.access(path, os.W_OK)):
            return f"--summary {path}: not writable"
    except OSError as exc:
        return f"--summary {path}: cannot create its folder: {exc.strerror or exc}"
    return None


def print_summary(summary: dict, ok: bool, out=None) -> None:
    """The human summary of ``run_demo``'s dict on ``out`` (default: the current stdout)."""
    out = out or sys.stdout
    orphans = summary["orphans"]
    print(file=out)
    print("Summary", file=out)
    print(f"  jobs: {summary['jobs_completed']}/{summary['jobs_submitted']} complete", file=out)
    for lease in summary["leases"]:
        agents = lease.get("vm_agents")
        seen = f", VM agents seen {len(agents['seen'])}/{len(agents['expected'])}" if agents else ""
        print(f"  lease {lease['id']}: {lease['device']} -> {lease['queue']} ({lease['vms']} VMs"
              f"{seen}): " + " -> ".join(lease["states"]), file=out)
    learnt = {d: n for d, n in (summary.get("nvswitches") or {}).items() if n}
    sources = summary.get("nvswitches_source") or {}
    for source, how in (("maas", "listed by MAAS commissioning"), ("split", "learnt at split")):
        these = {d: n for d, n in learnt.items() if sources.get(d, "split") == source}
        if these:
            print(f"  NVSwitches {how}: " + ", ".join(f"{d} {n}" for d, n in these.items())
                  + " (never lent to queues of several GPUs per VM, e.g. two-gpu-vm, unless "
                  "the agent host sets splitter.nvswitch_multi_gpu)", file=out)
    print("  orphans: " + (", ".join(f"{k}={v}" for k, v in orphans.items()) or "not counted"),
          file=out)
    for err in summary["errors"]:
        print(f"  error: {err}", file=out)
    print(f"  wall time: {summary['wall_seconds']}s", file=out)
    print("  result: " + ("OK" if ok else "FAILED"), file=out, flush=True)


def main(args) -> int:
    """Entry point of ``testflinger-magic demo``; returns the exit status.

    0: every job completed, nothing orphaned; 1: the demo failed (see the Summary); 2: a bad
    option (the summary path cannot be written); 128+N: ended by signal N (lab stopped).
    Options left None take the defaults (argparse validated the others).
    """
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    summary = getattr(args, "summary", None)
    summary_path = Path(summary if summary is not None else DEFAULT_SUMMARY)
    problem = check_summary_path(summary_path)
    if problem:
        print(f"testflinger-magic demo: {problem}", file=sys.stderr)
        return 2
    given_workdir = getattr(args, "workdir", None)
    workdir = Path(given_workdir) if given_workdir is not None else Path(tempfile.mkdtemp(prefix="tf-magic-demo-"))
    opt = LabOptions(workdir=workdir)
    if getattr(args, "time_scale", None) is not None:
        opt.time_scale = args.time_scale
    if getattr(args, "phase_seconds", None) is not None:
        opt.phase_seconds = args.phase_seconds
    jobs_dir = getattr(args, "jobs_dir", None)
    jobs_dir = Path(jobs_dir) if jobs_dir is not None else EXAMPLES / "jobs"
    copies = getattr(args, "copies", None)
    copies = DEFAULT_COPIES if copies is None else int(copies)
    timeout = getattr(args, "timeout", None)
    timeout = DEFAULT_TIMEOUT if timeout is None else float(timeout)

    def interrupted(signum, _frame):
        SIGNALLED.append(signum)
        raise DemoInterrupted(signum)

    # SIGTERM (timeout, CI cancellation, kill) unwinds like Ctrl-C, so the lab is stopped.
    # --json: the summary as JSON is the output (stdout); progress and the human summary go
    # to stderr.
    as_json = bool(getattr(args, "json", False))
    human = sys.stderr if as_json else sys.stdout
    SIGNALLED.clear()
    previous = signal.signal(signal.SIGTERM, interrupted)
    try:
        summary = run_demo(opt, jobs_dir=jobs_dir, copies=copies, timeout=timeout, out=human)
    except (ValueError, DefinitionError) as exc:  # bad job or queue files: nothing was started
        print(f"demo failed: {exc}", file=sys.stderr)
        _remove_temporary(workdir, given_workdir)
        return 1
    finally:
        signal.signal(signal.SIGTERM, previous)
    ok = (
        summary["jobs_completed"] == summary["jobs_submitted"] > 0
        and not any(summary["orphans"].values())
        and not summary["errors"]
        and summary["home_queue_served_after_return"]
    )
    print_summary(summary, ok, out=human)
    if as_json:
        print(json.dumps(summary, indent=2), flush=True)
    try:
        summary_path.write_text(json.dumps(summary, indent=2) + "\n")
        print(f"  summary written to {summary_path}", file=human)
    except OSError as exc:
        print(f"testflinger-magic demo: cannot write {summary_path}: {exc}", file=sys.stderr)
        ok = False
    if ok:
        _remove_temporary(workdir, given_workdir)
        if given_workdir is not None:
            print(f"  lab files in {workdir}", file=human)
    else:
        print(f"  lab files kept in {workdir} (daemon.log, supervisor/, agent logs)", file=human)
    if summary["interrupted"]:
        return 128 + summary["interrupted"]
    return 0 if ok else 1


def _remove_temporary(workdir: Path, given_workdir) -> None:
    """Remove the work directory the demo created itself (never one given with --workdir)."""
    if given_workdir is None:
        shutil.rmtree(workdir, ignore_errors=True)
