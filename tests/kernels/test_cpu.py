"""The C decode attention kernel against its reference twin, its checks, and how it is built.

Tolerance: 1e-5 absolute against the reference (both float32, sums in a different order).
"""

import pytest
import torch

from kernels import cpu
from kernels import reference as ref
from tests.kernels.paged_cases import make_paged_case, naive_decode
from tests.kernels.test_dispatch import run_python
from tests.kernels.test_triton import (
    ATTENTION_ATOL,
    NUM_KV_HEADS,
    SHAPE_IDS,
    SHAPES,
    assert_close,
    random_context_lens,
)


def decode_args(seed: int, context_lens: list[int], block_size=4, head_dim=8, ratio=2):
    gen = torch.Generator().manual_seed(seed)
    case = make_paged_case(gen, context_lens, block_size, NUM_KV_HEADS, head_dim)
    q = torch.randn(len(context_lens), NUM_KV_HEADS * ratio, head_dim, generator=gen)
    return case, [q, case.k_cache, case.v_cache, case.block_tables, case.context_lens, 0.3]


@pytest.mark.parametrize(("head_dim", "block_size", "ratio"), SHAPES, ids=SHAPE_IDS)
def test_decode_matches_reference(head_dim, block_size, ratio):
    gen = torch.Generator().manual_seed(head_dim * 100 + block_size * 10 + ratio)
    context_lens = random_context_lens(gen, block_size)
    case, args = decode_args(head_dim + ratio, context_lens, block_size, head_dim, ratio)
    args[-1] = head_dim**-0.5
    out = cpu.paged_decode_attention(*args)
    assert out.dtype == torch.float32 and out.shape == args[0].shape
    assert_close(out, ref.paged_decode_attention(*args), ATTENTION_ATOL, "decode vs reference")
    expected = naive_decode(args[0], case, head_dim**-0.5)
    assert_close(out, expected, ATTENTION_ATOL, "decode vs float64 naive attention")


def test_decode_uses_every_thread_count_alike():
    _, args = decode_args(5, [3, 70, 1, 33], block_size=16, head_dim=64, ratio=4)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = cpu.paged_decode_attention(*args)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, cpu.paged_decode_attention(*args)), "result depends on threads"


def test_empty_batch_returns_empty():
    _, args = decode_args(1, [5])
    args[0], args[3], args[4] = args[0][:0], args[3][:0], args[4][:0]
    assert cpu.paged_decode_attention(*args).shape == (0, *args[0].shape[1:])


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("block_tables", "out_of_range", r"sequence 1: context_lens\[1\] = 9 needs block_tables"),
        ("block_tables", "negative", r"sequence 1: .* entries in \[0, "),
        ("context_lens", "zero", r"sequence 0: context_lens\[0\] = 0 .* at least one token"),
        ("context_lens", "too_long", r"sequence 1: context_lens\[1\] = 400"),
    ],
)
def test_bad_tables_are_refused_before_any_read(field, value, message):
    _, args = decode_args(2, [3, 9])
    tables, lens = args[3].clone(), args[4].clone()
    if value == "out_of_range":
        tables[1, 2] = args[1].shape[0]
    elif value == "negative":
        tables[1, 0] = -1
    elif value == "zero":
        lens[0] = 0
    else:
        lens[1] = 400
    args[3], args[4] = tables, lens
    with pytest.raises(ValueError, match=message):
        cpu.paged_decode_attention(*args)


def test_wrong_dtype_and_layout_are_refused():
    _, args = decode_args(3, [3, 9])
    with pytest.raises(ValueError, match="q must be float32 for the CPU kernels"):
        half = [args[0].half(), args[1].half(), args[2].half(), *args[3:]]
        cpu.paged_decode_attention(*half)
    strided = torch.randn(args[0].shape[0], args[0].shape[1] * 2, args[0].shape[2])[:, ::2]
    with pytest.raises(ValueError, match="q must be contiguous"):
        cpu.paged_decode_attention(strided, *args[1:])
    with pytest.raises(ValueError, match="block_tables must have dtype torch.int32"):
        cpu.paged_decode_attention(*args[:3], args[3].long(), *args[4:])


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


def test_build_is_cached_in_the_build_dir(tmp_path):
    code = "from kernels import cpu\ncpu._library()\nprint(sorted(cpu.build_dir().iterdir()))"
    first = run_python(code, {"KVGATE_BUILD_DIR": str(tmp_path)})
    assert first.returncode == 0, first.stderr
    built = sorted(tmp_path.iterdir())
    assert len(built) == 1 and built[0].name.startswith("paged_decode-"), built
    mtime = built[0].stat().st_mtime_ns
    second = run_python(code, {"KVGATE_BUILD_DIR": str(tmp_path)})
    assert second.returncode == 0, second.stderr
    assert sorted(tmp_path.iterdir()) == built and built[0].stat().st_mtime_ns == mtime


def test_missing_compiler_is_a_clear_reason(tmp_path):
    code = "from kernels import cpu\nprint(cpu.why_unavailable())"
    env = {"KVGATE_BUILD_DIR": str(tmp_path), "CC": str(tmp_path / "no-such-cc")}
    result = run_python(code, env)
    assert result.returncode == 0, result.stderr
    assert "cannot run the C compiler" in result.stdout and "no-such-cc" in result.stdout
