"""A MAAS 2.0 REST API simulator on real HTTP, for the lab and the tests.

It speaks the subset of ``/MAAS/api/2.0/`` that python-libmaas and the MAAS CLI use to drive
machines, with the same wire format as MAAS (sources: the MAAS API reference at
https://maas.io/docs/api, and python-libmaas ``maas/client/bones`` and ``viscera/machines.py``):

- ``GET describe/`` (anonymous) lists the handlers. Their ``uri`` is ABSOLUTE and built from the
  request's ``Host`` header, because python-libmaas calls exactly those URIs after connecting.
- ``GET version/`` (anonymous), ``GET users/?op=whoami``.
- ``GET machines/`` (filters ``hostname``, ``mac_address``, ``id``, repeatable), ``POST machines/``
  (create; an admin may give ``description``, kept and shown in the machine document as MAAS'
  ``AdminMachineForm`` does), ``POST machines/?op=allocate`` (``system_id``, ``name``,
  ``tags``; 409 when nothing matches), ``GET|PUT|DELETE machines/<system_id>/``,
  ``GET machines/<system_id>/?op=power_parameters``, ``POST machines/<system_id>/?op=`` one of
  deploy, release, commission, abort, power_on, power_off, mark_broken, mark_fixed. As in MAAS
  (``DISPLAYED_MACHINE_FIELDS``), the machine document has no ``power_parameters``: read them
  with ``op=power_parameters``.
- ``GET subnets/``, ``GET subnets/<id>/``; ``GET nodes/<system_id>/interfaces/``,
  ``GET nodes/<system_id>/interfaces/<id>/`` and ``POST nodes/<system_id>/interfaces/<id>/?op=``
  ``link_subnet`` (``mode`` AUTO/DHCP/STATIC/LINK_UP, case-insensitive; ``subnet`` id or CIDR, of
  the interface's VLAN unless ``force``; ``ip_address`` for STATIC, else the lowest free address)
  or ``unlink_subnet`` (``id`` of the link). Both answer the interface document and need the
  machine Ready, Allocated or Broken (else 409), as MAAS' InterfaceHandler does.
- ``GET nodes/<system_id>/devices/`` (MAAS >= 3.0, filters ``bus``, ``hardware_type``,
  ``vendor_id``...): the PCI devices the machine's commissioning recorded from the PCI layout
  given to ``add_machine``/``set_hardware``; none for a machine never commissioned; an older
  ``version`` answers 404 "Unknown API endpoint" as MAAS' catch-all does
  (:mod:`.maas_sim_devices`).
- Authentication is OAuth 1.0 PLAINTEXT in the ``Authorization`` header, checked against the API
  key ``consumer:token:secret`` (signature ``<consumer secret>&<token secret>``, the consumer
  secret being empty as in MAAS). Failures answer 401.
- POST/PUT bodies are ``multipart/form-data``; python-libmaas base64-encodes every part
  (``Content-Transfer-Encoding: base64``), so parts are decoded with the ``email`` package.
  ``application/x-www-form-urlencoded`` is accepted too.
- Illegal transitions answer 409 (MAAS ``NodeStateViolation``), form errors 400 with a JSON
  ``{field: [message]}`` body as MAAS forms do, unknown machines 404.

Transitions that take time in MAAS complete lazily, judged on every request against ``clock()``:
``Commissioning -> Ready`` after ``delays["commissioning"]``, ``Deploying -> Deployed`` after
``delays["deploying"]``, ``Releasing -> Ready`` after ``delays["releasing"]`` (seconds, multiplied
by ``time_scale``). The machine ops and these transitions: :mod:`.maas_sim_lifecycle`.

Parts: :mod:`.maas_sim_records` (records, documents, request parsing), :mod:`.maas_sim_lifecycle`
(machine ops, timed transitions), :mod:`.maas_sim_net` (subnets, interface links, addresses,
bridges), :mod:`.maas_sim_power` (power control through :mod:`.virsh_power`, node events),
:mod:`.maas_sim_parts` (smaller pieces of MAAS behaviour).
"""

from __future__ import annotations

import base64
import collections
import hashlib
import ipaddress
import itertools
import json
import re
import threading
import time
from typing import Callable

