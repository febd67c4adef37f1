"""Past one device: more chat sessions than its KV cache holds (`kvgate bench scaling swap`),
two tensor-parallel ranks against one (`kvgate bench scaling tp`), and more executors as the
load grows (`kvgate bench scaling executors`).

The KV host tier on chat sessions that overflow the device: with it against without it,
in one process, in the same run.

Twice as many sessions as the device KV cache holds take turns: every session's turn 1, then
every session's turn 2 (turn 1 with its reply, then a new user message). Without a host tier
the sessions evicted under pressure are dropped and their turn 2 prefills the whole history;
with one (`--swap-space-gib`) they were moved to host memory, and turn 2 copies them back
and prefills only the new message. Both engines run the same turns, interleaved turn by turn
so that other work on the machine falls on both alike. Reports per engine the turn-2 prefill
tokens (prompt minus cached) and time to first token, and checks the replies are the same.

Tensor parallelism: two ranks against one, same run, float32 and bfloat16.

Prints, per dtype: the fraction of greedy tokens two ranks give equal to one rank's (16
prompts, 64 new tokens each, run concurrently; counted up to each prompt's first difference:
in bfloat16 the ranks' partial sums are rounded before they are added, so a near-tie may
flip), and output tokens/s of each with their ratio. The CPU default model is stories260K;
on CUDA a random model shaped like Llama-3.2-1B (32 query and 8 key/value heads), with eager
decode steps (--enforce-eager: CUDA graphs are not captured across ranks). With fewer than
two CUDA devices it says so and exits 2.

The executors' autoscaler (deploy/scaler_sim.py, KEDA's and the HPA's periods multiplied by
--time-scale) on a local stack, under Generate requests arriving at a rate that ramps up,
holds, and ramps down to nothing. The JSON and the plot (scaler.png beside --out) hold
replicas, the signal, the queue and TTFT p90 over time, and what became of every request
sent: finished whole, or failed with its status. It exits 1 when a request did not finish
whole or the fleet was not back at its minimum within --settle-s.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np
import torch

from bench.engine import Workload
from bench.harness import BenchFailure, Benchmark, add_model, print_json, scratch_folder
from bench.kernels import build_cuda_model
from bench.load import run_jobs
from bench.stats import RequestResult, scaling_timeline
from bench.workloads import GenerateJob
from common.model_files import default_gguf_path
from common.sampling_params import SamplingParams
from deploy.models import choose_model
from deploy.scaler_sim import Fleet, Sample, local_fleet, play
from deploy.scaling import ScalingRule
from engine.config import EngineConfig
from engine.engine import Engine

ENGINES = ("host_tier", "no_host_tier")


def session_prompts(num_sessions: int, prompt_len: int, vocab_size: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(0)
    return torch.randint(3, vocab_size, (num_sessions, prompt_len), generator=gen).tolist()


def run_turn(engine: Engine, request_id: str, session_id: str, prompt: list[int], max_tokens: int):
    """One turn alone: (reply tokens, prefill tokens, seconds to the first token)."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    engine.add_request(request_id, prompt, params, session_id=session_id)
    reply, ttft_s, cached = [], None, 0
    while engine.has_unfinished():
        for out in engine.step():
            if ttft_s is None:
                ttft_s, cached = time.perf_counter() - start, out.num_cached_tokens
            reply.extend(out.new_token_ids)
    return reply, len(prompt) - cached, ttft_s


def build_engines(args: argparse.Namespace, model: str) -> dict[str, Engine]:
    common = dict(
        model=model,
        block_size=args.block_size,
        num_gpu_blocks=args.device_sessions * args.blocks_per_session,
        max_num_seqs=4,
    )
    return {
        "host_tier": Engine(EngineConfig(**common, swap_space_gib=args.swap_space_gib)),
        "no_host_tier": Engine(EngineConfig(**common)),
    }


def run(args: argparse.Namespace) -> dict:
    model = str(default_gguf_path()) if args.model == "smollm2" else args.model
    engines = build_engines(args, model)
    num_sessions = 2 * args.device_sessions
    vocab = engines["host_tier"].model_config.vocab_size
    turn1 = session_prompts(num_sessions, args.prompt_len, vocab)
    news = session_prompts(num_sessions, args.new_len, vocab)
    replies = {name: [] for name in ENGINES}
    for i, prompt in enumerate(turn1):  # every turn 1: the later half evicts the earlier
        for name in ENGINES:
            reply, _, _ = run_turn(engines[name], f"s{i}-1", f"s{i}", prompt, args.reply_len)
            replies[name].append(reply)
        print(f"session {i}: turn 1 done", file=sys.stderr, flush=True)
    if replies["host_tier"] != replies["no_host_tier"]:
        raise SystemExit("turn 1 replies differ between the engines")
    turn2 = {name: [] for name in ENGINES}
    for i in range(num_sessions):
        prompt = turn1[i] + replies["host_tier"][i] + news[i]
        for name in ENGINES:
            turn2[name].append(run_turn(engines[name], f"s{i}-2", f"s{i}", prompt, args.reply_len))
        print(f"session {i}: turn 2 done", file=sys.stderr, flush=True)
    same = turn2["host_tier"] and all(
        a[0] == b[0] for a, b in zip(turn2["host_tier"], turn2["no_host_tier"], strict=True)
    )
    return summarize(args, model, engines, turn2, same)


