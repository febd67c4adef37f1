"""Engine benchmark: kvgate's Engine against transformers on one workload, in one process.

    python -m bench.bench_engine --out bench/results/engine.json
    python -m bench.bench_engine --model smollm2 --out bench/results/engine_smollm2.json

Without --model the model is a seeded random Llama of BENCH_SHAPE; with it, the weights of a
checkpoint folder or GGUF file (`smollm2`: the SmolLM2-135M-Instruct GGUF of `make setup`),
which transformers loads too (from_pretrained, with gguf_file= for a GGUF file), in float32.

Measures output tokens/s of (a) `transformers` generate one request at a time, (b)
`transformers` generate_batch (its continuous batching), (c) kvgate's Engine, each the best of
`--repeats` interleaved rounds; the machine's limit (bench/roofline.py: the workload's matmul
FLOPs at the best matmul FLOP/s, read in every round beside the peers); and the decode step
time at batch 8 for several context lengths. Prints the ratios and writes them as JSON.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, GenerationConfig, LlamaConfig, LlamaForCausalLM
from transformers.generation import ContinuousBatchingConfig

from bench.machine import matmul_flops_per_s
from bench.roofline import output_tokens_only_tokens_per_s, roofline_tokens_per_s
from bench.scratch import scratch_folder
from common.model_files import default_gguf_path, gguf_file
from common.sampling_params import SamplingParams
from engine.config import EngineConfig
from engine.engine import Engine
from engine.host_memory import retain_freed_memory

BENCH_SHAPE = dict(
    hidden_size=512,
    num_hidden_layers=8,
    num_attention_heads=8,
    num_key_value_heads=4,
    intermediate_size=1376,
    vocab_size=32000,
    max_position_embeddings=4096,
    tie_word_embeddings=False,
)


@dataclass
class Workload:
    num_requests: int = 64
    prompt_len: int = 128
    output_len: int = 128
    seed: int = 0

    def prompts(self, vocab_size: int) -> list[list[int]]:
        gen = torch.Generator().manual_seed(self.seed)
        shape = (self.num_requests, self.prompt_len)
        return torch.randint(3, vocab_size, shape, generator=gen).tolist()


def build_model(shape: dict, dtype: torch.dtype, seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(**shape)
    with torch.device("cpu"):
        model = LlamaForCausalLM(config)
    return model.to(dtype).eval()


def save_model(model: LlamaForCausalLM, folder: Path) -> Path:
    model.save_pretrained(folder)
    return folder


def load_hf_model(model: str | Path, dtype: torch.dtype = torch.float32):
    """transformers' model of a checkpoint folder or a GGUF file (dequantized), in eval mode."""
    gguf = gguf_file(model)
    if gguf is not None:
        loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=dtype)
    else:
        loaded = AutoModelForCausalLM.from_pretrained(model, dtype=dtype)
    return loaded.eval()


def model_shape(model) -> dict:
    """The architecture numbers of a transformers Llama, as BENCH_SHAPE spells them."""
    config = model.config
    return {key: getattr(config, key) for key in BENCH_SHAPE}


@contextmanager
def benchmark_model(args: argparse.Namespace, dtype: torch.dtype) -> Iterator[tuple[str, object]]:
    """(what the Engine loads, transformers' model) of --model, or of a seeded random Llama of
    BENCH_SHAPE saved to a scratch folder (removed when the block ends)."""
    if args.model:
        path = str(default_gguf_path()) if args.model == "smollm2" else args.model
        yield path, load_hf_model(path).to(dtype)
        return
    model = build_model(BENCH_SHAPE, torch.float32).to(dtype)
    with scratch_folder() as folder:
        save_model(model, folder)
        yield str(folder), model


def count_parameters(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def hf_generate_tokens_per_s(model, prompts: list[list[int]], output_len: int) -> float:
    """`transformers` generate, one request at a time (a sample of the workload)."""
    config = _greedy_config(output_len)
    device = model.device
    start = time.perf_counter()
    for prompt in prompts:
        ids = torch.tensor([prompt], device=device)
        model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config)
    _sync(str(device))
    return len(prompts) * output_len / (time.perf_counter() - start)


