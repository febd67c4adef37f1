"""Settings every test module needs before it is imported, and how tests share the cores.

Triton decides whether a kernel runs in its CPU interpreter when the kernel is defined, and its
own library functions (tl.sum, tl.max, ...) are defined when triton is first imported, which
importing transformers' Llama model already does. So TRITON_INTERPRET is set here, before pytest
imports any test module; bench/gpu_check.sh sets TRITON_INTERPRET=0 to run tests/gpu on a GPU.

`make test` runs two pytest-xdist workers (`-n 2`, scheduled by `pytest_xdist_make_scheduler`
below): each takes a whole test module at a time, its tests in order, so each worker runs at
most one stack at a time and the other core runs another module beside it. Each worker gives
torch one thread, so two workers use the two cores without their matmul threads waiting on
each other, and picks its free ports from its own half of deploy.stack's range
(KVGATE_FREE_PORTS), so two workers never hand a starting process the same port.
"""

import os
from pathlib import Path

import pytest

os.environ.setdefault("TRITON_INTERPRET", "1")
# The tests start processes (Popen: fork, then exec) while gRPC channels of the same process
# may be busy; gRPC's fork handlers then wait forever inside fork() (seen: a stack's executor
# restarted right after a streaming call). A child that execs at once needs none of them.
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")


def pytest_configure(config: pytest.Config) -> None:
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    if worker:
        import torch

        torch.set_num_threads(1)
        os.environ.setdefault(
            "KVGATE_FREE_PORTS", worker_ports(worker, int(os.environ["PYTEST_XDIST_WORKER_COUNT"]))
        )


def worker_ports(worker: str, workers: int) -> str:
    """Returns: KVGATE_FREE_PORTS for xdist worker `worker` ("gw1"): its share of the range."""
    from deploy.stack import free_port_range

    low, high = free_port_range()
    share = (high - low) // workers
    first = low + int(worker.removeprefix("gw")) * share
    return f"{first}-{first + share - 1}"


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


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log):
    """xdist's loadscope with the test's module as its scope: a module's tests run in order on
    one worker (its module fixtures, an engine, a model or a stack, built once; its later tests
    may build on what earlier ones did to its stack). (xdist's `loadgroup` does not group under
    pytest 9: it renames `item._nodeid`, which pytest 9 no longer reads.)"""
    from xdist.scheduler import LoadScopeScheduling

    class ByModule(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return nodeid.split("::", 1)[0]

    return ByModule(config, log)
