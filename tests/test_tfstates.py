"""testflinger_magic.tfstates against Testflinger itself.

Three sources, in order of authority: ``testflinger_common.enums`` when importable (inside the
real server), the enums file of the Testflinger source mirror when present on this machine, and
the facts recorded in ../shared/TESTFLINGER.md (§1.6 job states, §2 roles, §4.1 CLI polling).
"""

import ast
import subprocess
from pathlib import Path

import pytest

from testflinger_magic import tfstates

MIRROR = Path("/work/.mirror/canonical+testflinger/repo")
ENUMS_PATH = "common/src/testflinger_common/enums.py"


def _enum_values(source: str) -> dict[str, dict[str, str]]:
    """{class name: {member: value}} for the string-valued class attributes in ``source``."""
    out: dict[str, dict[str, str]] = {}
    for node in ast.parse(source).body:
        if isinstance(node, ast.ClassDef):
            members = {}
            for stmt in node.body:
                if (isinstance(stmt, ast.Assign) and len(stmt.targets) == 1
                        and isinstance(stmt.targets[0], ast.Name)
                        and isinstance(stmt.value, ast.Constant)
                        and isinstance(stmt.value.value, str)):
                    members[stmt.targets[0].id] = stmt.value.value
            out[node.name] = members
    return out


def _check_against(job_states, agent_states, roles):
    """Our names must all exist in Testflinger's enums (the values we rely on)."""
    assert {tfstates.JOB_WAITING, tfstates.JOB_COMPLETED, tfstates.JOB_CANCELLED} <= job_states
    # Every phase name an agent posts while a job runs is a JobState value.
    assert set(tfstates.JOB_PHASES) <= job_states
    assert {tfstates.AGENT_WAITING, tfstates.AGENT_OFFLINE, tfstates.AGENT_MAINTENANCE,
            tfstates.AGENT_RESTART} <= agent_states
    assert {tfstates.ROLE_ADMIN, tfstates.ROLE_MANAGER, tfstates.ROLE_CONTRIBUTOR,
            tfstates.ROLE_AGENT} == roles


def test_matches_testflinger_common_when_importable():
    enums = pytest.importorskip("testflinger_common.enums")
    _check_against({s.value for s in enums.JobState}, {s.value for s in enums.AgentState},
                   {s.value for s in enums.ServerRoles})


def test_matches_testflinger_source_mirror_when_present():
    if not MIRROR.exists():
        pytest.skip("no Testflinger source mirror on this machine")
    proc = subprocess.run(["git", "-C", str(MIRROR), "show", f"HEAD:{ENUMS_PATH}"],
                          capture_output=True, text=True)
    if proc.returncode != 0:
        pytest.skip(f"cannot read {ENUMS_PATH}: {proc.stderr.strip()}")
    enums = _enum_values(proc.stdout)
    _check_against(set(enums["JobState"].values()), set(enums["AgentState"].values()),
                   set(enums["ServerRoles"].values()))


def test_terminal_states_are_the_servers():
    # TESTFLINGER.md §1.6: the server treats complete, completed and cancelled as terminal.
    assert tfstates.JOB_TERMINAL == {"complete", "completed", "cancelled"}
    assert tfstates.JOB_WAITING not in tfstates.JOB_TERMINAL
    assert tfstates.JOB_RUNNING not in tfstates.JOB_TERMINAL
    assert not set(tfstates.JOB_PHASES) & tfstates.JOB_TERMINAL


def test_we_write_what_the_cli_polls_for():
    # TESTFLINGER.md §1.6/§4.1: agents write "complete" and `testflinger-cli --poll` stops only
    # on "complete"/"cancelled"; writing the enum's "completed" would poll forever.
    assert tfstates.JOB_COMPLETE == "complete"
    assert tfstates.JOB_COMPLETE != tfstates.JOB_COMPLETED
    assert {tfstates.JOB_COMPLETE, tfstates.JOB_CANCELLED} <= tfstates.JOB_TERMINAL


def test_phase_order_and_pop_state():
    # §1.5: popping a job sets "running"; §1.6: phases in this order, "cleanup" never posted.
    assert tfstates.JOB_RUNNING == "running"
    assert tfstates.JOB_PHASES == ("setup", "provision", "firmware_update", "test", "allocate",
                                   "allocated", "reserve")
    assert "cleanup" not in tfstates.JOB_PHASES


def test_agent_states_and_roles_are_distinct():
    agent = [tfstates.AGENT_WAITING, tfstates.AGENT_OFFLINE, tfstates.AGENT_MAINTENANCE,
             tfstates.AGENT_RESTART]
    roles = [tfstates.ROLE_ADMIN, tfstates.ROLE_MANAGER, tfstates.ROLE_CONTRIBUTOR,
             tfstates.ROLE_AGENT]
    assert len(set(agent)) == len(agent) and len(set(roles)) == len(roles)
    # An idle agent's state is also the waiting job state's name (§1.6, §3.2).
    assert tfstates.AGENT_WAITING == tfstates.JOB_WAITING
    # While a job runs the agent's state is the phase name, never offline/maintenance.
    assert not set(tfstates.JOB_PHASES) & set(agent)