from werkzeug.exceptions import HTTPException, NotFound
from werkzeug.routing import Map, Rule
from werkzeug.wrappers import Request, Response

from testflinger_magic.lab import maas_sim_devices as nodedev
from testflinger_magic.lab import maas_sim_parts as parts
from testflinger_magic.lab import virsh_power
from testflinger_magic.lab.maas_sim_lifecycle import OUTCOMES, LifecycleMixin
from testflinger_magic.lab.maas_sim_net import DEFAULT_SUBNETS, NetworkMixin
from testflinger_magic.lab.maas_sim_power import PowerMixin
from testflinger_magic.lab.maas_sim_records import (  # noqa: F401 (API, parse_*: re-exported)
    API, STATUS_CODES, USERNAME, Machine, SimError, Subnet, describe, form_bool,
    machine_json, parse_form, parse_oauth_header)

#: The MAAS version the simulator says it is (``GET version/``) unless told another
#: (``MaasSimulator(version=...)``); below 3.0 it has no node devices (maas_sim_devices).
MAAS_VERSION = "3.5.0"

DEFAULT_DELAYS = {"commissioning": 60.0, "deploying": 120.0, "releasing": 15.0}
#: The Ubuntu releases whose images the simulated MAAS has imported (its usable releases, what
#: a deploy's ``distro_series`` may name: maasserver/forms/__init__.py ``MachineForm``, whose
#: ``distro_series`` choices are ``list_all_usable_releases``). A fresh MAAS imports the
#: current LTS; a lab adds others in its image settings (``maas boot-source-selections``).
DEFAULT_USABLE_RELEASES = ("jammy", "noble")

_ARCHES = {"amd64", "arm64", "armhf", "i386", "ppc64el", "s390x"}
_POWER_TYPES = {"virsh", "ipmi", "manual", "lxd", "redfish", "amt", "webhook", "wedge"}
_MAC = re.compile(r"^[0-9a-f]{2}(:[0-9a-f]{2}){5}$")
_SYSTEM_ID_CHARS = "abcdefghjkmnpqrstwxy0123456789"


