"""What the daemon's registration tells of each device's hardware beyond its config: the
NVSwitch count MAAS' commissioning listed (``MaasDriver.nvswitch_count``, MAAS >= 3.0 node
devices), so the server keeps an HGX board out of queues of several GPUs per VM before its
first lend (testflinger_magic/fabric.py; TRIAL13 F16: that lend cost a whole deploy).

Bounded: one MAAS call per device per registration (the daemon registers at start and after
its token was refused, never per poll), none after MAAS was found unreachable or refused the
key (the remaining devices would each wait out the same timeout). A MAAS error never stops the
registration: it is logged and the device is registered without a count (the server then
learns it at the device's first split, as with a MAAS older than 3.0).
"""

from __future__ import annotations

import logging

from testflinger_magic.agent_host.maas import MaasAuthError, MaasError, MaasUnreachable

log = logging.getLogger(__name__)


def with_maas_counts(devices: list[dict], maas) -> list[dict]:
    """``devices`` (``DeviceConfig.registration()`` dicts: ``agent_name``, ``maas_system_id``,
    ...) each with ``nvswitches`` (an int) added where ``maas.nvswitch_count`` knows it; the
    others unchanged. ``maas`` without that method (a lab's or an older driver): unchanged."""
    ask = getattr(maas, "nvswitch_count", None)
    if ask is None:
        return list(devices)
    out, stop = [], None
    for d in devices:
        count = None
        if stop is None:
            try:
                count = ask(d["maas_system_id"])
            except (MaasUnreachable, MaasAuthError) as exc:
                stop = exc
                log.warning("MAAS cannot be asked for the NVSwitches of %s (%s): registering "
                            "without MAAS' counts; each device's first split learns them",
                            d["agent_name"], exc)
            except MaasError as exc:
                log.warning("MAAS did not list the NVSwitches of %s (machine %s): %s; "
                            "registering it without a count (its first split learns it)",
                            d["agent_name"], d["maas_system_id"], exc)
        if count is not None:
            d = dict(d, nvswitches=int(count))
            log.info("MAAS' commissioning lists %d NVSwitch(es) on %s", count, d["agent_name"])
        out.append(d)
    return out
