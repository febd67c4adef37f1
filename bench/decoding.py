"""Benchmarks of decoding features, each against the same work without it, in one run.

`kvgate bench engine choices`: one request of n choices against n separate requests of the
same prompt. The n choices of one request prefill the prompt once and share its KV blocks
(copy on write); n separate requests sent together each prefill it. Both are sampled at
temperature 1 with EOS ignored, so both produce n * output_len tokens; the figure is their
tokens/s ratio, with the KV blocks each held at its peak. With prefix caching (the engine's
default) the separate requests admitted a step after the first ones reuse their prompt
blocks, so the group saves less there than against `--no-prefix-caching`.

`kvgate bench engine spec`: decode tokens/s with and without speculative decoding (n-gram by
default; any --speculative-config, a draft model's too): one stream on a prompt the model
quotes back (as many paragraphs of the opening of Lewis Carroll's "Alice's Adventures in
Wonderland", 1865, public domain, bench/texts/, as fit --quote-tokens: about 1,000 tokens on
SmolLM2), one on a prompt it answers with new text, and `make bench-engine`'s random-token
workload at 1 and 64 streams. Two engines of one configuration but --speculative-config run
the same greedy requests in interleaved rounds; a one-stream round's rate counts the tokens
after the first one (the prompt's step is not decoding) over the time they took, a batch's
all its output tokens over its whole run. Both must produce the same tokens (else the
command fails); the speculating engine's proposed and accepted counts give the acceptance.

`kvgate bench serve structured`: what a JSON schema costs, on one stack and one Engine.

    kvgate bench serve structured --model smollm2 --output-len 16 --repeats 1

Two figures, each against unconstrained requests measured beside it:
- **tokens/s**: `--streams` streams with a JSON schema against as many unconstrained ones
  (EOS ignored), in interleaved rounds, through the stack's kvgate.v1 API (what a client gets)
  and on an in-process Engine of the same model (the executor's own step, where the mask is
  computed, without the stack's share of the CPU), each per second of wall time and per CPU
  second (which other work on a shared machine inflates less). The schema (rows_schema) asks
  for at least `--output-len` objects, so no stream can end before `--output-len` tokens:
  both sides produce the same tokens, and the figure is schema / unconstrained (target
  >= 0.85).
- **TTFT** as a kvgate.v1 client sees it, the three kinds of request taking turns: no
  constraint, a schema the gateway and executor have compiled before (cached), and a schema
  new to both each time (first use: one compile in the gateway before queueing, one in the
  executor). Target: cached p50 at most unconstrained p50 + 5 ms; first use is reported
  beside it. The engine's figure would leave out the gateway's compile and cache lookup, so
  TTFT is taken through the stack only.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from statistics import median

import grpc
import torch

from bench import harness
from bench.engine import BENCH_SHAPE, Workload, benchmark_model, best_rates
from bench.stats import generate_ttft_ms, paired_median_ms
from common.constraints import Constraint, ConstraintKind
from common.model_text import ModelText
from common.sampling_params import SamplingParams
from deploy.models import SHARED_MODEL
from deploy.stack import Stack, StackConfig, co_located_torch_threads, free_port
from engine.config import EngineConfig
from engine.engine import Engine
from engine.host_memory import retain_freed_memory
from engine.speculative_config import SpeculativeConfig
from protos.kvgate.v1 import inference_pb2, inference_pb2_grpc

# ---- n choices against n requests ------------------------------------------------------


def _choices_params(args: argparse.Namespace, n: int) -> SamplingParams:
    return SamplingParams(max_tokens=args.output_len, ignore_eos=True, seed=args.seed, n=n)


def run_requests(engine: Engine, requests: list[tuple[list[int], SamplingParams]]) -> dict:
    """Add the requests at once and step until all finish: tokens per second of wall time and
    per second of this process's CPU time (which other work on a shared machine inflates
    less; grammar threads included), the peak blocks held, and each sequence's (tokens,
    finish reason)."""
    start, start_cpu = time.perf_counter(), time.process_time()
    for i, (prompt, params) in enumerate(requests):
        engine.add_request(f"bench-{i}", prompt, params)
    tokens: Counter[tuple[str, int]] = Counter()
    reasons: dict[tuple[str, int], str] = {}
    peak_blocks = 0
    while engine.has_unfinished():
        for output in engine.step():
            sequence = (output.request_id, output.index)
            tokens[sequence] += len(output.new_token_ids)
            if output.finish_reason is not None:
                reasons[sequence] = f"FINISH_REASON_{output.finish_reason.name}"
        stats = engine.stats()
        peak_blocks = max(peak_blocks, stats.num_total_blocks - stats.num_free_blocks)
    harness.sync_device(engine.config.device)
    wall_s, cpu_s = time.perf_counter() - start, time.process_time() - start_cpu
    produced = sum(tokens.values())
    return rates(produced, wall_s, cpu_s) | {
        "peak_blocks": peak_blocks,
        "ends": [(count, reasons.get(key, "")) for key, count in tokens.items()],
    }


def rates(tokens: int, wall_s: float, cpu_s: float) -> dict:
    return {"tokens_per_s": tokens / wall_s, "tokens_per_cpu_s": tokens / cpu_s}


def choices_run(args: argparse.Namespace) -> dict:
    if args.device == "cpu":
        retain_freed_memory()  # as every CPU Engine sets it: both peers measure alike
    dtype = torch.float32 if args.device == "cpu" else torch.bfloat16
    with benchmark_model(args, dtype) as (engine_model, model):
        vocab_size = model.config.vocab_size
        del model
        config = EngineConfig(
            model=engine_model, device=args.device, max_num_seqs=max(args.n, 8),
            max_num_batched_tokens=args.max_num_batched_tokens, kv_cache_gib=args.kv_cache_gib,
            enable_prefix_caching=not args.no_prefix_caching,
        )  # fmt: skip
        engine = Engine(config)
        prompt_round = iter(range(1_000_000))

        def prompt() -> list[int]:  # a new prompt every round: nothing cached between rounds
            return Workload(1, args.prompt_len, 1, seed=next(prompt_round)).prompts(vocab_size)[0]

        peaks: dict[str, int] = {}
        per_cpu_s: dict[str, list[float]] = {"group": [], "separate": []}

        def measure(name: str, requests) -> float:
            result = run_requests(engine, requests)
            peaks[name] = max(peaks.get(name, 0), result["peak_blocks"])
            per_cpu_s[name].append(result["tokens_per_cpu_s"])
            return result["tokens_per_s"]

        run_requests(engine, [(prompt(), _choices_params(args, args.n))])  # warm-up
        best, samples = best_rates(
            {
                "group": lambda: measure("group", [(prompt(), _choices_params(args, args.n))]),
                "separate": lambda: measure(
                    "separate", [(p, _choices_params(args, 1)) for p in [prompt()] * args.n]
                ),
            },
            args.repeats,
        )
    result = _choices_result(args, engine_model, best, samples, peaks, engine.config.block_size)
    return result | {
        "samples_tokens_per_cpu_s": per_cpu_s,
        "group_over_separate_cpu_median": median(per_cpu_s["group"])
        / median(per_cpu_s["separate"]),
    }


def _choices_result(
    args, model: str, best: dict, samples: dict, peaks: dict, block_size: int
) -> dict:
    return {
        "model": args.model
        or f"random llama {BENCH_SHAPE['hidden_size']}x{BENCH_SHAPE['num_hidden_layers']}",
        "device": args.device,
        "n": args.n,
        "prompt_len": args.prompt_len,
        "output_len": args.output_len,
        "repeats": args.repeats,
        "group_tokens_per_s": best["group"],
        "separate_tokens_per_s": best["separate"],
        "group_over_separate": best["group"] / best["separate"],
        "group_over_separate_median": median(samples["group"]) / median(samples["separate"]),
        "samples_tokens_per_s": samples,
        "prompt_blocks": -(-args.prompt_len // block_size),
        "peak_blocks": peaks,
        "loaded": model,
        "torch_threads": torch.get_num_threads(),
        "load_average": harness.load_average(),
    }


def choices_summarize(result: dict) -> None:
    n = result["n"]
    print(f"n={n}, {result['prompt_len']}-token prompt, {result['output_len']} tokens each")
    print(f"  one request, n={n}   {result['group_tokens_per_s']:10.1f} output tokens/s")
    print(f"  {n} separate requests {result['separate_tokens_per_s']:10.1f} output tokens/s")
    print(f"  ratio                {result['group_over_separate']:.2f}x best rounds, "
          f"{result['group_over_separate_median']:.2f}x median rounds, "
          f"{result['group_over_separate_cpu_median']:.2f}x per CPU second")  # fmt: skip
    peaks = result["peak_blocks"]
    print(f"  peak KV blocks: {peaks['group']} (group) vs {peaks['separate']} (separate); "
          f"the prompt takes {result['prompt_blocks']}")  # fmt: skip


def choices_add_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of `kvgate bench engine choices`."""
    harness.add_model(
        parser, "", "checkpoint folder, GGUF file or smollm2 (default: a seeded random Llama)"
    )
    harness.add_device(parser)
    harness.add_workload(parser, num_requests=1, prompt_len=1024, output_len=16)
    parser.add_argument("--n", type=int, default=4, help="choices of the one request")
    parser.add_argument("--seed", type=int, default=0, help="sampling seed of every request")
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--kv-cache-gib", type=float, default=1.0)
    parser.add_argument("--no-prefix-caching", action="store_true",
                        help="separate requests admitted a step apart then cannot reuse the "
                             "first ones' prompt blocks")  # fmt: skip
    harness.add_repeats(parser, 3)
    harness.add_threads(parser)


