"""Decode latency at low concurrency, against the machine's read-bandwidth limit.

    python -m bench.bench_decode [--model PATH] [--variants float32 bfloat16 int8 int4]
        [--concurrency 1 4 16] [--out bench/results/decode.json]

At one or a few streams a decode step reads every weight once, so its time is bounded below by
weight bytes / read bandwidth. For each variant (float32, bfloat16, int8 and int4 weights) this
measures, in one run: the time per output token (TPOT: the median decode step once every
request has its prompt in the cache) at each concurrency; the weight and KV bytes a step reads;
the fraction of the bandwidth limit reached at one stream; where the time of a one-stream step
goes (each kernel, the scheduler, input preparation, sampling, and the rest: Python between
them); and the executor's resident memory (a fresh process per variant). The model is
SmolLM2-135M-Instruct's shape with seeded random weights unless --model names a checkpoint.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from bench.decode_profile import profile_step
from bench.machine import cpu_features, read_bandwidth_bytes_per_s
from bench.scratch import scratch_folder
from common.model_files import default_gguf_path
from common.sampling_params import SamplingParams
from executor.config import EngineConfig
from executor.engine import Engine
from executor.host_memory import resident_nbytes, retain_freed_memory

SMOLLM2_SHAPE = dict(
    hidden_size=576,
    intermediate_size=1536,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    head_dim=64,
    vocab_size=49152,
    tie_word_embeddings=True,
    rope_theta=100000.0,
    rms_norm_eps=1e-5,
    max_position_embeddings=8192,
)
VARIANTS = {
    "float32": {},
    "bfloat16": {"dtype": "bfloat16"},
    "int8": {"quantization": "int8"},
    "int4": {"quantization": "int4"},
}


def write_random_checkpoint(folder: Path, shape: dict = SMOLLM2_SHAPE, seed: int = 0) -> Path:
    """A Llama checkpoint of `shape` with seeded random weights (transformers' init)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    LlamaForCausalLM(LlamaConfig(**shape)).save_pretrained(folder)
    return folder


MODEL_HELP = (
    "checkpoint folder, GGUF file, smollm2 (the cached SmolLM2-135M-Instruct GGUF file: the "
    "default when it is cached) or shape (SmolLM2's shape with seeded random weights)"
)
RANDOM_SHAPE_LABEL = "SmolLM2-135M shape, seeded random weights"


def speed_model(model: str | None, folder: Path) -> tuple[str, str]:
    """(what the engine loads, how results name it) for --model; a random-weight checkpoint
    is written to `folder`."""
    model = model or ("smollm2" if default_gguf_path().is_file() else "shape")
    if model == "smollm2":
        return str(default_gguf_path()), f"SmolLM2-135M-Instruct ({default_gguf_path().name})"
    if model == "shape":
        return str(write_random_checkpoint(folder)), RANDOM_SHAPE_LABEL
    return model, model


def engine_for(model: str, variant: str, max_num_seqs: int = 64) -> Engine:
    config = EngineConfig(model=model, kv_cache_gib=0.5, max_num_seqs=max_num_seqs,
                          **VARIANTS[variant])  # fmt: skip
    return Engine(config)


def start_decoding(engine: Engine, concurrency: int, prompt_len: int, output_len: int) -> None:
    """Add `concurrency` requests and step until every prompt is in the cache."""
    gen = torch.Generator().manual_seed(concurrency)
    vocab = engine.model_config.vocab_size
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    for i in range(concurrency):
        prompt = torch.randint(3, vocab, (prompt_len,), generator=gen).tolist()
        engine.add_request(f"decode-{concurrency}-{i}", prompt, params)
    while engine.stats().num_waiting or any(
        r.num_computed_tokens < r.num_tokens - 1 for r in engine.scheduler.running
    ):
        engine.step()


def decode_tpot_ms(engine: Engine, concurrency: int, prompt_len: int, output_len: int) -> float:
    """Median decode step time with `concurrency` streams (each step: one token per stream)."""
    start_decoding(engine, concurrency, prompt_len, output_len)
    times = []
    while engine.has_unfinished():
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times[:-1] or times)


def weight_bytes_per_step(engine: Engine) -> int:
    """Bytes of weights one decode step reads: every linear layer (dense or quantized, the
    output layer once even when tied) and the norms; the embedding lookup reads one row."""
    model, total = engine.runner.model, 0
    for name, module in model.named_modules():
        quantized = getattr(module, "quantized", None)
        if name == "embed_tokens":
            continue
        if quantized is not None:
            total += quantized.nbytes
        for param in module.parameters(recurse=False):
            total += param.numel() * param.element_size()
    return total


def kv_bytes_per_token(engine: Engine) -> int:
    """Bytes of K and V one cached token holds across all layers."""
    return engine.runner.block_bytes // engine.runner.block_size


