"""Which Testflinger client may act for which agent host (``magic_agent_hosts.client_id``).

Testflinger knows callers only by the client of their token (``permissions.client_id``, which
``api/auth.py::authenticate`` puts in ``g.client_id``; agents of one host share one client,
TESTFLINGER.md §2). An agent host is bound to one client:

* its first registration pins it to the registering client (compare-and-set, so two clients
  racing for a new host name cannot both win);
* every agent-host call (register, work, report, heartbeat) from another client is refused
  (:class:`~.engine.Forbidden`, 403) before anything is written;
* only an admin changes a binding (:meth:`Bindings.rebind`, ``PUT
  /v1/magic/agent-hosts/<host>/binding``), may bind a host before it first registers (an
  operator-managed mapping), or forgets a host and frees its devices (:meth:`Bindings.forget`).

A host document from before bindings existed (no ``client_id``) is bound by its next
registration; until then its work and reports are refused, which makes the daemon register
again (it does so on 403).
"""

from __future__ import annotations

from testflinger_magic.db import DuplicateKeyErrors

from . import keptquarantine
from .errors import Conflict, Forbidden, Invalid, NotFound


#: How an agent host gets bound (``TESTFLINGER_MAGIC_AGENT_HOSTS``, ``init_app(agent_hosts=)``):
#: by its first registration (the default), or only by an admin before its daemon first
#: registers (``agent-hosts rebind HOST CLIENT_ID``): then an agent client cannot make itself a
#: new agent host, and so cannot have any Testflinger agent lent (TRIAL12 F1).
FIRST_REGISTRATION, ADMIN_BOUND = "first-registration", "admin-bound"
BINDING_MODES = (FIRST_REGISTRATION, ADMIN_BOUND)
#: The environment variable that sets the mode of a server (server/wsgi.py).
BINDING_ENV = "TESTFLINGER_MAGIC_AGENT_HOSTS"


def binding_mode(value: str | None, source: str = BINDING_ENV) -> str:
    """``value`` checked as a binding mode (None or empty: :data:`FIRST_REGISTRATION`);
    ValueError naming ``source`` and the modes otherwise."""
    if not value:
        return FIRST_REGISTRATION
    if value not in BINDING_MODES:
        raise ValueError(f"{source}: {value!r} is not a binding mode; use one of "
                         f"{', '.join(BINDING_MODES)}")
    return value


def _need_client(client_id) -> str:
    if not isinstance(client_id, str) or not client_id:
        raise Forbidden("the token carries no client_id; agent-host calls need a Testflinger "
                        "client (POST /v1/oauth2/token) to bind the agent host to")
    return client_id


