"""The kernel dispatcher: backend choice, clear refusals, one log line."""

import os
import pathlib
import subprocess
import sys

import pytest
import torch

from kernels import KernelBackend, cpu_build, get_kernels

REPO_ROOT = pathlib.Path(__file__).resolve().parents[2]


def run_python(code: str, extra_env: dict[str, str]) -> subprocess.CompletedProcess:
    """Run `code` in a fresh interpreter whose environment holds only PATH, HOME and extra_env."""
    env = {"PATH": os.environ["PATH"], "HOME": os.environ.get("HOME", "/tmp"), **extra_env}
    return subprocess.run(
        [sys.executable, "-c", code],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_triton_without_cuda_or_interpreter_refuses_at_start():
    code = "import torch\nfrom kernels import get_kernels\nget_kernels(torch.device('cpu'))"
    result = run_python(code, {"KVGATE_KERNELS": "triton"})
    assert result.returncode != 0, f"expected a refusal, got exit 0 and {result.stdout!r}"
    assert "RuntimeError: KVGATE_KERNELS=triton cannot run" in result.stderr, result.stderr
    assert "TRITON_INTERPRET" in result.stderr and "'reference'" in result.stderr, result.stderr


def test_choice_is_logged_once():
    code = (
        "import logging, torch\n"
        "from kernels import get_kernels\n"
        "logging.basicConfig(level=logging.INFO, format='%(name)s %(message)s')\n"
        "get_kernels(torch.device('cpu'))\n"
        "get_kernels(torch.device('cpu'))\n"
    )
    result = run_python(code, {})
    assert result.returncode == 0, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.startswith("kvgate.kernels")]
    expected = f"kvgate.kernels kernel backend cpu on cpu, ISA level {cpu_build.isa_level()}"
    assert lines == [expected], result.stderr


def test_unknown_backend_names_the_variable_and_the_choices(monkeypatch):
    monkeypatch.setenv("KVGATE_KERNELS", "cuda-graphs")
    with pytest.raises(
        ValueError, match="KVGATE_KERNELS='cuda-graphs'.*allowed: triton, cpu, reference"
    ):
        get_kernels(torch.device("cpu"))
    with pytest.raises(ValueError, match="allowed: triton, cpu, reference"):
        get_kernels(torch.device("cpu"), "flash")


def test_cpu_defaults_to_the_cpu_kernels_even_with_the_interpreter(monkeypatch):
    monkeypatch.delenv("KVGATE_KERNELS", raising=False)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    for dtype in (torch.float32, torch.bfloat16):
        backend = get_kernels(torch.device("cpu"), dtype=dtype)
        assert isinstance(backend, KernelBackend) and backend.name == "cpu"
        assert backend.paged_decode_attention.__module__ == "kernels.cpu_attention"
        assert backend.paged_prefill_attention.__module__ == "kernels.cpu_attention"
        assert backend.attention.__module__ == "kernels.cpu_attention"
        assert backend.rms_norm.__module__ == backend.silu_and_mul.__module__ == "kernels.cpu"
        assert backend.linear.__module__ == backend.linear_quantized.__module__
        assert backend.linear.__module__ == "kernels.cpu_linear"
        assert backend.decoder_layers.__module__ == "kernels.cpu_decoder"


def test_cpu_with_another_dtype_runs_the_reference_and_says_why(monkeypatch, caplog):
    monkeypatch.delenv("KVGATE_KERNELS", raising=False)
    backend = get_kernels(torch.device("cpu"), dtype=torch.float16)
    assert backend.name == "reference"
    assert "the CPU kernels run float32 and bfloat16; using the reference kernels" in caplog.text
    with pytest.raises(RuntimeError, match="KVGATE_KERNELS=cpu cannot run: dtype is torch.fl"):
        get_kernels(torch.device("cpu"), "cpu", torch.float16)


def test_cpu_without_a_compiler_runs_the_reference_or_refuses_when_asked(tmp_path):
    code = (
        "import logging, torch\n"
        "from kernels import get_kernels\n"
        "logging.basicConfig(level=logging.INFO, format='%(name)s %(message)s')\n"
        "print(get_kernels(torch.device('cpu')).name)\n"
        "get_kernels(torch.device('cpu'), 'cpu')\n"
    )
    env = {"KVGATE_BUILD_DIR": str(tmp_path), "CC": str(tmp_path / "no-such-cc")}
    result = run_python(code, env)
    assert result.stdout.strip() == "reference", result.stdout + result.stderr
    assert "cannot run the C compiler" in result.stderr, result.stderr
    assert "RuntimeError: KVGATE_KERNELS=cpu cannot run" in result.stderr, result.stderr


def test_triton_runs_on_cpu_under_the_interpreter(monkeypatch):
    monkeypatch.setenv("KVGATE_KERNELS", "triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    backend = get_kernels(torch.device("cpu"))
    assert backend.name == "triton"
    assert backend.rms_norm.__module__ == "kernels.triton_norm"
    assert backend.linear.__module__ == "kernels.cuda"
    assert backend.linear_quantized.__module__ == "kernels.triton_quant"