class MaasSimulator(LifecycleMixin, NetworkMixin, PowerMixin, nodedev.NodeDevicesMixin):
    """MAAS 2.0 API simulator. ``.app`` is the WSGI application.

    ``api_key``: ``consumer:token:secret`` the clients must sign with. ``time_scale``: factor on
    ``delays`` (seconds; keys ``commissioning``, ``deploying``, ``releasing``, or the op names
    ``commission``, ``deploy``, ``release``; ``ValueError`` on others). ``clock``: a
    monotonic clock in seconds (tests may pass a fake one). ``subnets``: CIDRs, ids 1, 2, ... in
    this order, each on its own VLAN; machines' interfaces are on the first one's VLAN
    (``ValueError`` if empty or not a network). ``usable_releases``: the Ubuntu series whose
    images MAAS has (a deploy naming another is refused with HTTP 400, as MAAS does).
    ``version``: the MAAS version it is (``GET version/``); below 3.0 it has no node devices
    (no ``NodeDevicesHandler`` in ``describe/``, 404 for its path). Thread-safe.
    """

    def __init__(self, api_key: str = "sim:sim:sim", time_scale: float = 1.0,
                 delays: dict | None = None, clock: Callable[[], float] = time.monotonic,
                 subnets: tuple[str, ...] | list[str] = DEFAULT_SUBNETS,
                 usable_releases: tuple[str, ...] | list[str] = DEFAULT_USABLE_RELEASES,
                 version: str = MAAS_VERSION):
        parts = api_key.split(":")
        if len(parts) != 3 or not all(parts):
            raise ValueError("api_key must be 'consumer:token:secret' (three non-empty parts)")
        self._consumer, self._token, self._secret = parts
        self.time_scale = float(time_scale)
        self.delays = dict(DEFAULT_DELAYS)
        for key, seconds in (delays or {}).items():
            # Op names ("deploy") are accepted for the status names ("deploying").
            name = OUTCOMES[key][3] if key in OUTCOMES else key
            if name not in DEFAULT_DELAYS:
                raise ValueError(f"delays: unknown key {key!r}; use {sorted(DEFAULT_DELAYS)} "
                                 f"or {sorted(OUTCOMES)}")
            self.delays[name] = float(seconds)
        self._clock = clock
        if not subnets:
            raise ValueError("subnets: at least one CIDR is needed")
        self._subnets = [Subnet(i + 1, ipaddress.ip_network(cidr), 5001 + i, i)
                         for i, cidr in enumerate(subnets)]
        self._link_ids = itertools.count(1)
        self._lock = threading.RLock()
        self._machines: dict[str, Machine] = {}
        self._failures: collections.Counter = collections.Counter()
        #: ``{op: until}``: transitions of ``op`` held past their delay (:meth:`hold`).
        self._holds: dict[str, Callable[[], bool]] = {}
        self.usable_releases = frozenset(usable_releases)
        self.version = str(version)
        self.node_devices_served = nodedev.supports_node_devices(self.version)
        self._node_device_ids = itertools.count(1)
        self._injections: list[parts.Injection] = []
        self._event_ids = itertools.count(1)
        self._keys_cache: dict = {}  # system_id -> (user_data, keys): PowerMixin._deploy_keys
        #: Where the virsh power driver's SSH lands (virsh_power.VirshHosts): ``add(host, uri)``
        #: registers a host; a Deployed machine's address reaches the host registered under its
        #: hostname, accepting the keys of its deploy user_data (``ssh_authorized_keys``).
        #: ``virsh.rack_key``: the simulated rack controller's public key (None: any key).
        self.virsh = virsh_power.VirshHosts(lookup=self._virsh_lookup)
        self._unreachable = False
        self._ids = itertools.count(1)
        self._iface_ids = itertools.count(1)
        # Recent (method, path?query) pairs, for tests that check what a client sent.
        self.requests: collections.deque = collections.deque(maxlen=1000)
        self._url_map = Map([
            Rule(f"{API}/describe/", endpoint="describe", methods=["GET"]),
            Rule(f"{API}/version/", endpoint="version", methods=["GET"]),
            Rule(f"{API}/users/", endpoint="users", methods=["GET"]),
            Rule(f"{API}/machines/", endpoint="machines", methods=["GET", "POST"]),
            Rule(f"{API}/machines/<system_id>/", endpoint="machine",
                 methods=["GET", "PUT", "POST", "DELETE"]),
            Rule(f"{API}/subnets/", endpoint="subnets", methods=["GET"]),
            Rule(f"{API}/subnets/<int:subnet_id>/", endpoint="subnet", methods=["GET"]),
            Rule(f"{API}/nodes/<system_id>/interfaces/", endpoint="interfaces", methods=["GET"]),
            Rule(f"{API}/nodes/<system_id>/interfaces/<int:iface_id>/", endpoint="interface",
                 methods=["GET", "POST"]),
            Rule(f"{API}/events/", endpoint="events", methods=["GET"]),
        ] + ([Rule(f"{API}/nodes/<system_id>/devices/", endpoint="node_devices",
                   methods=["GET"])] if self.node_devices_served else []),
            strict_slashes=True)

    # ------------------------------------------------------------------ Python API

    def add_machine(self, hostname: str, system_id: str | None = None, status: str = "Ready",
                    power_type: str = "ipmi", *, mac: str | None = None,
                    architecture: str = "amd64/generic", cpu_count: int = 64,
                    memory: int = 262144, tag_names: tuple = (),
                    power_parameters: dict | None = None,
                    interface_name: str | None = None, description: str = "",
                    hardware: str | None = None) -> str:
        """Add a machine directly in ``status`` (no transition); returns its system_id.
        ``interface_name``: its boot interface's name as commissioning found it (default
        ``eth0``); MAAS names a ``bridge_all`` bridge after it (``br-<name>``). ``hardware``:
        its PCI layout, a libvirt host document (lab/hosts.py), as :meth:`set_hardware`.

        Raises ``ValueError`` on a duplicate hostname/system_id/MAC or unknown status.
        """
        if status not in STATUS_CODES:
            raise ValueError(f"unknown MAAS status {status!r}")
        with self._lock:
            system_id = system_id or self._new_system_id()
            mac = (mac or self._mac_for(system_id)).lower()
            if system_id in self._machines:
                raise ValueError(f"system_id {system_id!r} already exists")
            self._check_unique(hostname, [mac], exc=ValueError)
            m = Machine(system_id=system_id, hostname=hostname, status_name=status,
                         power_type=power_type, power_parameters=dict(power_parameters or {}),
                         architecture=architecture, macs=[mac],
                         interface_ids=[next(self._iface_ids)], cpu_count=cpu_count,
                         memory=memory, tag_names=list(tag_names), description=description,
                         interface_names=[interface_name] if interface_name else [])
            m.vlan = self._subnets[0]
            if status != "New":  # commissioned: its boot interface has MAAS' default AUTO link
                self._auto_link(m)
            if status in ("Allocated", "Deployed", "Deploying"):
                m.owner = USERNAME
            if status == "Deployed":
                m.osystem, m.distro_series, m.power_state = "ubuntu", "jammy", "on"
                self._deploy_addresses(m)
            self._machines[system_id] = m
        if hardware is not None:
            self.set_hardware(system_id, hardware)
        return system_id

    def machines(self) -> dict[str, dict]:
        """Snapshot ``{system_id: machine JSON}`` with pending transitions applied."""
        with self._lock:
            self._advance_all()
            return {sid: machine_json(m) for sid, m in self._machines.items()}

    def machine(self, system_id: str) -> dict:
        """Snapshot of one machine (``KeyError`` if missing)."""
        return self.machines()[system_id]

    def power_parameters(self, system_id: str) -> dict:
        """The machine's power parameters (``KeyError`` if missing); over HTTP this is
        ``GET machines/<system_id>/?op=power_parameters``."""
        with self._lock:
            return dict(self._machines[system_id].power_parameters)

    def user_data(self, system_id: str) -> bytes | None:
        """The user_data of the machine's last deploy, base64-DEcoded (MAAS receives it base64
        encoded), or None. ``KeyError`` if missing."""
        with self._lock:
            raw = self._machines[system_id].user_data
        return base64.b64decode(raw) if raw else None

    def fail_next(self, system_id: str, op: str, times: int = 1) -> None:
        """Make the next ``op`` (``deploy``, ``commission`` or ``release``) of ``system_id`` end
        in ``Failed deployment`` / ``Failed commissioning`` / ``Releasing failed`` (MAAS' labels).

        ``system_id`` may also be a hostname, so that a machine not yet created (a VM the
        daemon will enrol) can be armed: its commissioning on creation then fails. ``times``:
        how many of the next ``op`` fail."""
        if op not in OUTCOMES:
            raise ValueError(f"op must be one of {sorted(OUTCOMES)}, not {op!r}")
        with self._lock:
            self._failures[(system_id, op)] += times

    def hold(self, op: str, until: Callable[[], bool]) -> None:
        """Test control: keep every pending ``op`` transition (``commission``, ``deploy`` or
        ``release``) in progress past its delay until ``until()`` is true; from then on (the
        hold is dropped) they complete as usual. ``ValueError`` on an unknown ``op``.

        Not a MAAS behaviour but a stand-in for its duration: how long MAAS takes to commission
        or deploy is the machine's boot and scripts (minutes; ``DEFAULT_DELAYS``), so a test can
        have work the daemon overlaps with it finish first without a timed race. ``until`` is
        called under the simulator's lock whenever such a transition is due (every request):
        it must be quick and must not call the simulator."""
        if op not in OUTCOMES:
            raise ValueError(f"op must be one of {sorted(OUTCOMES)}, not {op!r}")
        with self._lock:
            self._holds[op] = until

    def inject(self, method: str, path_regex: str, status: int, body="injected failure",
               times: int = 1) -> None:
        """Make the next ``times`` requests (-1: all) whose method is ``method`` ("*": any)
        and whose ``path?query`` matches ``path_regex`` (``re.search``) answer HTTP ``status``
        with ``body`` (str, or dict sent as JSON) instead of being handled."""
        with self._lock:
            self._injections.append(parts.Injection(method.upper() if method != "*" else "*",
                                                    re.compile(path_regex), int(status), body,
                                                    int(times)))

    def set_unreachable(self, unreachable: bool) -> None:
        """While true every request answers 503, as a proxy in front of a dead region does."""
        self._unreachable = bool(unreachable)

    # ------------------------------------------------------------------ helpers

    def _new_system_id(self) -> str:
        while True:
            n, chars = next(self._ids), []
            for _ in range(6):
                n, r = divmod(n * 7919 + 13, len(_SYSTEM_ID_CHARS))
                chars.append(_SYSTEM_ID_CHARS[r])
            sid = "".join(chars)
            if sid not in self._machines:
                return sid

    @staticmethod
    def _mac_for(system_id: str) -> str:
        d = hashlib.sha256(("mac" + system_id).encode()).digest()
        return "52:54:00:" + ":".join(f"{b:02x}" for b in d[:3])

    def _check_unique(self, hostname, macs, exc=None, skip=None):
        """MAAS refuses a machine whose hostname another node has (maasserver/models/node.py
        ``Node.hostname``: ``unique=True``) or a MAC another node's interface has
        (maasserver/forms/__init__.py ``MachineWithMACAddressesForm.clean_mac_addresses``:
        "MAC address ... already in use on ..."): HTTP 400 with the field's error."""
        for m in self._machines.values():
            if m.system_id == skip:
                continue
            if hostname and m.hostname == hostname:
                err = {"hostname": [f"Node with hostname {hostname!r} already exists."]}
                raise (exc(str(err)) if exc else SimError(400, err))
            for mac in macs:
                if mac in m.macs:
                    err = {"mac_addresses": [f"MAC address {mac} already in use on "
                                             f"{m.hostname}."]}
                    raise (exc(str(err)) if exc else SimError(400, err))

    # ------------------------------------------------------------------ WSGI

    def app(self, environ, start_response):
        """WSGI entry point."""
        request = Request(environ)
        self.requests.append((request.method, request.full_path))
        try:
            if self._unreachable:
                raise SimError(503, "MAAS region controller unavailable (simulated)")
            with self._lock:
                hit = next((i for i in self._injections
                            if i.matches(request.method, request.full_path.rstrip("?"))), None)
                if hit is not None:
                    hit.times -= 1
            if hit is not None:
                raise SimError(hit.status, hit.body)
            endpoint, args = self._url_map.bind_to_environ(environ).match()
            if endpoint not in ("describe", "version"):
                self._authenticate(request)
            with self._lock:
                result = getattr(self, f"_h_{endpoint}")(request, **args)
            if result is None:
                response = Response(status=204)
            else:
                response = Response(json.dumps(result), mimetype="application/json")
        except SimError as e:
            if isinstance(e.body, dict):
                response = Response(json.dumps(e.body), e.status, mimetype="application/json")
            else:
                response = Response(str(e.body), e.status, mimetype="text/plain")
        except NotFound:
            # src/maasserver/urls_api.py: the last pattern, ``handler_404``
            # (api/not_found.py ``not_found_handler``, MAASAPINotFound: text/plain)
            response = Response(f"Unknown API endpoint: {request.path}.", 404,
                                mimetype="text/plain")
        except HTTPException as e:
            response = Response(e.description or e.name, e.code, mimetype="text/plain")
        return response(environ, start_response)

    def _authenticate(self, request: Request) -> None:
        oauth = parse_oauth_header(request.headers.get("Authorization", ""))
        if not oauth:
            raise SimError(401, "Authorization Required")
        method = oauth.get("oauth_signature_method", "")
        if method != "PLAINTEXT":
            raise SimError(401, f"Unsupported OAuth signature method {method!r}")
        # PLAINTEXT signature is "<consumer secret>&<token secret>"; MAAS' consumer secret is "".
        if (oauth.get("oauth_consumer_key") != self._consumer
                or oauth.get("oauth_token") != self._token
                or oauth.get("oauth_signature") != f"&{self._secret}"):
            raise SimError(401, "Invalid access token")

    @staticmethod
    def _form(request: Request) -> list[tuple[str, str]]:
        return parse_form(request.headers.get("Content-Type", ""), request.get_data())

    def _h_describe(self, request):
        return describe(f"{request.scheme}://{request.host}", self.node_devices_served)

    def _h_version(self, request):
        return {"capabilities": ["networks-management", "static-ipaddresses", "ipv6-deployment-"
                                 "ubuntu", "devices-management", "storage-deployment-ubuntu",
                                 "network-deployment-ubuntu", "bridging-interface-ubuntu",
                                 "bridging-automatic-ubuntu", "authenticate-api"],
                "version": self.version, "subversion": "simulator"}

    def _h_users(self, request):
        if request.args.get("op") == "whoami":
            return {"username": USERNAME, "email": f"{USERNAME}@example.com",
                    "is_superuser": True, "resource_uri": f"{API}/users/{USERNAME}/"}
        if request.args.get("op"):
            raise SimError(400, f"Unrecognised signature: method=GET op={request.args['op']}")
        return [{"username": USERNAME, "email": f"{USERNAME}@example.com", "is_superuser": True}]

    def _h_machines(self, request):
        op = request.args.get("op")
        if request.method == "GET":
            if op:
                raise SimError(400, f"Unrecognised signature: method=GET op={op}")
            hostnames = set(request.args.getlist("hostname"))
            macs = {m.lower() for m in request.args.getlist("mac_address")}
            ids = set(request.args.getlist("id"))
            self._advance_all()
            return [machine_json(m) for m in self._machines.values()
                    if (not hostnames or m.hostname in hostnames)
                    and (not macs or macs & set(m.macs)) and (not ids or m.system_id in ids)]
        form = self._form(request)
        if op == "allocate":
            return self._allocate(form)
        if op:
            raise SimError(400, f"Unrecognised signature: method=POST op={op}")
        return self._create(form)

    def _allocate(self, form):
        args: dict[str, list[str]] = {}
        for k, v in form:
            args.setdefault(k, []).append(v)
        want_id = (args.get("system_id") or [None])[0]
        want_name = (args.get("name") or [None])[0]
        tags = set(args.get("tags", []))
        self._advance_all()
        for m in self._machines.values():
            if (m.status_name == "Ready" and m.owner is None
                    and (want_id is None or m.system_id == want_id)
                    and (want_name is None or m.hostname == want_name.split(".")[0])
                    and tags <= set(m.tag_names)):
                # maasserver/api/machines.py get_allocation_options -> Node.acquire(bridge_all..)
                if form_bool((args.get("bridge_all") or [""])[0]):
                    self._create_bridges(m, {k: v[0] for k, v in args.items()})
                m.status_name, m.owner, m.status_message = "Allocated", USERNAME, ""
                return machine_json(m)
        crit = ", ".join(f"{k}={v}" for k, v in form) or "any"
        raise SimError(409, f"No available machine matches constraints: {crit}")

    def _create(self, form):
        args: dict[str, list[str]] = {}
        for k, v in form:
            args.setdefault(k, []).append(v)
        errors: dict[str, list[str]] = {}
        arch = (args.get("architecture") or [""])[0]
        sub = (args.get("subarchitecture") or [""])[0]
        if arch and "/" not in arch:
            arch = f"{arch}/{sub or 'generic'}"
        if not arch or arch.split("/")[0] not in _ARCHES:
            errors["architecture"] = [f"Select a valid choice. {arch!r} is not one of the "
                                      "available choices."]
        macs = [m.strip().lower() for m in args.get("mac_addresses", [])]
        if not macs:
            errors["mac_addresses"] = ["This field is required."]
        elif not all(_MAC.match(m) for m in macs):
            errors["mac_addresses"] = ["One or more MAC addresses is invalid."]
        power_type = (args.get("power_type") or [""])[0]
        if power_type not in _POWER_TYPES:
            errors["power_type"] = [f"Select a valid choice. {power_type!r} is not one of the "
                                    "available choices."]
        params: dict = {}
        if "power_parameters" in args:
            try:
                params.update(json.loads(args["power_parameters"][0]))
            except (ValueError, TypeError):
                errors["power_parameters"] = ["Invalid JSON."]
        for k, v in args.items():
            if k.startswith("power_parameters_"):
                params[k[len("power_parameters_"):]] = v[0]
        if power_type == "virsh" and not params.get("power_address"):
            errors["power_parameters"] = ["power_address: This field is required."]
        bad_name = parts.hostname_problem((args.get("hostname") or [""])[0] or "ok")
        if bad_name:
            errors["hostname"] = [bad_name]
        if errors:
            raise SimError(400, errors)
        hostname = (args.get("hostname") or [""])[0].split(".")[0]
        self._check_unique(hostname, macs)
        system_id = self._new_system_id()
        m = Machine(system_id=system_id, hostname=hostname or f"node-{system_id}",
                     status_name="New", power_type=power_type, power_parameters=params,
                     architecture=arch, macs=macs,
                     description=(args.get("description") or [""])[0],
                     interface_ids=[next(self._iface_ids) for _ in macs],
                     vlan=self._subnets[0])
        self._machines[system_id] = m
        if (args.get("commission") or ["true"])[0].lower() not in ("false", "0"):
            self._start(m, "commission")
        return machine_json(m)

    def _h_machine(self, request, system_id):
        m = self._get(system_id)
        op = request.args.get("op")
        if request.method == "GET":
            if op == "power_parameters":
                return dict(m.power_parameters)
            if op:
                raise SimError(400, f"Unrecognised signature: method=GET op={op}")
            return machine_json(m)
        if request.method == "DELETE":
            del self._machines[system_id]
            return None
        form = dict(self._form(request))
        if request.method == "PUT":
            return self._update(m, form)
        handler = getattr(self, f"_op_{op}", None) if op else None
        if handler is None:
            raise SimError(400, f"Unrecognised signature: method=POST op={op}")
        handler(m, form)
        return machine_json(m)

    def _update(self, m, form):
        if "hostname" in form and form["hostname"] != m.hostname:
            bad_name = parts.hostname_problem(form["hostname"])
            if bad_name:
                raise SimError(400, {"hostname": [bad_name]})
            self._check_unique(form["hostname"], [], skip=m.system_id)
            m.hostname = form["hostname"]
        if "power_type" in form:
            if form["power_type"] not in _POWER_TYPES:
                raise SimError(400, {"power_type": ["Select a valid choice."]})
            m.power_type = form["power_type"]
        for k, v in form.items():
            if k.startswith("power_parameters_"):
                m.power_parameters[k[len("power_parameters_"):]] = v
        for k in ("cpu_count", "memory"):
            if k in form:
                try:
                    setattr(m, k, int(form[k]))
                except ValueError:
                    raise SimError(400, {k: ["Enter a whole number."]}) from None
        if "architecture" in form:
            m.architecture = form["architecture"]
        if "description" in form:  # MAAS API reference, PUT machines/{system_id}/ description
            m.description = form["description"]
        return machine_json(m)


