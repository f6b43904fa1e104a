"""A testflinger-agent look-alike for the embedded lab.

Run as ``python -m testflinger_magic.lab.sim_agent -c testflinger-agent.conf [-p METRICS_PORT]
[--token-file F]``. It reads the same YAML config as testflinger-agent and talks to the server the
same way (canonical/testflinger ``agent/src/testflinger_agent/__init__.py``, ``agent.py``,
``client.py``, ``job.py``; TESTFLINGER.md §3), but never executes anything: each phase echoes the
job's own ``provision_data`` / ``test_data.test_cmds`` into the output log and sleeps
``SIM_AGENT_PHASE_SECONDS`` (default 0.5 s), looking for a cancel every 10 s of it except in
``provision``, as the real agent's runner does.

Deviations, for a fast lab: an unreachable server is re-tried every ``polling_interval`` (capped at
30 s) instead of 30-180 s, and a failed job poll waits ``polling_interval`` instead of 60 s; a
phase is skipped only when its ``<phase>_data`` is missing or has ``skip: true`` (the configured
``<phase>_command`` is not looked at, since nothing is executed); no attachments, artifacts,
webhook events, provision logs or SIGUSR1 restarts. The server state ``restart`` makes it post
``offline`` and exit 1 (supervisord restarts it), as the real agent.

SIGTERM: outside a job the real agent installs no handler (``__init__.py::start_agent``), so
SIGTERM's default action ends it at once, killed by the signal (supervisord's ``stopProcess``
returns as soon as it is reaped); so does this one (:func:`_on_sigterm`). During a job the real
agent's ``runner.py::CommandRunner.run`` handler kills only the phase's command; here, where
nothing is executed, SIGTERM during a job ends the agent at its next pause, with status 0 and
nothing more posted (a deviation: the real one would go on to the next phase until supervisord's
SIGKILL).

``SIM_AGENT_NEWER=1`` (or ``SimAgent(newer=True)``) behaves as testflinger-agent after fe381ff
(TESTFLINGER.md §9): it never posts ``{"job_id": ...}`` (testflinger#1253: the server records it),
a restart keeps a server state ``offline``/``maintenance`` instead of posting ``waiting``
(#1291), and a restart request is acknowledged by posting ``restart`` before exiting (#1304).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import signal
import sys
import threading
from datetime import datetime, timezone
from pathlib import Path

import requests
import yaml
# At import, as testflinger-agent does: its agent.py imports metrics.py, which imports
# prometheus_client at module level (agent/src/testflinger_agent/metrics.py).
from prometheus_client import CollectorRegistry, Counter, start_http_server

logger = logging.getLogger("sim_agent")

#: Phases the agent walks, in order (``agent.py::process_jobs``).
PHASES = ("setup", "provision", "firmware_update", "test", "allocate", "reserve")
#: Agent states in which the agent takes no job (``agent.py::check_offline``).
OFFLINE_STATES = ("offline", "maintenance")
DEFAULT_PHASE_SECONDS = 0.5
#: Seconds between a running phase's checks for a cancel: ``runner.py::CommandRunner.run``
#: sleeps 10 s between ``check_stop_conditions`` calls while the phase's command runs
#: (``SIM_AGENT_CANCEL_CHECK_SECONDS`` overrides it, for tests).
CANCEL_CHECK_SECONDS = 10.0
#: The one phase with no cancel check (``job.py::run_test_phase``: "Do not allow cancellation
#: during provision for safety reasons").
NO_CANCEL_PHASE = "provision"
HTTP_TIMEOUT = 30

_COMMANDS = ("setup", "provision", "firmware_update", "test", "allocate", "reserve", "cleanup")
#: testflinger-agent's config schema (``agent/src/testflinger_agent/schema.py``, voluptuous):
#: key -> (required, type, default). Keys not listed are rejected.
CONFIG_SCHEMA: dict[str, tuple[bool, type, object]] = {
    "agent_id": (True, str, None),
    "identifier": (False, str, None),
    "location": (False, str, None),
    "polling_interval": (True, int, 10),
    "server_address": (True, str, None),
    "execution_basedir": (True, str, "/tmp/testflinger/run"),
    "logging_basedir": (True, str, "/tmp/testflinger/logs"),
    "results_basedir": (True, str, "/tmp/testflinger/results"),
    "logging_level": (True, str, "INFO"),
    "logging_quiet": (True, bool, False),
    "job_queues": (True, list, None),
    **{f"{c}_command": (True, str, "") for c in _COMMANDS},
    "provision_type": (False, str, None),
    "global_timeout": (False, int, None),
    "output_timeout": (False, int, None),
    "advertised_queues": (False, dict, None),
    "advertised_images": (False, dict, None),
    "output_bytes": (False, int, 10 * 1024 * 1024),
}


class ConfigError(ValueError):
    """A config file that testflinger-agent would refuse; the message names file and key."""


class Stopped(Exception):
    """Raised inside the loop once SIGTERM arrived: unwind without posting anything."""


def validate_config(data, source: str = "<config>") -> dict:
    """Check ``data`` against :data:`CONFIG_SCHEMA`, fill defaults, return a new dict.

    Raises :class:`ConfigError` listing every problem as ``source: key: message``.
    """
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: expected a mapping of settings, got {type(data).__name__}")
    problems, out = [], {}
    for key in data:
        if key not in CONFIG_SCHEMA:
            problems.append(f"{source}: {key}: extra keys not allowed")
    for key, (required, kind, default) in CONFIG_SCHEMA.items():
        if key in data:
            value = data[key]
            # bool is an int in Python; voluptuous's int check rejects neither, keep it strict.
            if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
                problems.append(f"{source}: {key}: expected {kind.__name__}, "
                                f"got {type(value).__name__}")
            out[key] = value
        elif default is not None:
            out[key] = default
        elif required:
            problems.append(f"{source}: {key}: required key not provided")
    if problems:
        raise ConfigError("\n".join(problems))
    return out


def load_config(path: str | os.PathLike) -> dict:
    """Read and validate a testflinger-agent.conf (YAML); raises :class:`ConfigError`."""
    try:
        text = Path(path).read_text()
        data = yaml.safe_load(text)
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read: {exc.strerror}") from exc
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not YAML: {exc}") from exc
    return validate_config(data, str(path))


class ServerClient:
    """HTTP to the Testflinger server: cookies (``agent_name``), Bearer token from a refresh
    token file (``{"refresh_token": str}``), one replay after a 401 (``client.py``).

    Every call first checks ``stop``: after SIGTERM nothing more is sent (raises :class:`Stopped`).
    """

    def __init__(self, server: str, token_file: str | None, stop: threading.Event):
        if not server.lower().startswith("http"):
            server = f"http://{server}"
        self.server = server.rstrip("/")
        self.token_file = token_file
        self.stop = stop
        self.session = requests.Session()
        self._token: str | None = None

    def _access_token(self, renew: bool = False) -> str | None:
        if self._token and not renew:
            return self._token
        self._token = None
        if not self.token_file:
            return None
        try:
            refresh = json.loads(Path(self.token_file).read_text()).get("refresh_token")
        except (OSError, ValueError) as exc:
            logger.error("Failed to read token file %s: %s", self.token_file, exc)
            return None
        resp = requests.post(f"{self.server}/v1/oauth2/refresh",
                             json={"refresh_token": refresh}, timeout=HTTP_TIMEOUT)
        if resp.ok:
            self._token = resp.json().get("access_token")
        else:
            logger.error("Token refresh failed: %s %s", resp.status_code, resp.text[:200])
        return self._token

    def request(self, method: str, path: str, **kwargs) -> requests.Response:
        """Send ``method`` to ``<server><path>``; raises Stopped, or requests' errors."""
        for attempt in (0, 1):
            if self.stop.is_set():
                raise Stopped()
            headers = dict(kwargs.pop("headers", {}) or {})
            token = self._access_token(renew=attempt == 1)
            if token:
                headers["Authorization"] = f"Bearer {token}"
            resp = self.session.request(method, f"{self.server}{path}", headers=headers,
                                        timeout=HTTP_TIMEOUT, **kwargs)
            if resp.status_code != 401 or not self.token_file:
                return resp
        return resp

    def post(self, path: str, data) -> requests.Response | None:
        """POST JSON; a connection error is logged and gives None (the agent carries on)."""
        try:
            resp = self.request("POST", path, json=data)
        except requests.RequestException as exc:
            logger.error("POST %s failed: %s", path, exc)
            return None
        if not resp.ok:
            logger.error("POST %s: %s %s", path, resp.status_code, resp.text[:200])
        return resp

    def get_json(self, path: str, **params) -> dict:
        """GET; the JSON body, or ``{}`` on an error or an empty body."""
        try:
            resp = self.request("GET", path, params=params or None)
        except requests.RequestException as exc:
            logger.error("GET %s failed: %s", path, exc)
            return {}
        if not resp.ok or not resp.content:
            return {}
        try:
            return resp.json()
        except ValueError:
            return {}

    def reachable(self) -> bool:
        try:
            return self.request("GET", "/v1").status_code < 500
        except requests.RequestException:
            return False