def hf_generate_batch_tokens_per_s(model, prompts: list[list[int]], output_len: int) -> float:
    """`transformers` generate_batch (continuous batching) over the whole workload.

    A small call first, untimed: generate_batch sizes its cache and warms up on each call.
    """
    warm_up = prompts[:2]
    model.generate_batch(
        inputs=warm_up,
        generation_config=_greedy_config(2),
        continuous_batching_config=_batch_cache_config(warm_up, 2),
    )
    start = time.perf_counter()
    outputs = model.generate_batch(
        inputs=prompts,
        generation_config=_greedy_config(output_len),
        continuous_batching_config=_batch_cache_config(prompts, output_len),
    )
    elapsed = time.perf_counter() - start
    produced = sum(len(o.generated_tokens) for o in outputs.values())
    return produced / elapsed


def _batch_cache_config(prompts: list[list[int]], output_len: int) -> ContinuousBatchingConfig:
    """A KV cache that holds the whole workload at once, and no more.

    Left to itself, generate_batch on a CPU sizes its cache from 60% of the machine's total
    RAM (whatever else runs there), gigabytes for a workload that needs megabytes.
    """
    config = ContinuousBatchingConfig()
    blocks_per_request = math.ceil((max(map(len, prompts)) + output_len) / config.page_size)
    config.num_blocks = len(prompts) * blocks_per_request
    return config


def _greedy_config(output_len: int) -> GenerationConfig:
    return GenerationConfig(
        max_new_tokens=output_len,
        min_new_tokens=output_len,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
    )


def kvgate_tokens_per_s(engine: Engine, prompts: list[list[int]], output_len: int) -> float:
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    for i, prompt in enumerate(prompts):
        engine.add_request(f"bench-{i}", prompt, params)
    produced = 0
    while engine.has_unfinished():
        produced += sum(len(o.new_token_ids) for o in engine.step())
    _sync(engine.config.device)
    return produced / (time.perf_counter() - start)


def decode_step_ms(
    engine: Engine, context_len: int, batch: int = 8, steps: int = 8, clock=time.perf_counter
) -> float:
    """Median time of one decode step for `batch` sequences at `context_len` tokens, read on
    `clock` (time.thread_time: this thread's CPU time, which other processes' load does not
    stretch; it counts all of a step only when the step runs on this thread alone)."""
    start_decoding(engine, context_len, batch, steps)
    times = []
    while engine.has_unfinished():
        _sync(engine.config.device)
        start = clock()
        engine.step()
        _sync(engine.config.device)
        times.append(clock() - start)
    return 1000 * statistics.median(times[:steps])


def start_decoding(engine: Engine, context_len: int, batch: int, steps: int) -> None:
    """Add `batch` random prompts of `context_len` tokens (seeded by the length) and run the
    engine until every one is decoding, with `steps` decode steps of each left (and two more)."""
    gen = torch.Generator().manual_seed(context_len)
    vocab = engine.model_config.vocab_size
    params = SamplingParams(max_tokens=steps + 2, temperature=0.0, ignore_eos=True)
    for i in range(batch):
        prompt = torch.randint(3, vocab, (context_len,), generator=gen).tolist()
        engine.add_request(f"ctx{context_len}-{i}", prompt, params)
    while engine.stats().num_waiting or _any_prefilling(engine):
        engine.step()


def _any_prefilling(engine: Engine) -> bool:
    return any(r.num_computed_tokens < r.num_tokens - 1 for r in engine.scheduler.running)


def best_rates(measures: dict, repeats: int) -> tuple[dict[str, float], dict[str, list[float]]]:
    """Run every measure `repeats` times, interleaved so that all see the same machine.

    Args:
        measures: name -> a callable returning a rate (higher is better).
        repeats: rounds; each round runs every measure once, in order.

    Returns:
        (best rate per name, every sample per name). The best of several runs is the least
        disturbed by other work on a shared machine, for every peer alike.
    """
    samples: dict[str, list[float]] = {name: [] for name in measures}
    for _ in range(repeats):
        for name, measure in measures.items():
            samples[name].append(measure())
    return {name: max(values) for name, values in samples.items()}, samples


