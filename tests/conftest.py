"""Settings every test module needs before it is imported, and how tests share the cores.

Triton decides whether a kernel runs in its CPU interpreter when the kernel is defined, and its
own library functions (tl.sum, tl.max, ...) are defined when triton is first imported, which
importing transformers' Llama model already does. So TRITON_INTERPRET is set here, before pytest
imports any test module; bench/gpu_check.sh sets TRITON_INTERPRET=0 to run tests/gpu on a GPU.

`make test` runs two pytest-xdist workers (`-n 2`, scheduled by `pytest_xdist_make_scheduler`
below): the tests that start servers or listen on ports (SERVER_TESTS) run one after another
on one worker, in order, while the other worker takes the in-process tests a module at a
time; each worker gives torch one thread, so two workers use the two cores without their
matmul threads waiting on each other.
"""

import os
from pathlib import Path

import pytest

os.environ.setdefault("TRITON_INTERPRET", "1")
# The tests start processes (Popen: fork, then exec) while gRPC channels of the same process
# may be busy; gRPC's fork handlers then wait forever inside fork() (seen: a stack's executor
# restarted right after a streaming call). A child that execs at once needs none of them.
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")

TESTS = Path(__file__).resolve().parent
# Run one at a time, on one worker: real servers, free ports, Redis, process trees.
SERVER_TESTS = (
    TESTS / "integration",
    TESTS / "unit" / "test_bench_cli.py",
    TESTS / "unit" / "test_redis_conn.py",
)


def pytest_configure(config: pytest.Config) -> None:
    if os.environ.get("PYTEST_XDIST_WORKER"):
        import torch

        torch.set_num_threads(1)


@pytest.fixture(scope="module")
def gguf() -> Path:
    """SmolLM2-135M-Instruct's GGUF file (fetched into the model cache by `make setup`)."""
    from common.model_files import default_gguf_path

    path = default_gguf_path()
    assert path.is_file(), f"{path} is missing: `make setup` fetches it (deploy/fetch_model.py)"
    return path


@pytest.fixture(scope="module")
def smollm2_tokenizer(gguf: Path):
    """transformers' tokenizer of the GGUF file: the class AutoTokenizer picks for it, without
    its slow config read."""
    from transformers import TokenizersBackend

    return TokenizersBackend.from_pretrained(gguf.parent, gguf_file=gguf.name)


@pytest.fixture(scope="module")
def smollm2_model(gguf: Path):
    """transformers' float32 model loaded from the same GGUF file."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32
    )
    return model.eval()


def test_group(path: Path) -> str:
    """The unit of work a worker takes whole, its tests in order: every server test together,
    else the test's module (its module fixtures, an engine or a model, built on one worker;
    its later tests may build on what earlier ones did to its stack)."""
    if any(path == p or p in path.parents for p in SERVER_TESTS):
        return "servers"
    return str(path)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log):
    """xdist's loadscope with test_group as the scope. (Its `loadgroup` with xdist_group
    marks does not group under pytest 9: it renames `item._nodeid`, which pytest 9 no longer
    reads, so each test was its own unit and a module's tests ran on both workers.)"""
    from xdist.scheduler import LoadScopeScheduling

    class ByTestGroup(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return test_group(config.rootpath / nodeid.split("::", 1)[0])

    return ByTestGroup(config, log)
