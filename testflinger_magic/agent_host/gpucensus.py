"""The GPUs of a deployed device: every one on the bus, the ones that can be lent, the refused
ones and why; and what to say when that is not what agent-host.yaml registers.

A device's ``gpus`` in agent-host.yaml is what the server plans VMs with (``vms_per_device:
gpus`` gives ``gpus // vm.gpus`` VMs), so it must be the number of GPUs that can be *lent*: a
GPU that ``pcidiscovery`` refuses (its IOMMU group holds a foreign endpoint, no IOMMU group)
is on the bus but cannot go to a VM. GPUs that share an IOMMU group only with each other
(``pcidiscovery``: VFIO gives a group whole to one guest, Linux
``Documentation/driver-api/vfio.rst``) go to VMs of at least as many GPUs as the group holds,
never to smaller ones: what can be lent depends on the GPUs per VM
(:meth:`Census.lendable_to`), and ``gpus`` counts what the queues the device serves can take
(one GPU per VM unless told: a device lent to a one-GPU queue with ``gpus`` counting grouped
GPUs would fail every such split). The split (``bringup.split``) and ``agent-host check``
compare the two with :func:`shortfall` and :func:`count_mismatch`; the give-back
(``teardown.verify_gpus_back``) compares the GPUs on the bus now with those of the split
(:attr:`Census.present`), never with the registered count.

Everything here is pure but :func:`take_census`, which reads the splitter.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from testflinger_magic.agent_host.pcidiscovery import Discovery, Refusal, group_sizes, lendable_of


@dataclass(frozen=True)
class Census:
    """``lendable``: the GPUs a split may lend (``splitplan.GPU``, sorted by address);
    ``present``: every GPU on the bus, lendable or refused, as ``{address: driver}`` (driver
    None: none bound, or libvirt does not report it); ``refused``: the refused GPUs with
    their reasons (``pcidiscovery.Refusal``), sorted by address; ``nvswitches``: below."""

    lendable: list
    present: dict[str, str | None]
    refused: list[Refusal] = field(default_factory=list)
    #: The host's NVSwitches (None: the splitter does not say, e.g. a script splitter).
    nvswitches: int | None = None
    #: GPUs lendable only with the rest of their IOMMU group (``Discovery.grouped``); each is
    #: also in ``refused``.
    grouped: list = field(default_factory=list)

    def lendable_to(self, gpus_per_vm: int = 1) -> list:
        """The GPUs VMs of ``gpus_per_vm`` GPUs can take (``Discovery.lendable``)."""
        return lendable_of(self.lendable, self.grouped, gpus_per_vm)

    def refused_to(self, gpus_per_vm: int = 1) -> list[Refusal]:
        """``refused`` without the grouped GPUs VMs of ``gpus_per_vm`` GPUs can take."""
        taken = {g.address for g in self.lendable_to(gpus_per_vm)}
        return [r for r in self.refused if r.address not in taken]


def census_of(disc: Discovery) -> Census:
    """The :class:`Census` of a ``pcidiscovery.Discovery``."""
    present = {a: disc.devices[a].driver if a in disc.devices else None for a in disc.all_gpus}
    for g in disc.gpus:  # a lendable GPU is on the bus whatever all_gpus says
        present.setdefault(g.address, g.driver)
    return Census(lendable=list(disc.gpus), present=dict(sorted(present.items())),
                  refused=list(disc.refused_gpus), nvswitches=len(disc.nvswitches),
                  grouped=list(disc.grouped))


def take_census(splitter, uri: str) -> Census:
    """The census of the host at ``uri``. A splitter with ``inspect`` (``LibvirtSplitter``)
    tells every GPU on the bus and the refused ones; one with only ``discover`` (a lab's
    script splitter, docs/script-splitter.md) tells the lendable GPUs, which are then all
    that is known to be present. Raises what the splitter raises (``SplitError``)."""
    inspect = getattr(splitter, "inspect", None)
    if callable(inspect):
        return census_of(inspect(uri))
    gpus = list(splitter.discover(uri))
    return Census(lendable=gpus, present={g.address: g.driver for g in gpus})


def refused_text(refused: list[Refusal]) -> str:
    """``"0000:ab:00.0: <reason>; 0000:ba:00.0: <reason>"``."""
    return "; ".join(f"{r.address}: {r.reason}" for r in refused)


def _fix(device: str, census: Census, per_vm: int = 1) -> str:
    can = len(census.lendable_to(per_vm))
    text = (f"set gpus: {can} for device {device} in the agent-host config (gpus is the "
            "number of GPUs that can be lent) and restart the daemon")
    if census.refused_to(per_vm):
        text += ", or fix the IOMMU grouping (ACS) so that every GPU can be lent"
    return text + _grouped_note(census, per_vm)


def _grouped_note(census: Census, per_vm: int) -> str:
    """What GPUs sharing an IOMMU group with each other change about ``gpus`` for VMs of
    ``per_vm`` GPUs: the count that fits bigger VMs, or that the count includes GPUs smaller
    VMs cannot take."""
    sizes = group_sizes(census.grouped)
    if not sizes:
        return ""
    bigger = sorted({n for n in sizes.values() if n > per_vm})
    if bigger:
        return (f"; GPUs sharing an IOMMU group with each other go whole to one VM of at least "
                f"{bigger[0]} GPUs: gpus: {len(census.lendable_to(bigger[-1]))} fits a device "
                f"lent only to queues of {bigger[-1]} or more GPUs per VM (keep it out of "
                "smaller ones with their devices.exclude)")
    smallest = min(sizes.values())
    return (f"; that counts GPUs sharing an IOMMU group with each other, which VMs of fewer "
            f"than {smallest} GPUs cannot take: only if every queue the device serves has "
            f"{smallest} or more GPUs per VM (else gpus: {len(census.lendable_to(1))}, what "
            "one GPU per VM can take)")


def _missing(registered: int, census: Census) -> str:
    gone = registered - len(census.present)
    if gone <= 0:
        return ""
    return (f"; the device is registered with gpus: {registered}, {gone} more than are on the "
            "bus (a GPU that fell off the bus? look for NVIDIA Xid 79 in the host's kernel log "
            "and compare lspci)")


def shortfall(vms: int, per_vm: int, census: Census, device: str, registered: int
              ) -> str | None:
    """Why ``vms`` VMs of ``per_vm`` GPUs cannot be lent on a host with ``census``, or None
    when they can. The sentence names how many GPUs the host has, how many can be lent, each
    refused GPU with its reason, and the fix (``gpus:`` in agent-host.yaml, or the IOMMU
    grouping). ``registered``: the device's ``gpus`` (what the server planned with)."""
    need = vms * per_vm
    lendable = census.lendable_to(per_vm)
    if need <= len(lendable):
        return None
    text = (f"{vms} VM(s) x {per_vm} GPU(s) need {need} GPUs; the host has "
            f"{len(census.present)} GPU(s), {len(lendable)} of them can be lent"
            + (f" to VMs of {per_vm} GPU(s)" if census.grouped else ""))
    refused = census.refused_to(per_vm)
    if refused:
        text += f"; refused: {refused_text(refused)}"
    return text + _missing(registered, census) + f". Fix: {_fix(device, census, per_vm)}"


