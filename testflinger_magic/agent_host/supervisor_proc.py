"""A private supervisord for the embedded lab and for tests.

``Supervisord(workdir)`` writes ``<workdir>/supervisord.conf`` and runs the real ``supervisord``
(the one installed beside this interpreter, from the ``supervisor`` package) in the foreground
as a child process. Programs go in ``<workdir>/conf.d/*.conf``, exactly like
``/etc/supervisor/conf.d`` on a Testflinger agent host, so :class:`agents.AgentProcesses` drives
it the same way it drives the production one.

    with Supervisord(tmp_path) as sv:
        procs = AgentProcesses(sv.url, sv.conf_dir, "...")
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import xmlrpc.client
from pathlib import Path

from supervisor.xmlrpc import SupervisorTransport

# sockaddr_un.sun_path is 108 bytes on Linux; keep a margin.
_MAX_SOCKET_PATH = 100


class SupervisordError(RuntimeError):
    """supervisord did not start or stop; the message includes the tail of its log."""


def rpc_proxy(url: str) -> xmlrpc.client.ServerProxy:
    """Return an XML-RPC proxy for a supervisord at ``url``.

    ``url`` is ``unix:///path/to/supervisor.sock`` or ``http://host:port``. A new proxy per
    caller keeps threads apart (a proxy holds one connection and is not thread-safe).
    """
    transport = SupervisorTransport(None, None, url)
    # For unix:// URLs the host part is ignored by SupervisorTransport.
    return xmlrpc.client.ServerProxy("http://127.0.0.1", transport=transport, allow_none=True)


def rpc_call(url: str, method: str, *args):
    """``supervisor.<method>(*args)`` on the supervisord at ``url`` through a proxy of its own
    (:func:`rpc_proxy`), whose connection is closed when the call returns or raises: a proxy
    left to the garbage collector keeps its socket open until then (``ResourceWarning:
    unclosed <socket.socket ...supervisor.sock>``), one per call in a daemon that runs for
    months. Raises what the call raises (``xmlrpc.client.Fault``, ``OSError``, ...)."""
    with rpc_proxy(url) as proxy:  # ServerProxy.__exit__ closes its transport's connection
        return getattr(proxy.supervisor, method)(*args)


def _supervisord_command(conf: Path) -> list[str]:
    exe = Path(sys.executable).parent / "supervisord"
    if exe.exists():
        return [str(exe), "-c", str(conf)]
    found = shutil.which("supervisord")
    if found:
        return [found, "-c", str(conf)]
    return [sys.executable, "-m", "supervisor.supervisord", "-c", str(conf)]


class Supervisord:
    """A supervisord owned by this process, configured in ``workdir``.

    Attributes: ``workdir``, ``conf_dir`` (``<workdir>/conf.d``), ``conf_path``, ``log_path``,
    ``socket_path``, ``url`` (``unix://<socket>``). The socket lives in ``workdir`` unless that
    path is too long for a unix socket, then in a short private temp dir.
    """

    def __init__(self, workdir: Path, *, start_timeout: float = 30.0):
        self.workdir = Path(workdir).resolve()
        self.conf_dir = self.workdir / "conf.d"
        self.conf_path = self.workdir / "supervisord.conf"
        self.log_path = self.workdir / "supervisord.log"
        self.child_log_dir = self.workdir / "logs"
        self.start_timeout = start_timeout
        self._sock_tmp: str | None = None
        sock = self.workdir / "supervisor.sock"
        if len(str(sock)) > _MAX_SOCKET_PATH:
            self._sock_tmp = tempfile.mkdtemp(prefix="tfm-sv-")
            sock = Path(self._sock_tmp) / "supervisor.sock"
        self.socket_path = sock
        self.url = f"unix://{sock}"
        self._proc: subprocess.Popen | None = None

    # -- configuration (pure text) -------------------------------------------------------------
    def config_text(self) -> str:
        """The supervisord.conf this instance runs with (``%`` is special there; paths are ours)."""
        return "\n".join(
            [
                "; written by testflinger_magic.agent_host.supervisor_proc",
                "[unix_http_server]",
                f"file={self.socket_path}",
                "chmod=0700",
                "",
                "[supervisord]",
                f"logfile={self.log_path}",
                f"pidfile={self.workdir / 'supervisord.pid'}",
                f"childlogdir={self.child_log_dir}",
                "nodaemon=true",
                "loglevel=info",
                "",
                "[rpcinterface:supervisor]",
                "supervisor.rpcinterface_factory = supervisor.rpcinterface:make_main_rpcinterface",
                "",
                "[supervisorctl]",
                f"serverurl={self.url}",
                "",
                "[include]",
                f"files = {self.conf_dir}/*.conf",
                "",
            ]
        )

    # -- lifecycle -------------------------------------------------------------------------------
    def start(self) -> "Supervisord":
        """Write the config, spawn supervisord and wait until its XML-RPC says RUNNING.

        Raises ``SupervisordError`` (with the log tail) if it exits or does not answer within
        ``start_timeout`` seconds. Starting an already started instance is a no-op.
        """
        if self.running():
            return self
        self.conf_dir.mkdir(parents=True, exist_ok=True)
        self.child_log_dir.mkdir(parents=True, exist_ok=True)
        self.conf_path.write_text(self.config_text())
        if self.socket_path.exists():  # stale socket from a crashed run
            self.socket_path.unlink()
        out = open(self.workdir / "supervisord.stdout", "ab")
        try:
            self._proc = subprocess.Popen(
                _supervisord_command(self.conf_path),
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                cwd=self.workdir,
                start_new_session=True,  # its own process group: stop() can clean up all of it
            )
        finally:
            out.close()
        deadline = time.monotonic() + self.start_timeout
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise SupervisordError(
                    f"supervisord exited with {self._proc.returncode}: {self._log_tail()}"
                )
            try:
                if rpc_call(self.url, "getState")["statename"] == "RUNNING":
                    return self
            except (OSError, xmlrpc.client.Error):
                pass
            time.sleep(0.05)
        self.stop()
        raise SupervisordError(
            f"supervisord did not answer on {self.url} within {self.start_timeout}s: "
            f"{self._log_tail()}"
        )

    def running(self) -> bool:
        """True while the supervisord child process is alive."""
        return self._proc is not None and self._proc.poll() is None

    def stop(self, timeout: float = 30.0) -> None:
        """Shut supervisord down (it stops its programs first); idempotent.

        Asks over XML-RPC, then falls back to SIGTERM and finally SIGKILL of its process group.
        supervisord starts each program in a process group of its own, so the programs' groups
        (pids read before shutdown) are killed too: no child outlives it.
        """
        proc = self._proc
        child_pids: list[int] = []
        if proc is not None and proc.poll() is None:
            try:
                child_pids = [int(p["pid"]) for p in rpc_call(self.url, "getAllProcessInfo")
                              if p.get("pid")]
            except (OSError, xmlrpc.client.Error):
                pass
            try:
                rpc_call(self.url, "shutdown")
            except (OSError, xmlrpc.client.Error):
                proc.terminate()
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                proc.wait(5)
        if proc is not None:
            # Anything that ignored supervisord's stop signal: its own group and the programs'.
            for pgid in [proc.pid, *child_pids]:
                try:
                    os.killpg(pgid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
        self._proc = None
        if self._sock_tmp:
            shutil.rmtree(self._sock_tmp, ignore_errors=True)

    def rpc(self) -> xmlrpc.client.ServerProxy:
        """A fresh XML-RPC proxy to this supervisord."""
        return rpc_proxy(self.url)

    def _log_tail(self, lines: int = 20) -> str:
        text = ""
        for path in (self.log_path, self.workdir / "supervisord.stdout"):
            if path.exists():
                text += path.read_text(errors="replace")
        return " | ".join(text.strip().splitlines()[-lines:])

    def __enter__(self) -> "Supervisord":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
