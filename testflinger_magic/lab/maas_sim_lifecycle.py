"""The MAAS simulator's machine lifecycle: its state machine.

:class:`LifecycleMixin` is part of :class:`~testflinger_magic.lab.maas_sim.MaasSimulator`: the
machine ops (``POST machines/<system_id>/?op=`` deploy, release, commission, abort, mark_broken,
mark_fixed), each legal only in the statuses MAAS allows (else 409, MAAS
``NodeStateViolation``), and the timed transitions they begin.

Transitions that take time in MAAS complete lazily, judged on every request against ``clock()``:
``Commissioning -> Ready`` after ``delays["commissioning"]``, ``Deploying -> Deployed`` after
``delays["deploying"]``, ``Releasing -> Ready`` after ``delays["releasing"]`` (seconds, multiplied
by ``time_scale``). A transition armed with ``MaasSimulator.fail_next`` ends in MAAS' failure
status instead (``OUTCOMES``); one held with ``MaasSimulator.hold`` stays in progress past its
delay until the test's condition holds.
"""

from __future__ import annotations

import contextlib

from testflinger_magic.agent_host import maas_status as st
from testflinger_magic.lab import virsh_power
from testflinger_magic.lab.maas_sim_records import STATUS_CODES, Machine, Pending, SimError

# Which op's pending transition ends where, and where it ends when failure was injected.
OUTCOMES = {
    "commission": ("Commissioning", "Ready", "Failed commissioning", "commissioning"),
    "deploy": ("Deploying", "Deployed", "Failed deployment", "deploying"),
    "release": ("Releasing", "Ready", st.FAILED_RELEASING, "releasing"),
}
_RELEASABLE = st.RELEASABLE  # maasserver/models/node.py RELEASABLE_STATUSES
_COMMISSIONABLE = st.COMMISSIONABLE  # maasserver/node_status.py NODE_TRANSITIONS
_BREAKABLE = set(STATUS_CODES) - {"Retired"}