# ---- speculative decoding --------------------------------------------------------------

# Public domain (Lewis Carroll, 1865): the opening of Alice's Adventures in Wonderland.
TEXT = Path(__file__).parent / "texts" / "alice_chapter1.txt"
QUOTE_ASK = "\n\nThe same text, copied word for word:\n\n"
STORY = "Write a short story about a lighthouse keeper who finds a strange map.\n\n"
RANDOM_STREAMS = (1, 64)  # `make bench-engine`'s random-token workload: one stream, and 64
RANDOM_PROMPT_LEN = 128


def quote_prompt(text: ModelText, budget: int) -> list[int]:
    """The model copies text it was given (proposals from the prompt are accepted): as many
    paragraphs of TEXT as fit `budget` tokens with the ask and the copy's first words."""
    paragraphs = TEXT.read_text().split("\n\n")
    best: list[int] = []
    for count in range(1, len(paragraphs) + 1):
        passage = "\n\n".join(paragraphs[:count])
        tokens = text.encode(f"{passage}{QUOTE_ASK}{passage[:40]}")
        if len(tokens) > budget:
            break
        best = tokens
    return best


def decode_tokens(engine: Engine, prompt: list[int], params: SamplingParams) -> tuple:
    """(the tokens, decode tokens/s): the tokens after the first over the time they took."""
    engine.add_request("bench", prompt, params)
    tokens: list[int] = []
    start = 0.0
    while engine.has_unfinished():
        for out in engine.step():
            if not tokens:
                start = time.perf_counter()
            tokens += out.new_token_ids
    harness.sync_device(engine.config.device)
    return tokens, (len(tokens) - 1) / (time.perf_counter() - start)