def measure_variant(model: str, variant: str, args: argparse.Namespace, bandwidth: float) -> dict:
    engine = engine_for(model, variant, max(args.concurrency))
    start_decoding(engine, 1, 8, 4)
    while engine.has_unfinished():
        engine.step()
    tpot = {n: decode_tpot_ms(engine, n, args.prompt_len, args.output_len)
            for n in args.concurrency}  # fmt: skip
    weights = weight_bytes_per_step(engine)
    context = args.prompt_len + args.output_len // 2
    step_bytes = weights + context * kv_bytes_per_token(engine)
    limit_tokens_per_s = bandwidth / step_bytes
    one_stream = 1000 / tpot[min(args.concurrency)]
    start_decoding(engine, 1, args.prompt_len, args.profile_steps + 2)
    profile = profile_step(engine, args.profile_steps)
    return {
        "tpot_ms": tpot,
        "tokens_per_s": {n: n * 1000 / ms for n, ms in tpot.items()},
        "weight_bytes_per_step": weights,
        "kv_bytes_per_step_one_stream": step_bytes - weights,
        "bandwidth_limit_tokens_per_s": limit_tokens_per_s,
        "fraction_of_bandwidth_limit": one_stream / limit_tokens_per_s,
        "profile_ms_per_step": profile,
    }


def resident_bytes(model: str, variant: str) -> dict:
    """Resident memory of a fresh process before and after building an engine of `variant` and
    decoding a few tokens: VmRSS, its anonymous and file-backed parts, and how much of the
    KV cache (0.5 GiB in every variant, resident only where written) is resident."""
    code = (
        "import json, sys\n"
        "from bench.bench_decode import engine_for, kv_resident, start_decoding\n"
        "from bench.machine import rss\n"
        "before = rss()\n"
        "engine = engine_for(sys.argv[1], sys.argv[2])\n"
        "start_decoding(engine, 1, 16, 8)\n"
        "while engine.has_unfinished(): engine.step()\n"
        "after = rss()\n"
        "print(json.dumps({'before_engine': before['VmRSS'], 'with_engine': after['VmRSS'],\n"
        "                  'with_engine_parts': after} | kv_resident(engine)))\n"
    )
    root = Path(__file__).resolve().parent.parent
    command = [sys.executable, "-c", code, model, variant]
    out = subprocess.run(command, capture_output=True, text=True, check=True, cwd=root)
    return json.loads(out.stdout.strip().splitlines()[-1])


def kv_resident(engine: Engine) -> dict[str, int]:
    """Bytes of the KV cache tensors, and of their pages resident now."""
    tensors = [t for layer in engine.runner.kv_caches for t in layer]
    return {
        "kv_cache_bytes": sum(t.nbytes for t in tensors),
        "kv_cache_resident": sum(resident_nbytes(t) for t in tensors),
    }


def run(args: argparse.Namespace) -> dict:
    retain_freed_memory()
    bandwidth = read_bandwidth_bytes_per_s()
    with scratch_folder() as folder:
        model, label = speed_model(args.model, folder)
        variants = {v: measure_variant(model, v, args, bandwidth) for v in args.variants}
        memory = {v: resident_bytes(model, v) for v in args.variants} if args.memory else {}
    return {
        "model": label,
        "torch_threads": torch.get_num_threads(),
        "cpu": cpu_features(),
        "load_average_at_end": os.getloadavg(),
        "read_bytes_per_s": bandwidth,
        "prompt_len": args.prompt_len,
        "output_len": args.output_len,
        "variants": variants,
        "resident_bytes": memory,
    }


def print_summary(result: dict) -> None:
    print(f"read bandwidth {result['read_bytes_per_s'] / 1e9:.1f} GB/s, "
          f"{result['torch_threads']} threads, load {result['load_average_at_end']}")  # fmt: skip
    for name, v in result["variants"].items():
        tpot = ", ".join(f"{n}: {ms:.1f}" for n, ms in v["tpot_ms"].items())
        print(f"{name:<9} TPOT ms by streams {tpot}; weights {v['weight_bytes_per_step'] / 1e6:.0f}"
              f" MB/step; limit {v['bandwidth_limit_tokens_per_s']:.0f} tok/s; one stream at "
              f"{100 * v['fraction_of_bandwidth_limit']:.0f}% of it")  # fmt: skip
        parts = sorted(v["profile_ms_per_step"].items(), key=lambda kv: -kv[1])
        print("          one-stream step: " + ", ".join(f"{k} {ms:.2f}" for k, ms in parts))
    mib = 1 << 20
    for name, mem in result["resident_bytes"].items():
        parts = mem["with_engine_parts"]
        print(f"{name:<9} resident {mem['with_engine'] / mib:.0f} MiB (anonymous "
              f"{parts['RssAnon'] / mib:.0f}, files {parts['RssFile'] / mib:.0f}); "
              f"{(mem['with_engine'] - mem['before_engine']) / mib:.0f} MiB for the engine, "
              f"{mem['kv_cache_resident'] / mib:.0f} of its {mem['kv_cache_bytes'] / mib:.0f} "
              "MiB KV cache")  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help=MODEL_HELP)
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--profile-steps", type=int, default=32)
    parser.add_argument("--no-memory", dest="memory", action="store_false",
                        help="skip the resident-memory processes")  # fmt: skip
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: default)")
    parser.add_argument("--out", default="bench/results/decode.json")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    result = run(args)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print_summary(result)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
