"""Kernel and step timings: CPU linear layers beside torch's (`kvgate bench kernels linear`),
each weight format's engine step by thread CPU time (`kvgate bench engine steps`), and on one
CUDA GPU the paged attention kernels (`kvgate bench kernels gpu`) and the engine (`kvgate bench
engine gpu`). The kernels' correctness on CUDA is tests/gpu/test_cuda_kernels.py's.

Linear layers of SmolLM2's shape: for 30 decoder layers' four weights each (q/k/v, o, gate/up,
down; distinct weights per layer, so that a pass reads them from memory as a decode step does,
not from the cache), measures the time of: float32 (kvgate: C kernels up to 64 rows, then MKL;
torch: MKL's w @ x^T), bfloat16 (kvgate: C kernel up to 8 rows, then, on CPUs without AMX
tiles, float32 sums of the widened values: the outer-product kernel up to 64 rows and MKL on
widened slices above, else oneDNN; torch: x @ w^T), int8 (kvgate; torch's _weight_int8pack_mm)
and int4 (kvgate; torch's _weight_int4pack_mm_for_cpu, groups of 32), each with bfloat16 and
float32 activations where torch accepts them. Reports each as ms per model pass and as weight
GB/s (bytes read / time), best of --repeats.

Engine steps by thread CPU time: on a machine shared with other work, wall-clock step times
follow the load (a step waits while another process holds the core, and formats measured one
after another meet different loads). With one torch thread (--threads 1, the default there)
the C kernels run on the thread that calls `Engine.step()`, whose CPU time (`time.thread_time`)
leaves the waiting out, and stepping the formats in turn gives each round the same machine
(sharing the caches and the memory bandwidth still shows). The kernels' ISA level is in the
results' `cpu` block (`KVGATE_CPU_ISA` picks a lower one).

    KVGATE_CPU_ISA=avx2 kvgate bench engine steps --model smollm2 --streams 1 --steps 24

Paged attention on the GPU: decode at batch 64, context 4096, 32 query / 8 KV heads, head_dim
128, block_size 16, bfloat16: median time (CUDA events), KV bytes read per second, fraction of
the H200's 4.8 TB/s; next to PyTorch's scaled_dot_product_attention on the same K/V already
gathered contiguously, and the reference kernel (gather, then SDPA). Prefill of 8 sequences x
2048 new tokens, same heads: time next to SDPA (causal) on contiguous K/V.

The engine on one CUDA GPU: a random model shaped like Llama-3.2-1B, bfloat16: output tokens/s
of kvgate's Engine and of `transformers` generate_batch at 1 and 64 concurrent requests (128
prompt, 128 output tokens, ignore_eos) on the same GPU in the same run, and the batch-1 decode
step time with CUDA graphs and without (enforce_eager) against the bandwidth bound (weight
bytes / 4.8 TB/s, the H200's HBM bandwidth).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM

from bench.cpu import (
    MODEL_HELP,
    VARIANTS,
    engine_for,
    speed_model,
    start_decoding,
    weight_bytes_per_step,
)
from bench.engine import (
    Workload,
    decode_step_ms,
    hf_generate_batch_tokens_per_s,
    kvgate_tokens_per_s,
)
from bench.harness import (
    BenchFailure,
    Benchmark,
    add_model,
    add_prompt_len,
    add_repeats,
    add_threads,
    best_seconds,
    cpu_features,
    load_average,
    require_positive,
    scratch_folder,
)
from engine.config import EngineConfig
from engine.engine import Engine
from kernels import KernelBackend, cpu_linear, get_kernels, quant
from kernels import reference as ref

SHAPES = ((960, 576), (576, 576), (3072, 576), (576, 1536))  # (out, in) of one layer
NUM_LAYERS = 30


def torch_int4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """torch's packed int4 of the same int4 values kvgate stores, and its scales_and_zeros."""
    q = quant.quantize_int4(weight, 32)
    values = quant.unpack_int4(q.qweight).to(torch.int32)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(values, 1)
    scales, zeros = q.scales.float(), q.zeros.float()
    # torch dequantizes (q - 8) * scale + zero; kvgate q * scale + zero.
    scales_and_zeros = torch.stack([scales.t(), (zeros + 8 * scales).t()], dim=-1)
    return packed, scales_and_zeros.contiguous()


def _channel_scales(q: quant.QuantizedWeight, x: torch.Tensor) -> torch.Tensor:
    return q.scales[:, 0].to(x.dtype)


