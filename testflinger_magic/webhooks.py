"""Webhook URLs of ``policy.notify``: where they may point, how they are sent, how they are shown.

A webhook URL is a secret (chat servers put the token in the path or query) and a request the
server makes on an operator's behalf (SSRF). So:

* **Where.** A URL may not point inside the lab or at the server itself: loopback, link-local
  (the cloud metadata services live at 169.254.169.254 / fd00:ec2::254), private, unspecified,
  multicast or otherwise not globally routable addresses, and the names ``localhost`` /
  ``*.localhost`` (RFC 6761) and the metadata service names, are refused -- when a definition
  is applied (:func:`url_problem`, literal addresses and those names) and again when an event is
  sent (:func:`post_json`, every address the name resolves to, and the connection goes to an
  address that was checked, so DNS cannot change its answer in between). A lab that needs an
  internal chat server lists it in an :class:`AllowList` (host names, addresses or networks;
  env ``TESTFLINGER_MAGIC_WEBHOOK_ALLOW`` or ``init_app(webhook_allow=...)``).
* **How.** One POST with a JSON body, no redirect followed (a 3xx is reported, not obeyed),
  every socket operation bounded by the timeout and the whole exchange by a deadline, at most
  :data:`MAX_RESPONSE_BYTES` of the answer read. No proxy is used: the address checked is the
  address connected to.
* **Shown.** Only :func:`redact`'s ``scheme://host[:port]/…redacted`` is ever returned by the
  API, written to a log line or an event.

Address classes are Python's ``ipaddress`` properties (IANA special-purpose registries,
RFC 6890); the metadata addresses are the clouds' documented instance metadata endpoints (AWS
IMDS 169.254.169.254 and fd00:ec2::254, Google ``metadata.google.internal``, Alibaba
100.100.100.200).
"""

from __future__ import annotations

import base64
import http.client
import ipaddress
import json
import os
import socket
import ssl
import time
from dataclasses import dataclass, field
from typing import Iterable
from urllib.parse import unquote, urlsplit

#: Environment variable holding the allow-list: comma- or space-separated hosts/addresses/networks.
ENV_ALLOW = "TESTFLINGER_MAGIC_WEBHOOK_ALLOW"
#: Bytes of a webhook's answer read at most (the rest is dropped with the connection).
MAX_RESPONSE_BYTES = 64 * 1024
#: Seconds one webhook POST may take, all of it (connect, send, answer).
DEFAULT_TIMEOUT = 5.0
#: Cloud instance metadata services (see the module docstring).
METADATA_ADDRESSES = frozenset(ipaddress.ip_address(a) for a in (
    "169.254.169.254", "fd00:ec2::254", "100.100.100.200"))
METADATA_NAMES = frozenset({"metadata.google.internal", "metadata.goog", "metadata",
                            "instance-data", "instance-data.ec2.internal"})
#: What :func:`redact` puts where the path, query and credentials were.
REDACTED = "…redacted"

_HINT = (f"webhooks may not point inside the lab or at the server itself; list it in the "
         f"webhook allow-list ({ENV_ALLOW}) if this chat server is meant to be internal")


class Refused(ValueError):
    """A webhook URL that may not be called (bad shape, or an address that is not allowed).
    The message names the URL only in its :func:`redact` form."""


def redact(url) -> str:
    """``scheme://host[:port]/…redacted``: where a webhook points, without its secrets (user
    info, path, query and fragment). Anything unparsable becomes ``<webhook URL …redacted>``."""
    try:
        parts = urlsplit(str(url))
        host, port = parts.hostname, parts.port
    except ValueError:
        host = None
    if not host or parts.scheme not in ("http", "https"):
        return f"<webhook URL {REDACTED}>"
    if ":" in host:
        host = f"[{host}]"
    return f"{parts.scheme}://{host}{f':{port}' if port else ''}/{REDACTED}"


def is_redacted(url) -> bool:
    """True when ``url`` carries :func:`redact`'s marker (also percent-encoded): it was copied
    from the API's or ``testflinger-magic queues``' output and is no longer the real URL."""
    text = str(url)
    return REDACTED in text or "%e2%80%a6redacted" in text.lower()


def _literal_address(host: str):
    """The IP address ``host`` spells, also in the forms ``inet_aton`` accepts (``2130706433``,
    ``0x7f.1``, ``0177.0.0.1``: getaddrinfo resolves them to 127.0.0.1), else None."""
    try:
        return ipaddress.ip_address(host)
    except ValueError:
        pass
    if host and all(c in "0123456789abcdefxABCDEFX." for c in host) and host[0].isdigit():
        try:
            return ipaddress.IPv4Address(socket.inet_aton(host))
        except OSError:
            return None
    return None


