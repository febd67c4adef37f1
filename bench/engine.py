"""`kvgate bench engine throughput`: kvgate's Engine against transformers on one workload, in
one process; and the helpers the other engine benchmarks build on.

    kvgate bench engine throughput --out bench/results/engine.json --out-key llama56m
    kvgate bench engine throughput --model smollm2 --out bench/results/engine.json --out-key smollm2

Without --model the model is a seeded random Llama of BENCH_SHAPE; with it, the weights of a
checkpoint folder or GGUF file (`smollm2`: the SmolLM2-135M-Instruct GGUF of `make setup`),
which transformers loads too (from_pretrained, with gguf_file= for a GGUF file), in float32.

Measures output tokens/s of (a) `transformers` generate one request at a time, (b)
`transformers` generate_batch (its continuous batching), (c) kvgate's Engine, each the best of
`--repeats` interleaved rounds; the machine's limit (the roofline below: the workload's matmul
FLOPs at the best matmul FLOP/s, read in every round beside the peers); and the decode step
time at batch 8 for several context lengths. --resident-only measures the executor's resident
memory under the workload alone.

The matmul roofline of a generation workload: the output tokens/s an engine would reach if
all its time went to the workload's linear layers at the machine's best matmul FLOP/s.

The workload's matmul FLOPs, per request of P prompt and O output tokens, greedy:

- the decoder's linear layers (q/k/v, output projection, gate/up, down) for every prompt token
  and every output token but the last (which is returned, never fed back): P + O - 1 tokens;
- the output layer (hidden x vocabulary) only where logits are needed: the last prompt token
  (it gives the first output token) and the O - 1 fed-back output tokens: O rows.

Each weight element is one multiply and one add per token (2 FLOPs). Attention's own products
(scores and the weighted sum over the context), norms, rotary and sampling are not counted:
they are the engine's overhead against this bound, not part of it. Biases are not counted
either (one add per output element).

The older figure, FLOP/s / (2 x parameters), counts one forward of every parameter per output
token and none for the prompt: for 128 prompt and 128 output tokens on SmolLM2 it is about
1.8x this bound, so no engine can reach it (`output_tokens_only_tokens_per_s` keeps it).

`kvgate bench load --compare-hf` runs the same requests offline through `transformers`
(compare_hf), for a ratio against the served run. Two peers, both greedy with exact output
lengths, run in the bench's process after the served run has finished: `generate` one request
at a time (a sample of the requests, as a rate), and `generate_batch` (transformers' continuous
batching) over all of them. Requests are grouped by output length, since generate_batch takes
one max_new_tokens; with
--range-ratio 0 that is one batch.
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
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, GenerationConfig, LlamaConfig, LlamaForCausalLM
from transformers.generation import ContinuousBatchingConfig

from bench.harness import (
    Benchmark,
    add_device,
    add_model,
    add_repeats,
    add_threads,
    add_workload,
    load_average,
    matmul_flops_per_s,
    model_path,
    scratch_folder,
    sync_device,
)
from common.model_files import gguf_file
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
        path = model_path(args.model)
        yield path, load_hf_model(path).to(dtype)
        return
    model = build_model(BENCH_SHAPE, torch.float32).to(dtype)
    with scratch_folder() as folder:
        save_model(model, folder)
        yield str(folder), model


def count_parameters(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def hf_generate_tokens_per_s(model, prompts: list[list[int]], output_len: int) -> float:
    """`transformers` generate, one request at a time (a sample of the workload)."""
    config = _greedy_config(output_len)
    device = model.device
    start = time.perf_counter()
    for prompt in prompts:
        ids = torch.tensor([prompt], device=device)
        model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config)
    sync_device(str(device))
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
    sync_device(engine.config.device)
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
        sync_device(engine.config.device)
        start = clock()
        engine.step()
        sync_device(engine.config.device)
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
        "from bench.engine import Engine, Workload, _engine_config, kvgate_tokens_per_s\n"
        "args = argparse.Namespace(**json.loads(sys.argv[2]))\n"
        "workload = Workload(args.num_requests, args.prompt_len, args.output_len)\n"
        "engine = Engine(_engine_config(sys.argv[1], args))\n"
        "kvgate_tokens_per_s(engine, workload.prompts(engine.model_config.vocab_size),\n"
        "                    workload.output_len)\n"
        "from bench.harness import rss\n"
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


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of `kvgate bench engine throughput`."""
    add_model(
        parser, "", "checkpoint folder, GGUF file or smollm2 (default: a seeded random Llama)"
    )
    add_device(parser)
    add_workload(parser)
    parser.add_argument("--hf-sample", type=int, default=2,
                        help="requests measured for one-at-a-time generate (a rate)")  # fmt: skip
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--kv-cache-gib", type=float, default=2.0)
    parser.add_argument("--contexts", type=int, nargs="+", default=[64, 256, 1024, 2048])
    add_repeats(parser, 3)
    add_threads(parser)
    parser.add_argument("--resident-only", action="store_true",
                        help="only the executor's resident memory under the workload (CPU), "
                             "in a fresh process")  # fmt: skip


def run_throughput(args: argparse.Namespace) -> dict:
    """`kvgate bench engine throughput`, or its --resident-only part."""
    if not args.resident_only:
        return run(args)
    with benchmark_model(args, torch.float32) as (engine_model, _):
        resident = resident_under_workload(engine_model, args)
    workload = Workload(args.num_requests, args.prompt_len, args.output_len)
    return {
        "model": args.model or "random",
        "workload": vars(workload),
        "kv_cache_gib": args.kv_cache_gib,
        "load_average_at_end": load_average(),
        "kvgate_resident_bytes": resident,
    }


