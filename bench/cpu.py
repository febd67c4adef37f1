"""The CPU speed runs: decode latency against the read-bandwidth limit (`kvgate bench engine
decode`), throughput per number format at 64 streams (`... dtypes`), and both with the machine's
limits and the targets they meet (`... cpu`, the run of `make bench-engine`).

Every ratio is between measures of one run. The float32 one-stream speed "today" (the bar of
the int8 and int4 one-stream targets) is --float32-baseline-tokens-per-s, a figure measured
elsewhere, or else this code's float32.

Decode latency: at one or a few streams a decode step reads every weight once, so its time is
bounded below by weight bytes / read bandwidth. For each variant (float32, bfloat16, int8 and
int4 weights) this measures, in one run: the time per output token (TPOT: the median decode step
once every request has its prompt in the cache) at each concurrency; the weight and KV bytes a
step reads; the fraction of the bandwidth limit reached at one stream; where the time of a
one-stream step goes (profile_step: each kernel, the scheduler, input preparation, the output
layer, sampling, and the rest: Python between them; the engine's parts are wrapped with timers
for the measured steps and restored after; times are exclusive, and the timers cost about a
microsecond a call, which lands in the parts they wrap); and the executor's resident memory (a
fresh process per variant). The model is SmolLM2-135M-Instruct's shape with seeded random
weights unless --model names a checkpoint.

Number formats: kvgate float32, bfloat16, int8 and int4 beside transformers generate_batch in
bfloat16, on SmolLM2-135M's shape. Each measure is the best of --repeats interleaved rounds
(bench.engine.best_rates), on 64 requests of 128 prompt and 128 output tokens (EOS ignored).
The roofline of a format is the workload's matmul FLOPs at the machine's best matmul FLOP/s in
it (2048 x 2048 x 2048, read in every round beside the formats; bench/engine.py). int8 runs
with float32 activations (the CPU default) and with bfloat16 ones, int4 with bfloat16 ones.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import statistics
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import torch

from bench.engine import (
    Workload,
    best_rates,
    hf_generate_batch_tokens_per_s,
    kvgate_tokens_per_s,
    load_hf_model,
    output_tokens_only_tokens_per_s,
    roofline_tokens_per_s,
)
from bench.harness import (
    Benchmark,
    add_model,
    add_output_len,
    add_prompt_len,
    add_repeats,
    add_threads,
    add_workload,
    cpu_features,
    load_average,
    machine_limits,
    matmul_flops_per_s,
    read_bandwidth_bytes_per_s,
    scratch_folder,
)
from common.model_files import default_gguf_path
from common.sampling_params import SamplingParams
from engine.config import EngineConfig
from engine.engine import Engine
from engine.host_memory import resident_nbytes, retain_freed_memory
from kernels import cpu_decoder
from kernels.decoder import decoder_layers_with

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
    # int8 layers against activations rounded to int8 blocks (--int8-activations)
    "int8-a8": {"quantization": "int8", "int8_activations": True},
    "int4-a8": {"quantization": "int4", "int8_activations": True},
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
        "from bench.cpu import engine_for, kv_resident, start_decoding\n"
        "from bench.harness import rss\n"
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


def measure_decode(model: str, args: argparse.Namespace) -> dict:
    retain_freed_memory()
    bandwidth = read_bandwidth_bytes_per_s()
    variants = {v: measure_variant(model, v, args, bandwidth) for v in args.variants}
    memory = {v: resident_bytes(model, v) for v in args.variants} if args.memory else {}
    return {
        "torch_threads": torch.get_num_threads(),
        "cpu": cpu_features(),
        "load_average_at_end": load_average(),
        "read_bytes_per_s": bandwidth,
        "prompt_len": args.prompt_len,
        "output_len": args.output_len,
        "variants": variants,
        "resident_bytes": memory,
    }


def run_decode(args: argparse.Namespace) -> dict:
    """`kvgate bench engine decode`."""
    with scratch_folder() as folder:
        model, label = speed_model(args.model, folder)
        return measure_decode(model, args) | {"model": label}


def summarize_decode(result: dict) -> None:
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


def add_decode_arguments(parser: argparse.ArgumentParser) -> None:
    add_model(parser, None, MODEL_HELP)
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    add_prompt_len(parser, 128)
    add_output_len(parser, 64)
    parser.add_argument("--profile-steps", type=int, default=32)
    parser.add_argument("--no-memory", dest="memory", action="store_false",
                        help="skip the resident-memory processes")  # fmt: skip
    add_threads(parser)


class ExclusiveTimers:
    """Timers that subtract nested timed calls from their caller's time."""

    def __init__(self) -> None:
        self.seconds: Counter[str] = Counter()
        self._children: list[float] = []

    def wrap(self, name: str, fn: Callable) -> Callable:
        def timed(*args, **kwargs):
            self._children.append(0.0)
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                elapsed = time.perf_counter() - start
                self.seconds[name] += elapsed - self._children.pop()
                if self._children:
                    self._children[-1] += elapsed

        return timed


