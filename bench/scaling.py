"""Past one device: more chat sessions than its KV cache holds (`kvgate bench scaling swap`),
two tensor-parallel ranks against one (`kvgate bench scaling tp`), more executors as the load
grows (`kvgate bench scaling executors`), and chat sessions through a rolling restart of two
executors (`kvgate bench scaling restart`).

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

The rolling restart, with KV moves on a drain against without them, in the same run.

A local stack with two executors serves `--sessions` chat sessions taking greedy turns on a few
workers: each turn's prompt is the previous prompt, its reply and a short new user message, sent
with the session's id. Once every session has taken `--warmup-turns` turns, executor-0 gets
SIGTERM; once it has exited it starts again, and once it serves executor-1 goes the same way.
The sessions keep taking turns until each has taken `--turns-after` more after the restart.

Both stacks run this: "moving" (the executors' KvTransfer on: a drain pushes each running turn's
and each idle session's KV to the peer) and "recompute" (`--kv-transfer-port -1`: a drain waits
for its running turns and the sessions' KV is lost). Per turn the JSON holds its status, prompt
and cached prompt tokens, and the session's executor after it (its SessionState in Redis). A
session's first turn after its executor changed is a turn after a move; its history is the
previous turn's prompt plus completion tokens, and what it re-prefilled is the history less its
cached prompt tokens (at least 0). Per side: failed turns, lost sessions (a turn after a move
that found under half its history cached, or a session gone from Redis), the mean re-prefilled
share of history over turns after a move, and each drain's seconds from the signal to the exit
with what moved (the executor's "moved to" log lines, the receiver's blocks in). It exits 1 when
the moving side failed a turn, lost a session or re-prefilled over 5% of history on average.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import queue
import re
import signal
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import grpc
import numpy as np
import torch

from bench.engine import Workload
from bench.harness import (
    BenchFailure,
    Benchmark,
    add_model,
    add_output_len,
    add_prompt_len,
    load_average,
    model_path,
    plot_path,
    print_json,
    require_positive,
    scratch_folder,
    sync_device,
)
from bench.kernels import build_cuda_model
from bench.load import run_jobs
from bench.stats import RequestResult, scaling_timeline
from bench.workloads import GenerateJob
from client.api import Completion, KvgateClient, sampling_params
from common.model_text import ModelText
from common.sampling_params import SamplingParams
from common.tenants import DEFAULT_TENANT
from deploy.models import SHARED_MODEL, choose_model
from deploy.scaler_sim import Fleet, Sample, local_fleet, play
from deploy.scaling import ScalingRule
from deploy.stack import Stack, StackConfig, free_port, wait_until
from engine.config import EngineConfig
from engine.engine import Engine
from protos.kvgate.v1 import inference_pb2, internal_pb2

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


def swap_turns(args: argparse.Namespace) -> dict:
    """Every session's turn 1 on both engines, then every turn 2; the result (swap_result)."""
    model = model_path(args.model)
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
    return swap_result(args, model, engines, turn2, same)


def swap_result(args, model: str, engines: dict[str, Engine], turn2: dict, same: bool) -> dict:
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
    add_prompt_len(parser, 256, "turn 1 prompt tokens")
    add("--reply-len", type=int, default=32, help="reply tokens of each turn")
    add("--new-len", type=int, default=32, help="turn 2's new message tokens")
    add("--block-size", type=int, default=16)
    add("--swap-space-gib", type=float, default=1.0)


