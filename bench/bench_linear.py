"""Linear layers of SmolLM2's shape, kvgate's CPU kernels beside torch's, per batch size.

    python -m bench.bench_linear [--rows 1 4 8 16 64 256] [--out bench/results/linear.json]

For 30 decoder layers' four weights each (q/k/v, o, gate/up, down; distinct weights per layer,
so that a pass reads them from memory as a decode step does, not from the cache), measures the
time of: float32 (kvgate: C kernels up to 64 rows, then MKL; torch: MKL's w @ x^T, which kvgate
ran at every batch above 8 rows before), bfloat16 (kvgate: C kernel up to 8 rows, then, on
CPUs without AMX tiles, float32 sums of the widened values: the outer-product kernel up to 64
rows and MKL on widened slices above, else oneDNN; torch: x @ w^T), int8 (kvgate; torch's
_weight_int8pack_mm) and int4 (kvgate; torch's _weight_int4pack_mm_for_cpu, groups of 32),
each with bfloat16 and float32 activations where torch accepts them. Reports each as ms per
model pass and as weight GB/s (bytes read / time), best of --repeats.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Callable
from pathlib import Path

import torch

from bench.machine import cpu_features
from kernels import cpu_linear, quant

SHAPES = ((960, 576), (576, 576), (3072, 576), (576, 1536))  # (out, in) of one layer
NUM_LAYERS = 30


def best_seconds(fn: Callable[[], object], repeats: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


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


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 8, 16, 64, 256])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default="bench/results/linear.json")
    args = parser.parse_args(argv)
    results = measure(args.rows, args.repeats)
    out = {"torch_threads": torch.get_num_threads(), "cpu": cpu_features(),
           "load_average_at_end": os.getloadavg(), "ms_per_model_pass": results}  # fmt: skip
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    print(f"{'weights, activations':<36}" + "".join(f"{n:>16}" for n in args.rows))
    for name, by_rows in results.items():
        cells = "".join(f"{by_rows[n]['ms']:>8.1f} ms{by_rows[n]['weight_gb_per_s']:>4.0f}G"
                        for n in args.rows)  # fmt: skip
        print(f"{name:<36}{cells}")
    print(f"load average {out['load_average_at_end']}; wrote {args.out}")


if __name__ == "__main__":
    main()