def profile_step(engine: Engine, steps: int) -> dict[str, float]:
    """Milliseconds per step of each part over the next `steps` steps (the engine must have
    that many steps of work left), with "other" the untimed rest and "step" the total."""
    timers = ExclusiveTimers()
    runner, model = engine.runner, engine.runner.model
    kernels = runner.kernels
    fields = [f.name for f in dataclasses.fields(kernels) if f.name != "name"]
    timed = dataclasses.replace(
        kernels, **{f: timers.wrap(f"kernel {f}", getattr(kernels, f)) for f in fields}
    )
    runner.kernels = dataclasses.replace(timed, decoder_layers=_visible_stack(kernels, timed))
    head = model.lm_head.forward

    def output_layer(x, _kernels, out_dtype=None):  # its matmul counts here, not as a kernel
        return head(x, kernels, out_dtype)

    patched = [
        (engine.scheduler, "schedule", "schedule", engine.scheduler.schedule),
        (runner, "_prepare", "prepare inputs", runner._prepare),
        (model.embed_tokens, "forward", "embedding", model.embed_tokens.forward),
        (model.lm_head, "forward", "output layer", output_layer),
        (engine, "sampler", "sampling", engine.sampler),
        (engine.kv_cache, "register_computed_blocks", "block bookkeeping",
         engine.kv_cache.register_computed_blocks),
    ]  # fmt: skip
    originals = [(obj, attr, getattr(obj, attr)) for obj, attr, _, _ in patched]
    for obj, attr, name, fn in patched:
        setattr(obj, attr, timers.wrap(name, fn))
    inside = _c_stack_timing(kernels, start=True)
    try:
        start = time.perf_counter()
        for _ in range(steps):
            engine.step()
        total = time.perf_counter() - start
    finally:
        runner.kernels = kernels
        for obj, attr, original in originals:
            setattr(obj, attr, original)
        inside = _c_stack_timing(kernels, start=False) if inside is not None else None
    per_step = {name: 1000 * s / steps for name, s in timers.seconds.items()}
    if inside:
        # The one-call decoder stack, split by the kernels it ran (timed in C).
        stack = per_step.pop("kernel decoder_layers", 0.0)
        for kind, seconds in inside.items():
            per_step[f"kernel {kind} (in the stack)"] = 1000 * seconds / steps
        per_step["stack, between its kernels"] = stack - 1000 * sum(inside.values()) / steps
    per_step["other"] = 1000 * total / steps - sum(per_step.values())
    per_step["step"] = 1000 * total / steps
    return per_step


def _visible_stack(kernels, timed) -> Callable:
    """The decoder stack with each kernel call timed: the one-call C stack (timed in C) when the
    step is small enough for it, else the layers one timed kernel call at a time."""
    one_call = timed.decoder_layers
    per_call = decoder_layers_with(timed.linear, timed.linear_quantized, timed.rms_norm,
                                   timed.attention, timed.silu_and_mul)  # fmt: skip

    def decoder_layers(weights, hidden, step):
        if kernels.name == "cpu" and hidden.shape[0] <= cpu_decoder.one_call_rows(weights):
            return one_call(weights, hidden, step)
        return per_call(weights, hidden, step)

    return decoder_layers


def _c_stack_timing(kernels, start: bool) -> dict[str, float] | None:
    """Turn the CPU decoder stack's own timing on (start) or read it and turn it off; None
    when the kernels are not the CPU ones."""
    if kernels.name != "cpu":
        return None
    return cpu_decoder.kernel_seconds(keep_timing=start)