def count_mismatch(configured: int, census: Census, device: str, gpus_per_vm: int = 1
                   ) -> str | None:
    """What ``agent-host check`` says when the device's ``gpus`` (``configured``) is not the
    number of GPUs VMs of ``gpus_per_vm`` GPUs can take (``Census.lendable_to``: GPUs sharing
    an IOMMU group with each other count only for VMs that can take the group whole), else
    None."""
    can = len(census.lendable_to(gpus_per_vm))
    if can == configured:
        return None
    to = f" to VMs of {gpus_per_vm} GPU(s)" if census.grouped else ""
    head = (f"device {device}: gpus: {configured} in the agent-host config, but {can} of the "
            f"host's {len(census.present)} GPU(s) can be lent{to}")
    if can < configured:
        head += (f": the server plans VMs for {configured} GPUs and every lend would fail at "
                 "split")
        refused = census.refused_to(gpus_per_vm)
        if refused:
            head += f"; refused: {refused_text(refused)}"
        return (head + _missing(configured, census)
                + f". Fix: {_fix(device, census, gpus_per_vm)}")
    return (head + f": the server plans VMs for {configured}, leaving {can - configured} idle. "
            f"Fix: set gpus: {can} for device {device} in the agent-host config"
            + _grouped_note(census, gpus_per_vm))