def run(args: argparse.Namespace) -> dict:
    dtype = torch.float32 if args.device == "cpu" else torch.bfloat16
    if args.device == "cpu":
        # Process-wide, as every CPU Engine sets it: all peers measure with the same malloc.
        retain_freed_memory()
    workload = Workload(args.num_requests, args.prompt_len, args.output_len)
    output_len = workload.output_len
    with benchmark_model(args, dtype) as (engine_model, model):
        vocab_size = model.config.vocab_size
        prompts = workload.prompts(vocab_size)
        # Warm-up prompts of another seed: the measured prompts must not hit the prefix cache.
        warm_up = Workload(4, args.prompt_len, 8, seed=workload.seed + 1).prompts(vocab_size)

        def fresh_engine() -> Engine:
            engine = Engine(_engine_config(engine_model, args))
            kvgate_tokens_per_s(engine, warm_up, 8)
            return engine

        model = model.to(args.device)
        best, samples = best_rates(
            {
                "kvgate": lambda: kvgate_tokens_per_s(fresh_engine(), prompts, output_len),
                "hf_generate": lambda: hf_generate_tokens_per_s(
                    model, prompts[: args.hf_sample], output_len
                ),
                "hf_generate_batch": lambda: hf_generate_batch_tokens_per_s(
                    model, prompts, output_len
                ),
                # The roofline's rate, read in every round beside the peers: its best reading
                # is the machine's limit, whatever the moment of one reading was like.
                "matmul": lambda: matmul_flops_per_s(dtype, device=args.device),
            },
            args.repeats,
        )
        flops, matmul_samples = best.pop("matmul"), samples.pop("matmul")
        engine = fresh_engine()
        step_ms = {str(c): decode_step_ms(engine, c) for c in args.contexts}
        del engine
        resident = resident_under_workload(engine_model, args) if args.device == "cpu" else {}
    result = _result(args, workload, model, flops, best, samples, step_ms)
    return result | {
        "samples_matmul_flops_per_s": matmul_samples,
        "kvgate_resident_bytes": resident,
    }


def resident_under_workload(model: str, args: argparse.Namespace) -> dict[str, int]:
    """The executor's memory for this model and workload: VmRSS at the end and VmHWM (the
    peak) of a fresh process that builds the Engine as this benchmark does and runs the whole
    workload once (a CPU Engine keeps freed memory, so the end is near the peak)."""
    code = (
        "import argparse, json, sys\n"
        "from bench.bench_engine import Engine, Workload, _engine_config, kvgate_tokens_per_s\n"
        "args = argparse.Namespace(**json.loads(sys.argv[2]))\n"
        "workload = Workload(args.num_requests, args.prompt_len, args.output_len)\n"
        "engine = Engine(_engine_config(sys.argv[1], args))\n"
        "kvgate_tokens_per_s(engine, workload.prompts(engine.model_config.vocab_size),\n"
        "                    workload.output_len)\n"
        "from bench.machine import rss\n"
        "print(json.dumps(rss(('VmRSS', 'VmHWM', 'RssAnon', 'RssFile'))))\n"
    )
    fields = ("num_requests", "prompt_len", "output_len", "max_num_batched_tokens", "kv_cache_gib",
              "device")  # fmt: skip
    settings = json.dumps({name: getattr(args, name) for name in fields})
    root = Path(__file__).resolve().parent.parent
    out = subprocess.run([sys.executable, "-c", code, model, settings], capture_output=True,
                         text=True, check=True, cwd=root)  # fmt: skip
    return json.loads(out.stdout.strip().splitlines()[-1])


def _result(args, workload, model, flops, best, samples, step_ms) -> dict:
    """run's JSON: the rates beside each other and against the roofline."""
    kvgate, hf_one, hf_batch = best["kvgate"], best["hf_generate"], best["hf_generate_batch"]
    num_params = count_parameters(model)
    roofline = roofline_tokens_per_s(flops, model.config, workload)
    output_only = output_tokens_only_tokens_per_s(flops, num_params)
    return {
        "device": args.device,
        "torch_threads": torch.get_num_threads(),
        "load_average_at_end": os.getloadavg(),
        "workload": vars(workload),
        "model": args.model or "seeded random Llama",
        "model_shape": model_shape(model),
        "num_parameters": num_params,
        "matmul_flops_per_s": flops,
        "repeats": args.repeats,
        "samples_tokens_per_s": samples,
        "medians_tokens_per_s": {name: statistics.median(v) for name, v in samples.items()},
        "hf_generate_sample_requests": args.hf_sample,
        "hf_generate_tokens_per_s": hf_one,
        "hf_generate_batch_tokens_per_s": hf_batch,
        "kvgate_tokens_per_s": kvgate,
        "roofline_tokens_per_s": roofline,
        "roofline_output_tokens_only_tokens_per_s": output_only,
        "step_ms_by_context": step_ms,
        "kvgate_over_hf_generate": kvgate / hf_one,
        "kvgate_over_hf_generate_batch": kvgate / hf_batch,
        "kvgate_fraction_of_roofline": kvgate / roofline,
        "kvgate_fraction_of_roofline_output_tokens_only": kvgate / output_only,
    }