def _as(t: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return t.to(x.dtype)


def candidates(weights: list[torch.Tensor], dtype: torch.dtype) -> dict[str, list[Callable]]:
    """name -> one call per weight, taking x [rows, in] of `dtype`."""
    int8 = [quant.quantize_int8(w) for w in weights]
    int4 = [quant.quantize_int4(w, 32) for w in weights]
    torch4 = [torch_int4(w) for w in weights]
    runs: dict[str, list[Callable]] = {
        "kvgate int8": [lambda x, q=q: cpu_linear.linear_quantized(x, q) for q in int8],
        "kvgate int4": [lambda x, q=q: cpu_linear.linear_quantized(x, q) for q in int4],
        "torch int8pack": [
            lambda x, q=q: torch.ops.aten._weight_int8pack_mm(x, q.qweight, _channel_scales(q, x))
            for q in int8
        ],
        "torch int4pack": [
            lambda x, p=p: torch.ops.aten._weight_int4pack_mm_for_cpu(x, p[0], 32, _as(p[1], x))
            for p in torch4
        ],
    }  # fmt: skip
    dense = [w.to(dtype) for w in weights]
    runs[f"kvgate {str(dtype)[6:]}"] = [lambda x, w=w: cpu_linear.linear(x, w) for w in dense]
    if dtype == torch.bfloat16:
        runs["torch bfloat16"] = [lambda x, w=w: x @ w.t() for w in dense]
    else:
        runs["torch float32"] = [lambda x, w=w: torch.mm(w, x.t()) for w in dense]
    return runs


def measure(rows: list[int], repeats: int) -> dict:
    gen = torch.Generator().manual_seed(0)
    weights = [
        torch.randn(n, k, generator=gen) * 0.02 for _ in range(NUM_LAYERS) for n, k in SHAPES
    ]
    params = NUM_LAYERS * sum(n * k for n, k in SHAPES)
    bytes_per_weight = {"int8": 1.0, "int4": 0.5, "float32": 4.0, "bfloat16": 2.0}
    results: dict = {}
    for dtype in (torch.float32, torch.bfloat16):
        for name, calls in candidates(weights, dtype).items():
            for n in rows:
                xs = {k: torch.randn(n, k, generator=gen).to(dtype) for k in (576, 1536)}
                seconds = best_seconds(
                    lambda calls=calls, xs=xs: [c(xs[w.shape[1]]) for c, w in zip(calls, weights,
                                                strict=True)], repeats,
                )  # fmt: skip
                width = next(v for k, v in bytes_per_weight.items() if k in name)
                key = f"{name}, {str(dtype)[6:]} x"
                results.setdefault(key, {})[n] = {
                    "ms": 1000 * seconds, "weight_gb_per_s": params * width / seconds / 1e9,
                }  # fmt: skip
    return results


def add_linear_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 8, 16, 64, 256])
    add_repeats(parser, 5)
    add_threads(parser)


def run_linear(args: argparse.Namespace) -> dict:
    """`kvgate bench kernels linear`."""
    results = measure(args.rows, args.repeats)
    return {"torch_threads": torch.get_num_threads(), "cpu": cpu_features(), "rows": args.rows,
            "load_average_at_end": load_average(), "ms_per_model_pass": results}  # fmt: skip


def summarize_linear(result: dict) -> None:
    rows = result["rows"]
    print(f"{'weights, activations':<36}" + "".join(f"{n:>16}" for n in rows))
    for name, by_rows in result["ms_per_model_pass"].items():
        cells = "".join(f"{by_rows[n]['ms']:>8.1f} ms{by_rows[n]['weight_gb_per_s']:>4.0f}G"
                        for n in rows)  # fmt: skip
        print(f"{name:<36}{cells}")
    print(f"load average {result['load_average_at_end']}")


H200_BANDWIDTH_GBPS = 4800.0


def cpu_seconds(step) -> float:
    """The calling thread's CPU seconds for step()."""
    start = time.thread_time()
    step()
    return time.thread_time() - start


def measure_steps(model: str, args: argparse.Namespace) -> dict:
    engines = {v: engine_for(model, v, max_num_seqs=args.streams) for v in args.variants}
    prefill_s = {
        v: cpu_seconds(lambda e=e: start_decoding(e, args.streams, args.prompt_len, args.steps + 2))
        for v, e in engines.items()
    }
    step_s: dict[str, list[float]] = {v: [] for v in engines}
    for _ in range(args.steps):
        for v, engine in engines.items():
            step_s[v].append(cpu_seconds(engine.step))
    formats = {}
    for v, times in step_s.items():
        median = statistics.median(times)
        formats[v] = {
            "prefill_cpu_s": prefill_s[v],
            "step_cpu_ms_median": 1000 * median,
            "step_cpu_ms_min": 1000 * min(times),
            "decode_tokens_per_cpu_s": args.streams / median,
            "weight_bytes_per_step": weight_bytes_per_step(engines[v]),
        }
    return {"formats": formats, "streams": args.streams, "prompt_len": args.prompt_len}