def batch_tokens(engine: Engine, prompts: list[list[int]], params: SamplingParams) -> tuple:
    """(every request's tokens, output tokens/s of the whole batch from its first step)."""
    for i, prompt in enumerate(prompts):
        engine.add_request(f"bench-{i}", prompt, params)
    tokens: dict[str, list[int]] = {f"bench-{i}": [] for i in range(len(prompts))}
    start = time.perf_counter()
    while engine.has_unfinished():
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
    harness.sync_device(engine.config.device)
    outputs = list(tokens.values())
    return outputs, sum(map(len, outputs)) / (time.perf_counter() - start)


def spec_run(args: argparse.Namespace) -> dict:
    if args.device == "cpu":
        retain_freed_memory()  # as every CPU Engine sets it: both peers measure alike
    path = harness.model_path(args.model)
    spec = SpeculativeConfig.from_json(args.speculative_config)
    engines = {
        name: Engine(EngineConfig(model=path, device=args.device, speculative_config=config))
        for name, config in (("off", None), ("spec", spec))
    }
    text = ModelText(path)
    params = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    budget = min(args.quote_tokens, text.limits.max_model_len - args.output_len)
    prompts = {"quote": quote_prompt(text, budget), "story": text.encode(STORY)}
    workloads = {
        name: _spec_workload(engines, [prompt], params, args) for name, prompt in prompts.items()
    }
    for streams in RANDOM_STREAMS:
        random = Workload(streams, RANDOM_PROMPT_LEN, args.output_len, seed=streams)
        workloads[f"random_{streams}"] = _spec_workload(
            engines, random.prompts(text.limits.vocab_size), params, args
        )
    return {
        "model": args.model,
        "device": args.device,
        "speculative_config": args.speculative_config,
        "output_len": args.output_len,
        "repeats": args.repeats,
        "workloads": workloads,
        "torch_threads": torch.get_num_threads(),
        "load_average": harness.load_average(),
    }


