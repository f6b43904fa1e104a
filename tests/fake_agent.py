"""A fake testflinger-agent installation for the pre-warm tests (imported by tests/test_*prewarm*).

``make(root)`` writes ``root/bin/fake-agent``, a console script as pip writes one for
testflinger-agent (``[project.scripts] testflinger-agent = "testflinger_agent.cmd:main"``:
``#!<python>``, ``from testflinger_agent.cmd import main``, ``sys.exit(main())`` under the
``__main__`` guard), and its package ``root/bin/fakeagent`` beside it (the script's folder is
``sys.path[0]``). Every import of the package and every run of ``main`` appends a JSON line to
``<trace-dir>/<agent>.jsonl`` (``--trace-dir`` argument; ``<agent>``: the name of the ``-c``
config's folder) with the pid, the time (``at``, epoch seconds), ``sys.argv`` and whether the
agent's go file (``<config folder>/.testflinger-magic-go``) existed at that moment: the import
before it, main only after. ``main`` then returns ``--exit N``, raises with ``--raise``, or
sleeps (as an agent runs until stopped).

``-m`` forms: ``fakeagent.mainmod`` (guarded, imports ``fakeagent.dep``) and
``fakeagent.noguard`` (no guard, like a package's ``__main__.py``: its body runs the agent).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

INIT = '''
import json, os, sys, time
from pathlib import Path


def _arg(flag):
    return sys.argv[sys.argv.index(flag) + 1] if flag in sys.argv[:-1] else None


def trace(event):
    config = Path(_arg("-c") or "testflinger-agent.conf")
    folder = Path(_arg("--trace-dir") or ".")
    with open(folder / (config.parent.name + ".jsonl"), "a") as f:
        f.write(json.dumps({"event": event, "pid": os.getpid(), "at": time.time(),
                            "argv": sys.argv,
                            "go": (config.parent / ".testflinger-magic-go").exists()}) + "\\n")


trace("import")
'''

CMD = '''
import sys
import time

from fakeagent import trace


def main():
    trace("main")
    if "--exit" in sys.argv:
        return int(sys.argv[sys.argv.index("--exit") + 1])
    if "--raise" in sys.argv:
        raise RuntimeError("fake agent failed")
    time.sleep(3600)
    return 0
'''

DEP = '''
from fakeagent import trace

trace("import dep")
'''

MAINMOD = '''
import sys

import fakeagent.dep
from fakeagent.cmd import main

if __name__ == "__main__":
    sys.exit(main())
'''

NOGUARD = '''
import sys

import fakeagent.dep
from fakeagent.cmd import main

sys.exit(main())
'''

SCRIPT = '''#!{python}
# -*- coding: utf-8 -*-
import re
import sys
from fakeagent.cmd import main
if __name__ == '__main__':
    sys.argv[0] = re.sub(r'(-script\\.pyw|\\.exe)?$', '', sys.argv[0])
    sys.exit(main())
'''


def make(root: Path) -> Path:
    """Write the fake installation under ``root``; returns the console script's path."""
    bin_dir = Path(root) / "bin"
    pkg = bin_dir / "fakeagent"
    pkg.mkdir(parents=True)
    for name, text in (("__init__.py", INIT), ("cmd.py", CMD), ("dep.py", DEP),
                       ("mainmod.py", MAINMOD), ("noguard.py", NOGUARD)):
        (pkg / name).write_text(text)
    script = bin_dir / "fake-agent"
    script.write_text(SCRIPT.format(python=sys.executable))
    script.chmod(0o755)
    return script


def events(trace_dir: Path, agent: str) -> list[dict]:
    """The trace lines of ``agent`` (the config folder's name), oldest first."""
    path = Path(trace_dir) / f"{agent}.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
