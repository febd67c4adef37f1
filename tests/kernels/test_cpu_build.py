"""Building the C kernels and choosing their ISA level (kernels/cpu_build.py)."""

import fnmatch
import tomllib
from pathlib import Path

import pytest
import torch

from kernels import cpu_build, dispatch
from tests.kernels.test_dispatch import run_python


def test_loading_the_library_leaves_float_denormals_alone():
    """-ffast-math must not reach the link: crtfastmath.o would flush denormals process-wide."""
    code = (
        "import torch\n"
        "from kernels import cpu\n"
        "cpu._library()\n"
        "tiny = torch.tensor([1e-38]) / 1000\n"
        "print(float(tiny[0]) > 0)\n"
    )
    result = run_python(code, {})
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "True", "denormals are flushed after loading the library"


def test_build_is_cached_in_the_build_dir_by_isa_level(tmp_path):
    code = "from kernels import cpu\ncpu._library()"
    env = {"KVGATE_BUILD_DIR": str(tmp_path), "KVGATE_CPU_ISA": "scalar"}
    first = run_python(code, env)
    assert first.returncode == 0, first.stderr
    built = sorted(tmp_path.iterdir())
    stems = [path.name.rsplit("-", 1)[0] for path in built]
    assert stems == ["cpu-isa", "cpu-kernels-scalar"], f"expected the probe and one level: {built}"
    mtimes = [path.stat().st_mtime_ns for path in built]
    second = run_python(code, env)
    assert second.returncode == 0, second.stderr
    assert sorted(tmp_path.iterdir()) == built, "the second load built again"
    assert [path.stat().st_mtime_ns for path in built] == mtimes, "the second load rebuilt"


def test_the_isa_level_is_the_cpus_unless_the_variable_asks_for_a_lower_one():
    assert cpu_build.choose_isa_level("", "avx2") == "avx2"
    assert cpu_build.choose_isa_level(" Scalar ", "avx2") == "scalar"
    assert cpu_build.choose_isa_level("avx2", "avx512") == "avx2"
    with pytest.raises(ValueError, match=r"KVGATE_CPU_ISA=avx512: this CPU .* runs up to avx2"):
        cpu_build.choose_isa_level("avx512", "avx2")
    with pytest.raises(ValueError, match=r"KVGATE_CPU_ISA='sse4' is no ISA level"):
        cpu_build.choose_isa_level("sse4", "avx512")


def test_a_level_the_cpu_cannot_run_stops_the_backend_choice(monkeypatch):
    """A bad KVGATE_CPU_ISA is a setting to correct: get_kernels raises, naming the variable,
    instead of running the reference kernels."""
    monkeypatch.setenv(cpu_build.ISA_ENV, "avx1024")
    cpu_build.library.cache_clear()
    try:
        with pytest.raises(ValueError, match="KVGATE_CPU_ISA='avx1024' is no ISA level"):
            dispatch.get_kernels(torch.device("cpu"))
    finally:
        cpu_build.library.cache_clear()


def test_missing_compiler_is_a_clear_reason(tmp_path):
    code = "from kernels import cpu\nprint(cpu.why_unavailable())"
    env = {"KVGATE_BUILD_DIR": str(tmp_path), "CC": str(tmp_path / "no-such-cc")}
    result = run_python(code, env)
    assert result.returncode == 0, result.stderr
    assert "cannot run the C compiler" in result.stdout and "no-such-cc" in result.stdout


def test_an_installed_package_carries_every_file_the_build_reads():
    """An image installs kvgate without its git tree (pip install /src): the package data
    must hold every C source and header cpu_build compiles."""
    root = Path(cpu_build.__file__).resolve().parents[1]
    config = tomllib.loads((root / "pyproject.toml").read_text())
    patterns = config["tool"]["setuptools"]["package-data"]["kernels"]
    read = [*cpu_build.SOURCES, *cpu_build.HEADERS, cpu_build.PROBE_SOURCE]
    missing = [
        path.name
        for path in read
        if not any(fnmatch.fnmatch(f"csrc/{path.name}", pattern) for pattern in patterns)
    ]
    assert not missing, f"pyproject's kernels package data {patterns} leaves out {missing}"
