"""libvirt test-driver hosts holding VM domains, for the MAAS simulator's virsh power driver.

``vm_host(path, names)`` writes a host file whose domains are defined and shut off, as the
splitter leaves them (MAAS powers them on); ``add_vm_host(sim, tmp, host, names)`` registers it
with ``sim.virsh`` under ``host`` (the host part of the virsh power_address) and returns its URI.
"""

from __future__ import annotations

from pathlib import Path

TEST_NS = "http://libvirt.org/schemas/domain/test/1.0"
SHUTOFF = 5  # virDomainState VIR_DOMAIN_SHUTOFF, read from <test:runstate>


def vm_host(path: Path, names) -> str:
    domains = "".join(
        f"<domain type='test'><name>{n}</name><memory unit='MiB'>512</memory><vcpu>1</vcpu>"
        f"<os><type>hvm</type></os><test:runstate xmlns:test='{TEST_NS}'>{SHUTOFF}"
        "</test:runstate></domain>" for n in names)
    path.write_text(f"<node><cpu><nodes>1</nodes><sockets>1</sockets><cores>4</cores>"
                    f"<threads>1</threads></cpu><memory>8388608</memory>{domains}</node>\n")
    return f"test://{path}"


def add_vm_host(sim, tmp: Path, host: str, names, **auth) -> str:
    uri = vm_host(Path(tmp) / f"vmhost-{host}.xml", names)
    sim.virsh.add(host, uri, **auth)
    return uri