ROOFLINE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
KVGATE_FORMATS = {
    "kvgate float32": {},
    "kvgate bfloat16": {"dtype": "bfloat16"},
    "kvgate int8": {"quantization": "int8"},
    "kvgate int8 bfloat16": {"quantization": "int8", "dtype": "bfloat16"},
    "kvgate int4 bfloat16": {"quantization": "int4", "dtype": "bfloat16"},
}


def kvgate_measure(model: str, formats: dict, prompts: list[list[int]], output_len: int):
    """A callable: a fresh engine of `formats`, warmed up, then the workload's tokens/s."""

    def measure() -> float:
        engine = Engine(EngineConfig(model=model, max_num_seqs=len(prompts), kv_cache_gib=1.0,
                                     max_num_batched_tokens=2048, **formats))  # fmt: skip
        kvgate_tokens_per_s(engine, prompts[:2], 4)
        return kvgate_tokens_per_s(engine, prompts, output_len)

    return measure


def measure_dtypes(model: str, workload: Workload, repeats: int, formats: list[str]) -> dict:
    retain_freed_memory()
    hf = load_hf_model(model, torch.bfloat16)
    prompts = workload.prompts(hf.config.vocab_size)
    num_params = sum(p.numel() for p in hf.parameters())
    measures = {name: kvgate_measure(model, KVGATE_FORMATS[name], prompts, workload.output_len)
                for name in formats}  # fmt: skip
    measures["transformers bfloat16 generate_batch"] = lambda: hf_generate_batch_tokens_per_s(
        hf, prompts, workload.output_len
    )
    # The rooflines' matmul rates, read in every round beside the formats: their best reading
    # is the machine's limit, whatever the moment of one reading was like.
    for dtype in ROOFLINE_DTYPES:
        measures[f"matmul {dtype}"] = functools.partial(matmul_flops_per_s, ROOFLINE_DTYPES[dtype])
    best, samples = best_rates(measures, repeats)
    flops = {dtype: best.pop(f"matmul {dtype}") for dtype in ROOFLINE_DTYPES}
    flops_samples = {dtype: samples.pop(f"matmul {dtype}") for dtype in ROOFLINE_DTYPES}
    roofline = {name: roofline_tokens_per_s(f, hf.config, workload) for name, f in flops.items()}
    output_only = {name: output_tokens_only_tokens_per_s(f, num_params)
                   for name, f in flops.items()}  # fmt: skip
    return {
        "workload": vars(workload),
        "num_parameters": num_params,
        "torch_threads": torch.get_num_threads(),
        "cpu": cpu_features(),
        "load_average_at_end": load_average(),
        "matmul_flops_per_s": flops,
        "samples_matmul_flops_per_s": flops_samples,
        "roofline_tokens_per_s": roofline,
        "roofline_output_tokens_only_tokens_per_s": output_only,
        "tokens_per_s": best,
        "samples_tokens_per_s": samples,
        "medians_tokens_per_s": {n: statistics.median(v) for n, v in samples.items()},
    }


def summarize_dtypes(result: dict) -> None:
    flops, roof = result["matmul_flops_per_s"], result["roofline_tokens_per_s"]
    for name in ("float32", "bfloat16"):
        print(f"matmul {name} {flops[name] / 1e9:.0f} GFLOP/s: roofline {roof[name]:.0f} tokens/s")
    rates = result["tokens_per_s"]
    base = rates.get("kvgate float32")
    for name, rate in rates.items():
        ratio = f"{rate / base:.2f}x float32" if base else ""
        print(f"{name:<40}{rate:>10.1f} tokens/s  {ratio}")


def add_dtypes_arguments(parser: argparse.ArgumentParser) -> None:
    add_model(parser, None, MODEL_HELP)
    parser.add_argument("--formats", nargs="+", default=list(KVGATE_FORMATS),
                        choices=list(KVGATE_FORMATS))  # fmt: skip
    add_workload(parser)
    add_repeats(parser, 2)
    add_threads(parser)


def run_dtypes(args: argparse.Namespace) -> dict:
    """`kvgate bench engine dtypes`."""
    workload = Workload(args.num_requests, args.prompt_len, args.output_len)
    with scratch_folder() as folder:
        model, label = speed_model(args.model, folder)
        return measure_dtypes(model, workload, args.repeats, args.formats) | {"model": label}


