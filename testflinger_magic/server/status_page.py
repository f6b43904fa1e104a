"""The status page: ``GET /v1/magic/`` renders queues, open leases, devices and recent events.

A read-only HTML view of the same data as ``GET /v1/magic/status`` and ``/events`` (role: read,
so an anonymous browser works while Testflinger's OIDC is off). It refreshes itself every few
seconds.
"""

from __future__ import annotations

import time
from datetime import datetime, timezone
from pathlib import Path

import jinja2
from flask import Response, url_for

from testflinger_magic.cli_output import bringup_lines, cancel_waiting_text
from testflinger_magic.durations import format_duration

from . import auth
from .api import _plugin, bp

_ENV = jinja2.Environment(
    loader=jinja2.FileSystemLoader(Path(__file__).with_name("templates")),
    autoescape=jinja2.select_autoescape(["html"]),
)
REFRESH_SECONDS = 5
RECENT_EVENTS = 30


def _age(then, now=None) -> str:
    """``then`` (epoch seconds) as a short age such as ``42s``, ``5m`` or ``3h``."""
    if not then:
        return "?"
    seconds = max(0, int((now or time.time()) - float(then)))
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds // size}{unit}"
    return f"{seconds}s"


def drain_text(drain: dict, now: float) -> str:
    """A draining lease's drain as people read it: ``"idle drain: grace until 12:03:04 UTC
    (4m left); then running jobs are cancelled"`` (``drain``: the lease's drain document,
    ``grace_until`` epoch seconds)."""
    kind = drain.get("kind") or "operator"
    until = drain.get("grace_until")
    if not isinstance(until, (int, float)):
        return f"{kind} drain"
    at = datetime.fromtimestamp(until, timezone.utc).strftime("%H:%M:%S UTC")
    left = f"{format_duration(until - now)} left" if until > now else "grace over"
    return f"{kind} drain: grace until {at} ({left}); then running jobs are cancelled"


@bp.get("/")
@auth.require(*auth.READ_ROLES)
def status_page():
    """HTML status page (text/html)."""
    plugin = _plugin()
    status = plugin.engine.status()
    events = list(reversed(plugin.events.list(limit=1000)))[:RECENT_EVENTS]
    now = plugin.engine.clock()
    # Absolute links: Testflinger serves this page at /v1/magic as well as /v1/magic/ (its
    # url_map has strict_slashes off), where a relative "status" would be /v1/status.
    links = {"status": url_for("testflinger_magic.status"),
             "metrics": url_for("testflinger_magic.metrics")}
    html = _ENV.get_template("status.html").render(
        status=status, events=events, refresh=REFRESH_SECONDS, links=links,
        now=datetime.fromtimestamp(now, timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC"),
        age=lambda t: _age(t, now), drain_text=lambda d: drain_text(d, now),
        # The waiting jobs' leases still bringing up, as status' WHY JOBS WAIT says (TRIAL7).
        bringing=lambda q: bringup_lines(q, status.get("leases") or [], now),
        cancel_text=lambda at: cancel_waiting_text(at, now, utc=True),
    )
    return Response(html, content_type="text/html; charset=utf-8")