def summarize_throughput(result: dict) -> None:
    if "kvgate_tokens_per_s" in result:
        print_summary(result)
        return
    resident = result["kvgate_resident_bytes"]
    print(f"resident {resident['VmRSS'] / 2**20:.0f} MiB, peak {resident['VmHWM'] / 2**20:.0f} MiB")


def decoder_linear_parameters(config) -> int:
    """Weight elements of every decoder layer's linear layers, summed over the layers.

    `config`: a transformers Llama-family config (hidden_size, intermediate_size,
    num_hidden_layers, num_attention_heads, num_key_value_heads, optional head_dim).
    """
    hidden = config.hidden_size
    head_dim = getattr(config, "head_dim", None) or hidden // config.num_attention_heads
    q_width = config.num_attention_heads * head_dim
    kv_width = config.num_key_value_heads * head_dim
    attention = hidden * (q_width + 2 * kv_width) + q_width * hidden
    mlp = 3 * hidden * config.intermediate_size
    return config.num_hidden_layers * (attention + mlp)


def workload_matmul_flops(config, num_requests: int, prompt_len: int, output_len: int) -> int:
    """Matmul FLOPs of `num_requests` greedy requests of `prompt_len` + `output_len` tokens."""
    if prompt_len < 1 or output_len < 1:
        raise ValueError(f"prompt_len and output_len must be >= 1, got {prompt_len}, {output_len}")
    decoder_tokens = prompt_len + output_len - 1
    head = config.hidden_size * config.vocab_size
    per_request = decoder_linear_parameters(config) * decoder_tokens + head * output_len
    return 2 * num_requests * per_request


def roofline_tokens_per_s(flops_per_s: float, config, workload) -> float:
    """Output tokens/s of `workload` (num_requests, prompt_len, output_len) if its matmuls ran
    at `flops_per_s` and nothing else took time."""
    flops = workload_matmul_flops(
        config, workload.num_requests, workload.prompt_len, workload.output_len
    )
    return flops_per_s * workload.num_requests * workload.output_len / flops


def output_tokens_only_tokens_per_s(flops_per_s: float, num_parameters: int) -> float:
    """FLOP/s / (2 x parameters): one forward of every parameter per output token, the prompt
    free. Not a bound of the workload (see the module); kept to compare with older runs."""
    return flops_per_s / (2 * num_parameters)


def one_at_a_time_tokens_per_s(model, prompts: list[list[int]], output_lens: list[int]) -> float:
    """Output tokens/s of `generate` called once per request, in order."""
    seconds = sum(
        output_len / hf_generate_tokens_per_s(model, [prompt], output_len)
        for prompt, output_len in zip(prompts, output_lens, strict=True)
    )
    return sum(output_lens) / seconds


def batch_tokens_per_s(model, prompts: list[list[int]], output_lens: list[int]) -> float:
    """Output tokens/s of `generate_batch`, one call per distinct output length."""
    groups: dict[int, list[list[int]]] = defaultdict(list)
    for prompt, output_len in zip(prompts, output_lens, strict=True):
        groups[output_len].append(prompt)
    seconds = sum(
        len(group) * output_len / hf_generate_batch_tokens_per_s(model, group, output_len)
        for output_len, group in groups.items()
    )
    return sum(output_lens) / seconds


def compare_hf(
    model_dir: Path,
    prompts: list[list[int]],
    output_lens: list[int],
    kvgate_tokens_per_s: float,
    sample: int,
) -> dict[str, float | int | str]:
    """Runs the peers and returns their throughputs and kvgate's ratios to them.

    Args:
        model_dir: the served model's folder or GGUF file.
        prompts: the run's prompts as token ids, as the gateway tokenized them.
        output_lens: each request's output tokens.
        kvgate_tokens_per_s: the served run's output token throughput.
        sample: how many requests `generate` runs one at a time.

    Returns:
        The peers' output tokens/s, the ratios, the device and the sample size.
    """
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = load_hf_model(model_dir).to(device)
    with torch.inference_mode():
        one = one_at_a_time_tokens_per_s(model, prompts[:sample], output_lens[:sample])
        batch = batch_tokens_per_s(model, prompts, output_lens)
    return {
        "device": device,
        "generate_sample_requests": len(prompts[:sample]),
        "generate_batch_requests": len(prompts),
        "hf_generate_tokens_per_s": one,
        "hf_generate_batch_tokens_per_s": batch,
        "kvgate_over_hf_generate": kvgate_tokens_per_s / one,
        "kvgate_over_hf_generate_batch": kvgate_tokens_per_s / batch,
    }


def print_comparison(comparison: dict) -> None:
    print(
        f"transformers on {comparison['device']}: generate one at a time on a sample of "
        f"{comparison['generate_sample_requests']} requests, generate_batch on "
        f"{comparison['generate_batch_requests']} (small samples: a rate, not a full run)"
    )
    print(f"  generate        {comparison['hf_generate_tokens_per_s']:10.1f} output tokens/s")
    print(f"  generate_batch  {comparison['hf_generate_batch_tokens_per_s']:10.1f} output tokens/s")
    print(f"  kvgate / generate        {comparison['kvgate_over_hf_generate']:.2f}x")
    print(f"  kvgate / generate_batch  {comparison['kvgate_over_hf_generate_batch']:.2f}x")


BENCHMARKS = {
    "engine throughput": Benchmark(
        add_arguments, run_throughput, "engine.json", summarize_throughput
    )
}
