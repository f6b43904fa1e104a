"""``testflinger-magic agent-host --config FILE``: the daemon's process (``main``): the config,
the ``state_dir`` and agent-host locks (agent_host/statedir.py), the signals, and the exit
status. Split out of daemon.py (``python -m testflinger_magic.agent_host.daemon`` still runs
it); ``cli_config`` loads a config for the agent-host commands."""

from __future__ import annotations

import logging
import os
import signal
import sys

from testflinger_magic.agent_host.config import AgentHostConfig, ConfigError, load_file

log = logging.getLogger("testflinger_magic.agent_host")


def cli_config(path) -> AgentHostConfig | None:
    """For the agent-host commands: set up logging and load ``path`` (agent-host.yaml); on a
    bad file print the problems (file:line: field: message) and return None (exit status 2)."""
    logging.basicConfig(level=logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return load_file(path)
    except ConfigError as exc:
        print(exc)
        return None


def main(args) -> int:
    """``testflinger-magic agent-host --config FILE``: run the daemon until SIGTERM/SIGINT.

    ``args.config``: path of agent-host.yaml. Returns the exit status (2: bad configuration,
    a ``state_dir`` that cannot be created or written, or one another daemon holds:
    agent_host/statedir.py; each printed as ``file: state_dir: why``; another daemon of the
    same ``agent_host`` on this machine, whatever its state_dir: ``file: agent_host: why``;
    the server refusing this daemon instance because another machine's (or state_dir's)
    daemon runs the agent host, at registration or at a later heartbeat: the same form).
    """
    from testflinger_magic.agent_host.statedir import (HostBusy, HostLock, StateDirBusy,
                                                       StateLock, state_dir_problem)

    config = cli_config(args.config)
    if config is None:
        return 2
    problem = state_dir_problem(config.state_dir)
    if problem:
        print(f"{config.source}: state_dir: {problem}")
        return 2
    lock = StateLock(config.state_dir)
    try:
        lock.acquire()
    except StateDirBusy as exc:
        print(f"{config.source}: state_dir: {exc}")
        return 2
    try:
        host_lock = HostLock(config.agent_host, os.path.abspath(config.source),
                             config.host_lock_dir)
        host_lock.acquire()
    except HostBusy as exc:
        lock.release()
        print(f"{config.source}: agent_host: {exc}")
        return 2
    except OSError as exc:
        lock.release()
        print(f"{config.source}: host_lock_dir: cannot take the agent host's lock: {exc}")
        return 2
    try:
        return _run(config)
    finally:
        host_lock.release()
        lock.release()


def _run(config: AgentHostConfig) -> int:
    """Run the daemon of ``config`` until SIGTERM/SIGINT (``main`` holds the state_dir lock):
    0, or 2 when the server refused this daemon instance (another one runs the agent host:
    the refusal is printed as ``file: agent_host: why``)."""
    from testflinger_magic.agent_host.daemon import Daemon

    daemon = Daemon(config)

    def _stop(signum, _frame):
        if daemon.stopping:
            # A second signal: the operator wants out now. Exiting mid-step is what SIGKILL does,
            # and the next start resumes from the journal and the server's state.
            log.warning("signal %d again: exiting now", signum)
            logging.shutdown()
            sys.stdout.flush()
            os._exit(128 + signum)
        log.info("signal %d: stopping (steps in flight stop at their next wait; a second "
                 "signal exits at once)", signum)
        daemon.stop()

    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    daemon.run_forever()
    if daemon.refused is not None:
        # Another daemon instance runs this agent host (server/hostinstance.py): the message
        # says which and what to do; exit non-zero so systemd/snap shows the failure.
        print(f"{config.source}: agent_host: {daemon.refused}", flush=True)
        return 2
    return 0
