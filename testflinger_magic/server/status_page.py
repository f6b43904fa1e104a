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
from flask import Response

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


@bp.get("/")
@auth.require(*auth.READ_ROLES)
def status_page():
    """HTML status page (text/html)."""
    plugin = _plugin()
    status = plugin.engine.status()
    events = list(reversed(plugin.events.list(limit=1000)))[:RECENT_EVENTS]
    now = plugin.engine.clock()
    html = _ENV.get_template("status.html").render(
        status=status, events=events, refresh=REFRESH_SECONDS,
        now=datetime.fromtimestamp(now, timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC"),
        age=lambda t: _age(t, now),
    )
    return Response(html, content_type="text/html; charset=utf-8")
