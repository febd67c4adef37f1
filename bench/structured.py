"""`kvgate bench serve structured`: what a JSON schema costs, on one stack and one Engine, in
one run.

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
import statistics
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import torch

from bench.harness import (
    BenchFailure,
    Benchmark,
    add_model,
    add_stream_rounds,
    add_ttft_turns,
    cpu_features,
    load_average,
    scratch_folder,
)
from bench.stats import paired_median_ms
from common.constraints import Constraint, ConstraintKind
from common.model_files import default_gguf_path
from common.model_text import ModelText
from common.sampling_params import SamplingParams
from deploy.models import SHARED_MODEL
from deploy.stack import Stack, StackConfig, co_located_torch_threads, free_port
from engine.config import EngineConfig
from engine.engine import Engine
from protos.kvgate.v1 import inference_pb2, inference_pb2_grpc

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
    if schema is None:
        return inference_pb2.SamplingParams(
            max_tokens=max_tokens, temperature=1.0, seed=seed, ignore_eos=True
        )
    return inference_pb2.SamplingParams(
        max_tokens=max_tokens, temperature=1.0, seed=seed, json_schema=json.dumps(schema)
    )


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


def rates(tokens: int, wall_s: float, cpu_s: float) -> dict:
    return {"tokens_per_s": tokens / wall_s, "tokens_per_cpu_s": tokens / cpu_s}


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
    """All streams added at once to the Engine, stepped until done: tokens per second of wall
    time and per CPU second of this process (its grammar threads included), and the ends."""
    start, start_cpu = time.perf_counter(), time.process_time()
    for seed in range(streams):
        engine.add_request(f"r{seed}", prompt, engine_params(output_len, seed, schema))
    tokens = dict.fromkeys(range(streams), 0)
    reasons: dict[int, str] = {}
    while engine.has_unfinished():
        for output in engine.step():
            index = int(output.request_id[1:])
            tokens[index] += len(output.new_token_ids)
            if output.finish_reason is not None:
                reasons[index] = f"FINISH_REASON_{output.finish_reason.name}"
    wall_s, cpu_s = time.perf_counter() - start, time.process_time() - start_cpu
    ends = [(tokens[i], reasons.get(i, "")) for i in range(streams)]
    return rates(sum(tokens.values()), wall_s, cpu_s) | {"ends": ends}


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


def ttft_once(stub: inference_pb2_grpc.InferenceStub, params: inference_pb2.SamplingParams):
    """TTFT in ms of one Generate, as its client sees it (then read to its end)."""
    request = inference_pb2.GenerateRequest(prompt=PROMPT, params=params)
    start = time.perf_counter()
    chunks = stub.Generate(request, timeout=600)
    next(c for c in chunks if c.token_ids)
    ttft = 1000 * (time.perf_counter() - start)
    list(chunks)
    return ttft


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
                samples[side].append(ttft_once(stub, kvgate_params(TTFT_MAX_TOKENS, turn, schema)))
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
        "median": statistics.median(schema) / statistics.median(free),
        "best": max(schema) / max(free),
        "by_round": [s / f for s, f in zip(schema, free, strict=True)],
    }


def ttft_report(samples: dict[str, list[float]]) -> dict:
    p50 = {side: statistics.median(values) for side, values in samples.items()}
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


def resolve_model(name: str) -> str:
    path = default_gguf_path() if name == "smollm2" else Path(name)
    if not path.exists():
        raise BenchFailure(f"--model {name}: {path} does not exist")
    return str(path)


def run(args: argparse.Namespace) -> dict:
    for flag in ("streams", "output_len", "repeats", "ttft_requests"):
        if getattr(args, flag) < 1:
            raise BenchFailure(f"--{flag.replace('_', '-')} must be at least 1")
    model = resolve_model(args.model)
    schema = rows_schema(args.output_len)
    load_at_start = load_average()
    with scratch_folder() as folder:
        samples = measure_stack(model, folder, args, schema)
    samples["engine"] = measure_engine(model, args, schema)
    return {
        "model": Path(model).name,
        "streams": args.streams,
        "output_len": args.output_len,
        "repeats": args.repeats,
        "schema": schema,
        "cpu": cpu_features(),
        "load_average_at_start": load_at_start,  # 1, 5 and 15 minutes: other work running
        "load_average_at_end": load_average(),
        "schema_over_unconstrained": {
            where: {rate: ratios(rounds) for rate, rounds in samples[where]["rounds"].items()}
            for where in ("stack", "engine")
        },
        **ttft_report(samples["ttft_samples_ms"]),
        **samples,
    }


def rate_line(what: str, rounds: dict[str, list[float]], ratio: dict) -> str:
    schema, free = (statistics.median(rounds[side]) for side in ("schema", "unconstrained"))
    return (f"  {what:<23} schema {schema:9.1f}, unconstrained {free:9.1f}: "
            f"{ratio['median']:.2f}x median, {ratio['best']:.2f}x best (>= 0.85)")  # fmt: skip


def summarize(result: dict) -> None:
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


def failure(result: dict) -> str | None:
    """Streams that ended before --output-len tokens leave the two sides' work unequal."""
    for where in ("stack", "engine"):
        for side, ends in result[where]["short_ends"].items():
            if ends:
                return f"{where} {side}: {len(ends)} streams ended early, e.g. {ends[0]}"
    return None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model(parser, str(SHARED_MODEL), "checkpoint folder, GGUF file or smollm2 "
              "(default: stories260K)")  # fmt: skip
    add_stream_rounds(parser, output_len=64, repeats=3)
    parser.add_argument("--kv-cache-gib", type=float, default=1.0, help="the Engine's KV cache")
    add_ttft_turns(parser, 30, "kind of request")


BENCHMARKS = {
    "serve structured": Benchmark(add_arguments, run, "structured.json", summarize, failure)
}