def run_swap(args: argparse.Namespace) -> dict:
    """`kvgate bench scaling swap`."""
    turn2_len = args.prompt_len + 2 * args.reply_len + args.new_len
    args.blocks_per_session = -(-turn2_len // args.block_size)
    return swap_turns(args)


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
        sync_device(config.device)
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
    add_output_len(parser, 192)
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
    result["png"] = str(scaling_timeline(result, plot_path(args.out, args.out_key)))
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


# ---- chat sessions through a rolling restart (`kvgate bench scaling restart`) ------------

SIDES = {"moving": [], "recompute": ["--kv-transfer-port", "-1"]}
EXECUTORS = ("executor-0", "executor-1")
MAX_REPREFILL_SHARE = 0.05  # the bar of the moving side
WORDS = ["cat", "dog", "ball", "tree", "sun", "boat", "bird", "cake", "park", "hat"]
DRAIN_TIMEOUT_S = 600.0
TURN_TIMEOUT_S = 300.0
MOVED_BLOCKS_IN = re.compile(
    r'^kvgate_executor_kv_moved_blocks_total\{direction="in"\} (\S+)$', re.MULTILINE
)


@dataclass(slots=True)
class Turn:
    """What one turn of a session gave."""

    session: int
    turn: int
    session_id: str  # the chat's id (a chat that outgrew the context starts over)
    ok: bool
    status: str  # "OK", a gRPC status code's name, or the finish reason of a cut turn
    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0
    completion_tokens: int = 0
    executor_id: str = ""  # the session's executor after the turn ("": gone from Redis)
    history_tokens: int = 0  # the previous turn's prompt plus completion tokens
    after_move: bool = False  # the session's first turn after its executor changed
    ttft_ms: float = 0.0  # time to first token, as the gateway timed it


@dataclass(slots=True)
class Session:
    """One chat: its id now, the token ids of its next turn's prompt, and its turns so far.
    A chat that would outgrow the model's context starts over under a new id."""

    index: int
    opening: list[int]
    session_id: str = ""
    prompt: list[int] = field(default_factory=list)
    turns: list[Turn] = field(default_factory=list)

    def start_over(self) -> None:
        self.session_id = f"restart-{self.index}-{time.time_ns() % 10**12}"
        self.prompt = list(self.opening)


def new_sessions(count: int, text: ModelText) -> list[Session]:
    sessions = []
    for i in range(count):
        a, b = WORDS[i % 10], WORDS[(i // 10) % 10]
        opening = f"Once upon a time, there was a little {a} who loved the {b}. One day, the {a}"
        sessions.append(Session(i, text.encode(opening)))
        sessions[-1].start_over()
    return sessions


def session_executor(stack: Stack, session_id: str) -> str:
    """The executor of the session's last turn in Redis ("" when the session is gone)."""
    raw = stack.redis().get(stack.keys.session(DEFAULT_TENANT, session_id))
    return "" if raw is None else internal_pb2.SessionState.FromString(raw).executor_id


def take_turn(stack: Stack, session: Session, max_tokens: int) -> Turn:
    """Sends the session's next turn, greedy; its reply's token ids join the prompt."""
    params = sampling_params(max_tokens=max_tokens, temperature=0.0)
    completion = Completion()
    index, number = session.index, len(session.turns)
    try:
        request = inference_pb2.GenerateRequest(
            prompt_token_ids=session.prompt, params=params, session_id=session.session_id
        )
        with KvgateClient(stack.address, retry=False) as client:
            for chunk in client.stub.Generate(request, timeout=TURN_TIMEOUT_S):
                completion.add(chunk)
    except grpc.RpcError as error:
        return Turn(index, number, session.session_id, False,
                    f"{error.code().name}: {error.details()}")  # fmt: skip
    if completion.finish_reason not in ("stop", "length") or completion.usage is None:
        return Turn(index, number, session.session_id, False, completion.finish_reason or "none")
    usage = completion.usage
    session.prompt += completion.token_ids
    return Turn(index, number, session.session_id, True, "OK", usage.prompt_tokens,
                usage.cached_prompt_tokens, usage.completion_tokens,
                session_executor(stack, session.session_id),
                ttft_ms=completion.timings.ttft_ms)  # fmt: skip


def record(session: Session, turn: Turn) -> None:
    """Adds the turn, with its history and whether it is the chat's first after a move."""
    done = [t for t in session.turns if t.ok and t.session_id == turn.session_id]
    if turn.ok and done:
        turn.history_tokens = done[-1].prompt_tokens + done[-1].completion_tokens
        turn.after_move = turn.executor_id != done[-1].executor_id
    session.turns.append(turn)


def next_prompt(session: Session, text: ModelText, max_tokens: int) -> None:
    """Adds a short user message to the prompt; starts the chat over when the next turn would
    not fit the model's context."""
    word = WORDS[len(session.turns) % len(WORDS)]
    session.prompt += text.encode(f" Then the {word} said hello.", add_special_tokens=False)
    if len(session.prompt) + max_tokens > text.limits.max_model_len:
        session.start_over()


class Chats:
    """The sessions taking turns on `workers` threads, round robin, until stopped."""

    def __init__(self, stack: Stack, sessions: list[Session], text: ModelText, args) -> None:
        self.stack, self.sessions, self.text = stack, sessions, text
        self.max_tokens = args.max_tokens
        self.waiting: queue.Queue[int] = queue.Queue()
        for index in range(len(sessions)):
            self.waiting.put(index)
        self.stop = threading.Event()
        self.error: BaseException | None = None
        self.threads = [
            threading.Thread(target=self._work, daemon=True) for _ in range(args.workers)
        ]
        for thread in self.threads:
            thread.start()

    def _work(self) -> None:
        try:
            self._take_turns()
        except BaseException as error:  # noqa: BLE001 (raised again by wait_turns)
            self.error = error
            self.stop.set()

    def _take_turns(self) -> None:
        while not self.stop.is_set():
            try:
                index = self.waiting.get(timeout=0.1)
            except queue.Empty:
                continue
            session = self.sessions[index]
            turn = take_turn(self.stack, session, self.max_tokens)
            record(session, turn)
            if turn.ok:
                next_prompt(session, self.text, self.max_tokens)
            self.waiting.put(index)

    def fewest_turns(self) -> int:
        return min(len(s.turns) for s in self.sessions)

    def wait_turns(self, count: int, what: str) -> None:
        """Waits until every session has taken `count` turns. Raises: a worker's error."""
        wait_until(lambda: self.stop.is_set() or self.fewest_turns() >= count, 3600.0, what)
        if self.error is not None:
            raise self.error

    def join(self) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join()


def moved_blocks_in(stack: Stack, executor_id: str) -> float:
    """The executor's kvgate_executor_kv_moved_blocks_total{direction="in"} now."""
    url = f"http://127.0.0.1:{stack.metrics_ports[executor_id]}/metrics"
    with urllib.request.urlopen(url, timeout=10.0) as reply:
        match = MOVED_BLOCKS_IN.search(reply.read().decode())
    return float(match.group(1)) if match else 0.0


def moved_lines(log: Path, offset: int) -> dict[str, int]:
    """The "draining: KIND NAME moved to PEER" lines of the log after `offset`, by kind."""
    with open(log, "rb") as file:
        file.seek(offset)
        text = file.read().decode(errors="replace")
    found = re.findall(r"draining: (request|session) \S+ moved to", text)
    return {kind: found.count(kind) for kind in ("request", "session")}


def restart(stack: Stack, executor_id: str, peer: str, moving: bool) -> dict:
    """SIGTERM to the executor, its exit awaited and timed, then it starts again and serves."""
    log = stack.log_path(executor_id)
    offset = log.stat().st_size
    blocks_before = moved_blocks_in(stack, peer)
    proc = stack.procs[executor_id]
    start = time.perf_counter()
    proc.send_signal(signal.SIGTERM)
    status = proc.wait(timeout=DRAIN_TIMEOUT_S)
    drain_s = time.perf_counter() - start
    blocks_in = moved_blocks_in(stack, peer) - blocks_before
    stack.start_executor(executor_id)
    if moving:  # the next drain pushes to it: its KvTransfer address must be known
        wait_until(lambda: bool(getattr(stack.executor_status(executor_id),
                                        "kv_transfer_address", "")), 60.0, executor_id)  # fmt: skip
    moved = moved_lines(log, offset)
    return {"executor": executor_id, "exit_status": status, "drain_s": drain_s,
            "requests_moved": moved["request"], "sessions_moved": moved["session"],
            "blocks_in_at_peer": blocks_in}  # fmt: skip


def restart_stack_config(args: argparse.Namespace, folder: Path, side: str) -> StackConfig:
    flags = ["--num-gpu-blocks", str(args.num_gpu_blocks), "--block-size", "16",
             "--max-num-seqs", "64", *SIDES[side]]  # fmt: skip
    return StackConfig(
        model=args.model_path,
        port=free_port(),
        log_dir=folder / side,
        executor_flags=flags,
        scheduler_flags=["--batch-window-ms", "2"],
    )


def run_side(args: argparse.Namespace, folder: Path, side: str) -> dict:
    """One stack through the warm-up, the rolling restart and the turns after it."""
    stack = Stack(restart_stack_config(args, folder, side))
    chats = None
    try:
        stack.start_all(num_executors=2)
        text = ModelText(args.model_path)
        sessions = new_sessions(args.sessions, text)
        chats = Chats(stack, sessions, text, args)
        chats.wait_turns(args.warmup_turns, "the warm-up")
        start = time.perf_counter()
        drains = [restart(stack, EXECUTORS[0], EXECUTORS[1], side == "moving"),
                  restart(stack, EXECUTORS[1], EXECUTORS[0], side == "moving")]  # fmt: skip
        restart_s = time.perf_counter() - start
        after = chats.fewest_turns() + args.turns_after
        chats.wait_turns(after, "the turns after the restart")
        chats.join()
        gone = [
            s.session_id
            for s in sessions
            if chatted(s) and not session_executor(stack, s.session_id)
        ]
    finally:
        if chats is not None:
            chats.stop.set()
        stack.stop_all()
    return side_figures(sessions, drains, restart_s, gone)


def chatted(session: Session) -> bool:
    """Whether the session's chat now has a turn done (so a SessionState in Redis)."""
    return any(t.ok and t.session_id == session.session_id for t in session.turns)


def reprefill_share(turns: list[Turn]) -> float | None:
    """The mean over `turns` of history less cached prompt tokens (at least 0), over history."""
    shares = [max(t.history_tokens - t.cached_prompt_tokens, 0) / t.history_tokens for t in turns]
    return statistics.fmean(shares) if shares else None


def median_ttft(turns: list[Turn]) -> float | None:
    return statistics.median(t.ttft_ms for t in turns) if turns else None


def paired_ttft_ratios(sessions: list[Session]) -> list[float]:
    """For each turn after a move: its TTFT over the TTFT of the same chat's turn before it,
    when that one stayed on its executor (history one turn shorter; same run)."""
    ratios = []
    for session in sessions:
        done = [t for t in session.turns if t.ok]
        for before, after in itertools.pairwise(done):
            stayed = before.history_tokens and not before.after_move
            if after.after_move and before.session_id == after.session_id and stayed:
                ratios.append(after.ttft_ms / before.ttft_ms)
    return ratios


def side_figures(
    sessions: list[Session], drains: list[dict], restart_s: float, gone: list[str]
) -> dict:
    turns = [t for s in sessions for t in s.turns]
    moved = [t for t in turns if t.after_move]
    stayed = [t for t in turns if t.history_tokens and not t.after_move]
    lost = {t.session for t in moved if t.cached_prompt_tokens < t.history_tokens / 2}
    lost |= {i for i, s in enumerate(sessions) if s.session_id in gone}
    failed = [t for t in turns if not t.ok]
    return {
        "turns": len(turns),
        "failed_turns": len(failed),
        "failures": sorted({t.status for t in failed}),
        "turns_after_a_move": len(moved),
        "lost_sessions": len(lost),
        "sessions_gone_from_redis": len(gone),
        "reprefill_share_after_move_mean": reprefill_share(moved),
        # the same over later turns of a chat that stayed on its executor: what a turn costs
        # with no move (the last reply token's KV is never computed)
        "reprefill_share_stayed_mean": reprefill_share(stayed),
        # TTFT of the turns after a move against the later turns that stayed, same run
        "ttft_ms_after_move_median": median_ttft(moved),
        "ttft_ms_stayed_median": median_ttft(stayed),
        # and against the same chat's turn before the move, which stayed (per-chat pairs)
        "ttft_after_move_paired_ratio_median": (
            statistics.median(ratios) if (ratios := paired_ttft_ratios(sessions)) else None
        ),
        "ttft_pairs": len(ratios),
        "history_tokens_after_move_mean": (
            statistics.fmean(t.history_tokens for t in moved) if moved else None
        ),
        "drains": drains,
        "restart_s": restart_s,
        "lost_session_indices": sorted(lost),
        "turns_after_a_move_records": [asdict(t) for t in moved],
    }


def add_restart_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of `kvgate bench scaling restart`."""
    add_model(
        parser, str(SHARED_MODEL), "model folder, GGUF file or smollm2 (default: stories260K)"
    )
    add = parser.add_argument
    add("--sessions", type=int, default=64, help="chat sessions taking turns")
    add("--workers", type=int, default=4, help="turns at once")
    add("--max-tokens", type=int, default=32, help="reply tokens of a turn (greedy)")
    add("--warmup-turns", type=int, default=2, help="turns of every session before the restart")
    add("--turns-after", type=int, default=1, help="turns of every session after the restart")
    add("--num-gpu-blocks", type=int, default=2048, help="KV blocks of each executor")
    add("--log-dir", type=Path, default=None, help="keep the stacks' logs here (SIDE/NAME.log)")


POSITIVE_FLAGS = ("sessions", "workers", "max_tokens", "warmup_turns", "turns_after")


def run_restart(args: argparse.Namespace) -> dict:
    """`kvgate bench scaling restart`. Raises: BenchFailure on a flag under 1."""
    require_positive(args, *POSITIVE_FLAGS)
    args.model_path = model_path(args.model)
    flags = (*POSITIVE_FLAGS, "num_gpu_blocks")
    result: dict = {"model": args.model_path, **{name: getattr(args, name) for name in flags}}
    result["load_average_at_start"] = load_average()
    with scratch_folder("kvgate-restart-") as scratch:
        for side in SIDES:
            result[side] = run_side(args, args.log_dir or scratch, side)
    result["load_average_at_end"] = load_average()
    return result


ROWS = [("failed turns", "failed_turns"), ("lost sessions", "lost_sessions"),
        ("turns after a move", "turns_after_a_move"),
        ("re-prefilled share", "reprefill_share_after_move_mean"),
        ("(turns that stayed)", "reprefill_share_stayed_mean"),
        ("TTFT ms after a move", "ttft_ms_after_move_median"),
        ("(turns that stayed)", "ttft_ms_stayed_median"),
        ("TTFT ratio, chat pairs", "ttft_after_move_paired_ratio_median"),
        ("turns", "turns")]  # fmt: skip


def summarize_restart(result: dict) -> None:
    print(f"{'rolling restart':<24}{'moving':>12}{'recompute':>12}")
    for label, key in ROWS:
        cells = [result[side][key] for side in SIDES]
        print(f"{label:<24}" + "".join(f"{c:>12.3f}" if isinstance(c, float) else f"{c!s:>12}"
                                       for c in cells))  # fmt: skip
    for i, name in enumerate(EXECUTORS):
        drains = [result[side]["drains"][i] for side in SIDES]
        print(f"{name + ' drain s':<24}" + "".join(f"{d['drain_s']:>12.2f}" for d in drains))
        print(f"{name + ' moved':<24}" + "".join(
            f"{str(d['requests_moved']) + 'r ' + str(d['sessions_moved']) + 's':>12}"
            for d in drains))  # fmt: skip


def restart_failure(result: dict) -> str | None:
    """The moving side failed a turn, lost a session or re-prefilled over the bar."""
    moving = result["moving"]
    share = moving["reprefill_share_after_move_mean"]
    if moving["failed_turns"]:
        return f"{moving['failed_turns']} failed turn(s) with KV moves: {moving['failures']}"
    if moving["lost_sessions"]:
        return f"{moving['lost_sessions']} session(s) lost with KV moves"
    if share is None:
        return "no turn came after a move: the restart moved no session"
    if share > MAX_REPREFILL_SHARE:
        return f"re-prefilled {share:.1%} of history after a move (the bar: 5%)"
    return None


BENCHMARKS = {
    "scaling swap": Benchmark(add_swap_arguments, run_swap, "swap.json", print_json),
    "scaling tp": Benchmark(add_tp_arguments, run_tp, "tensor_parallel.json", print_table),
    "scaling executors": Benchmark(
        add_executors_arguments, run_scaler, "scaler.json", summarize_executors, executors_failure
    ),
    "scaling restart": Benchmark(
        add_restart_arguments, run_restart, "restart.json", summarize_restart, restart_failure
    ),
}