class LifecycleMixin:
    """Machine ops and timed transitions (see the module docstring); mixed into
    ``MaasSimulator`` (uses its ``_machines``, ``_failures``, ``_holds``, ``_clock``,
    ``delays``, ``time_scale``, and the network and power mixins' ``_auto_link``,
    ``_deploy_addresses``, ``_release_addresses``, ``_power``, ``_power_failed`` and
    ``_virsh_running``), whose lock every caller holds."""

    def _finalize_release(self, m: Machine) -> None:
        """maasserver/models/node.py ``Node._finalize_release``: ``release_interface_config``
        (AUTO addresses released, acquired bridges deleted with their links moved back to the
        parent), owner and OS cleared, Ready."""
        m.owner, m.osystem, m.distro_series, m.user_data = None, "", "", None
        self._release_addresses(m)
        for parent, (bridge, _) in m.bridges.items():
            m.links.setdefault(parent, []).extend(m.links.pop(bridge, []))
        m.bridges.clear()
        m.power_state = "off"
        m.status_name, m.status_message, m.pending = "Ready", "", None

    def _start(self, m: Machine, op: str) -> None:
        """Begin a timed transition (status becomes the op's in-progress status).

        A virsh machine is powered through ``virsh_power`` as MAAS' rack does: on for commission
        and deploy (maasserver/models/node.py ``Node._start`` -> ``_power_control_node``), off
        for release (``Node._release`` -> ``_stop``). When that power action fails, MAAS puts
        the machine back in its previous status (``_start_bmc_unavailable`` for a start;
        ``_release``'s errback ``_set_status`` for a release) with the failure in its events."""
        busy, _, _, delay_key = OUTCOMES[op]
        fail = False
        for key in ((m.system_id, op), (m.hostname, op)):
            if self._failures[key] > 0:
                self._failures[key] -= 1
                fail = True
                break
        old = m.prev_status = m.status_name
        m.status_name, m.status_message = busy, f"{busy} started"
        m.pending = Pending(op, self._clock() + self.delays[delay_key] * self.time_scale, fail)
        if m.power_type == "virsh":
            change = "off" if op == "release" else "on"
            try:
                self._power(m, change)
            except virsh_power.VirshError as e:
                self._power_failed(m, change, old, str(e), start=op != "release")
                return
        self._advance(m)

    def _advance(self, m: Machine) -> None:
        p = m.pending
        if p is None or self._clock() < p.done_at:
            return
        # A test's hold (MaasSimulator.hold): the op takes longer, until the test lets it end.
        until = self._holds.get(p.op)
        if until is not None:
            if not until():
                return
            del self._holds[p.op]
        # A virsh machine PXE-boots into commissioning or its deployment only while its domain
        # runs (a shut-off domain never reports back to MAAS' metadata server).
        if m.power_type == "virsh" and p.op in ("commission", "deploy") \
                and not self._virsh_running(m):
            return
        m.pending = None
        _, ok, failed, _ = OUTCOMES[p.op]
        if p.fail:
            m.status_name = failed
            m.status_message = f"{failed}: simulated failure of {p.op} on {m.hostname}"
            return
        if p.op == "deploy":
            try:
                self._deploy_addresses(m)
            except SimError as e:  # MAAS fails the deployment when it cannot give an address
                m.status_name, m.status_message = failed, f"{failed}: {e.body}"
                return
            m.power_state = "on"
            self._fresh_os(m)
        elif p.op == "release":
            self._finalize_release(m)
        elif p.op == "commission":
            # The commissioning environment powers the machine off when done (metadataserver
            # api.py: a node whose boot purpose is "poweroff" gets the poweroff user data).
            if m.power_type == "virsh":
                with contextlib.suppress(virsh_power.VirshError):
                    self._power(m, "off")
            m.power_state = "off"
            self._auto_link(m)
            self._record_node_devices(m)
        m.status_name, m.status_message = ok, ""

    def _fresh_os(self, m: Machine) -> None:
        """A deployment writes the OS image to the machine's disk (MAAS deploys with curtin,
        whose storage config wipes and partitions the boot disk: maasserver/preseed_storage.py),
        so libvirt domains a previous deployment defined on it are gone. A machine whose host
        name the simulator's virsh hosts know (the lab's GPU hosts) gets its test-driver host
        file emptied of domains (TRIAL15 F2: a lab host kept a closed lease's domains across a
        release and redeploy, and the next lease's split collided with them)."""
        host = self.virsh.static.get(m.hostname)
        if host is None:
            return
        from testflinger_magic.agent_host.libvirt_session import session  # noqa: PLC0415

        with session(host.uri) as s:
            for dom in s.conn.listAllDomains():
                if dom.isActive():
                    dom.destroy()
                dom.undefine()
                s.changed = True

    def _advance_all(self):
        for m in self._machines.values():
            self._advance(m)

    def _get(self, system_id: str) -> Machine:
        m = self._machines.get(system_id)
        if m is None:
            raise SimError(404, "No Machine matches the given query.")
        self._advance(m)
        return m

    def _conflict(self, m: Machine, what: str):
        return SimError(409, f"{m.hostname}: Cannot {what} node because it's in the "
                             f"{m.status_name} state.")


    def _op_deploy(self, m, form):
        if m.status_name != "Allocated":
            raise self._conflict(m, "deploy")
        series = form.get("distro_series") or "jammy"  # MAAS: Config default_distro_series
        # maasserver/api/machines.py MachineHandler.deploy: MachineForm.set_distro_series
        # finds the release by name ("jammy") or "osystem/release"; one MAAS has no usable
        # images of fails the form's choice field: MAASAPIValidationError(form.errors), HTTP
        # 400 with the errors by field as JSON, and the machine stays Allocated.
        release = series.split("/", 1)[1] if series.startswith("ubuntu/") else series
        if release not in self.usable_releases:
            raise SimError(400, {"distro_series": [
                f"Select a valid choice. {series} is not one of the available choices."]})
        m.osystem = form.get("osystem", "ubuntu")
        m.distro_series = release
        m.user_data = form.get("user_data", "").encode() or None
        m.power_state = "on"
        self._start(m, "deploy")

    def _op_release(self, m, form):
        # maasserver/models/node.py Node._release: a powered machine is powered off and
        # Releasing until it is off; one already off is released to Ready at once.
        if m.status_name not in _RELEASABLE:
            raise self._conflict(m, "release")
        if m.power_state != "off":
            self._start(m, "release")
        else:
            self._finalize_release(m)

    def _op_commission(self, m, form):
        if m.status_name not in _COMMISSIONABLE:
            raise self._conflict(m, "commission")
        self._start(m, "commission")

    def _op_abort(self, m, form):
        back = {"Commissioning": None, "Deploying": "Allocated"}
        if m.status_name not in back:
            raise self._conflict(m, "abort")
        m.status_name = back[m.status_name] or m.prev_status
        m.pending, m.status_message = None, form.get("comment", "Aborted")

    def _op_mark_broken(self, m, form):
        # maasserver/models/node.py Node.mark_broken: a releasable machine is released first
        # (powered off, its resources freed), then Broken whatever release did.
        if m.status_name not in _BREAKABLE:
            raise self._conflict(m, "mark broken")
        m.prev_status = m.status_name
        if m.status_name in _RELEASABLE:
            with contextlib.suppress(virsh_power.VirshError):
                self._power(m, "off")
            self._finalize_release(m)
        m.status_name, m.pending = "Broken", None
        m.status_message = form.get("comment", "") or "Marked broken"

    def _op_mark_fixed(self, m, form):
        # Node.mark_fixed: Broken -> Deployed if it was Deployed before, else Ready.
        if m.status_name != "Broken":
            raise self._conflict(m, "mark fixed")
        m.status_name = st.DEPLOYED if m.prev_status == st.DEPLOYED else st.READY
        m.status_message = ""
        if m.status_name == st.READY:
            m.owner, m.osystem, m.distro_series = None, "", ""