def _spec_workload(engines: dict, prompts: list[list[int]], params: SamplingParams, args) -> dict:
    """Both engines take turns on `prompts`: one stream's decode tokens/s (from its first
    token), or a batch's output tokens/s."""
    outputs: dict[str, list] = {}
    before = engines["spec"].stats()

    def measure(name: str) -> float:
        if len(prompts) == 1:
            outputs[name], rate = decode_tokens(engines[name], prompts[0], params)
        else:
            outputs[name], rate = batch_tokens(engines[name], prompts, params)
        return rate

    best, samples = best_rates({name: lambda n=name: measure(n) for name in engines}, args.repeats)
    after = engines["spec"].stats()
    proposed = after.num_spec_proposed_tokens - before.num_spec_proposed_tokens
    accepted = after.num_spec_accepted_tokens - before.num_spec_accepted_tokens
    return {
        "streams": len(prompts),
        "prompt_tokens": len(prompts[0]),
        "off_tokens_per_s": best["off"],
        "spec_tokens_per_s": best["spec"],
        "speedup": best["spec"] / best["off"],
        "speedup_median": median(samples["spec"]) / median(samples["off"]),
        "samples_tokens_per_s": samples,
        "proposed_tokens": proposed,
        "accepted_tokens": accepted,
        "acceptance_rate": accepted / proposed if proposed else 0.0,
        "drafts": after.num_spec_drafts - before.num_spec_drafts,
        "same_tokens": outputs["off"] == outputs["spec"],
    }


def spec_summarize(result: dict) -> None:
    print(f"{result['model']}, greedy streams of {result['output_len']} tokens, spec: "
          f"{result['speculative_config']}")  # fmt: skip
    for name, w in result["workloads"].items():
        print(f"  {name:<9} ({w['streams']:2d} x {w['prompt_tokens']:4d}-token prompt) off "
              f"{w['off_tokens_per_s']:7.1f} tok/s, spec {w['spec_tokens_per_s']:7.1f} tok/s: "
              f"{w['speedup']:.2f}x best, {w['speedup_median']:.2f}x median; accepted "
              f"{w['accepted_tokens']}/{w['proposed_tokens']} "
              f"({w['acceptance_rate']:.0%}) in {w['drafts']} drafts")  # fmt: skip


def spec_failure(result: dict) -> str | None:
    differing = [name for name, w in result["workloads"].items() if not w["same_tokens"]]
    if differing:
        return f"speculation changed the greedy tokens of {', '.join(differing)}"
    return None


