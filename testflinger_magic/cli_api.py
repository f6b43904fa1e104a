"""The HTTP client of ``testflinger-magic`` and its output helper (split from cli.py).

Credentials follow testflinger-cli's conventions (TESTFLINGER.md §4): a JWT from
``POST /v1/oauth2/token`` (HTTP Basic) sent as ``Authorization: Bearer``.
"""

from __future__ import annotations

import json
from typing import Any

import requests

DEFAULT_SERVER = "http://127.0.0.1:8000"
TIMEOUT = 30.0  # seconds per HTTP request


class CliError(Exception):
    """A failure to report on stderr (exit code 1)."""


# ---------------------------------------------------------------------------------------------
# HTTP client

class ApiClient:
    """Minimal client of the operator API. ``server`` is the base URL (no ``/v1``)."""

    def __init__(self, server: str, client_id: str | None = None,
                 secret_key: str | None = None, session: requests.Session | None = None):
        self.server = server.rstrip("/")
        self.client_id, self.secret_key = client_id, secret_key
        self.session = session or requests.Session()
        self._token: str | None = None

    def _url(self, path: str) -> str:
        return f"{self.server}{path}"

    def token(self) -> str | None:
        """Access token from ``POST /v1/oauth2/token`` (Basic auth), or None without
        credentials. Raises :class:`CliError` when the server refuses them."""
        if self._token or not (self.client_id and self.secret_key):
            return self._token
        resp = self._send("POST", "/v1/oauth2/token", auth=(self.client_id, self.secret_key))
        try:
            self._token = resp.json()["access_token"]
        except (ValueError, KeyError, TypeError) as exc:
            raise CliError(f"{self._url('/v1/oauth2/token')}: no access_token in the answer") \
                from exc
        return self._token

    def _send(self, method: str, path: str, **kwargs) -> requests.Response:
        url = self._url(path)
        try:
            resp = self.session.request(method, url, timeout=TIMEOUT, **kwargs)
        except requests.ConnectionError as exc:
            raise CliError(f"cannot connect to the Testflinger server at {self.server} "
                           f"({method} {url}): is it running? Set --server or "
                           "TESTFLINGER_SERVER") from exc
        except requests.RequestException as exc:
            raise CliError(f"{method} {url} failed: {exc}") from exc
        if resp.status_code == 404 and path.startswith("/v1/magic") and not _plugin_answer(resp):
            raise CliError(f"no testflinger-magic plugin at {self.server} (HTTP 404 for "
                           f"{method} {path}): is --server the Testflinger server with the "
                           "plugin mounted?")
        if resp.status_code >= 400:
            text = _error_text(method, url, resp)
            if resp.status_code in (401, 403) and not (self.client_id and self.secret_key):
                text += ("\nhint: no credentials were given; pass --client-id and --secret-key "
                         "(or set TESTFLINGER_CLIENT_ID and TESTFLINGER_SECRET_KEY)")
            raise CliError(text)
        return resp

    def call(self, method: str, path: str, body: Any = None, params: dict | None = None) -> Any:
        """Send one request and return its decoded JSON (``{}`` for an empty body). Raises
        :class:`CliError` with the server's message on HTTP >= 400 or a connection error."""
        headers = {}
        token = self.token()
        if token:
            headers["Authorization"] = f"Bearer {token}"
        resp = self._send(method, path, json=body, params=params, headers=headers)
        if not resp.content:
            return {}
        try:
            return resp.json()
        except ValueError as exc:
            raise CliError(f"{method} {self._url(path)}: the answer is not JSON") from exc


def _plugin_answer(resp: requests.Response) -> bool:
    """True when a 404 comes from the plugin (a JSON ``message`` naming what is unknown), False
    for a server without it: an HTML page (Flask) or APIFlask's generic ``Not Found``."""
    try:
        data = resp.json()
    except ValueError:
        return False
    message = data.get("message") if isinstance(data, dict) else None
    return isinstance(message, str) and message.strip().lower() not in ("", "not found")


def _error_text(method: str, url: str, resp: requests.Response) -> str:
    """The server's own message for a failed call, with any file:line issues under it."""
    lines = [f"{method} {url}: HTTP {resp.status_code}"]
    try:
        data = resp.json()
    except ValueError:
        data = None
    if isinstance(data, dict):
        msg = data.get("message") or data.get("detail") or data.get("error")
        if isinstance(msg, (dict, list)):
            msg = json.dumps(msg)
        issues = [_issue_text(i) for i in data.get("issues") or [] if isinstance(i, dict)]
        if issues and (not msg or "\n" in str(msg) or msg in issues):
            msg = f"{len(issues)} problem(s) in the definitions"  # the server's msg repeats them
        lines[0] += f": {msg}" if msg else f": {json.dumps(data)}"
        lines += issues + _detail_lines(data.get("detail"))
    elif resp.text.strip():
        lines[0] += f": {resp.text.strip()[:500]}"
    return "\n".join(lines)


def _detail_lines(detail: Any) -> list[str]:
    """apiflask's validation ``detail`` ``{location: {field: [message, ...]}}`` as
    ``field: message`` lines (the server's 422 names the field there, not in ``message``)."""
    if not isinstance(detail, dict):
        return []
    out = []
    for fields in detail.values():
        if isinstance(fields, dict):
            for field, msgs in fields.items():
                for m in msgs if isinstance(msgs, list) else [msgs]:
                    out.append(f"{field}: {m if isinstance(m, str) else json.dumps(m)}")
    return out


# ---------------------------------------------------------------------------------------------
# Output

def _emit(args, data: Any, render) -> int:
    print(json.dumps(data, indent=2, sort_keys=True) if args.json else render(data))
    return 0


def _issue_text(issue: dict) -> str:
    """One server issue ``{file, line, field, message}`` as ``queues.Issue`` prints it (no
    line when it is 0)."""
    from testflinger_magic.queues import Issue  # noqa: PLC0415

    try:
        line = int(issue.get("line") or 0)
    except (TypeError, ValueError):
        line = 0
    return str(Issue(str(issue.get("file", "?")), line, str(issue.get("field", "?")),
                     str(issue.get("message", ""))))
