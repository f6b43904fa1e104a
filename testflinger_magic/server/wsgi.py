"""``testflinger_magic.server.wsgi:app``: the real Testflinger server with the plugin mounted.

It builds the app the way Testflinger's ``server/app.py`` does (``setup_secrets_store()`` then
``create_flask_app(secrets_store=...)``; TESTFLINGER.md §1.1) and calls :func:`init_app` on it with
Testflinger's own database. Serve it with ``gunicorn testflinger_magic.server.wsgi:app``.
Magic queue definitions may be applied at start from the file named by
``TESTFLINGER_MAGIC_QUEUES`` (optional; only when new or changed since its last start-up apply,
so a restart keeps what ``apply`` changed since: server/startup.py); ``TESTFLINGER_MAGIC_TICK``
sets the tick period (s).
"""

from __future__ import annotations

import os

try:
    from testflinger.application import create_flask_app
    from testflinger.secrets import setup_secrets_store
except ImportError as exc:  # pragma: no cover - depends on the deployment
    raise ImportError(
        "testflinger_magic.server.wsgi needs the Testflinger server package ('testflinger', from "
        "canonical/testflinger server/) installed in this environment; it is not on PyPI. For "
        "the embedded lab use testflinger_magic.lab.jobservice instead."
    ) from exc

from . import init_app

secrets_store = setup_secrets_store()
app = create_flask_app(secrets_store=secrets_store)
plugin = init_app(
    app,
    definitions=os.environ.get("TESTFLINGER_MAGIC_QUEUES") or None,
    tick_seconds=float(os.environ.get("TESTFLINGER_MAGIC_TICK", "5")),
)
