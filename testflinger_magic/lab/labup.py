"""``testflinger-magic lab up``: start the embedded lab (:class:`.lab.Lab`), print how to use
it, watch its agent-host daemon, and stop everything on Ctrl-C or SIGTERM."""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
from pathlib import Path

from ..durations import format_duration
from ..unservable import UNSERVABLE_GRACE
from .lab import (  # noqa: F401 (LabError: cli_local; lab_definitions: tests)
    REPO_ROOT, Lab, LabError, LabOptions, lab_definitions, policy_summary)


class LabInterrupted(KeyboardInterrupt):
    """SIGINT/SIGTERM while ``lab up`` starts the lab; ``signum`` is the signal."""

    def __init__(self, signum: int):
        super().__init__(f"signal {signum}")
        self.signum = signum


def magic_command() -> str:
    """How the banner names ``testflinger-magic``: bare when it is on PATH, else the script
    next to this interpreter (``.venv/bin/testflinger-magic``, which nothing puts on PATH;
    TRIAL16 F6), quoted for a shell."""
    import shlex
    import shutil

    if shutil.which("testflinger-magic"):
        return "testflinger-magic"
    beside = Path(sys.executable).parent / "testflinger-magic"
    return shlex.quote(str(beside)) if beside.exists() else "testflinger-magic"


def lab_options(args, workdir: Path) -> LabOptions:
    """The LabOptions of ``lab up``'s parsed ``args`` (argparse Namespace; an option not given
    keeps the lab's default), with the lab in ``workdir``."""
    opt = LabOptions(workdir=workdir)
    for key in ("devices", "gpus", "time_scale", "phase_seconds", "maas_version"):
        if getattr(args, key, None) is not None:
            setattr(opt, key, getattr(args, key))
    opt.newer_testflinger = bool(getattr(args, "newer_testflinger", False))
    opt.uncommissioned = bool(getattr(args, "uncommissioned", False))
    return opt


def maas_flavour(opt: LabOptions) -> str:
    """What ``--maas-version``/``--uncommissioned`` made of the lab's MAAS, for the banner."""
    from .maas_sim_devices import supports_node_devices  # noqa: PLC0415

    parts = []
    if opt.maas_version:
        parts.append(f"MAAS {opt.maas_version}" + (
            "" if supports_node_devices(opt.maas_version)
            else " (older than 3.0: no node devices API)"))
    if opt.uncommissioned:
        parts.append("its machines list no node devices (as if never commissioned)")
    return "; ".join(parts) + ": NVSwitch counts are learnt at a device's first split"


def main_up(args) -> int:
    """``testflinger-magic lab up``: start the lab and keep it running until Ctrl-C or SIGTERM.

    Without ``--workdir`` the lab runs in a new temporary folder, removed when the lab stops
    (however it stops: Ctrl-C, SIGTERM, a component that fails to start); a ``--workdir`` is
    kept. Returns 0 after a requested stop, 128+N when signal N (Ctrl-C: 130) came while the
    lab was starting (it is stopped, no banner); a lab that cannot start raises
    :class:`LabError`."""
    import shutil
    import tempfile

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    given = getattr(args, "workdir", None)
    workdir = Path(given) if given is not None else Path(tempfile.mkdtemp(prefix="tf-magic-lab-"))
    opt = lab_options(args, workdir)
    stop = threading.Event()
    restart = threading.Event()

    def interrupted(signum, _frame):
        raise LabInterrupted(signum)

    # While starting, Ctrl-C/SIGTERM unwind at once (Lab.start stops what it started): no
    # banner for a lab that is going away. Once up, they only ask the wait below to end.
    previous = {sig: signal.signal(sig, interrupted) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        lab = Lab(opt)
        try:
            lab.start()
            signal.signal(signal.SIGINT, lambda *a: stop.set())
            signal.signal(signal.SIGTERM, lambda *a: stop.set())
            # Before the banner names it: a SIGHUP's default action would end the process
            # and leave the lab's processes behind.
            previous[signal.SIGHUP] = signal.signal(signal.SIGHUP, lambda *a: restart.set())
        except LabInterrupted as exc:
            lab.stop()  # Lab.start stopped what it started; a signal after it returned too
            print(f"lab up: interrupted by {signal.Signals(exc.signum).name} while starting; "
                  "the lab is stopped", file=sys.stderr)
            return 128 + exc.signum
        try:
            user = f"--client-id lab-user --secret-key {lab.clients['lab-user']['secret']}"
            admin = f"--client-id lab-admin --secret-key {lab.clients['lab-admin']['secret']}"
            generation = " (newer Testflinger: after fe381ff)" if opt.newer_testflinger else ""
            print(f"Lab is up. Testflinger server: {lab.server_url}{generation}")
            print(f"  status page:  {lab.server_url}/v1/magic/")
            if opt.maas_version or opt.uncommissioned:
                print(f"  MAAS simulator: {maas_flavour(opt)}")
            print(f"  testflinger-cli --server {lab.server_url} list-queues")
            import shlex  # noqa: PLC0415 - the banner's only use
            job = shlex.quote(str(REPO_ROOT / "examples" / "jobs" / "gpu-smoke.yaml"))  # any cwd
            print(f"  testflinger-cli --server {lab.server_url} submit {user} --poll {job}")
            tm = magic_command()
            print(f"  {tm} --server {lab.server_url} status")
            print(f"  {tm} --server {lab.server_url} {admin} drain LEASE_ID")
            print(f"  {tm} --server {lab.server_url} queues")
            print("  the lab shortens the example's policy so a cycle takes about a minute: "
                  + policy_summary(lab.definitions))
            print("  jobs waiting on a queue no registered device can serve are cancelled, told "
                  f"why, after {format_duration(lab.opt.unservable_grace)} (a real server: "
                  f"{format_duration(UNSERVABLE_GRACE)})")
            kept = "kept" if given is not None else "temporary: removed when the lab stops"
            print(f"  work directory: {workdir} ({kept})")
            print("  the agent-host daemon is watched: one that dies is said here and restarted")
            print(f"  kill -HUP {os.getpid()} restarts the Testflinger server alone (same database, "
                  "port and clients), to rehearse a server restart")
            print("  Ctrl-C or SIGTERM stops everything")
            sys.stdout.flush()
            while not stop.wait(1.0):
                if restart.is_set():
                    restart.clear()
                    try:
                        print(lab.restart_jobservice())
                    except Exception as exc:  # noqa: BLE001 - said; the lab keeps running
                        print(f"lab: restarting the Testflinger server failed: "
                              f"{type(exc).__name__}: {exc}")
                    sys.stdout.flush()
                said = lab.check_daemon()  # a daemon that died is reaped, said and restarted
                if said:
                    print(said)
                    sys.stdout.flush()
            print("Stopping the lab...")
            sys.stdout.flush()
        finally:
            lab.stop()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if given is None:
            shutil.rmtree(workdir, ignore_errors=True)
    # Said once everything is down (TRIAL10: the output ended at "Stopping the lab...").
    print("Lab stopped: its servers, supervisord, agents and daemon are gone"
          + ("" if given is not None else "; its temporary work directory is removed"))
    return 0