def run_steps(args: argparse.Namespace) -> dict:
    """`kvgate bench engine steps`."""
    require_positive(args, "streams", "steps", "prompt_len")
    with scratch_folder() as folder:
        model, label = speed_model(args.model, folder)
        result = measure_steps(model, args)
    return result | {"model": label, "cpu": cpu_features(), "load_average_at_end": load_average()}


def summarize_steps(result: dict) -> None:
    formats = result["formats"]
    base = formats.get("float32")
    print(f"{result['streams']} streams, kernels {result['cpu'].get('kernels_isa')}, "
          f"load {result['load_average_at_end']}; thread CPU time")  # fmt: skip
    for name, f in formats.items():
        step = f["step_cpu_ms_median"]
        ratio = f" ({base['step_cpu_ms_median'] / step:.2f}x float32)" if base else ""
        prefill = f" ({base['prefill_cpu_s'] / f['prefill_cpu_s']:.2f}x)" if base else ""
        print(f"{name:<9} decode step {step:.2f} ms{ratio}, min {f['step_cpu_ms_min']:.2f}; "
              f"prefill {f['prefill_cpu_s']:.2f} s{prefill}")  # fmt: skip


def add_steps_arguments(parser: argparse.ArgumentParser) -> None:
    add_model(parser, None, MODEL_HELP)
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--streams", type=int, default=1, help="sequences decoded together")
    add_prompt_len(parser, 32)
    parser.add_argument("--steps", type=int, default=24, help="decode steps timed per format")
    add_threads(parser, default=1)


@dataclass(frozen=True)
class Shape:
    """One attention shape to check."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    context_lens: tuple[int, ...]


@dataclass
class Row:
    """One line of the printed table."""

    section: str
    case: str
    dtype: str
    metric: str
    value: str
    status: str = ""


def paged_case(
    shape: Shape, dtype: torch.dtype, device: torch.device, seed: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random K/V caches with shuffled blocks, block tables (-1 past the end), context lens."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    blocks_needed = [math.ceil(n / shape.block_size) for n in shape.context_lens]
    num_blocks = sum(blocks_needed) + 1
    cache_shape = (num_blocks, shape.block_size, shape.num_kv_heads, shape.head_dim)
    k_cache = torch.randn(cache_shape, generator=gen).to(device=device, dtype=dtype)
    v_cache = torch.randn(cache_shape, generator=gen).to(device=device, dtype=dtype)
    order = torch.randperm(num_blocks, generator=gen)
    block_tables = torch.full((len(blocks_needed), max(blocks_needed) + 1), -1, dtype=torch.int32)
    used = 0
    for seq, needed in enumerate(blocks_needed):
        block_tables[seq, :needed] = order[used : used + needed]
        used += needed
    context_lens = torch.tensor(shape.context_lens, dtype=torch.int32)
    return k_cache, v_cache, block_tables.to(device), context_lens.to(device)


def cuda_time_ms(fn: Callable[[], object], warmup: int = 10, iters: int = 50) -> float:
    """Median of `iters` CUDA-event-timed calls after `warmup` untimed ones."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def bandwidth_rows(case: str, name: str, time_ms: float, kv_bytes: int) -> list[Row]:
    gbps = kv_bytes / (time_ms * 1e-3) / 1e9
    return [
        Row("decode", case, "bfloat16", f"{name} time", f"{time_ms * 1e3:.1f} us"),
        Row(
            "decode",
            case,
            "bfloat16",
            f"{name} KV GB/s",
            f"{gbps:.0f} ({gbps / H200_BANDWIDTH_GBPS:.0%} of 4.8 TB/s)",
        ),
    ]