def summarize(args, model: str, engines: dict[str, Engine], turn2: dict, same: bool) -> dict:
    result = {
        "model": model,
        "sessions": 2 * args.device_sessions,
        "sessions_the_device_holds": args.device_sessions,
        "device_blocks": args.device_sessions * args.blocks_per_session,
        "block_size": args.block_size,
        "turn1_prompt_tokens": args.prompt_len,
        "reply_tokens": args.reply_len,
        "turn2_new_tokens": args.new_len,
        "swap_space_gib": args.swap_space_gib,
        "torch_threads": torch.get_num_threads(),
        "load_average_1m_at_end": os.getloadavg()[0],
        "turn2_replies_identical": bool(same),
    }
    for name, turns in turn2.items():
        stats = engines[name].stats()
        result[name] = {
            "turn2_prefill_tokens": sum(t[1] for t in turns),
            "turn2_ttft_s_median": statistics.median(t[2] for t in turns),
            "turn2_ttft_s_mean": statistics.fmean(t[2] for t in turns),
            "swapped_out_blocks": stats.num_swapped_out_blocks,
            "swapped_in_blocks": stats.num_swapped_in_blocks,
            "offloaded_sessions": stats.num_offloaded_sessions,
            "dropped_sessions": stats.num_evicted_sessions,
        }
    with_tier, without = result["host_tier"], result["no_host_tier"]
    result["prefill_tokens_ratio"] = (
        with_tier["turn2_prefill_tokens"] / without["turn2_prefill_tokens"]
    )
    result["ttft_median_ratio"] = with_tier["turn2_ttft_s_median"] / without["turn2_ttft_s_median"]
    return result


