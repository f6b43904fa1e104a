"""REST client for the agent-host side of ``/v1/magic`` (docs/architecture.md, "Agent-host protocol").

Authentication is Testflinger's: ``POST /v1/oauth2/token`` with HTTP Basic ``client_id:secret``
answers ``{"access_token", "refresh_token", ...}`` (testflinger server ``api/v1.py::retrieve_token``,
used the same way by the agent-host charm's ``testflinger_client.py`` and the CLI's ``auth.py``);
older servers answered the bare JWT as text, which is accepted too. The token is sent as
``Authorization: Bearer <jwt>``; on a 401 the client fetches a new token and retries once.
Connection errors are retried with exponential backoff (``retries`` times).
"""

from __future__ import annotations

import logging
import threading
import time

import requests


log = logging.getLogger(__name__)

VERSION = "0.1.0"


#: ``_unknown`` entry for a server that refuses the devices' ``nvswitches`` (older than it): a
#: ``list.key`` name stands for ``key`` in every dict of the body's ``list``.
DEVICE_NVSWITCHES = "devices.nvswitches"


def _refused_fields(detail) -> set[str]:
    """The field names a 422's ``detail`` (apiflask: ``{"json": {field: [...]}}``) refuses;
    a field of the items of a list, ``{"devices": {"0": {"nvswitches": [...]}}}``, as
    ``devices.nvswitches``."""
    found = (detail.get("json") or {}) if isinstance(detail, dict) else {}
    names = set()
    for key, value in (found.items() if isinstance(found, dict) else ()):
        items = value.values() if isinstance(value, dict) else ()
        if items and all(isinstance(item, dict) for item in items):
            names |= {f"{key}.{sub}" for item in items for sub in item}
        else:
            names.add(key)
    return names


def _without(body: dict, unknown: set[str]) -> dict:
    """``body`` without the fields in ``unknown`` (top-level names, and ``list.key`` names:
    ``key`` left out of each dict of ``body[list]``)."""
    out = {k: v for k, v in body.items() if k not in unknown}
    for name in unknown:
        top, _, sub = name.partition(".")
        if sub and isinstance(out.get(top), list):
            out[top] = [{k: v for k, v in item.items() if k != sub}
                        if isinstance(item, dict) else item for item in out[top]]
    return out


class ClientError(Exception):
    """Base of the errors below; ``status`` is the HTTP status (0: no answer)."""

    status = 0


class AuthError(ClientError):
    """The server refused the client id/secret (401 from /v1/oauth2/token)."""

    status = 401


class Forbidden(ClientError):
    """403: the device/lease is not this agent host's, or the client lacks the ``agent`` role."""

    status = 403


class NotFound(ClientError):
    """404: no such lease."""

    status = 404


class StaleLease(ClientError):
    """409: the report's generation/state is stale; ``.lease`` is the server's current document."""

    status = 409

    def __init__(self, message: str, lease: dict | None):
        super().__init__(message)
        self.lease = lease or {}


class InstanceConflict(ClientError):
    """409 to a register or heartbeat: another daemon instance (another machine, or another
    ``state_dir``) runs this agent host and heartbeats (server/hostinstance.py). ``.data``:
    the server's ``instance_conflict`` (``{"agent_host", "instance", "last_heartbeat",
    "silent_for", "stale_after", "caller"}``). The daemon exits on it (daemon.py)."""

    status = 409

    def __init__(self, message: str, data: dict | None = None):
        super().__init__(message)
        self.data = data or {}


class ServerError(ClientError):
    """Any other failure: 5xx, 422, a non-JSON answer, or the server unreachable after retries."""

    def __init__(self, message: str, status: int = 0):
        super().__init__(message)
        self.status = status


def _fields(detail, prefix: str = "") -> list[str]:
    """``["devices.0.gpus: Must be greater than or equal to 0 and less than or equal to 64."]``
    of an apiflask/marshmallow error ``detail`` (``{"json": {"devices": {"0": {"gpus":
    [...]}}}}``; the location key ``json``/``query`` is left out)."""
    if isinstance(detail, dict):
        out = []
        for key, value in detail.items():
            if not prefix and key in ("json", "query", "form", "headers"):
                out += _fields(value, "")
            else:
                out += _fields(value, f"{prefix}.{key}" if prefix else str(key))
        return out
    if isinstance(detail, list):
        return [f"{prefix or '-'}: {' '.join(str(m) for m in detail)}"]
    return [f"{prefix or '-'}: {detail}"] if detail else []


