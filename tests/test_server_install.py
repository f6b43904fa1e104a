"""The server plugin as operator-guide "Installing the server plugin" installs it: the package's
main dependencies only (no ``[lab]`` extra), inside Testflinger's environment (TRIAL3 #9)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib")  # Python >= 3.11

ROOT = Path(__file__).resolve().parent.parent

#: Imports every server module (wsgi aside: it needs the Testflinger package) with mongomock
#: made unimportable, as in an environment where only the main dependencies are installed.
PROBE = textwrap.dedent("""
    import importlib, pkgutil, sys

    class Block:
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] == "mongomock":
                raise ImportError("mongomock is not installed here")

    sys.meta_path.insert(0, Block())
    import testflinger_magic.server as server
    for m in pkgutil.iter_modules(server.__path__):
        if m.name != "wsgi":
            importlib.import_module("testflinger_magic.server." + m.name)
    import testflinger_magic.reconcile, testflinger_magic.leases, testflinger_magic.gates
    assert "mongomock" not in sys.modules
    from testflinger_magic import db
    try:
        db.connect()
    except RuntimeError as exc:
        print(exc)
""")


def test_the_server_side_needs_no_mongomock():
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert "pip install 'testflinger-magic[lab]'" in out.stdout


def test_mongomock_is_a_lab_dependency_not_a_server_one():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    names = [d.split(">")[0].split("=")[0].strip() for d in project["dependencies"]]
    assert "mongomock" not in names and "pymongo" in names
    assert any(d.startswith("mongomock") for d in project["optional-dependencies"]["lab"])