class SimAgent:
    """The agent loop. ``config``: validated config dict; ``phase_seconds``: sleep per phase;
    ``in_job``: an event set while a job runs (``main``'s SIGTERM handler reads it)."""

    def __init__(self, config: dict, client: ServerClient, phase_seconds: float,
                 on_job=lambda: None, newer: bool = False,
                 in_job: threading.Event | None = None,
                 cancel_check: float = CANCEL_CHECK_SECONDS):
        self.cancel_check = cancel_check
        self.config = config
        self.client = client
        self.stop = client.stop
        self.agent_id = config["agent_id"]
        self.interval = config["polling_interval"]
        self.phase_seconds = phase_seconds
        self.on_job = on_job
        self.newer = newer
        #: set while a job runs (``run_job``): how SIGTERM is taken depends on it (``main``)
        self.in_job = in_job if in_job is not None else threading.Event()

    # -- server calls (client.py)
    def post_agent_data(self, data: dict) -> None:
        self.client.post(f"/v1/agents/data/{self.agent_id}", data)

    def set_state(self, state: str, comment: str = "") -> None:
        self.post_agent_data({"state": state, "comment": comment})

    def agent_state(self) -> tuple[str, str]:
        data = self.client.get_json(f"/v1/agents/data/{self.agent_id}")
        return data.get("state", "unknown"), data.get("comment", "")

    def post_advertised(self) -> None:
        if "advertised_queues" in self.config:
            self.client.post("/v1/agents/queues", self.config["advertised_queues"])
        if "advertised_images" in self.config:
            self.client.post("/v1/agents/images", self.config["advertised_images"])

    def sleep(self, seconds: float) -> None:
        if self.stop.wait(seconds):
            raise Stopped()

    # -- lifecycle (agent.py, __init__.py)
    def startup(self) -> None:
        """Post waiting (wiping offline/maintenance, as the real agent; a newer agent keeps
        them, testflinger#1291), queues, identity (``agent.py::TestflingerAgent.__init__``:
        ``set_agent_state(WAITING)`` then ``_post_initial_agent_data``). No ``job_id``, as the
        real one: the job it ran when it was stopped stays named in its document (only
        ``process_jobs`` clears it, after a job's outcome), and is never resumed: the restarted
        agent asks for a new job (testflinger_magic.stalejob)."""
        self.wait_for_server()
        if not (self.newer and self.agent_state()[0] in OFFLINE_STATES):
            self.set_state("waiting")
        self.post_advertised()
        data = {"location": self.config.get("location", ""), "queues": self.config["job_queues"],
                "provision_type": self.config.get("provision_type", "")}
        if self.config.get("identifier"):
            data["identifier"] = self.config["identifier"]
        self.post_agent_data(data)

    def wait_for_server(self) -> None:
        delay = min(self.interval, 30)
        while not self.client.reachable():
            logger.warning("Testflinger server unreachable, waiting for connectivity")
            self.sleep(delay)

    def run_forever(self) -> None:
        """The main loop (``start_agent``); returns only by exception (Stopped, SystemExit)."""
        self.startup()
        while True:
            self.wait_for_server()
            state, comment = self.agent_state()
            if state in OFFLINE_STATES:
                logger.error("Agent %s is %s, not processing jobs. Reason: %s",
                             self.agent_id, state, comment or "Unknown")
                while self.agent_state()[0] in OFFLINE_STATES:
                    self.sleep(self.interval)
            self.post_advertised()
            self.process_jobs()
            self.sleep(self.interval)

    def _check_restart(self, state: str, comment: str) -> None:
        if state == "restart":
            # testflinger#1304: a newer agent says it is restarting; an older one posts offline.
            self.set_state("restart" if self.newer else "offline", comment)
            logger.info("Restart requested by the server; exiting for supervisord")
            raise SystemExit(1)

    def process_jobs(self) -> None:
        """Take jobs until none is left (``agent.py::process_jobs``), after sending again the
        outcomes the server did not take."""
        self.retry_old_results()
        state, comment = self.agent_state()
        if state in OFFLINE_STATES:
            self.set_state("offline", comment)
            return
        self._check_restart(state, comment)
        job = self.next_job()
        while job:
            self.in_job.set()
            try:
                self.run_job(job)
            finally:
                self.in_job.clear()
            if not self.newer:  # testflinger#1253: the server clears it on the terminal result
                self.post_agent_data({"job_id": ""})
            state, comment = self.agent_state()
            if state in OFFLINE_STATES:
                self.set_state("offline", comment)
                return
            self._check_restart(state, comment)
            self.set_state("waiting")
            job = self.next_job()

    def next_job(self) -> dict | None:
        try:
            resp = self.client.request("GET", "/v1/job",
                                       params={"queue": self.config["job_queues"]})
        except requests.RequestException as exc:
            logger.error("Job poll failed: %s", exc)
            self.sleep(self.interval)
            return None
        if not resp.ok:
            logger.error("Job poll: %s %s", resp.status_code, resp.text[:200])
            return None
        return resp.json() if resp.content and resp.status_code != 204 else None

    # -- one job (agent.py + job.py)
    def run_job(self, job: dict) -> None:
        job_id = job["job_id"]
        logger.info("Starting job %s", job_id)
        self.on_job()
        if not self.newer:  # testflinger#1253: the server set it when it handed the job out
            self.post_agent_data({"job_id": job_id})
        status, fragment, deferred = {}, 0, None
        for phase in PHASES:
            result = self.client.get_json(f"/v1/result/{job_id}")
            if result.get("job_state") == "cancelled":
                logger.info("Job cancellation was requested, exiting.")
                break
            state, comment = self.agent_state()
            if state in OFFLINE_STATES or state == "restart":
                deferred = comment  # acted on after the job, as the real agent
            self.client.post(f"/v1/result/{job_id}", {"job_state": phase})
            self.set_state(phase, deferred or "")
            text = phase_output(job, phase)
            if text is None:
                logger.info("No %s_data defined in job data, skipping...", phase)
                continue
            self.client.post(f"/v1/result/{job_id}/log/output", {
                "fragment_number": fragment,
                "timestamp": datetime.now(timezone.utc).isoformat(),
                "phase": phase,
                "log_data": text,
            })
            fragment += 1
            if self.run_phase(job_id, phase):
                self.client.post(f"/v1/result/{job_id}/log/output", {
                    "fragment_number": fragment,
                    "timestamp": datetime.now(timezone.utc).isoformat(),
                    "phase": phase,
                    "log_data": "\nJob cancellation was requested, exiting.\n",
                })
                fragment += 1
                continue  # the next phase's check sees the cancel and ends the job
            status[phase] = 0
            if phase == "allocate":
                self.client.post(f"/v1/result/{job_id}", {"job_state": "allocated"})
        self.transmit_outcome(job_id, {"status": status, "job_state": "complete"})
        logger.info("Finished job %s", job_id)
        # Before anything more is posted: the server must answer (agent.py process_jobs:
        # ``wait_for_server_connectivity`` after ``transmit_job_outcome``). A restart of the
        # server at a job's end lost the outcome and the agent's ``waiting`` post here, and the
        # job and agent stayed in ``reserve`` for ever (TRIAL18 F4).
        self.wait_for_server()

    # -- job outcomes (client.py transmit_job_outcome, agent.py retry_old_results)
    def _results_dir(self) -> Path:
        return Path(self.config["results_basedir"])

    def transmit_outcome(self, job_id: str, outcome: dict) -> bool:
        """POST the job's outcome (``job_state: complete``); one the server did not take (no
        answer, or not a 2xx: client.py ``post_result`` raises TFServerError for both) is kept
        in ``results_basedir/<job_id>/testflinger-outcome.json``, as the real agent moves its
        rundir there (agent.py ``process_jobs``: ``shutil.move(rundir, results_basedir)``),
        and sent again by :meth:`retry_old_results`. True when the server took it."""
        resp = self.client.post(f"/v1/result/{job_id}", outcome)
        if resp is not None and resp.ok:
            return True
        kept = self._results_dir() / job_id
        try:
            kept.mkdir(parents=True, exist_ok=True)
            (kept / "testflinger-outcome.json").write_text(json.dumps(outcome))
        except OSError as exc:
            logger.error("could not keep the outcome of job %s: %s", job_id, exc)
        return False

    def retry_old_results(self) -> None:
        """Send again the outcomes the server did not take (agent.py ``retry_old_results``, at
        the start of each ``process_jobs``): a taken one is removed, the others wait for the
        next loop ("better luck next time")."""
        base = self._results_dir()
        if not base.is_dir():
            return
        for kept in sorted(p for p in base.iterdir() if p.is_dir()):
            outcome = kept / "testflinger-outcome.json"
            try:
                data = json.loads(outcome.read_text())
            except (OSError, ValueError):
                logger.error("Unable to read the outcome kept in %s", kept)
                continue
            logger.info("Attempting to send result: %s", kept)
            resp = self.client.post(f"/v1/result/{kept.name}", data)
            if resp is not None and resp.ok:
                shutil.rmtree(kept, ignore_errors=True)

    def run_phase(self, job_id: str, phase: str) -> bool:
        """The phase's simulated command: ``phase_seconds`` of sleep, with a check for a cancel
        every ``cancel_check`` s while it runs, except in ``provision``
        (``runner.py::CommandRunner.run`` with ``job.py``'s ``JobCancelledChecker``). Returns
        True if a cancel stopped it (its command killed, the rest of it not run)."""
        left = self.phase_seconds
        while left > 0:
            step = min(self.cancel_check, left)
            self.sleep(step)
            left -= step
            if left > 0 and phase != NO_CANCEL_PHASE and _cancelled(self.client, job_id):
                logger.info("Job cancellation was requested during %s, exiting.", phase)
                return True
        return False