def _engine_config(model: str, args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(
        model=model,
        device=args.device,
        max_num_seqs=args.num_requests,
        max_num_batched_tokens=args.max_num_batched_tokens,
        kv_cache_gib=args.kv_cache_gib,
    )


def print_summary(result: dict) -> None:
    print(f"model                      {result['model']}")
    print(f"parameters                 {result['num_parameters'] / 1e6:.1f} M")
    print(f"matmul                     {result['matmul_flops_per_s'] / 1e9:.1f} GFLOP/s")
    print(f"roofline                   {result['roofline_tokens_per_s']:.0f} tokens/s")
    print(f"transformers generate      {result['hf_generate_tokens_per_s']:.1f} tokens/s")
    print(f"transformers generate_batch {result['hf_generate_batch_tokens_per_s']:.1f} tokens/s")
    print(f"kvgate Engine              {result['kvgate_tokens_per_s']:.1f} tokens/s")
    print(f"kvgate / generate          {result['kvgate_over_hf_generate']:.2f}x")
    print(f"kvgate / generate_batch    {result['kvgate_over_hf_generate_batch']:.2f}x")
    print(f"kvgate / roofline          {100 * result['kvgate_fraction_of_roofline']:.1f}%")
    if resident := result.get("kvgate_resident_bytes"):
        print(
            f"executor resident          {resident['VmRSS'] / 2**20:.0f} MiB "
            f"(peak {resident['VmHWM'] / 2**20:.0f} MiB)"
        )
    old = result["kvgate_fraction_of_roofline_output_tokens_only"]
    print(f"  (FLOP/s / 2 x params, output tokens only: {100 * old:.1f}%)")
    medians = result["medians_tokens_per_s"]
    print(
        f"medians of the rounds: kvgate {medians['kvgate']:.1f}, generate_batch "
        f"{medians['hf_generate_batch']:.1f} tokens/s, "
        f"{medians['kvgate'] / medians['hf_generate_batch']:.2f}x, "
        f"{100 * medians['kvgate'] / result['roofline_tokens_per_s']:.1f}% of the roofline"
    )
    steps = result["step_ms_by_context"]
    for context, ms in steps.items():
        print(f"decode step, batch 8, context {context:>5}: {ms:.2f} ms")
    first, last = min(steps, key=int), "1024"
    if last in steps:
        print(f"step(1024) / step({first})    {steps[last] / steps[first]:.2f}x")


def main(argv: list[str] | None = None) -> None:
    from bench import cpu_speed  # here: it builds on this module's measures

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="bench/results/engine.json")
    model_help = "checkpoint folder, GGUF file or smollm2 (default: a seeded random Llama)"
    parser.add_argument("--model", default="", help=model_help)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--hf-sample", type=int, default=2,
                        help="requests measured for one-at-a-time generate (a rate)")  # fmt: skip
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--kv-cache-gib", type=float, default=2.0)
    parser.add_argument("--contexts", type=int, nargs="+", default=[64, 256, 1024, 2048])
    repeats_help = "rounds of every throughput measurement; the best of each counts"
    parser.add_argument("--repeats", type=int, default=3, help=repeats_help)
    threads_help = "torch CPU threads for every measurement (0: torch's default)"
    parser.add_argument("--threads", type=int, default=0, help=threads_help)
    parser.add_argument("--no-cpu-speed", dest="run_cpu_speed", action="store_false",
                        help="skip the CPU decode-latency and number-format runs")  # fmt: skip
    cpu_speed.add_arguments(parser)
    parser.add_argument("--resident-only", action="store_true",
                        help="only the executor's resident memory under the workload (CPU), "
                             "in a fresh process")  # fmt: skip
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    if args.resident_only:
        with benchmark_model(args, torch.float32) as (engine_model, _):
            resident = resident_under_workload(engine_model, args)
        workload = Workload(args.num_requests, args.prompt_len, args.output_len)
        result = {
            "model": args.model or "random",
            "workload": vars(workload),
            "kv_cache_gib": args.kv_cache_gib,
            "load_average_at_end": os.getloadavg(),
            "kvgate_resident_bytes": resident,
        }
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
        print(
            f"resident {resident['VmRSS'] / 2**20:.0f} MiB, peak "
            f"{resident['VmHWM'] / 2**20:.0f} MiB; wrote {args.out}"
        )
        return
    result = run(args)
    print_summary(result)
    if args.run_cpu_speed and args.device == "cpu":
        result["cpu_speed"] = cpu_speed.run(args)
        cpu_speed.print_summary(result["cpu_speed"])
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
