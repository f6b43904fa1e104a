"""The operator's input files are read with a bound (TRIAL3 finding 6: ``validate /dev/urandom``
never returned): a device, a FIFO or a file over the limit is refused naming the file, before
anything blocks or is read to the end."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from testflinger_magic import cli
from testflinger_magic.fileutil import MAX_INPUT_FILE, InputFileError, read_input_text

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def _fifo(tmp_path) -> Path:
    path = tmp_path / "queues.yaml"
    os.mkfifo(path)
    return path


def test_read_input_text_refuses_devices_fifos_and_big_files(tmp_path):
    with pytest.raises(InputFileError, match="is a character device, not a regular file"):
        read_input_text("/dev/urandom")
    with pytest.raises(InputFileError, match=r"is a pipe \(FIFO\)"):
        read_input_text(_fifo(tmp_path))  # refused before open(), which would block
    big = tmp_path / "big.yaml"
    big.write_text("#" * (MAX_INPUT_FILE + 1))
    with pytest.raises(InputFileError, match="is larger than 1 MiB"):
        read_input_text(big)
    big.write_text("#" * MAX_INPUT_FILE)
    assert len(read_input_text(big)) == MAX_INPUT_FILE
    with pytest.raises(IsADirectoryError):
        read_input_text(tmp_path)
    with pytest.raises(FileNotFoundError):
        read_input_text(tmp_path / "missing")


def test_validate_dev_urandom_returns_naming_the_file(capsys):
    """Run as the installed command would be, with a timeout: before the fix it never ended."""
    done = subprocess.run([sys.executable, "-m", "testflinger_magic.cli", "validate",
                           "/dev/urandom"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 1
    assert done.stderr.strip() == ("/dev/urandom: is a character device, not a regular file; "
                                   "give a file's path")


def test_validate_refuses_a_fifo_and_a_huge_file(tmp_path, capsys):
    fifo = _fifo(tmp_path)
    assert cli.main(["validate", str(fifo)]) == 1
    assert f"{fifo}: is a pipe (FIFO), not a regular file" in capsys.readouterr().err
    big = tmp_path / "big.yaml"
    big.write_text("magic_queues: {}\n" + "#" * MAX_INPUT_FILE)
    assert cli.main(["validate", "--json", str(big)]) == 1
    assert "is larger than 1 MiB" in capsys.readouterr().out
    # the example itself is far below the bound and still valid
    assert cli.main(["validate", str(EXAMPLES / "magic-queues.yaml")]) == 0


def test_agent_host_config_and_traces_are_bounded_too(tmp_path, capsys):
    from testflinger_magic.agent_host.config import ConfigError, load_file
    from testflinger_magic.lab.simulate import load_trace
    from testflinger_magic.queues import DefinitionError

    with pytest.raises(ConfigError) as err:
        load_file("/dev/urandom")
    assert str(err.value) == ("/dev/urandom: is a character device, not a regular file; give "
                              "a file's path")
    fifo = _fifo(tmp_path)
    with pytest.raises(DefinitionError, match="is a pipe"):
        load_trace(fifo)
    csv = tmp_path / "t.csv"
    csv.write_text("submit,queue,duration\n0,one-gpu-vm,10m\n")
    assert len(load_trace(csv).jobs) == 1