def _cancelled(client, job_id: str) -> bool:
    """``client.py::check_job_state`` is ``cancelled`` (``JobCancelledChecker``)."""
    return client.get_json(f"/v1/result/{job_id}").get("job_state") == "cancelled"


def phase_output(job: dict, phase: str) -> str | None:
    """The text a phase "prints", or None when ``job.py`` would skip the phase (no
    ``<phase>_data``, or ``skip: true``; setup always runs). Pure."""
    if phase == "setup":
        return f"[sim-agent] setup for job {job.get('job_id')} on queue {job.get('job_queue')}\n"
    data = job.get(f"{phase}_data")
    if not data or (isinstance(data, dict) and data.get("skip", False)):
        return None
    lines = [f"[sim-agent] {phase} (simulated; nothing is executed)"]
    if phase == "test" and isinstance(data, dict) and data.get("test_cmds"):
        lines += [f"$ {cmd}" for cmd in str(data["test_cmds"]).splitlines() if cmd.strip()]
    else:
        lines.append(yaml.safe_dump(data, default_flow_style=False).rstrip())
    return "\n".join(lines) + "\n"


def start_metrics(port: int, agent_id: str):
    """Serve Prometheus text on 127.0.0.1:``port`` with counter ``testflinger_agent_jobs_total``.

    Returns the function that counts one job. Raises OSError if the port is taken.
    """
    registry = CollectorRegistry()
    jobs = Counter("jobs", "Number of jobs", ["agent_id"], namespace="testflinger_agent",
                   registry=registry)
    jobs.labels(agent_id=agent_id)  # exported as 0 before the first job
    start_http_server(port, addr="127.0.0.1", registry=registry)
    return lambda: jobs.labels(agent_id=agent_id).inc()


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="testflinger-agent look-alike (lab)")
    parser.add_argument("-c", "--config", default="testflinger-agent.conf")
    parser.add_argument("-p", "--metrics_port", type=int, default=None)
    parser.add_argument("--token-file", default=None,
                        help="JSON {refresh_token}; used only if the file exists")
    return parser.parse_args(argv)


