"""Pure: a machine's NVSwitch count from the node devices MAAS lists for it (MAAS >= 3.0).

MAAS keeps every PCI device its commissioning found as a *node device* (canonical/maas
src/maasserver/models/nodedevice.py ``NodeDevice``, filled by
src/metadataserver/builtin_scripts/hooks.py ``update_node_devices`` from LXD's resources) and
lists them at ``GET /MAAS/api/2.0/nodes/{system_id}/devices/`` (src/maasserver/api/
nodedevices.py ``NodeDevicesHandler.read``, filters ``vendor_id`` etc., compared
case-insensitively). MAAS 2.9 and older have no such endpoint: python-libmaas then builds no
``NodeDevices`` handler from ``describe/``, and the path answers 404 "Unknown API endpoint"
(src/maasserver/api/not_found.py ``not_found_handler``).

A node device carries no PCI class, so an NVSwitch is recognised by what it does carry
(:func:`is_nvswitch`): NVIDIA's vendor id ``10de``; a ``hardware_type`` other than GPU (5:
metadataserver/enum.py ``HARDWARE_TYPE``; MAAS makes GPU every display controller LXD lists
as a card, an NVSwitch is a bridge, class 0x0680, so NODE); and either a product name with
"NVSwitch" in it (pci.ids names them so: "GA100 [A100 NVSwitch]", "GH100 [H100 NVSwitch]") or a
product id in :data:`NVSWITCH_PRODUCT_IDS`, for a commissioning image whose pci.ids is older
than the board (LXD then gives no product name). The HD audio function of a PCIe GPU (class
0x0403, e.g. 10de:22ba "AD102 High Definition Audio Controller") and the GPUs never count.
"""

from __future__ import annotations

#: NVIDIA's PCI vendor id as MAAS stores it (4 lower-case hex digits, LXD's form).
NVIDIA = "10de"
#: MAAS' HARDWARE_TYPE.GPU (maascommon/enums/node.py ``HardwareDeviceTypeEnum.GPU``).
HARDWARE_TYPE_GPU = 5
#: NVSwitch product ids of vendor 10de, each with its pci.ids name and source:
#: 1af1 "GA100 [A100 NVSwitch]" (HGX A100; pci.ids 2023.04.10, Debian package pci.ids
#: 0.0~2023.04.11-1); 22a3 "GH100 [H100 NVSwitch]" (HGX H100/H200; in later pci.ids, the name
#: lspci prints on HGX H100 boards as "Bridge [0680]: NVIDIA Corporation GH100 [H100
#: NVSwitch] [10de:22a3]"). Other generations are recognised by their name.
NVSWITCH_PRODUCT_IDS = frozenset({"1af1", "22a3"})


def is_nvswitch(doc: dict) -> bool:
    """True for a node device document (``NodeDeviceHandler`` fields ``vendor_id``,
    ``product_id``, ``product_name``, ``hardware_type``) that is an NVIDIA NVSwitch."""
    if str(doc.get("vendor_id") or "").lower() != NVIDIA:
        return False
    if doc.get("hardware_type") == HARDWARE_TYPE_GPU:  # an int in MAAS' rendering
        return False
    return ("nvswitch" in str(doc.get("product_name") or "").lower()
            or str(doc.get("product_id") or "").lower() in NVSWITCH_PRODUCT_IDS)


def nvswitch_count(docs: list[dict]) -> int | None:
    """The NVSwitches among node device documents ``docs``, or None when MAAS lists no NVIDIA
    device at all (a machine never commissioned, or one MAAS knows nothing NVIDIA on: it cannot
    say)."""
    nvidia = [d for d in docs if isinstance(d, dict)
              and str(d.get("vendor_id") or "").lower() == NVIDIA]
    if not nvidia:
        return None
    return sum(1 for d in nvidia if is_nvswitch(d))