class MagicClient:
    """Client for one Testflinger server. Thread-safe (a lock guards the token).

    ``server_url``: e.g. ``http://127.0.0.1:5000`` (no trailing ``/v1``). ``secret`` may be a
    pydantic ``SecretStr``. ``timeout``: seconds per HTTP request beyond a long-poll's wait.
    """

    def __init__(self, server_url: str, client_id: str, secret, *, timeout: float = 30.0,
                 retries: int = 4, backoff: float = 0.5):
        self.server_url = server_url.rstrip("/")
        self.client_id = client_id
        self._secret = secret
        self.timeout = timeout
        self.retries = retries
        self.backoff = backoff
        self._token: str | None = None
        self._lock = threading.Lock()
        self._session = requests.Session()
        #: Optional body fields an older server refused as unknown (see :meth:`_post_optional`).
        self._unknown: set[str] = set()

    def _secret_value(self) -> str:
        getter = getattr(self._secret, "get_secret_value", None)
        return getter() if getter else str(self._secret)

    # -- transport -----------------------------------------------------------------------------
    def _send(self, method: str, path: str, *, json=None, params=None, auth=None, headers=None,
              timeout: float | None = None) -> requests.Response:
        url = f"{self.server_url}{path}"
        delay = self.backoff
        for attempt in range(self.retries + 1):
            try:
                return self._session.request(method, url, json=json, params=params, auth=auth,
                                             headers=headers, timeout=timeout or self.timeout)
            except (requests.ConnectionError, requests.Timeout) as exc:
                if attempt == self.retries:
                    raise ServerError(f"{method} {url}: server unreachable after "
                                      f"{self.retries + 1} attempts: {exc}") from None
                log.warning("%s %s failed (%s); retrying in %.1fs", method, url,
                            type(exc).__name__, delay)
                time.sleep(delay)
                delay = min(delay * 2, 30.0)
        raise AssertionError("unreachable")

    def token(self, refresh: bool = False) -> str:
        """The access token (JWT), fetched from /v1/oauth2/token when missing or ``refresh``."""
        with self._lock:
            if self._token and not refresh:
                return self._token
            resp = self._send("POST", "/v1/oauth2/token",
                              auth=(self.client_id, self._secret_value()))
            if resp.status_code == 401:
                raise AuthError(f"server refused client id {self.client_id!r}: "
                                f"{resp.text.strip()[:200]}")
            if resp.status_code != 200:
                raise ServerError(f"token request answered {resp.status_code}: "
                                  f"{resp.text.strip()[:200]}", resp.status_code)
            try:
                body = resp.json()
            except ValueError:
                body = resp.text.strip()
            token = body.get("access_token") if isinstance(body, dict) else body
            if not token or not isinstance(token, str):
                raise ServerError("token response has no access_token", resp.status_code)
            self._token = token
            return token

    def _call(self, method: str, path: str, *, json=None, params=None,
              timeout: float | None = None) -> requests.Response:
        resp = None
        for refresh in (False, True):
            headers = {"Authorization": f"Bearer {self.token(refresh=refresh)}"}
            resp = self._send(method, path, json=json, params=params, headers=headers,
                              timeout=timeout)
            if resp.status_code != 401:
                break
        return resp

    def _post_optional(self, path: str, body: dict, optional: tuple[str, ...]) -> requests.Response:
        """POST ``body``, leaving out the ``optional`` fields this server refused before.

        The server's schemas refuse unknown fields (marshmallow, 422 ``{"detail": {"json":
        {field: ["Unknown field."]}}}``), so a daemon upgraded before its server would fail to
        register or heartbeat over a field that only adds information (``templates``,
        ``maas_unreachable_since``, ``instance``: an older server cannot refuse a second
        instance anyway; the devices' ``nvswitches``, :data:`DEVICE_NVSWITCHES`): such a 422
        naming only optional fields is retried once without them, and they are not sent again
        to this server (logged once)."""
        resp = self._call("POST", path, json=_without(body, self._unknown))
        if resp.status_code != 422:
            return resp
        try:
            refused = _refused_fields(resp.json().get("detail") or {})
        except (ValueError, AttributeError):
            return resp
        if not refused or not refused <= set(optional):
            return resp
        log.warning("the server at %s predates the optional field(s) %s: not sent to it",
                    self.server_url, ", ".join(sorted(refused)))
        self._unknown |= refused
        return self._call("POST", path, json=_without(body, self._unknown))

    @staticmethod
    def _body(resp: requests.Response, what: str) -> dict:
        try:
            body = resp.json()
        except ValueError:
            body = None
        message = body.get("message") if isinstance(body, dict) else None
        message = message or resp.text.strip()[:300]
        fields = _fields(body.get("detail")) if isinstance(body, dict) else []
        if fields:  # a 422's fields (apiflask's detail): "devices.0.gpus: Must be ..."
            message = f"{message}: " + "; ".join(fields)
        if resp.status_code == 200 and isinstance(body, dict):
            return body
        if resp.status_code == 403:
            raise Forbidden(f"{what}: forbidden: {message}")
        if resp.status_code == 404:
            raise NotFound(f"{what}: not found: {message}")
        if resp.status_code == 409 and isinstance(body, dict) \
                and isinstance(body.get("instance_conflict"), dict):
            raise InstanceConflict(f"{what}: refused: {message}", body["instance_conflict"])
        if resp.status_code == 409:
            raise StaleLease(f"{what}: stale: {message}",
                             body.get("lease") if isinstance(body, dict) else None)
        if resp.status_code == 401:
            raise AuthError(f"{what}: token refused twice: {message}")
        raise ServerError(f"{what}: HTTP {resp.status_code}: {message}", resp.status_code)

    # -- protocol ------------------------------------------------------------------------------
    def register(self, host: str, devices: list[dict], templates: list[str] | None = None,
                 instance: str | None = None, nvswitch_multi_gpu: bool | None = None) -> dict:
        """Register ``host`` and its devices (dicts as ``DeviceConfig.registration()``) and,
        unless None, the agent template folders it has (``apply`` warns of a queue naming none),
        this daemon's instance id (agent_host/instance.py) and the host's
        ``splitter.nvswitch_multi_gpu`` (the server then lends its NVSwitch devices to queues
        of several GPUs per VM, testflinger_magic/fabric.py). A device dict may carry
        ``nvswitches`` (the count MAAS' commissioning listed, agent_host/regfacts.py); a server
        older than that field refuses it (422) and is sent the devices without it.

        Returns ``{"agent_host", "devices": [names]}``; ``Forbidden`` if a device belongs to
        another host; ``InstanceConflict`` if another daemon instance runs ``host``.
        """
        body = {"devices": devices, "version": VERSION}
        if templates is not None:
            body["templates"] = list(templates)
        if instance is not None:
            body["instance"] = instance
        if nvswitch_multi_gpu is not None:
            body["nvswitch_multi_gpu"] = bool(nvswitch_multi_gpu)
        resp = self._post_optional(f"/v1/magic/agent-hosts/{host}", body, (
            "templates", "instance", "nvswitch_multi_gpu", DEVICE_NVSWITCHES))
        return self._body(resp, f"register {host}")

    def work(self, host: str, wait: float = 0, known: set[str] | None = None) -> list[dict]:
        """Leases needing work on ``host``'s devices, long-polling up to ``wait`` seconds (≤30).

        ``known``: ``{"<lease id>:<generation>", ...}`` as the last answer had them; the server
        then answers as soon as its set differs (a new lease, or any lease changed), else when
        ``wait`` ends (docs/api.md). None: it answers at once while a lease needs a step."""
        wait = max(0, min(int(wait), 30))
        params: dict = {"wait": wait}
        if known is not None:
            params["known"] = ",".join(sorted(known))
        resp = self._call("GET", f"/v1/magic/agent-hosts/{host}/work", params=params,
                          timeout=self.timeout + wait)
        return list(self._body(resp, f"work {host}").get("leases", []))

    def open_leases(self) -> list[dict]:
        """Every open lease (any state but returned/failed: draining ones too, which
        ``work`` leaves out) of every host, ``GET /v1/magic/leases?open=1`` (agent clients may
        read it). Raises ``ClientError`` when the server does not answer: never an empty list
        then, since the orphan sweep removes what no open lease owns."""
        resp = self._call("GET", "/v1/magic/leases", params={"open": "1"})
        return list(self._body(resp, "list open leases").get("leases", []))

    def report(self, lease_id: str, body: dict) -> dict:
        """Report a step result; returns the new lease document.

        Raises ``StaleLease`` (409, with ``.lease``), ``Forbidden`` (403), ``NotFound`` (404),
        ``ServerError`` (422/5xx/unreachable).
        """
        path = f"/v1/magic/leases/{lease_id}/report"
        # ``facts`` only adds what the step learnt: a server predating it (422 naming it) gets
        # the report without. ``blame: hardware`` is said to such a server as the ``queue``
        # blame it knows (it suspends the queue rather than counting a device failure).
        resp = self._post_optional(path, body, ("facts",))
        if resp.status_code == 422 and body.get("blame") == "hardware" \
                and "blame" in str(resp.text):
            log.warning("the server at %s predates blame 'hardware': reported as 'queue'",
                        self.server_url)
            resp = self._post_optional(path, {**body, "blame": "queue"}, ("facts",))
        if resp.status_code == 422 and body.get("quarantine") and "quarantine" in str(resp.text):
            # A server predating a bring-up step's quarantine: the failure still counts.
            log.warning("the server at %s quarantines on a restore's report only: reported "
                        "without quarantine", self.server_url)
            resp = self._post_optional(path, {k: v for k, v in body.items()
                                              if k != "quarantine"}, ("facts",))
        return self._body(resp, f"report {lease_id}")

    def heartbeat(self, host: str, lease_ids: list[str],
                  maas_unreachable_since: float | None = None,
                  instance: str | None = None) -> dict:
        """Tell the server ``host`` is alive and working on ``lease_ids``;
        ``maas_unreachable_since`` (epoch seconds): MAAS has not answered this host since then
        (sent only when set: the server then lends none of its devices, docs/api.md);
        ``instance``: as in :meth:`register` (``InstanceConflict`` when another daemon
        instance took the host over)."""
        body: dict = {"leases": list(lease_ids)}
        if maas_unreachable_since is not None:
            body["maas_unreachable_since"] = float(maas_unreachable_since)
        if instance is not None:
            body["instance"] = instance
        resp = self._post_optional(f"/v1/magic/agent-hosts/{host}/heartbeat", body,
                                   ("maas_unreachable_since", "instance"))
        return self._body(resp, f"heartbeat {host}")