def time_paged_decode(device: torch.device, tk: KernelBackend) -> list[Row]:
    batch, context_len, num_heads, num_kv_heads, head_dim, block_size = 64, 4096, 32, 8, 128, 16
    shape = Shape(num_heads, num_kv_heads, head_dim, block_size, (context_len,) * batch)
    k_cache, v_cache, block_tables, context_lens = paged_case(shape, torch.bfloat16, device, 4)
    q = torch.randn(batch, num_heads, head_dim, device=device, dtype=torch.bfloat16)
    scale = head_dim**-0.5
    kv_bytes = 2 * batch * context_len * num_kv_heads * head_dim * k_cache.element_size()
    case = f"B{batch} ctx{context_len} {num_heads}/{num_kv_heads}h d{head_dim} bs{block_size}"
    args = (q, k_cache, v_cache, block_tables, context_lens, scale)
    triton_ms = cuda_time_ms(lambda: tk.paged_decode_attention(*args))
    reference_ms = cuda_time_ms(lambda: ref.paged_decode_attention(*args), warmup=3, iters=10)

    tables = block_tables[:, : context_len // block_size].long().flatten()
    gathered = (batch, context_len, num_kv_heads, head_dim)
    keys = k_cache.index_select(0, tables).view(gathered).transpose(1, 2).contiguous()
    values = v_cache.index_select(0, tables).view(gathered).transpose(1, 2).contiguous()
    grouped_q = q.view(batch, num_kv_heads, num_heads // num_kv_heads, head_dim)
    sdpa_ms = cuda_time_ms(
        lambda: F.scaled_dot_product_attention(grouped_q, keys, values, scale=scale)
    )
    return [
        *bandwidth_rows(case, "triton paged", triton_ms, kv_bytes),
        *bandwidth_rows(case, "sdpa contiguous", sdpa_ms, kv_bytes),
        *bandwidth_rows(case, "reference", reference_ms, kv_bytes),
        Row("decode", case, "bfloat16", "triton / sdpa time", f"{triton_ms / sdpa_ms:.2f}x"),
    ]


def time_paged_prefill(device: torch.device, tk: KernelBackend) -> list[Row]:
    num_seqs, seq_len, num_heads, num_kv_heads, head_dim, block_size = 8, 2048, 32, 8, 128, 16
    shape = Shape(num_heads, num_kv_heads, head_dim, block_size, (seq_len,) * num_seqs)
    k_cache, v_cache, block_tables, context_lens = paged_case(shape, torch.bfloat16, device, 5)
    q = torch.randn(num_seqs * seq_len, num_heads, head_dim, device=device, dtype=torch.bfloat16)
    cu = torch.arange(0, num_seqs + 1, dtype=torch.int32, device=device) * seq_len
    scale = head_dim**-0.5
    args = (q, k_cache, v_cache, block_tables, cu, context_lens, scale)
    triton_ms = cuda_time_ms(lambda: tk.paged_prefill_attention(*args), warmup=3, iters=10)
    keys = torch.randn(num_seqs, num_kv_heads, seq_len, head_dim, device=device)
    keys = keys.to(torch.bfloat16)
    queries = q.view(num_seqs, seq_len, num_heads, head_dim).transpose(1, 2)

    def sdpa():
        return F.scaled_dot_product_attention(
            queries, keys, keys, is_causal=True, scale=scale, enable_gqa=True
        )

    sdpa_ms = cuda_time_ms(sdpa, warmup=3, iters=10)
    case = f"{num_seqs}x{seq_len} new tokens {num_heads}/{num_kv_heads}h d{head_dim}"
    return [
        Row("prefill", case, "bfloat16", "triton paged time", f"{triton_ms * 1e3:.0f} us"),
        Row("prefill", case, "bfloat16", "sdpa causal time", f"{sdpa_ms * 1e3:.0f} us"),
        Row("prefill", case, "bfloat16", "triton / sdpa time", f"{triton_ms / sdpa_ms:.2f}x"),
    ]


def print_rows(rows: list[Row]) -> None:
    headers = ("section", "case", "dtype", "metric", "value", "status")
    cells = [headers, *[(r.section, r.case, r.dtype, r.metric, r.value, r.status) for r in rows]]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    for index, row in enumerate(cells):
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)))
        if index == 0:
            print("  ".join("-" * width for width in widths))


def require_cuda() -> None:
    """Raises: BenchFailure when torch sees no CUDA device."""
    if not torch.cuda.is_available():
        raise BenchFailure(f"no CUDA device visible to torch {torch.__version__}; run on a GPU")


def run_gpu_kernels(args: argparse.Namespace) -> dict:
    """`kvgate bench kernels gpu`."""
    require_cuda()
    device = torch.device("cuda")
    tk = get_kernels(device, "triton")
    rows = [*time_paged_decode(device, tk), *time_paged_prefill(device, tk)]
    return {"device": torch.cuda.get_device_name(device), "torch": torch.__version__,
            "rows": [dataclasses.asdict(row) for row in rows]}  # fmt: skip


def summarize_gpu_kernels(result: dict) -> None:
    print(f"device: {result['device']}, torch {result['torch']}")
    print_rows([Row(**row) for row in result["rows"]])


