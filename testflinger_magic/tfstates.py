"""Testflinger state names the plugin relies on.

testflinger-common (``testflinger_common.enums``) is not on the package registries, so the plugin
keeps its own copy of the few names it needs; ``tests/test_tfstates.py`` compares them with
``testflinger_common.enums`` whenever that is importable (inside the real server).

Source: canonical/testflinger ``common/src/testflinger_common/enums.py`` and
``server/src/testflinger/api/v1.py`` (see ../shared/TESTFLINGER.md §1.6).
"""

# Job states (``result_data.job_state``).
JOB_WAITING = "waiting"
JOB_RUNNING = "running"
#: Agents write "complete"; the enum says "completed". The server treats both as terminal;
#: testflinger-cli's --poll stops only on "complete" and "cancelled", so we write "complete".
JOB_COMPLETE = "complete"
JOB_COMPLETED = "completed"
JOB_CANCELLED = "cancelled"
JOB_TERMINAL = frozenset({JOB_COMPLETE, JOB_COMPLETED, JOB_CANCELLED})
#: Phase names an agent posts while it runs a job, in order (TESTFLINGER.md §1.6).
JOB_PHASES = ("setup", "provision", "firmware_update", "test", "allocate", "allocated", "reserve")

# Agent states (``agents.state``).
AGENT_WAITING = "waiting"
AGENT_OFFLINE = "offline"
AGENT_MAINTENANCE = "maintenance"
AGENT_RESTART = "restart"

# Server roles (``ServerRoles``); checked by exact membership, not hierarchy.
ROLE_ADMIN = "admin"
ROLE_MANAGER = "manager"
ROLE_CONTRIBUTOR = "contributor"
ROLE_AGENT = "agent"
