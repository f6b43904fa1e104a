"""testflinger-magic server plugin: mount it on a Testflinger (or compatible) Flask app.

``init_app(app)`` registers the ``/v1/magic`` APIBlueprint, the app-level dispatch hooks on
Testflinger's own routes, and starts the reconcile ticker. See docs/architecture.md.
"""

from __future__ import annotations

import time

from . import startup
from .plugin import MagicPlugin

__all__ = ["MagicPlugin", "init_app", "default_db"]


def default_db():
    """Testflinger's database (``testflinger.database.mongo.db``) when the real server is
    importable, else a fresh locked mongomock database (:func:`testflinger_magic.db.connect`)."""
    try:
        from testflinger.database import mongo  # noqa: PLC0415
    except ImportError:
        from testflinger_magic import db as tfdb  # noqa: PLC0415

        return tfdb.connect()
    return mongo.db


def init_app(app, db=None, *, definitions=None, tick_seconds: float = 5.0,
             start_ticker: bool = True, clock=time.time, webhook_allow=None,
             agent_hosts: str | None = None) -> MagicPlugin:
    """Mount the plugin on ``app`` and return it (also at ``app.extensions["testflinger_magic"]``).

    ``db``: the database (default :func:`default_db`). ``definitions``: a list of MagicQueue or
    a YAML path, applied at start when new or changed since their last start-up apply, so a
    restart keeps what operators applied since (:mod:`.startup`; raises
    ``queues.DefinitionError`` on a bad file).
    ``tick_seconds``: reconcile period in seconds; ``start_ticker=False`` leaves ticking to the
    caller (``plugin.tick()``; tests). ``clock() -> epoch seconds``. ``webhook_allow``: internal
    webhook destinations a lab allows (host names, addresses, networks), added to
    ``$TESTFLINGER_MAGIC_WEBHOOK_ALLOW`` (:mod:`testflinger_magic.webhooks`). ``agent_hosts``:
    ``"admin-bound"`` to let only agent hosts an admin bound register, ``"first-registration"``
    (None: ``$TESTFLINGER_MAGIC_AGENT_HOSTS``, else that) to bind each by its first
    registration (:mod:`.bindings`).
    """
    # Flask-bound pieces; importing api adds every route of its blueprint (api_hosts,
    # status_page: api.py imports them).
    from . import api, dispatch  # noqa: PLC0415

    if db is None:
        db = default_db()
        if db is None:
            # Testflinger's create_flask_app leaves MongoDB unconnected when TESTING is set
            # (server/src/testflinger/application.py ``create_flask_app``: ``setup_mongodb``
            # only when TESTING is not True).
            raise RuntimeError(
                "testflinger_magic.init_app: Testflinger's database is not connected "
                "(testflinger.database.mongo.db is None, as create_flask_app leaves it with "
                "TESTING set): mount the plugin on an app whose MongoDB is set up, or pass db=")
    plugin = MagicPlugin(db, tick_seconds=tick_seconds, clock=clock,
                         webhook_allow=webhook_allow, agent_hosts=agent_hosts)
    app.extensions["testflinger_magic"] = plugin
    # On a plain Flask app (the lab), apiflask's input validation reads its settings from
    # app.config; an APIFlask app (Testflinger's) already has them.
    from apiflask import settings as apiflask_settings  # noqa: PLC0415

    for key in dir(apiflask_settings):
        if key.isupper():
            app.config.setdefault(key, getattr(apiflask_settings, key))
    if "testflinger_magic" not in app.blueprints:
        app.register_blueprint(api.bp)
    dispatch.install(app, plugin)
    # Only when new or changed since their last start-up apply: a restart must not undo what
    # an operator applied since (server/startup.py).
    startup.apply_at_start(plugin, definitions)
    if start_ticker:
        plugin.start()
    return plugin
