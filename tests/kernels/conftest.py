"""Kernel tests run the Triton kernels in the CPU interpreter.

TRITON_INTERPRET is read when a kernel is defined, so it is set here, before any test module
imports the Triton kernels.
"""

import os

os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402

from kernels import cpu_build  # noqa: E402


@pytest.fixture(params=cpu_build.runnable_isa_levels())
def isa_level(request, monkeypatch) -> str:
    """Runs a test once per ISA level this CPU runs, on the C kernels built for that level
    ($KVGATE_CPU_ISA, as a user forces one): the AVX2 and portable code are tested on an AVX-512
    machine too. Fails when the library loaded reports another level (a build that lost its
    flags, which would test the same code twice)."""
    level = request.param
    monkeypatch.setenv(cpu_build.ISA_ENV, level)
    cpu_build.library.cache_clear()
    built = cpu_build.ISA_LEVELS[cpu_build.library().kvgate_isa_level()]
    assert built == level, f"asked for the {level} kernels, loaded the {built} ones"
    assert cpu_build.library().kvgate_linear_columns_available(), (
        f"the {level} kernels must have the 9-64-row outer-product kernel"
    )
    yield level
    cpu_build.library.cache_clear()
