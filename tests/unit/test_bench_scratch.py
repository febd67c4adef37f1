"""bench.scratch: a benchmark's scratch folder goes however the run ends, SIGTERM included."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest

from bench.scratch import scratch_folder
from deploy.stack import ROOT

HOLD_FOLDER = """
import sys, time
from bench.scratch import scratch_folder
with scratch_folder() as folder:
    (folder / "model.safetensors").write_bytes(b"x" * 1024)
    print(folder, flush=True)
    time.sleep(60)
"""


def test_the_folder_goes_when_the_process_gets_sigterm():
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLD_FOLDER], cwd=ROOT, stdout=subprocess.PIPE, text=True
    )
    try:
        folder = Path(proc.stdout.readline().strip())
        assert (folder / "model.safetensors").is_file(), "the child wrote into its folder"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 128 + signal.SIGTERM
    finally:
        proc.kill()
        proc.wait()
    assert not folder.exists(), f"{folder} was left behind after SIGTERM"


def test_the_folder_goes_on_an_exception_and_the_sigterm_handler_comes_back():
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(RuntimeError), scratch_folder() as folder:
        (folder / "weights").write_bytes(b"x")
        assert signal.getsignal(signal.SIGTERM) is not before
        raise RuntimeError("the benchmark failed")
    assert not folder.exists()
    assert signal.getsignal(signal.SIGTERM) is before