def add_swap_arguments(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add_model(parser, "smollm2", "checkpoint folder, GGUF file or smollm2")
    add("--device-sessions", type=int, default=8, help="sessions the device KV cache holds")
    add("--prompt-len", type=int, default=256, help="turn 1 prompt tokens")
    add("--reply-len", type=int, default=32, help="reply tokens of each turn")
    add("--new-len", type=int, default=32, help="turn 2's new message tokens")
    add("--block-size", type=int, default=16)
    add("--swap-space-gib", type=float, default=1.0)


def run_swap(args: argparse.Namespace) -> dict:
    """`kvgate bench scaling swap`."""
    turn2_len = args.prompt_len + 2 * args.reply_len + args.new_len
    args.blocks_per_session = -(-turn2_len // args.block_size)
    return run(args)


NUM_PROMPTS, OUTPUT_LEN = 16, 64
CPU_MODEL = Path(__file__).resolve().parents[2] / "shared" / "models" / "stories260K"


def greedy_run(config: EngineConfig, prompts: list[list[int]]) -> dict:
    """Greedy tokens per prompt and output tokens/s of one engine (closed after)."""
    engine = Engine(config)
    try:
        params = SamplingParams(max_tokens=OUTPUT_LEN, temperature=0.0, ignore_eos=True)
        engine.add_request("warm-up", prompts[0], SamplingParams(max_tokens=4, temperature=0.0))
        while engine.has_unfinished():
            engine.step()
        tokens: dict[str, list[int]] = {}
        start = time.perf_counter()
        for i, prompt in enumerate(prompts):
            engine.add_request(str(i), prompt, params)
        while engine.has_unfinished():
            for out in engine.step():
                tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
        if config.device != "cpu":
            torch.cuda.synchronize()
        seconds = time.perf_counter() - start
    finally:
        engine.close()
        del engine
        if config.device != "cpu":
            torch.cuda.empty_cache()
    return {"tokens": tokens, "tokens_per_s": sum(map(len, tokens.values())) / seconds}


def equal_fraction(one: dict[str, list[int]], two: dict[str, list[int]]) -> float:
    """Tokens equal position by position up to each prompt's first difference."""
    equal = 0
    for rid, ours in one.items():
        for a, b in zip(ours, two[rid], strict=True):
            if a != b:
                break
            equal += 1
    return equal / sum(map(len, one.values()))


def measure(model: Path, device: str, vocab_size: int, prompt_len: int) -> dict:
    workload = Workload(num_requests=NUM_PROMPTS, prompt_len=prompt_len)
    prompts = workload.prompts(vocab_size)
    result: dict = {"model": str(model), "device": device}
    for dtype in ("float32", "bfloat16"):
        runs = []
        for tp in (1, 2):
            config = EngineConfig(model=str(model), device=device, dtype=dtype, num_gpu_blocks=2048,
                                  enforce_eager=True, tensor_parallel_size=tp)  # fmt: skip
            runs.append(greedy_run(config, prompts))
        result[dtype] = {
            "equal_token_fraction": equal_fraction(runs[0]["tokens"], runs[1]["tokens"]),
            "tokens_per_s_tp1": runs[0]["tokens_per_s"],
            "tokens_per_s_tp2": runs[1]["tokens_per_s"],
        }
    return result


def print_table(result: dict) -> None:
    print(f"{'tensor parallel, ' + result['device']:<28}{'equal':>8}{'tp1 tok/s':>12}"
          f"{'tp2 tok/s':>12}{'ratio':>8}")  # fmt: skip
    for dtype in ("float32", "bfloat16"):
        r = result[dtype]
        one, two = r["tokens_per_s_tp1"], r["tokens_per_s_tp2"]
        print(f"{dtype:<28}{r['equal_token_fraction']:>8.3f}{one:>12.1f}{two:>12.1f}"
              f"{two / one:>8.2f}")  # fmt: skip


def add_tp_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    add_model(parser, None, "CPU: a checkpoint folder (default: stories260K)")


def run_tp(args: argparse.Namespace) -> dict:
    """`kvgate bench scaling tp`. Raises: BenchFailure on CUDA with fewer than two devices."""
    if args.device == "cpu":
        model = Path(args.model) if args.model else CPU_MODEL
        vocab = json.loads((model / "config.json").read_text())["vocab_size"]
        return measure(model, "cpu", vocab, prompt_len=32)
    count = torch.cuda.device_count()
    if count < 2:
        raise BenchFailure(f"{count} CUDA device(s): two ranks need two")
    with scratch_folder() as folder:
        built = build_cuda_model()
        built.save_pretrained(folder)
        vocab = built.config.vocab_size
        del built
        torch.cuda.empty_cache()
        result = measure(folder, "cuda", vocab, prompt_len=128)
    return result | {"device": f"cuda, {count} x {torch.cuda.get_device_name()}"}


# The executors' autoscaler under a ramp of load (`kvgate bench scaling executors`).
PROMPTS = ["Once upon a time", "The cat", "A big red ball", "Tom had a toy", "The sun was"]
# Width of the windows TTFT p90 is computed over, in seconds.
TTFT_WINDOW_S = 10.0


def ramp_arrivals_s(duration_s: float, peak_rate: float) -> list[float]:
    """Arrival times under a rate that ramps from 0 to peak_rate over the first third of
    duration_s, holds it for the second, and falls back to 0 over the last: request k
    arrives when the integral of the rate reaches k + 1/2."""
    third = duration_s / 3.0
    times = np.linspace(0.0, duration_s, int(duration_s * 100) + 1)
    rate = np.interp(times, [0.0, third, 2 * third, duration_s], [0.0, peak_rate, peak_rate, 0.0])
    arrived = np.concatenate([[0.0], np.cumsum((rate[1:] + rate[:-1]) / 2 * np.diff(times))])
    count = int(arrived[-1])
    return np.interp(np.arange(count) + 0.5, arrived, times).tolist()


@dataclass(slots=True)
class PlayConfig:
    """How the playback runs."""

    model: str
    duration_s: float  # of the load ramp
    peak_rate: float  # requests per second at the ramp's top
    output_len: int  # tokens per request
    time_scale: float  # KEDA's and the HPA's periods are multiplied by this
    max_replicas: int  # the manifest's, or fewer on a small machine
    settle_s: float  # most time after the load for the scale-in to reach the minimum


def run_executors(config: PlayConfig, rule: ScalingRule, fleet: Fleet) -> dict:
    """The load on a thread, the autoscaler on this one, until the load is done and the fleet
    is back at its minimum (or config.settle_s after the load)."""
    arrivals = ramp_arrivals_s(config.duration_s, config.peak_rate)
    jobs = [GenerateJob(f"{PROMPTS[i % len(PROMPTS)]} {i}", config.output_len)
            for i in range(len(arrivals))]  # fmt: skip
    gaps = np.diff([0.0, *arrivals]).tolist()
    outcome: list[list[RequestResult]] = []
    address = fleet.stack.address
    load = threading.Thread(
        target=lambda: outcome.append(run_jobs(address, jobs, gaps, progress=False)[0])
    )
    load.start()
    give_up_s = config.duration_s + config.settle_s
    samples, settled = play(fleet, rule, config.time_scale, lambda: not load.is_alive(), give_up_s)
    load.join()
    result = report(config, rule, samples, arrivals, outcome[0], fleet.exits)
    result["settled"] = settled
    return result


def report(
    config: PlayConfig,
    rule: ScalingRule,
    samples: list[Sample],
    arrivals_s: list[float],
    results: list[RequestResult],
    exits: dict[str, int],
) -> dict:
    """What the run shows: the timeline, TTFT p90 by arrival window, and what became of every
    request (finished whole, failed, or lost: sent but never answered)."""
    whole = [r for r in results if r.ok and r.output_tokens == config.output_len]
    errors: dict[str, int] = {}
    for result in results:
        if result not in whole:
            key = result.error or f"{result.output_tokens} of {config.output_len} tokens"
            errors[key] = errors.get(key, 0) + 1
    windows = []
    edges = np.arange(0.0, config.duration_s + TTFT_WINDOW_S, TTFT_WINDOW_S)
    for start in edges[:-1]:
        ttfts = [r.ttft_s for r, t in zip(results, arrivals_s, strict=True)
                 if start <= t < start + TTFT_WINDOW_S and r.ok]  # fmt: skip
        p90 = float(np.percentile(ttfts, 90)) * 1000.0 if ttfts else None
        windows.append({"t_s": float(start + TTFT_WINDOW_S / 2), "ttft_p90_ms": p90,
                        "requests": len(ttfts)})  # fmt: skip
    return {
        "config": asdict(config),
        "rule": asdict(rule),
        "samples": [asdict(s) for s in samples],
        "ttft_p90": windows,
        "requests": {
            "sent": len(arrivals_s),
            "finished": len(whole),
            "failed": sum(errors.values()),
            "errors": errors,
        },
        "drained_executors_exit_status": exits,
        "most_replicas": max(s.replicas for s in samples),
    }


def add_executors_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of `kvgate bench scaling executors` (--out: the CLI's; the PNG goes beside it)."""
    add_model(parser, "", "model folder (default: make run's)")
    parser.add_argument("--duration-s", type=float, default=180.0, help="of the load ramp")
    parser.add_argument("--peak-rate", type=float, default=12.0, help="requests/s at the top")
    parser.add_argument("--output-len", type=int, default=192)
    parser.add_argument("--time-scale", type=float, default=0.1)
    parser.add_argument(
        "--max-replicas", type=int, default=ScalingRule.from_manifest().max_replicas
    )
    parser.add_argument("--settle-s", type=float, default=120.0)


def run_scaler(args: argparse.Namespace) -> dict:
    """`kvgate bench scaling executors`: plays the scaler, draws its PNG next to --out."""
    rule = ScalingRule.from_manifest()
    config = PlayConfig(
        model=args.model or str(choose_model()),
        duration_s=args.duration_s,
        peak_rate=args.peak_rate,
        output_len=args.output_len,
        time_scale=args.time_scale,
        max_replicas=min(args.max_replicas, rule.max_replicas),
        settle_s=args.settle_s,
    )
    rule = replace(rule, max_replicas=config.max_replicas)
    load_before = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    with (
        scratch_folder("kvgate-scaler-") as scratch,
        local_fleet(config.model, rule, scratch) as fleet,
    ):
        result = run_executors(config, rule, fleet)
    result["machine_load_at_start"] = load_before
    result["machine_load_at_end"] = subprocess.run(["uptime"], capture_output=True,
                                                   text=True).stdout.strip()  # fmt: skip
    result["png"] = str(scaling_timeline(result, args.out.with_suffix(".png")))
    return result


def summarize_executors(result: dict) -> None:
    requests = result["requests"]
    print(f"{requests['sent']} sent, {requests['finished']} finished whole, "
          f"{requests['failed']} failed; up to {result['most_replicas']} executors; "
          f"{result['png']}")  # fmt: skip


def executors_failure(result: dict) -> str | None:
    """A lost request, or a fleet not back at its minimum within --settle-s."""
    requests = result["requests"]
    if not result["settled"]:
        return (
            f"the fleet was not back at {result['rule']['min_replicas']} executor(s) within "
            "--settle-s after the load: the scale-in was cut short (raise --settle-s)"
        )
    if requests["finished"] != requests["sent"]:
        unfinished = requests["sent"] - requests["finished"]
        return f"{unfinished} of {requests['sent']} requests did not finish whole"
    return None


BENCHMARKS = {
    "scaling swap": Benchmark(add_swap_arguments, run_swap, "swap.json", print_json),
    "scaling tp": Benchmark(add_tp_arguments, run_tp, "tensor_parallel.json", print_table),
    "scaling executors": Benchmark(
        add_executors_arguments, run_scaler, "scaler.json", summarize_executors, executors_failure
    ),
}
