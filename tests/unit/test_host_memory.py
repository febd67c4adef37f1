"""engine/host_memory: large freed activations stay in the process heap for reuse; the KV
cache and its host tier are resident only where blocks are written."""

from __future__ import annotations

import json
import mmap
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from engine.config import EngineConfig
from engine.host_memory import resident_nbytes
from engine.model_runner import ModelRunner
from executor.config import ExecutorConfig
from tests.helpers import STORIES_260K, greedy, make_engine, run_to_completion

ROOT = Path(__file__).resolve().parents[2]

# Allocates a 20 MiB tensor and frees it, reading glibc's mallinfo2 while it lives and after.
PROBE = textwrap.dedent(
    """
    import ctypes, json, sys
    import torch
    from engine.host_memory import retain_freed_memory

    class MallInfo2(ctypes.Structure):
        _fields_ = [(name, ctypes.c_size_t) for name in (
            "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks",
            "uordblks", "fordblks", "keepcost")]

    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = MallInfo2
    if sys.argv[1] == "retain":
        assert retain_freed_memory()
        assert retain_freed_memory()  # a second call is a no-op
    before = libc.mallinfo2().hblkhd
    x = torch.ones(5 << 20)
    mmapped = libc.mallinfo2().hblkhd - before
    del x
    print(json.dumps({"mmapped": mmapped, "free_in_heap": libc.mallinfo2().fordblks}))
    """
)
MIB = 1 << 20


def _probes(*modes: str) -> list[dict[str, int]]:
    """PROBE's readings, one fresh process per mode (started together: each imports torch)."""
    procs = [
        subprocess.Popen([sys.executable, "-c", PROBE, mode], cwd=ROOT, text=True,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        for mode in modes
    ]  # fmt: skip
    readings = []
    for proc in procs:
        stdout, stderr = proc.communicate(timeout=120)
        assert proc.returncode == 0, stderr
        readings.append(json.loads(stdout.splitlines()[-1]))
    return readings


@pytest.mark.skipif(sys.platform != "linux", reason="mallinfo2/mallopt are glibc's (Linux)")
def test_a_large_activation_comes_from_the_heap_and_stays_there():
    default, retained = _probes("default", "retain")
    # glibc's defaults map a fresh 20 MiB block (and unmap it on free): new pages every step.
    assert default["mmapped"] >= 20 * MIB, default
    assert retained["mmapped"] == 0, retained
    assert retained["free_in_heap"] >= 20 * MIB, retained


def test_the_executor_flag_and_its_variable_reach_the_engine(monkeypatch: pytest.MonkeyPatch):
    def retained(*flags: str) -> bool:
        config = ExecutorConfig.from_args(["--model", str(STORIES_260K), *flags])
        return config.engine.retain_freed_memory

    monkeypatch.delenv("KVGATE_RETAIN_FREED_MEMORY", raising=False)
    assert retained() is True
    assert retained("--no-retain-freed-memory") is False
    monkeypatch.setenv("KVGATE_RETAIN_FREED_MEMORY", "off")
    assert retained() is False
    assert retained("--retain-freed-memory") is True
    monkeypatch.setenv("KVGATE_RETAIN_FREED_MEMORY", "maybe")
    with pytest.raises(ValueError, match="KVGATE_RETAIN_FREED_MEMORY"):
        retained()


def test_the_model_runner_sets_the_thresholds_only_when_asked(monkeypatch: pytest.MonkeyPatch):
    calls: list[str] = []
    monkeypatch.setattr("engine.model_runner.retain_freed_memory", lambda: calls.append("set"))
    ModelRunner(EngineConfig(model=str(STORIES_260K), retain_freed_memory=False))
    assert calls == []
    ModelRunner(EngineConfig(model=str(STORIES_260K)))
    assert calls == ["set"]


def test_the_kv_cache_and_its_host_tier_are_resident_only_where_blocks_are_written():
    engine = make_engine(kv_cache_gib=0.05, swap_space_gib=0.05)
    caches = [t for layer in engine.runner.kv_caches for t in layer]
    host = [t for layer in engine.runner.host_pool.host_caches for t in layer]
    assert sum(resident_nbytes(t) for t in caches + host) == 0, "nothing written yet"
    params = greedy(27)
    engine.add_request("r", [1, 403, 407, 261, 378], params)  # 32 tokens: blocks 0 and 1
    assert len(run_to_completion(engine)["r"]) == 27
    block_bytes = caches[0][0].nbytes
    bound = (2 * block_bytes + 2 * mmap.PAGESIZE) * len(caches)  # page-rounded, both ends
    resident = sum(resident_nbytes(t) for t in caches)
    total = sum(t.nbytes for t in caches)
    assert 0 < resident <= bound, f"{resident} bytes resident of {total}, expected <= {bound}"
    assert sum(resident_nbytes(t) for t in host) == 0, "nothing was swapped out"
    assert all(torch.count_nonzero(t[2:]) == 0 for t in caches), "unwritten blocks read 0"
    assert sum(resident_nbytes(t) for t in caches) == resident, "reading them took no memory"
