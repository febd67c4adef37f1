"""Kernel tests run the Triton kernels in the CPU interpreter (tests/conftest.py turns it on
before any module is imported)."""

import os

if os.environ.get("TRITON_INTERPRET") != "1":
    raise RuntimeError(
        f"tests/kernels runs Triton in its CPU interpreter; TRITON_INTERPRET is "
        f"{os.environ['TRITON_INTERPRET']!r}: unset it or set it to 1"
    )

import pytest

from kernels import cpu_build


@pytest.fixture(params=cpu_build.runnable_isa_levels())
def isa_level(request, monkeypatch) -> str:
    """Runs a test once per ISA level this CPU runs, on the C kernels built for that level
    ($KVGATE_CPU_ISA, as a user forces one): the AVX2 and portable code are tested on an AVX-512
    machine too. Fails when the library loaded reports another level (a build that lost its
    flags, which would test the same code twice), or when a vector level lacks one of its
    vector kernels (the portable loops would pass the same tests, slowly)."""
    level = request.param
    monkeypatch.setenv(cpu_build.ISA_ENV, level)
    cpu_build.library.cache_clear()
    built = cpu_build.ISA_LEVELS[cpu_build.library().kvgate_isa_level()]
    assert built == level, f"asked for the {level} kernels, loaded the {built} ones"
    lib = cpu_build.library()
    assert lib.kvgate_linear_columns_available(), (
        f"the {level} kernels must have the 9-64-row outer-product kernel"
    )
    vector = level != "scalar"
    vector_kernels = {
        "attention register tiles": lib.kvgate_attention_tiles_built(),
        "int4 integer multiply-adds": lib.kvgate_int4_integer_built(),
        "int8 x int8-block integer multiply-adds": lib.kvgate_int8_integer_built(),
        "column-major RMSNorm in vectors": lib.kvgate_rms_norm_vector_built(),
    }
    for name, present in vector_kernels.items():
        assert bool(present) == vector, (
            f"the {level} kernels {'lack' if vector else 'have'} the {name}"
        )
    yield level
    cpu_build.library.cache_clear()