def address_problem(address) -> str | None:
    """Why a webhook may not go to ``address`` (an ``ipaddress`` address or its text), e.g.
    ``"loopback address"``, or None if it is a globally routable unicast address."""
    ip = ipaddress.ip_address(address) if isinstance(address, str) else address
    mapped = getattr(ip, "ipv4_mapped", None)
    if mapped is not None:
        ip = mapped
    meta = " (a cloud metadata service)" if ip in METADATA_ADDRESSES else ""
    for flag, what in (("is_unspecified", "unspecified address"),
                       ("is_loopback", "loopback address"),
                       ("is_link_local", "link-local address"),
                       ("is_multicast", "multicast address"),
                       ("is_private", "private address")):
        if getattr(ip, flag):
            return what + meta
    if not ip.is_global:
        return "address that is not globally routable" + meta
    return None


def _name_problem(host: str) -> str | None:
    name = host.rstrip(".").lower()
    if name == "localhost" or name.endswith(".localhost") or name in (
            "localhost.localdomain", "ip6-localhost", "ip6-loopback"):
        return "localhost name (loopback)"
    if name in METADATA_NAMES:
        return "cloud metadata service name"
    return None


@dataclass(frozen=True)
class AllowList:
    """Webhook destinations allowed although internal: exact host names (case-insensitive),
    addresses and networks (``10.20.0.0/16``)."""

    hosts: frozenset = frozenset()
    networks: tuple = field(default_factory=tuple)
    #: Allow every destination: for a client-side pre-check that leaves the decision to the
    #: server (``testflinger-magic apply``), never for sending.
    everything: bool = False

    @classmethod
    def parse(cls, entries: Iterable[str] | str | None, source: str = "webhook allow-list"
              ) -> "AllowList":
        """From a list of entries or one comma/space-separated string. Raises ValueError naming
        ``source`` and the entry for one that is not a host name, address or network."""
        if entries is None:
            return cls()
        if isinstance(entries, str):
            entries = entries.replace(",", " ").split()
        hosts, nets = set(), []
        for raw in entries:
            entry = str(raw).strip()
            if not entry:
                continue
            try:
                nets.append(ipaddress.ip_network(entry.strip("[]"), strict=False))
                continue
            except ValueError:
                pass
            name = entry.rstrip(".").lower()
            if not name or any(c in name for c in "/:@?#[] \t") or name.startswith("."):
                raise ValueError(f"{source}: {entry!r} is not a host name, address or network "
                                 "(e.g. chat.lab.example, 10.0.0.5, 10.20.0.0/16)")
            hosts.add(name)
        return cls(frozenset(hosts), tuple(nets))

    @classmethod
    def from_env(cls, environ=None) -> "AllowList":
        """The allow-list in ``$TESTFLINGER_MAGIC_WEBHOOK_ALLOW`` (empty if unset)."""
        environ = os.environ if environ is None else environ
        return cls.parse(environ.get(ENV_ALLOW, ""), source=ENV_ALLOW)

    def __or__(self, other: "AllowList") -> "AllowList":
        return AllowList(self.hosts | other.hosts, self.networks + other.networks,
                         self.everything or other.everything)

    def allows_host(self, host: str) -> bool:
        return self.everything or host.rstrip(".").lower() in self.hosts

    def allows_address(self, address) -> bool:
        if self.everything:
            return True
        ip = ipaddress.ip_address(address) if isinstance(address, str) else address
        mapped = getattr(ip, "ipv4_mapped", None)
        return any(ip in n or (mapped is not None and mapped in n) for n in self.networks)


def _shape(url: str) -> tuple[str, str, int]:
    """(scheme, host, port) of an http(s) URL with a host, else Refused."""
    try:
        parts = urlsplit(url)
        host, port = parts.hostname, parts.port
    except ValueError:
        raise Refused(f"{redact(url)}: not a valid http(s) URL") from None
    if parts.scheme not in ("http", "https") or not host:
        raise Refused(f"{redact(url)}: not an http(s) URL with a host")
    return parts.scheme, host, port or (443 if parts.scheme == "https" else 80)