def spec_add_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of `kvgate bench engine spec`."""
    harness.add_model(parser, "smollm2", "checkpoint folder, GGUF file or smollm2")
    harness.add_device(parser)
    harness.add_output_len(parser, 64, "tokens of each stream")
    parser.add_argument(
        "--quote-tokens", type=int, default=1500,
        help="most prompt tokens of the quoting workload (paragraphs of bench/texts/ that fit)",
    )  # fmt: skip
    parser.add_argument(
        "--speculative-config",
        default='{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, '
        '"prompt_lookup_min": 2}',
        help="the speculating engine's --speculative-config",
    )
    harness.add_repeats(parser, 3)
    harness.add_threads(parser)


# ---- JSON schemas against unconstrained requests --------------------------------------

PROMPT = "Once upon a time"
TTFT_MAX_TOKENS = 4
TTFT_SIDES = ("unconstrained", "cached_schema", "first_use_schema")


def row_schema(tag: str | None = None) -> dict:
    """An object with a bounded string, an integer and an enum; `tag` adds a constant field,
    which makes a schema no cache has seen."""
    properties: dict = {
        "name": {"type": "string", "maxLength": 16},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "color": {"enum": ["red", "green", "blue"]},
    }
    if tag is not None:
        properties["tag"] = {"const": tag}
    return {
        "type": "object",
        "properties": properties,
        "required": list(properties),
        "additionalProperties": False,
    }


def rows_schema(min_items: int) -> dict:
    """A list of at least `min_items` rows: every row takes more than one token, so no
    output ends before `min_items` tokens."""
    return {"type": "array", "items": row_schema(), "minItems": min_items}


def kvgate_params(max_tokens: int, seed: int, schema: dict | None) -> inference_pb2.SamplingParams:
    """Sampled at temperature 1.0; unconstrained requests ignore EOS."""
    params = inference_pb2.SamplingParams(
        max_tokens=max_tokens, temperature=1.0, seed=seed, ignore_eos=schema is None
    )
    if schema is not None:
        params.json_schema = json.dumps(schema)
    return params


def engine_params(max_tokens: int, seed: int, schema: dict | None) -> SamplingParams:
    """kvgate_params' twin for the in-process Engine."""
    if schema is None:
        return SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=seed, ignore_eos=True)
    constraint = Constraint(ConstraintKind.JSON_SCHEMA, json.dumps(schema))
    return SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=seed, constraint=constraint)


def stream(stub: inference_pb2_grpc.InferenceStub, params: inference_pb2.SamplingParams) -> tuple:
    """(output tokens, finish reason, text) of one Generate read to its end."""
    request = inference_pb2.GenerateRequest(prompt=PROMPT, params=params)
    tokens, reason, text = 0, 0, ""
    for chunk in stub.Generate(request, timeout=3600):
        tokens += len(chunk.token_ids)
        reason = chunk.finish_reason or reason
        text += chunk.text
    return tokens, inference_pb2.FinishReason.Name(reason), text


def cpu_seconds(pids: list[int]) -> float:
    """User and system CPU seconds the processes have used (/proc/PID/stat)."""
    total_ticks = 0
    for pid in pids:
        fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
        total_ticks += int(fields[11]) + int(fields[12])  # utime and stime
    return total_ticks / os.sysconf("SC_CLK_TCK")


def stack_round(stack: Stack, streams: int, output_len: int, schema: dict | None) -> dict:
    """All streams at once through kvgate.v1: tokens per second of wall time and per CPU
    second of the stack's processes, how the streams ended, and the first stream's text."""
    pids = [process.pid for process in stack.procs.values()]
    with ThreadPoolExecutor(streams) as pool, grpc.insecure_channel(stack.address) as channel:
        stub = inference_pb2_grpc.InferenceStub(channel)
        start, start_cpu = time.perf_counter(), cpu_seconds(pids)
        done = list(pool.map(lambda s: stream(stub, kvgate_params(output_len, s, schema)),
                             range(streams)))  # fmt: skip
        wall_s, cpu_s = time.perf_counter() - start, cpu_seconds(pids) - start_cpu
    ends = [(tokens, reason) for tokens, reason, _ in done]
    return rates(sum(t for t, _ in ends), wall_s, cpu_s) | {"ends": ends, "text": done[0][2]}


def engine_round(engine: Engine, prompt: list[int], streams: int, output_len: int, schema) -> dict:
    """All streams added at once to the Engine, stepped until done (run_requests)."""
    return run_requests(engine, [(prompt, engine_params(output_len, seed, schema))
                                 for seed in range(streams)])  # fmt: skip


