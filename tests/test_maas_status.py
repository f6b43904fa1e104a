"""The product's MAAS status table (agent_host/maas_status.py) against MAAS' own list.

``MAAS_NODE_STATUS_CHOICES`` is transcribed from canonical/maas at commit
9e51f33ce6f7f19bd91ecddfd97baf5495db4eba (3.5.0-beta1-2488-g9e51f33ce):
src/maascommon/node.py ``NODE_STATUS_LABELS`` with the codes of src/maascommon/enums/node.py
``NodeStatus``; src/maasserver/enum.py builds ``NODE_STATUS_CHOICES`` as
``[(k.value, v) for k, v in NODE_STATUS_LABELS.items()]``, so this is that list, in that order.
"""

from testflinger_magic.agent_host import maas as maas_mod
from testflinger_magic.agent_host import maas_status as st
from testflinger_magic.agent_host import steps
from testflinger_magic.lab import maas_sim

MAAS_NODE_STATUS_CHOICES = (
    (0, "New"), (1, "Commissioning"), (2, "Failed commissioning"), (3, "Missing"),
    (4, "Ready"), (5, "Reserved"), (10, "Allocated"), (9, "Deploying"), (6, "Deployed"),
    (7, "Retired"), (8, "Broken"), (11, "Failed deployment"), (12, "Releasing"),
    (13, "Releasing failed"), (14, "Disk erasing"), (15, "Failed disk erasing"),
    (16, "Rescue mode"), (17, "Entering rescue mode"), (18, "Failed to enter rescue mode"),
    (19, "Exiting rescue mode"), (20, "Failed to exit rescue mode"), (21, "Testing"),
    (22, "Failed testing"),
)
# src/maasserver/models/node.py RELEASABLE_STATUSES (codes).
MAAS_RELEASABLE_STATUSES = {10, 5, 8, 9, 6, 11, 15, 13}
# src/maascommon/node.py NODE_FAILURE_STATUS_TRANSITION_MAP (codes).
MAAS_FAILURE_MAP = {1: 2, 9: 11, 12: 13, 14: 15, 17: 18, 19: 20, 21: 22}


def test_table_is_maas_node_status_choices():
    assert st.CODES == {name: code for code, name in MAAS_NODE_STATUS_CHOICES}
    assert st.FAILED_RELEASING == "Releasing failed"


def test_maas_groups_match_maas():
    name = dict(MAAS_NODE_STATUS_CHOICES)
    assert st.RELEASABLE == {name[c] for c in MAAS_RELEASABLE_STATUSES}
    assert st.FAILURE_OF == {name[a]: name[b] for a, b in MAAS_FAILURE_MAP.items()}


def test_every_status_name_the_product_uses_is_maas_spelling():
    known = set(st.CODES)
    groups = [st.RELEASABLE, st.COMMISSIONABLE, st.LINKABLE, st.DEPLOYING_OR_DEPLOYED,
              st.RELEASED_OR_RELEASING, st.DEPLOY_FAIL, st.COMMISSION_FAIL, st.RELEASE_FAIL,
              set(st.FAILURE_OF) | set(st.FAILURE_OF.values()),
              steps.DEPLOY_FAIL, steps.COMMISSION_FAIL, steps.RELEASE_FAIL,
              maas_mod.RELEASABLE, maas_mod.RELEASED_OR_RELEASING, maas_mod.DEPLOYING_OR_DEPLOYED,
              set(maas_sim.STATUS_CODES)]
    for group in groups:
        assert set(group) <= known, set(group) - known
    assert maas_sim.STATUS_CODES == st.CODES
    assert "Releasing failed" in steps.RELEASE_FAIL and "Releasing failed" in maas_mod.RELEASABLE
