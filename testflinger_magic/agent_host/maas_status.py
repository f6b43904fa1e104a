"""Every MAAS machine status the product uses, by MAAS' own names and codes, in one place.

The MAAS API gives a machine's status as ``status`` (a code) and ``status_name`` (a label). Both
come from MAAS:

- codes: ``maascommon.enums.node.NodeStatus`` (src/maascommon/enums/node.py), mirrored by
  ``maasserver.enum.NODE_STATUS`` (src/maasserver/enum.py);
- labels: ``maascommon.node.NODE_STATUS_LABELS`` (src/maascommon/node.py), which is what
  ``maasserver.enum.NODE_STATUS_CHOICES`` is built from, and what the API's ``status_name``
  renders. Note MAAS' spelling: ``"Releasing failed"`` (FAILED_RELEASING), not "Failed
  releasing"; ``"Failed to enter rescue mode"``.

Read from canonical/maas at commit 9e51f33ce6f7f19bd91ecddfd97baf5495db4eba
(``git describe``: 3.5.0-beta1-2488-g9e51f33ce); tests/test_maas_status.py checks this table
against a transcription of that list. The groups below (``RELEASABLE`` ...) are MAAS' own sets,
named with their source.
"""

from __future__ import annotations

# -- labels (status_name) -------------------------------------------------------------------------
NEW = "New"
COMMISSIONING = "Commissioning"
FAILED_COMMISSIONING = "Failed commissioning"
MISSING = "Missing"
READY = "Ready"
RESERVED = "Reserved"
ALLOCATED = "Allocated"
DEPLOYING = "Deploying"
DEPLOYED = "Deployed"
RETIRED = "Retired"
BROKEN = "Broken"
FAILED_DEPLOYMENT = "Failed deployment"
RELEASING = "Releasing"
FAILED_RELEASING = "Releasing failed"
DISK_ERASING = "Disk erasing"
FAILED_DISK_ERASING = "Failed disk erasing"
RESCUE_MODE = "Rescue mode"
ENTERING_RESCUE_MODE = "Entering rescue mode"
FAILED_ENTERING_RESCUE_MODE = "Failed to enter rescue mode"
EXITING_RESCUE_MODE = "Exiting rescue mode"
FAILED_EXITING_RESCUE_MODE = "Failed to exit rescue mode"
TESTING = "Testing"
FAILED_TESTING = "Failed testing"

#: ``{status_name: status code}`` (maascommon/enums/node.py NodeStatus; maascommon/node.py
#: NODE_STATUS_LABELS), in MAAS' code order.
CODES: dict[str, int] = {
    NEW: 0, COMMISSIONING: 1, FAILED_COMMISSIONING: 2, MISSING: 3, READY: 4, RESERVED: 5,
    DEPLOYED: 6, RETIRED: 7, BROKEN: 8, DEPLOYING: 9, ALLOCATED: 10, FAILED_DEPLOYMENT: 11,
    RELEASING: 12, FAILED_RELEASING: 13, DISK_ERASING: 14, FAILED_DISK_ERASING: 15,
    RESCUE_MODE: 16, ENTERING_RESCUE_MODE: 17, FAILED_ENTERING_RESCUE_MODE: 18,
    EXITING_RESCUE_MODE: 19, FAILED_EXITING_RESCUE_MODE: 20, TESTING: 21, FAILED_TESTING: 22,
}

# -- MAAS' own groups -----------------------------------------------------------------------------
#: Statuses from which ``release`` is legal: maasserver/models/node.py ``RELEASABLE_STATUSES``.
RELEASABLE = frozenset({ALLOCATED, RESERVED, BROKEN, DEPLOYING, DEPLOYED, FAILED_DEPLOYMENT,
                        FAILED_DISK_ERASING, FAILED_RELEASING})

#: In-progress status -> the status MAAS moves to when it fails:
#: maascommon/node.py ``NODE_FAILURE_STATUS_TRANSITION_MAP``.
FAILURE_OF = {
    COMMISSIONING: FAILED_COMMISSIONING, DEPLOYING: FAILED_DEPLOYMENT,
    RELEASING: FAILED_RELEASING, DISK_ERASING: FAILED_DISK_ERASING,
    ENTERING_RESCUE_MODE: FAILED_ENTERING_RESCUE_MODE,
    EXITING_RESCUE_MODE: FAILED_EXITING_RESCUE_MODE, TESTING: FAILED_TESTING,
}

#: Statuses from which ``commission`` is legal (maasserver/node_status.py NODE_TRANSITIONS: the
#: statuses listing COMMISSIONING among their successors, and Ready).
COMMISSIONABLE = frozenset({NEW, READY, BROKEN, FAILED_COMMISSIONING, FAILED_TESTING, MISSING})

#: Statuses in which interface links may change: maasserver/api/interfaces.py
#: ``ALLOWED_STATES`` (READY, ALLOCATED, BROKEN).
LINKABLE = frozenset({READY, ALLOCATED, BROKEN})

# -- the product's groups (decisions, built from the names above) --------------------------------
#: Being deployed or deployed: no deploy needed.
DEPLOYING_OR_DEPLOYED = frozenset({DEPLOYING, DEPLOYED})
#: Release has nothing to do (already released or on its way).
RELEASED_OR_RELEASING = frozenset({READY, RELEASING, DISK_ERASING, NEW, COMMISSIONING})
#: A deploy ended badly.
DEPLOY_FAIL = frozenset({FAILED_DEPLOYMENT, BROKEN})
#: Commissioning (with its tests) ended badly.
COMMISSION_FAIL = frozenset({FAILED_COMMISSIONING, FAILED_TESTING, BROKEN})
#: A release ended badly (maas2's recovery applies: release.release_to_ready).
RELEASE_FAIL = frozenset({FAILED_RELEASING, FAILED_DISK_ERASING, BROKEN})
