"""``testflinger-magic agent-hosts list|rebind|forget``: the agent-host bindings (admin).

Each agent host is bound to the Testflinger client that may act for it (its first registration
binds it; server/bindings.py). These commands show the bindings, move one to another client
(``rebind HOST CLIENT_ID``: e.g. the host's credentials were re-issued; a client Testflinger
does not know, or one without the agent role, is refused unless ``--force``) or forget a host so its
devices may be registered by another (``forget HOST``; refused while one holds a lease).
"""

from __future__ import annotations

import time
from urllib.parse import quote

from testflinger_magic.cli_api import _emit
from testflinger_magic.cli_output import _items, table


def _host_rows(hosts: list[dict]) -> list[dict]:
    now = time.time()
    rows = []
    for h in hosts:
        beat = h.get("last_heartbeat")
        rows.append({"_id": h.get("_id"), "client_id": h.get("client_id") or "(unbound)",
                     "devices": ", ".join(h.get("devices") or []) or "-",
                     "version": h.get("version"),
                     # the daemon instance the server accepted (server/hostinstance.py):
                     # "<hostname>/<machine id>:<state_dir>"; "-": an older daemon says none
                     "instance": h.get("instance") or "-",
                     "heartbeat": f"{int(now - beat)}s ago"
                     if isinstance(beat, (int, float)) else "never"})
        down = h.get("maas_unreachable_since")
        if isinstance(down, (int, float)):  # the daemon's heartbeat says so: not lent meanwhile
            rows[-1]["heartbeat"] += f" (MAAS unreachable for {int(now - down)}s)"
    return rows


def cmd_list(args, api) -> int:
    data = api.call("GET", "/v1/magic/agent-hosts")
    return _emit(args, data, lambda d: table(_host_rows(_items(d, "agent_hosts")),
                                             ["_id", "client_id", "devices", "version",
                                              "instance", "heartbeat"]))


def cmd_rebind(args, api) -> int:
    body = {"client_id": args.bind_client, "reason": args.reason}
    if args.force:  # a client unknown or not an agent yet (else the server answers 409)
        body["force"] = True
    data = api.call("PUT", f"/v1/magic/agent-hosts/{quote(args.host, safe='')}/binding", body)
    def render(d):
        bound = d.get("client_id", args.bind_client)
        if "previous_client_id" in d and d["previous_client_id"] == bound:
            return f"agent host {args.host} is already bound to client {bound}; nothing changed"
        was = d.get("previous_client_id")
        said = f"agent host {args.host} bound to client {bound}" + (f" (was {was})" if was else "")
        if was and d.get("last_heartbeat") is not None:
            # TRIAL19 F4: the running daemon is refused from now on, and until the host goes
            # stale (no heartbeat for 2 minutes) its devices may still be lent, with nobody
            # to bring them up.
            said += (f"; its running daemon (client {was}) is refused from now on: restart it "
                     f"with client {bound}'s credentials now (until the host goes stale, after "
                     "2 minutes without a heartbeat, its devices may still be lent and wait "
                     "for it)")
        return said
    return _emit(args, data, render)


def cmd_forget(args, api) -> int:
    data = api.call("DELETE", f"/v1/magic/agent-hosts/{quote(args.host, safe='')}",
                    params={"reason": args.reason})
    return _emit(args, data, lambda d: f"agent host {args.host} forgotten; devices "
                                       f"deregistered: {', '.join(d.get('devices') or []) or '-'}"
                                       " (a daemon still running for it registers it again at "
                                       "its next poll: stop it first)"
                                       + (f"; quarantine kept for {', '.join(d['quarantine_kept'])}"
                                          " (still quarantined when registered again: "
                                          "unquarantine lifts it)"
                                          if d.get("quarantine_kept") else ""))


def add_parsers(sub, api_parent) -> None:
    """Add ``agent-hosts`` and its subcommands to the CLI's subparsers ``sub``; ``api_parent``
    carries the global options (``--json`` and the connection options)."""
    from testflinger_magic.cli_types import nonempty, reason_text  # noqa: PLC0415

    hosts = sub.add_parser("agent-hosts", help="agent hosts and the clients bound to them",
                           description=__doc__.split("\n\n")[1])
    hosts_sub = hosts.add_subparsers(dest="hosts_command", required=True, metavar="ACTION")
    help_ = "agent hosts, bound client, devices, daemon instance, last heartbeat"
    p = hosts_sub.add_parser("list", parents=[api_parent], help=help_, description=help_)
    p.set_defaults(func=cmd_list, needs_api=True)
    help_ = "bind HOST to CLIENT_ID (admin); only that client may then act for it"
    p = hosts_sub.add_parser("rebind", parents=[api_parent], help=help_, description=help_)
    p.add_argument("host", metavar="HOST", type=nonempty("HOST"), help="agent host name")
    p.add_argument("bind_client", metavar="CLIENT_ID", type=nonempty("CLIENT_ID"),
                   help="the Testflinger client that may act for HOST from now on")
    p.add_argument("--reason", default="rebound by operator", type=reason_text,
                   help="why, recorded in the events (default: %(default)s)")
    p.add_argument("--force", action="store_true",
                   help="bind even a client Testflinger does not know (yet) or one without "
                   "the agent role; without it the server refuses, since the host could then "
                   "not register")
    p.set_defaults(func=cmd_rebind, needs_api=True)
    help_ = ("remove HOST and deregister its devices (admin; refused while one holds a lease)")
    p = hosts_sub.add_parser("forget", parents=[api_parent], help=help_, description=help_)
    p.add_argument("host", metavar="HOST", type=nonempty("HOST"), help="agent host name")
    p.add_argument("--reason", default="forgotten by operator", type=reason_text,
                   help="why, recorded in the events (default: %(default)s)")
    p.set_defaults(func=cmd_forget, needs_api=True)