def interleaved_rounds(measure: Callable[[dict | None], dict], schema: dict, repeats: int):
    """`repeats` rounds of each side in turn, after one untimed round of each (compiles,
    first allocations): per side each round's tokens per wall and per CPU second, the ends that
    were not the full run (each stream must end with FINISH_REASON_LENGTH), and a text of the
    last round."""
    sides = {"unconstrained": None, "schema": schema}
    for side in sides.values():
        measure(side)
    rounds: dict[str, dict[str, list[float]]] = {
        rate: {name: [] for name in sides} for rate in ("tokens_per_s", "tokens_per_cpu_s")
    }
    short: dict[str, list] = {name: [] for name in sides}
    texts: dict[str, str] = {}
    for _ in range(repeats):
        for name, side in sides.items():
            result = measure(side)
            for rate, samples in rounds.items():
                samples[name].append(result[rate])
            short[name] += [end for end in result["ends"] if end[1] != "FINISH_REASON_LENGTH"]
            texts[name] = result.get("text", "")
    return {"rounds": rounds, "short_ends": short, "texts": texts}


def ttft_turns(address: str, requests: int, interval_s: float, first_tag: str) -> dict:
    """Each kind of request once per turn, `interval_s` apart; first-use schemas are tagged
    `first_tag` and the turn's index, new to every cache."""
    samples: dict[str, list[float]] = {side: [] for side in TTFT_SIDES}
    with grpc.insecure_channel(address) as channel:
        stub = inference_pb2_grpc.InferenceStub(channel)
        for turn in range(requests):
            schemas = {"unconstrained": None, "cached_schema": row_schema(),
                       "first_use_schema": row_schema(f"{first_tag}{turn}")}  # fmt: skip
            for side, schema in schemas.items():
                time.sleep(interval_s)
                params = kvgate_params(TTFT_MAX_TOKENS, turn, schema)
                request = inference_pb2.GenerateRequest(prompt=PROMPT, params=params)
                samples[side].append(generate_ttft_ms(stub, request))
    return samples


def stack_config(model: str, folder: Path, streams: int) -> StackConfig:
    config = StackConfig(model=model, port=free_port(), log_dir=folder / "logs")
    config.executor_flags = ["--max-num-seqs", str(max(64, streams))]
    config.gateway_flags = ["--max-queue-len", str(4 * streams)]
    return config


def measure_stack(model: str, folder: Path, args: argparse.Namespace, schema: dict) -> dict:
    stack = Stack(stack_config(model, folder, args.streams))
    try:
        stack.start_all()
        ttft_turns(stack.address, 2, 0.0, "warm-up")  # untimed: compiles the cached schema
        ttft = ttft_turns(stack.address, args.ttft_requests, args.ttft_interval_s, "first-use")
        rounds = interleaved_rounds(
            lambda side: stack_round(stack, args.streams, args.output_len, side),
            schema,
            args.repeats,
        )
    finally:
        stack.stop_all()
    return {"ttft_samples_ms": ttft, "stack": rounds}


def measure_engine(model: str, args: argparse.Namespace, schema: dict) -> dict:
    """The Engine gets the model threads the stack's executor gets."""
    torch.set_num_threads(co_located_torch_threads())
    config = EngineConfig(model=model, max_num_seqs=args.streams, kv_cache_gib=args.kv_cache_gib)
    engine = Engine(config)
    prompt = ModelText(model).encode(PROMPT)
    rounds = interleaved_rounds(
        lambda side: engine_round(engine, prompt, args.streams, args.output_len, side),
        schema,
        args.repeats,
    )
    del rounds["texts"]  # token ids only
    return rounds


def ratios(rounds: dict[str, list[float]]) -> dict:
    """schema / unconstrained by the median rounds, by the best rounds and round by round."""
    schema, free = rounds["schema"], rounds["unconstrained"]
    return {
        "median": median(schema) / median(free),
        "best": max(schema) / max(free),
        "by_round": [s / f for s, f in zip(schema, free, strict=True)],
    }


