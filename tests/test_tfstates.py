"""testflinger_magic.tfstates against Testflinger itself.

Three sources, in order of authority: ``testflinger_common.enums`` when importable (inside the
real server), the Testflinger source mirror when present on this machine (its enums, the
server's terminal-state queries, the CLI's poll loop), and the facts recorded in
../shared/TESTFLINGER.md (§1.6 job states, §2 roles, §4.1 CLI polling). Checks that need a source
skip, saying why, when it is absent (CI has no mirror).
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


#: Where the Testflinger server filters out finished jobs (``"$nin": [...]`` on
#: ``result_data.job_state``: job search, cancel, incomplete-jobs count, queue page).
SERVER_TERMINAL_FILES = ["server/src/testflinger/api/v1.py", "server/src/testflinger/database.py",
                         "server/src/testflinger/views.py"]
#: Where ``testflinger-cli --poll`` loops (``do_poll``: ``if job_state in (...): break``).
CLI_PATH = "cli/testflinger_cli/__init__.py"


def _mirror_source(path: str) -> str:
    """``path`` at the mirror's HEAD, or skip (with the reason) when it cannot be read.

    CI has no mirror: these checks then skip rather than compare our constants with copies of
    themselves, which could never fail.
    """
    if not MIRROR.exists():
        pytest.skip(f"no Testflinger source mirror at {MIRROR} (CI has none)")
    proc = subprocess.run(["git", "-C", str(MIRROR), "show", f"HEAD:{path}"],
                          capture_output=True, text=True)
    if proc.returncode != 0:
        pytest.skip(f"cannot read {path} from the mirror: {proc.stderr.strip()}")
    return proc.stdout


def _str_collection(node) -> set[str] | None:
    """The strings of a list/tuple/set literal made only of string constants, else None."""
    if not isinstance(node, (ast.List, ast.Tuple, ast.Set)) or not node.elts:
        return None
    if not all(isinstance(e, ast.Constant) and isinstance(e.value, str) for e in node.elts):
        return None
    return {e.value for e in node.elts}


def server_terminal_filters(source: str) -> list[set[str]]:
    """Every ``{"result_data.job_state": {"$nin": [...]}}`` list in ``source`` (as sets)."""
    pairs = []  # (key node, value node) of "result_data.job_state": {...}
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Dict):
            pairs += zip(node.keys, node.values)
        elif (isinstance(node, ast.Assign) and len(node.targets) == 1
              and isinstance(node.targets[0], ast.Subscript)):  # query["..."] = {...}
            pairs.append((node.targets[0].slice, node.value))
    found = []
    for key, value in pairs:
        if not (isinstance(key, ast.Constant) and key.value == "result_data.job_state"
                and isinstance(value, ast.Dict)):
            continue
        for k2, v2 in zip(value.keys, value.values):
            states = _str_collection(v2)
            if isinstance(k2, ast.Constant) and k2.value == "$nin" and states is not None:
                found.append(states)
    return found


def cli_poll_stop_states(source: str) -> list[set[str]]:
    """In ``do_poll``, the states of every ``if job_state in (...):`` whose body breaks the loop."""
    found = []
    for fn in ast.walk(ast.parse(source)):
        if not (isinstance(fn, ast.FunctionDef) and fn.name == "do_poll"):
            continue
        for node in ast.walk(fn):
            if not (isinstance(node, ast.If) and isinstance(node.test, ast.Compare)):
                continue
            test = node.test
            if not (isinstance(test.left, ast.Name) and test.left.id == "job_state"
                    and len(test.ops) == 1 and isinstance(test.ops[0], ast.In)):
                continue
            states = _str_collection(test.comparators[0])
            if states is not None and any(isinstance(s, ast.Break) for s in node.body):
                found.append(states)
    return found


def test_terminal_states_are_the_servers():
    # TESTFLINGER.md §1.6: the server treats complete, completed and cancelled as terminal. Read
    # that from the server's own queries, so a Testflinger change shows up here.
    filters = []
    for path in SERVER_TERMINAL_FILES:
        filters += [(path, states) for states in server_terminal_filters(_mirror_source(path))]
    assert filters, f"no result_data.job_state $nin filter found in {SERVER_TERMINAL_FILES}"
    for path, states in filters:
        assert states == set(tfstates.JOB_TERMINAL), (path, sorted(states))
    assert tfstates.JOB_WAITING not in tfstates.JOB_TERMINAL
    assert tfstates.JOB_RUNNING not in tfstates.JOB_TERMINAL
    assert not set(tfstates.JOB_PHASES) & tfstates.JOB_TERMINAL


def test_we_write_what_the_cli_polls_for():
    # TESTFLINGER.md §1.6/§4.1: `testflinger-cli --poll` stops only on the states its do_poll
    # loop breaks on; the state we write for a finished job must be one of them (the enum's
    # "completed" is not: writing it would poll forever).
    stops = cli_poll_stop_states(_mirror_source(CLI_PATH))
    assert stops, f"no `if job_state in (...): break` found in do_poll of {CLI_PATH}"
    for states in stops:
        assert tfstates.JOB_COMPLETE in states and tfstates.JOB_CANCELLED in states, states
        assert tfstates.JOB_COMPLETED not in states, states
        assert states <= tfstates.JOB_TERMINAL, states


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


def test_job_event_names_match_a_newer_testflinger_when_the_mirror_has_them():
    """tfevents' names are testflinger_common's ``JobEvent`` values (testflinger#1297) and its
    collection the one ``database.create_indexes`` makes; skipped while the mirror predates
    server-side job events (fe381ff has no ``JobEvent``)."""
    from testflinger_magic import tfevents

    enums = _enum_values(_mirror_source(ENUMS_PATH))
    if "JobEvent" not in enums:
        pytest.skip("the mirror's Testflinger predates server-side job events (#1297-#1299)")
    assert set(enums["JobEvent"].values()) == set(tfevents.MESSAGES)
    assert f"mongo.db.{tfevents.COLLECTION}." in _mirror_source(
        "server/src/testflinger/database.py")