def _on_sigterm(signum: int, in_job: threading.Event, stop: threading.Event) -> None:
    """SIGTERM as testflinger-agent takes it. Outside a job (``in_job`` clear) the real agent
    has SIGTERM at its default action (``__init__.py::start_agent`` installs no handler, and
    ``runner.py::CommandRunner.cleanup`` restores ``SIG_DFL`` after each phase): restore it and
    send the signal again, so the process dies at once, killed by SIGTERM, whatever HTTP call
    it is in. During a job: ``stop`` is set and the agent ends at its next pause (module
    docstring)."""
    if in_job.is_set():
        stop.set()
        return
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)


def main(argv=None) -> int:
    """Entry point; returns the exit status (2: bad config or metrics port)."""
    args = parse_args(argv)
    logging.basicConfig(stream=sys.stdout, level=logging.INFO,
                        format="[%(asctime)s] %(levelname)s %(name)s: %(message)s")
    try:
        config = load_config(args.config)
    except ConfigError as exc:
        print(f"sim_agent: invalid config:\n{exc}", file=sys.stderr)
        return 2
    logging.getLogger().setLevel(logging.getLevelName(config["logging_level"])
                                 if isinstance(logging.getLevelName(config["logging_level"]), int)
                                 else logging.INFO)
    stop = threading.Event()
    in_job = threading.Event()
    signal.signal(signal.SIGTERM, lambda signum, _frame: _on_sigterm(signum, in_job, stop))
    on_job = lambda: None  # noqa: E731
    if args.metrics_port is not None:
        try:
            on_job = start_metrics(args.metrics_port, config["agent_id"])
        except OSError as exc:
            print(f"sim_agent: metrics port {args.metrics_port}: {exc}", file=sys.stderr)
            return 2
    token_file = args.token_file if args.token_file and Path(args.token_file).exists() else None
    phase_seconds = float(os.environ.get("SIM_AGENT_PHASE_SECONDS", DEFAULT_PHASE_SECONDS))
    client = ServerClient(config["server_address"], token_file, stop)
    agent = SimAgent(config, client, phase_seconds, on_job,
                     newer=os.environ.get("SIM_AGENT_NEWER", "") not in ("", "0"), in_job=in_job,
                     cancel_check=float(os.environ.get("SIM_AGENT_CANCEL_CHECK_SECONDS",
                                                       CANCEL_CHECK_SECONDS)))
    try:
        agent.run_forever()
    except Stopped:
        logger.info("SIGTERM received, exiting")
        return 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