def ttft_report(samples: dict[str, list[float]]) -> dict:
    p50 = {side: median(values) for side, values in samples.items()}
    return {
        "ttft_ms_p50": p50,
        "ttft_p50_ms_cached_minus_unconstrained": p50["cached_schema"] - p50["unconstrained"],
        "ttft_paired_ms_cached_minus_unconstrained": paired_median_ms(
            samples["cached_schema"], samples["unconstrained"]
        ),
        "ttft_p50_ms_first_use_minus_unconstrained": (
            p50["first_use_schema"] - p50["unconstrained"]
        ),
    }


def structured_run(args: argparse.Namespace) -> dict:
    harness.require_positive(args, "streams", "output_len", "repeats", "ttft_requests")
    model = harness.model_path(args.model)
    schema = rows_schema(args.output_len)
    load_at_start = harness.load_average()
    with harness.scratch_folder() as folder:
        samples = measure_stack(model, folder, args, schema)
    samples["engine"] = measure_engine(model, args, schema)
    return {
        "model": Path(model).name,
        "streams": args.streams,
        "output_len": args.output_len,
        "repeats": args.repeats,
        "schema": schema,
        "cpu": harness.cpu_features(),
        "load_average_at_start": load_at_start,  # 1, 5 and 15 minutes: other work running
        "load_average_at_end": harness.load_average(),
        "schema_over_unconstrained": {
            where: {rate: ratios(rounds) for rate, rounds in samples[where]["rounds"].items()}
            for where in ("stack", "engine")
        },
        **ttft_report(samples["ttft_samples_ms"]),
        **samples,
    }


def rate_line(what: str, rounds: dict[str, list[float]], ratio: dict) -> str:
    schema, free = (median(rounds[side]) for side in ("schema", "unconstrained"))
    return (f"  {what:<23} schema {schema:9.1f}, unconstrained {free:9.1f}: "
            f"{ratio['median']:.2f}x median, {ratio['best']:.2f}x best (>= 0.85)")  # fmt: skip


def structured_summarize(result: dict) -> None:
    print(f"{result['model']}: {result['streams']} streams x {result['output_len']} tokens, "
          f"{result['repeats']} rounds; load {result['load_average_at_end']}")  # fmt: skip
    for where, by_rate in result["schema_over_unconstrained"].items():
        for rate, ratio in by_rate.items():
            print(rate_line(f"{where} {rate}", result[where]["rounds"][rate], ratio))
    p50, paired = result["ttft_ms_p50"], result["ttft_paired_ms_cached_minus_unconstrained"]
    print(f"  TTFT p50 ms: unconstrained {p50['unconstrained']:.2f}, cached schema "
          f"{p50['cached_schema']:.2f} (paired {paired['median']:+.2f}, 95% "
          f"{paired['ci95_low']:+.2f} to {paired['ci95_high']:+.2f}; target <= +5), "
          f"first use {p50['first_use_schema']:.2f}")  # fmt: skip


def structured_failure(result: dict) -> str | None:
    """Streams that ended before --output-len tokens leave the two sides' work unequal."""
    for where in ("stack", "engine"):
        for side, ends in result[where]["short_ends"].items():
            if ends:
                return f"{where} {side}: {len(ends)} streams ended early, e.g. {ends[0]}"
    return None


def structured_add_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of `kvgate bench serve structured`."""
    harness.add_model(parser, str(SHARED_MODEL), "checkpoint folder, GGUF file or smollm2 "
                      "(default: stories260K)")  # fmt: skip
    harness.add_stream_rounds(parser, output_len=64, repeats=3)
    parser.add_argument("--kv-cache-gib", type=float, default=1.0, help="the Engine's KV cache")
    harness.add_ttft_turns(parser, 30, "kind of request")


BENCHMARKS = {
    "engine choices": harness.Benchmark(
        choices_add_arguments, choices_run, "choices.json", choices_summarize
    ),
    "engine spec": harness.Benchmark(
        spec_add_arguments, spec_run, "spec.json", spec_summarize, spec_failure
    ),
    "serve structured": harness.Benchmark(
        structured_add_arguments,
        structured_run,
        "structured.json",
        structured_summarize,
        structured_failure,
    ),  # fmt: skip
}
