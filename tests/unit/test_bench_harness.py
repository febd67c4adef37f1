"""bench.harness.scratch_folder: a benchmark's scratch folder goes however the run ends,
SIGTERM included."""

from __future__ import annotations

import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from bench.harness import scratch_folder
from deploy.stack import ROOT

HOLD_FOLDER = """
import sys, time
from bench.harness import scratch_folder
with scratch_folder() as folder:
    for index in range(int(sys.argv[1])):
        (folder / f"shard-{index}.bin").write_bytes(b"x" * 64)
    print(folder, flush=True)
    time.sleep(60)
"""


def hold_folder(num_files: int) -> tuple[subprocess.Popen, Path]:
    """A child process holding a scratch folder of `num_files` files, and the folder."""
    argv = [sys.executable, "-c", HOLD_FOLDER, str(num_files)]
    proc = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.PIPE, text=True)
    folder = Path(proc.stdout.readline().strip())
    assert (folder / "shard-0.bin").is_file(), "the child wrote into its folder"
    return proc, folder


def terminate(num_files: int, gaps_s: list[float]) -> bool:
    """SIGTERM a child holding a folder of `num_files` files, then once more after each gap.

    Returns: whether the folder was left behind (it is removed either way).
    """
    proc, folder = hold_folder(num_files)
    try:
        proc.send_signal(signal.SIGTERM)
        for gap_s in gaps_s:
            time.sleep(gap_s)
            proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 128 + signal.SIGTERM
    finally:
        proc.kill()
        proc.wait()
        left = folder.exists()
        shutil.rmtree(folder, ignore_errors=True)
    return left


def test_the_folder_goes_when_the_process_gets_sigterm():
    assert not terminate(1, []), "the folder was left behind after SIGTERM"


def test_a_second_sigterm_does_not_stop_the_removal():
    # 50 ms: most likely while the 20,000 files are being removed
    assert not terminate(20_000, [0.05]), "the folder was left behind after two SIGTERMs"


def test_the_folder_goes_on_an_exception_and_the_sigterm_handler_comes_back():
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(RuntimeError), scratch_folder() as folder:
        (folder / "weights").write_bytes(b"x")
        assert signal.getsignal(signal.SIGTERM) is not before
        raise RuntimeError("the benchmark failed")
    assert not folder.exists()
    assert signal.getsignal(signal.SIGTERM) is before
