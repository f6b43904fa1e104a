"""The GPUs of a deployed device: every one on the bus, the ones that can be lent, the refused
ones and why; and what to say when that is not what agent-host.yaml registers.

A device's ``gpus`` in agent-host.yaml is what the server plans VMs with (``vms_per_device:
gpus`` gives ``gpus // vm.gpus`` VMs), so it must be the number of GPUs that can be *lent*: a
GPU that ``pcidiscovery`` refuses (its IOMMU group holds a foreign endpoint, no IOMMU group)
is on the bus but cannot go to a VM. The split (``bringup.split``) and ``agent-host check``
compare the two with :func:`shortfall` and :func:`count_mismatch`; the give-back
(``teardown.verify_gpus_back``) compares the GPUs on the bus now with those of the split
(:attr:`Census.present`), never with the registered count.

Everything here is pure but :func:`take_census`, which reads the splitter.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from testflinger_magic.agent_host.pcidiscovery import Discovery, Refusal


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


def census_of(disc: Discovery) -> Census:
    """The :class:`Census` of a ``pcidiscovery.Discovery``."""
    present = {a: disc.devices[a].driver if a in disc.devices else None for a in disc.all_gpus}
    for g in disc.gpus:  # a lendable GPU is on the bus whatever all_gpus says
        present.setdefault(g.address, g.driver)
    return Census(lendable=list(disc.gpus), present=dict(sorted(present.items())),
                  refused=list(disc.refused_gpus), nvswitches=len(disc.nvswitches))


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


def _fix(device: str, census: Census) -> str:
    text = (f"set gpus: {len(census.lendable)} for device {device} in the agent-host config "
            "(gpus is the number of GPUs that can be lent) and restart the daemon")
    if census.refused:
        text += ", or fix the IOMMU grouping (ACS) so that every GPU can be lent"
    return text


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
    if need <= len(census.lendable):
        return None
    text = (f"{vms} VM(s) x {per_vm} GPU(s) need {need} GPUs; the host has "
            f"{len(census.present)} GPU(s), {len(census.lendable)} of them can be lent")
    if census.refused:
        text += f"; refused: {refused_text(census.refused)}"
    return text + _missing(registered, census) + f". Fix: {_fix(device, census)}"


def count_mismatch(configured: int, census: Census, device: str) -> str | None:
    """What ``agent-host check`` says when the device's ``gpus`` (``configured``) is not the
    number of GPUs that can be lent, else None."""
    can = len(census.lendable)
    if can == configured:
        return None
    head = (f"device {device}: gpus: {configured} in the agent-host config, but {can} of the "
            f"host's {len(census.present)} GPU(s) can be lent")
    if can < configured:
        head += (f": the server plans VMs for {configured} GPUs and every lend would fail at "
                 "split")
        if census.refused:
            head += f"; refused: {refused_text(census.refused)}"
        return head + _missing(configured, census) + f". Fix: {_fix(device, census)}"
    return (head + f": the server plans VMs for {configured}, leaving {can - configured} idle. "
            f"Fix: set gpus: {can} for device {device} in the agent-host config")
