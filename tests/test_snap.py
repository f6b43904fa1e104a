"""snap/snapcraft.yaml: what the snap exposes, checked against the package and docs/install.md
(nothing here builds the snap; install.md says what is not verified)."""

from __future__ import annotations

import tomllib
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
SNAP = yaml.safe_load((ROOT / "snap" / "snapcraft.yaml").read_text())
INSTALL = (ROOT / "docs" / "install.md").read_text()


def _script() -> str:
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert "testflinger-magic" in scripts
    return "bin/testflinger-magic"


def test_the_daemon_is_a_service_reading_snap_common():
    app = SNAP["apps"]["agent-host"]
    assert app["daemon"] == "simple" and app["restart-condition"] == "always"
    assert app["command"] == (f"{_script()} agent-host --config $SNAP_COMMON/agent-host.yaml")


def test_the_cli_is_an_app_so_check_sweep_and_user_data_run_from_the_snap():
    """TRIAL13 F10: the only app was the daemon; `agent-host check`, `sweep --dry-run` and
    `user-data`, which the guides tell an admin to run, had no command in a snap install."""
    app = SNAP["apps"]["testflinger-magic"]
    assert app["command"] == _script() and "daemon" not in app
    # snapd names it <snap>.<app> (snapcraft.io/docs/commands-and-aliases): the docs' alias.
    exposed = f"{SNAP['name']}.testflinger-magic"
    assert f"sudo snap alias {exposed} testflinger-magic" in INSTALL
    for sub in ("agent-host check", "agent-host sweep --config $C --dry-run",
                "agent-host user-data --config $C"):
        assert f"sudo testflinger-magic {sub}" in INSTALL, sub


def test_install_says_where_the_daemons_log_goes():
    """TRIAL13 F10: the journal of snapd's unit snap.<snap>.<app> (service management docs)."""
    service = f"{SNAP['name']}.agent-host"
    assert f"snap logs -n all {service}" in INSTALL
    assert f"journalctl -u snap.{service}" in INSTALL


def test_the_cli_has_the_subcommands_the_docs_run():
    from testflinger_magic import cli

    for argv in (["agent-host", "check", "--help"], ["agent-host", "sweep", "--help"],
                 ["agent-host", "user-data", "--help"]):
        try:
            cli.main(argv)
        except SystemExit as exc:
            assert exc.code == 0, argv