def targets(decode: dict, dtypes: dict, baseline_one_stream: float | None) -> dict:
    """Each target's measured value, its bound and whether it is met."""
    variants = decode["variants"]
    one_stream = {name: v["tokens_per_s"][min(v["tokens_per_s"])] for name, v in variants.items()}
    base = baseline_one_stream or one_stream["float32"]
    rates = dtypes["tokens_per_s"]
    hf = rates["transformers bfloat16 generate_batch"]
    memory = decode["resident_bytes"]
    rows = {
        "float32 one stream / bandwidth limit": (
            variants["float32"]["fraction_of_bandwidth_limit"], 0.60),
        "int8 one stream / float32 one stream": (one_stream["int8"] / base, 3.0),
        "int4 one stream / float32 one stream": (one_stream["int4"] / base, 5.0),
        "64 streams bfloat16 / float32": (rates["kvgate bfloat16"] / rates["kvgate float32"], 1.8),
        "64 streams bfloat16 / transformers bfloat16 generate_batch": (
            rates["kvgate bfloat16"] / hf, 5.0),
        "64 streams bfloat16 / bfloat16 matmul roofline": (
            rates["kvgate bfloat16"] / dtypes["roofline_tokens_per_s"]["bfloat16"], 0.50),
        "64 streams int8 (float32 activations) / float32": (
            rates["kvgate int8"] / rates["kvgate float32"], 1.0),
    }  # fmt: skip
    if memory:
        whole = memory["int8"]["with_engine"] / memory["float32"]["with_engine"]
        rows["resident int8 / float32, whole process"] = (whole, 0.40)
        rows["resident int8 / float32, whole process, every KV block written"] = (
            _kv_full(memory["int8"]) / _kv_full(memory["float32"]), 0.40)  # fmt: skip
        rows["resident int8 / float32, without the torch import and the KV cache"] = (
            _model_share(memory["int8"]) / _model_share(memory["float32"]), 0.40)  # fmt: skip
    return {name: {"measured": value, "target": bound, "met": value >= bound
                   if not name.startswith("resident") else value <= bound}
            for name, (value, bound) in rows.items()}  # fmt: skip


def _kv_full(memory: dict) -> int:
    """The process's resident size had every block of its KV cache been written."""
    return memory["with_engine"] - memory["kv_cache_resident"] + memory["kv_cache_bytes"]


def _model_share(memory: dict) -> int:
    return memory["with_engine"] - memory["before_engine"] - memory["kv_cache_resident"]


def run_cpu(args: argparse.Namespace) -> dict:
    """`kvgate bench engine cpu`: decode latency and number formats on one model, in one run."""
    decode_args = argparse.Namespace(
        variants=list(VARIANTS), concurrency=[1, 4, 16], prompt_len=128, output_len=64,
        profile_steps=32, memory=True,
    )  # fmt: skip
    with scratch_folder() as folder:
        model, label = speed_model(args.model, folder)
        decode = measure_decode(model, decode_args) | {"model": label}
        dtypes = measure_dtypes(model, Workload(64, 128, 128), args.repeats, list(KVGATE_FORMATS))
    result = {"model": label, "machine": machine_limits(), "decode": decode, "dtypes": dtypes}
    result["targets"] = targets(decode, dtypes, args.float32_baseline_tokens_per_s)
    return result


def summarize_cpu(result: dict) -> None:
    summarize_decode(result["decode"])
    summarize_dtypes(result["dtypes"])
    print(f"{'target':<72}{'measured':>10}{'bound':>8}  met")
    for name, t in result["targets"].items():
        print(f"{name:<72}{t['measured']:>10.2f}{t['target']:>8.2f}  {'yes' if t['met'] else 'NO'}")


def add_cpu_arguments(parser: argparse.ArgumentParser) -> None:
    add_model(parser, None, MODEL_HELP)
    add_repeats(parser, 2)
    add_threads(parser)
    parser.add_argument("--float32-baseline-tokens-per-s", type=float, default=None,
                        help="the float32 one-stream speed before the change, measured "
                             "elsewhere (default: this code's)")  # fmt: skip


BENCHMARKS = {
    "engine cpu": Benchmark(add_cpu_arguments, run_cpu, "cpu_speed.json", summarize_cpu),
    "engine decode": Benchmark(add_decode_arguments, run_decode, "decode.json", summarize_decode),
    "engine dtypes": Benchmark(add_dtypes_arguments, run_dtypes, "dtypes.json", summarize_dtypes),
}