class Bindings:
    """Bindings of agent hosts to clients in ``db.magic_agent_hosts``.

    ``events``: the plugin's EventLog; ``clock() -> epoch seconds``; ``claimed(devices) ->
    {device: "lease <id> (<state>)"}`` for devices holding a claim (Engine._claimed).
    """

    def __init__(self, db, events, clock, claimed, mode: str = FIRST_REGISTRATION):
        self.db = db
        self.events = events
        self.clock = clock
        self._claimed = claimed
        self.mode = binding_mode(mode, "Bindings(mode=)")

    # ------------------------------------------------------------------ checks (read only)
    def check(self, host: str, client_id, *, unbound_ok: bool = False) -> dict | None:
        """The host's document if ``client_id`` may act for ``host``; raises Forbidden (403)
        if the host is bound to another client, or (unless ``unbound_ok``, which registration
        uses) if it is not registered or not bound yet; in :data:`ADMIN_BOUND` mode an unbound
        host is refused even then (an admin binds it first). Returns None for an unknown host
        when ``unbound_ok``."""
        client_id = _need_client(client_id)
        doc = self.db.magic_agent_hosts.find_one({"_id": host})
        bound = (doc or {}).get("client_id")
        if bound is not None and bound != client_id:
            raise Forbidden(f"agent host {host} is bound to client {bound}; client {client_id} "
                            "may not act for it (an admin rebinds it: testflinger-magic "
                            f"agent-hosts rebind {host} CLIENT_ID)")
        if bound is None and unbound_ok and self.mode == ADMIN_BOUND:
            raise Forbidden(f"agent host {host} is not bound to a client, and this server "
                            f"binds agent hosts by an admin only ({BINDING_ENV}={ADMIN_BOUND}):"
                            f" an admin binds it first: testflinger-magic agent-hosts rebind "
                            f"{host} {client_id}")
        if bound is None and not unbound_ok:
            what = "is not registered" if doc is None else "is not bound to a client yet"
            raise Forbidden(f"agent host {host} {what}; register it first (its first "
                            "registration binds it to the registering client)")
        return doc

    # ------------------------------------------------------------------ writes
    def pin(self, host: str, client_id: str) -> None:
        """Bind ``host`` to ``client_id`` if it is not bound yet (compare-and-set; a client
        that lost the race gets Forbidden). Call after :meth:`check` and the device checks,
        so a refused registration writes nothing."""
        now = self.clock()
        try:
            self.db.magic_agent_hosts.insert_one({
                "_id": host, "client_id": client_id, "bound_at": now, "registered_at": now,
                "devices": [], "last_heartbeat": None})
            self._record("agent_host.bound", f"agent host {host} bound to client {client_id} "
                         "by its first registration", host, client_id)
            return
        except DuplicateKeyErrors:
            pass
        res = self.db.magic_agent_hosts.update_one(
            {"_id": host, "client_id": None}, {"$set": {"client_id": client_id, "bound_at": now}})
        if res.modified_count:
            self._record("agent_host.bound", f"agent host {host} bound to client {client_id} "
                         "by its registration (it was registered before bindings)", host,
                         client_id)
            return
        self.check(host, client_id)  # bound meanwhile: to us (fine) or to another (403)

    def rebind(self, host: str, client_id: str, reason: str, by: str | None,
               force: bool = False) -> dict:
        """Admin: bind ``host`` to ``client_id`` (creating the binding if the host never
        registered: its registration then needs that client). Returns the host document plus
        ``previous_client_id`` (None: it was unbound); rebinding to the client it is bound to
        changes nothing and records no event.

        A client Testflinger does not know (no ``client_permissions`` document with that
        ``client_id``: every client that can get a token has one, Testflinger's
        ``database.check_client_exists``) is refused with Conflict (a typo would lock the host's
        daemon out) unless ``force`` (binding before the client is created). So is a client
        whose role is not ``agent``: the agent-host routes require that role (auth.AGENT_ROLES,
        exact membership as Testflinger's ``require_role``), so the daemon could never act; the
        role is the document's ``role``, ``contributor`` when it has none (Testflinger's default
        for legacy clients, ``api/v1.py`` client permissions and ``api/auth.py``)."""
        from testflinger_magic import tfstates  # noqa: PLC0415

        if not isinstance(client_id, str) or not client_id.strip():
            raise Invalid("client_id", "must be a non-empty Testflinger client id")
        client_id = client_id.strip()
        if not force:
            perm = self.db.client_permissions.find_one({"client_id": client_id}, {"role": 1})
            if perm is None:
                raise Conflict(f"no Testflinger client {client_id!r} is known "
                               f"(client_permissions): agent host {host} bound to it could not "
                               "register; check the id, or bind it anyway with force "
                               "(agent-hosts rebind --force), e.g. before the client is created")
            role = str(perm.get("role") or tfstates.ROLE_CONTRIBUTOR)
            if role != tfstates.ROLE_AGENT:
                raise Conflict(f"Testflinger client {client_id!r} has role {role!r}, not "
                               f"{tfstates.ROLE_AGENT!r}: agent host {host} bound to it could "
                               "not register or poll (the agent-host routes require role "
                               f"{tfstates.ROLE_AGENT!r}); give the client that role, pick the "
                               "host's agent client, or bind it anyway with force "
                               "(agent-hosts rebind --force)")
        now = self.clock()
        old = (self.db.magic_agent_hosts.find_one({"_id": host}) or {}).get("client_id")
        if old == client_id:  # already so: nothing to change, no event
            return dict(self.db.magic_agent_hosts.find_one({"_id": host}), previous_client_id=old)
        self.db.magic_agent_hosts.update_one(
            {"_id": host},
            {"$set": {"client_id": client_id, "bound_at": now},
             "$setOnInsert": {"devices": [], "registered_at": None, "last_heartbeat": None}},
            upsert=True)
        self._record("agent_host.rebound", f"agent host {host} bound to client {client_id} "
                     f"(was {old or 'unbound'}) by {by or 'an admin'}: {reason}", host,
                     client_id, previous=old)
        return dict(self.db.magic_agent_hosts.find_one({"_id": host}), previous_client_id=old)

    def forget(self, host: str, reason: str, by: str | None) -> dict:
        """Admin: remove ``host`` and deregister its devices, so another host may register
        them. Conflict (409, nothing removed) while one of its devices holds a lease; NotFound
        for an unknown host. Returns ``{"agent_host", "devices": [deregistered]}``."""
        doc = self.db.magic_agent_hosts.find_one({"_id": host})
        if doc is None:
            raise NotFound(f"agent host {host} is not registered")
        names = sorted(d["_id"] for d in self.db.magic_devices.find({"agent_host": host},
                                                                     {"_id": 1}))
        held = self._claimed(names)
        if held:
            raise Conflict(f"agent host {host} still has device(s) holding a lease: "
                           + ", ".join(f"{d}: {held[d]}" for d in sorted(held))
                           + "; drain them and wait until returned (or unquarantine a failed "
                           "one) first")
        removed, docs = [], []
        for name in names:
            gone = self.db.magic_devices.find_one_and_delete({"_id": name, "agent_host": host})
            if gone is None:
                continue
            if self._claimed([name]):  # lent between the check and the delete: put it back
                self.db.magic_devices.insert_one(gone)
                raise Conflict(f"device {name} of agent host {host} was just lent; drain it "
                               "first")
            removed.append(name)
            docs.append(gone)
        # A quarantine outlives the registration (keptquarantine, TRIAL18 F6).
        kept = keptquarantine.keep(self.db, docs, self.clock())
        self.db.magic_agent_hosts.delete_one({"_id": host})
        self._record("agent_host.forgotten", f"agent host {host} (client "
                     f"{doc.get('client_id') or 'unbound'}) forgotten by {by or 'an admin'}: "
                     f"{reason}; devices deregistered: {', '.join(removed) or 'none'}"
                     + (f"; quarantine kept for {', '.join(kept)} (still quarantined when "
                        "registered again)" if kept else ""), host,
                     doc.get("client_id"), devices=removed, quarantine_kept=kept)
        return {"agent_host": host, "devices": removed, "quarantine_kept": kept}

    def _record(self, kind, message, host, client_id, **data) -> None:
        self.events.record(kind, message, data={"host": host, "client_id": client_id, **data})