class _Served:
    """Handle for a werkzeug server thread: ``.url``, ``.port``, ``.stop()``."""

    def __init__(self, server, thread):
        self._server, self._thread = server, thread
        self.port = server.server_port
        self.url = f"http://{server.host}:{self.port}"

    def stop(self) -> None:
        """Stop serving and close the socket; idempotent."""
        if self._thread.is_alive():
            self._server.shutdown()
            self._thread.join()
        self._server.server_close()


def serve(sim: MaasSimulator, host: str = "127.0.0.1", port: int = 0):
    """Serve ``sim.app`` on real HTTP; returns a handle with ``.url`` (no trailing slash, e.g.
    ``http://127.0.0.1:41234``; MAAS URL is ``.url + "/MAAS/"``), ``.port`` and ``.stop()``.

    Uses ``testflinger_magic.lab.httpserve.serve`` when present, else a threaded werkzeug server.
    """
    try:
        from testflinger_magic.lab import httpserve
    except ImportError:
        httpserve = None
    if httpserve is not None:
        return httpserve.serve(sim.app, host=host, port=port)
    from werkzeug.serving import WSGIRequestHandler, make_server

    class _QuietHandler(WSGIRequestHandler):
        def log_request(self, *args, **kwargs):  # one line per poll would drown the lab log
            pass

    server = make_server(host, port, sim.app, threaded=True, request_handler=_QuietHandler)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05},
                              name="maas-sim", daemon=True)
    thread.start()
    return _Served(server, thread)