LLAMA_1B_SHAPE = dict(
    hidden_size=2048,
    num_hidden_layers=16,
    num_attention_heads=32,
    num_key_value_heads=8,
    intermediate_size=8192,
    vocab_size=128256,
    max_position_embeddings=4096,
    tie_word_embeddings=True,
)
HBM_BYTES_PER_S = 4.8e12


def build_cuda_model(seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    with torch.device("cuda"):
        model = LlamaForCausalLM(LlamaConfig(**LLAMA_1B_SHAPE, dtype=torch.bfloat16))
    return model.to(torch.bfloat16).eval()


def weight_bytes(model: torch.nn.Module) -> int:
    unique = {p.data_ptr(): p for p in model.parameters()}
    return sum(p.numel() * p.element_size() for p in unique.values())


def eager_batch1_decode_ms(model_dir: Path) -> float:
    """The batch-1 decode step without CUDA graphs (enforce_eager), its engine freed after."""
    engine = Engine(EngineConfig(model=str(model_dir), device="cuda", max_num_seqs=1,
                                 gpu_memory_utilization=0.4, enforce_eager=True))  # fmt: skip
    kvgate_tokens_per_s(engine, Workload(num_requests=1).prompts(LLAMA_1B_SHAPE["vocab_size"]), 4)
    step_ms = decode_step_ms(engine, context_len=128, batch=1, steps=16)
    del engine
    torch.cuda.empty_cache()
    return step_ms


def measure_engine(model_dir: Path, model: LlamaForCausalLM, concurrency: list[int]) -> dict:
    eager_ms = eager_batch1_decode_ms(model_dir)
    engine = Engine(EngineConfig(model=str(model_dir), device="cuda", max_num_seqs=max(concurrency),
                                 gpu_memory_utilization=0.8))  # fmt: skip
    workload = Workload(num_requests=max(concurrency))
    prompts = workload.prompts(LLAMA_1B_SHAPE["vocab_size"])
    kvgate_tokens_per_s(engine, prompts[:2], 4)  # warm-up: Triton compiles here
    result: dict = {"kvgate_tokens_per_s": {}, "hf_generate_batch_tokens_per_s": {}}
    for n in concurrency:
        result["kvgate_tokens_per_s"][n] = kvgate_tokens_per_s(engine, prompts[:n], 128)
        result["hf_generate_batch_tokens_per_s"][n] = hf_generate_batch_tokens_per_s(
            model, prompts[:n], 128
        )
    result["batch1_decode_ms"] = decode_step_ms(engine, context_len=128, batch=1, steps=16)
    result["batch1_decode_ms_eager"] = eager_ms
    result["bandwidth_bound_ms"] = 1000 * weight_bytes(model) / HBM_BYTES_PER_S
    return result


def summarize_gpu_engine(result: dict) -> None:
    print(
        f"{'engine, Llama-3.2-1B shape, bf16':<44}{'kvgate':>12}{'generate_batch':>16}{'ratio':>8}"
    )
    for n, ours in result["kvgate_tokens_per_s"].items():
        theirs = result["hf_generate_batch_tokens_per_s"][n]
        print(
            f"{f'tokens/s at {n} concurrent':<44}{ours:>12.1f}{theirs:>16.1f}{ours / theirs:>8.2f}"
        )
    decode, bound = result["batch1_decode_ms"], result["bandwidth_bound_ms"]
    eager = result["batch1_decode_ms_eager"]
    print(f"{'batch-1 decode step, CUDA graphs (ms)':<44}{decode:>12.3f}")
    print(f"{'batch-1 decode step, eager (ms)':<44}{eager:>12.3f}{'':>16}{eager / decode:>8.2f}")
    print(
        f"{'bound: weight bytes / 4.8 TB/s (ms)':<44}{bound:>12.3f}{'':>16}{bound / decode:>8.2f}"
    )


def add_gpu_engine_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 64])


def run_gpu_engine(args: argparse.Namespace) -> dict:
    """`kvgate bench engine gpu`."""
    require_cuda()
    model = build_cuda_model()
    with scratch_folder() as folder:
        model.save_pretrained(folder)
        result = measure_engine(folder, model, args.concurrency)
    return result | {"device": torch.cuda.get_device_name()}


BENCHMARKS = {
    "kernels linear": Benchmark(add_linear_arguments, run_linear, "linear.json", summarize_linear),
    "engine steps": Benchmark(add_steps_arguments, run_steps, "steps.json", summarize_steps),
    "kernels gpu": Benchmark(
        lambda parser: None, run_gpu_kernels, "gpu_kernels.json", summarize_gpu_kernels
    ),
    "engine gpu": Benchmark(
        add_gpu_engine_arguments, run_gpu_engine, "gpu_engine.json", summarize_gpu_engine
    ),
}
