"""Settings every test module needs before it is imported, and how tests share the cores.

Triton decides whether a kernel runs in its CPU interpreter when the kernel is defined, and its
own library functions (tl.sum, tl.max, ...) are defined when triton is first imported, which
importing transformers' Llama model already does. So TRITON_INTERPRET is set here, before pytest
imports any test module; bench/gpu_check.sh sets TRITON_INTERPRET=0 to run tests/gpu on a GPU.

`make test` runs two pytest-xdist workers (`-n 2 --dist loadgroup`): the tests that start
servers or listen on ports (SERVER_TESTS) run one after another on one worker, in one group,
while the other worker takes the in-process tests a module at a time; each worker gives torch
one thread, so two workers use the two cores without their matmul threads waiting on each
other.
"""

import os
from pathlib import Path

import pytest

os.environ.setdefault("TRITON_INTERPRET", "1")

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


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The server tests in one group; every other module a group of its own, so that its
    module fixtures (an engine, a model) are built on one worker only."""
    for item in items:
        path = item.path
        if any(path == p or p in path.parents for p in SERVER_TESTS):
            group = "servers"
        else:
            group = str(path)
        item.add_marker(pytest.mark.xdist_group(group))