def url_problem(url: str, allow: AllowList | None = None) -> str | None:
    """Why ``url`` may not be a webhook, judged without DNS (a literal address or a reserved
    name; a host name is checked again after resolution when sending), or None. The text names
    the URL only in its :func:`redact` form."""
    allow = allow or AllowList()
    try:
        _, host, _ = _shape(url)
    except Refused as exc:
        return str(exc)
    if allow.allows_host(host):
        return None
    ip = _literal_address(host)
    if ip is not None:
        if allow.allows_address(ip):
            return None
        why = address_problem(ip)
        return None if why is None else f"{redact(url)}: {host} is a {why}; {_HINT}"
    why = _name_problem(host)
    return None if why is None else f"{redact(url)}: {host} is a {why}; {_HINT}"


def resolve(url: str, allow: AllowList | None = None) -> list[tuple]:
    """The ``(family, sockaddr)`` pairs to connect to for ``url``, every one checked; raises
    :class:`Refused` if the URL is refused or any address it resolves to is not allowed (a name
    answering both a public and a loopback address is refused), ``OSError`` if it does not
    resolve."""
    allow = allow or AllowList()
    problem = url_problem(url, allow)
    if problem:
        raise Refused(problem)
    _, host, port = _shape(url)
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    out = []
    for family, _, _, _, sockaddr in infos:
        ip = ipaddress.ip_address(sockaddr[0].split("%")[0])
        if not (allow.allows_host(host) or allow.allows_address(ip)):
            why = address_problem(ip)
            if why:
                raise Refused(f"{redact(url)}: {host} resolves to {ip}, a {why}; {_HINT}")
        out.append((family, sockaddr))
    if not out:
        raise OSError(f"{host} resolves to no address")
    return out


class _PinnedHTTP(http.client.HTTPConnection):
    """An HTTP connection to ``host`` made to the already checked ``sockaddr``."""

    def __init__(self, host, port, target, timeout):
        super().__init__(host, port, timeout=timeout)
        self._target = target

    def connect(self):
        family, sockaddr = self._target
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.settimeout(self.timeout)
        try:
            sock.connect(sockaddr)
        except OSError:
            sock.close()
            raise
        self.sock = sock


class _PinnedHTTPS(_PinnedHTTP):
    """HTTPS over :class:`_PinnedHTTP`: certificate checked against the URL's host name."""

    def __init__(self, host, port, target, timeout, context=None):
        super().__init__(host, port, target, timeout)
        self._context = context or ssl.create_default_context()
        self.default_port = 443

    def connect(self):
        super().connect()
        self.sock = self._context.wrap_socket(self.sock, server_hostname=self.host)


def post_json(url: str, body: dict, allow: AllowList | None = None,
              timeout: float = DEFAULT_TIMEOUT, ssl_context=None) -> tuple[int, int]:
    """POST ``body`` as JSON to ``url`` once; returns ``(HTTP status, answer bytes read)``.

    Raises :class:`Refused` (URL or resolved address not allowed), ``OSError`` /
    ``http.client.HTTPException`` (connection, TLS, timeouts: each socket operation waits at most
    what is left of ``timeout`` seconds). A 3xx is returned, never followed; at most
    :data:`MAX_RESPONSE_BYTES` of the answer are read."""
    deadline = time.monotonic() + timeout
    targets = resolve(url, allow)
    scheme, host, port = _shape(url)
    parts = urlsplit(url)
    path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    headers = {"Content-Type": "application/json", "User-Agent": "testflinger-magic",
               "Connection": "close"}
    if parts.username is not None:  # user:password@host, as requests would send it
        creds = f"{unquote(parts.username)}:{unquote(parts.password or '')}"
        headers["Authorization"] = "Basic " + base64.b64encode(creds.encode()).decode()
    data = json.dumps(body, default=str).encode()

    def left() -> float:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError(f"gave up after {timeout:g}s")
        return remaining

    conn = (_PinnedHTTPS(host, port, targets[0], left(), ssl_context) if scheme == "https"
            else _PinnedHTTP(host, port, targets[0], left()))
    try:
        conn.request("POST", path, body=data, headers=headers)
        sock = conn.sock  # getresponse() hands it to the response (conn.sock becomes None)

        def bound() -> None:
            try:
                sock.settimeout(left())
            except OSError:
                pass  # closed under us: the next read says so

        bound()
        resp = conn.getresponse()
        read = 0
        while read < MAX_RESPONSE_BYTES:
            bound()
            chunk = resp.read(min(16384, MAX_RESPONSE_BYTES - read))
            if not chunk:
                break
            read += len(chunk)
        return resp.status, read
    finally:
        conn.close()
