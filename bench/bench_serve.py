"""Serving benchmark: the whole stack (gateway, Redis, scheduler, executor) against the
in-process Engine, on the engine benchmark's model and workload, in one run.

    python -m bench.bench_serve --out bench/results/serve.json

Reports the throughput ratio grpc / in-process (target >= 0.9) and the TTFT p50 at
1 request/s (the two sides take turns, half a second apart); the stack's TTFT minus
batch_window_ms is compared with the in-process TTFT (target: at most 3 ms more). The same
client also times a do-nothing gRPC server (bench/grpc_floor.py) at the same rate: the share
of that difference any Python gRPC front end pays before it does any work.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import torch
from tokenizers import Tokenizer, models, pre_tokenizers

from bench.bench_engine import BENCH_SHAPE, Workload, build_model
from bench.scratch import scratch_folder
from common.sampling_params import SamplingParams
from deploy.stack import Stack, StackConfig, co_located_torch_threads, free_port
from executor.config import EngineConfig
from executor.engine import Engine
from protos.kvgate.v1 import inference_pb2, inference_pb2_grpc


def write_model(folder: Path) -> None:
    """Saves the engine benchmark's model with a word-level tokenizer over its whole vocabulary."""
    build_model(BENCH_SHAPE, torch.float32).save_pretrained(folder)
    vocab = {f"w{i}": i for i in range(BENCH_SHAPE["vocab_size"])}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="w0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"unk_token": "w0"}))


def engine_config(folder: Path, args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(
        model=str(folder),
        device=args.device,
        max_num_seqs=args.num_requests,
        max_num_batched_tokens=args.max_num_batched_tokens,
        kv_cache_gib=args.kv_cache_gib,
    )


def inprocess_tokens_per_s(engine: Engine, prompts: list[list[int]], output_len: int) -> float:
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    for index, prompt in enumerate(prompts):
        engine.add_request(f"tput-{index}", prompt, params)
    produced = 0
    while engine.has_unfinished():
        produced += sum(len(o.new_token_ids) for o in engine.step())
    return produced / (time.perf_counter() - start)


def inprocess_ttft_once(engine: Engine, request_id: str, prompt: list[int]) -> float:
    """TTFT in ms of one request alone in the engine (then run to its end, untimed)."""
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    engine.add_request(request_id, prompt, params)
    while not any(o.new_token_ids for o in engine.step()):
        pass
    ttft = 1000 * (time.perf_counter() - start)
    while engine.has_unfinished():
        engine.step()
    return ttft


def grpc_request(prompt: list[int], max_tokens: int) -> inference_pb2.GenerateRequest:
    params = inference_pb2.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return inference_pb2.GenerateRequest(prompt_token_ids=prompt, params=params)


def grpc_tokens_per_s(address: str, prompts: list[list[int]], output_len: int) -> float:
    # The channel is closed before the pool waits for its threads: on SIGTERM (SystemExit)
    # that cancels the streams at once instead of waiting for them to finish.
    with ThreadPoolExecutor(len(prompts)) as pool, grpc.insecure_channel(address) as channel:
        stub = inference_pb2_grpc.InferenceStub(channel)

        def stream(prompt: list[int]) -> int:
            chunks = stub.Generate(grpc_request(prompt, output_len), timeout=3600)
            return sum(len(chunk.token_ids) for chunk in chunks)

        start = time.perf_counter()
        produced = sum(pool.map(stream, prompts))
    return produced / (time.perf_counter() - start)


def grpc_ttft_once(stub: inference_pb2_grpc.InferenceStub, prompt: list[int]) -> float:
    """TTFT in ms of one Generate call, as its client sees it (then read to its end)."""
    start = time.perf_counter()
    chunks = stub.Generate(grpc_request(prompt, 4), timeout=600)
    next(c for c in chunks if c.token_ids)
    ttft = 1000 * (time.perf_counter() - start)
    list(chunks)
    return ttft


def grpc_ttft_ms(address: str, prompts: list[list[int]], interval_s: float) -> list[float]:
    with grpc.insecure_channel(address) as channel:
        stub = inference_pb2_grpc.InferenceStub(channel)
        ttfts = []
        for prompt in prompts:
            time.sleep(interval_s)
            ttfts.append(grpc_ttft_once(stub, prompt))
    return ttfts


def interleaved_ttft_ms(
    engine: Engine, address: str, prompts: list[list[int]], interval_s: float
) -> tuple[list[float], list[float]]:
    """TTFT of each prompt in process and through the stack, taking turns half an interval
    apart: each side gets a request every `interval_s`, and both see the same machine (on a
    shared machine the in-process TTFT alone moves by several ms between minutes)."""
    inprocess, stack = [], []
    with grpc.insecure_channel(address) as channel:
        stub = inference_pb2_grpc.InferenceStub(channel)
        for index, prompt in enumerate(prompts):
            time.sleep(interval_s / 2)
            inprocess.append(inprocess_ttft_once(engine, f"ttft-{index}", prompt))
            time.sleep(interval_s / 2)
            stack.append(grpc_ttft_once(stub, prompt))
    return inprocess, stack


def grpc_floor_ttft_ms(prompts: list[list[int]], interval_s: float) -> list[float]:
    """grpc_ttft_ms against bench/grpc_floor.py, started as its own process like a gateway."""
    port = free_port()
    command = [sys.executable, "-m", "bench.grpc_floor", "--port", str(port)]
    server = subprocess.Popen(command, cwd=Path(__file__).resolve().parents[1])
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            grpc.channel_ready_future(channel).result(timeout=30)
        grpc_ttft_ms(f"127.0.0.1:{port}", prompts[:2], 0.0)  # warm-up, untimed
        return grpc_ttft_ms(f"127.0.0.1:{port}", prompts, interval_s)
    finally:
        server.terminate()
        server.wait(10)


def stack_config(folder: Path, args: argparse.Namespace) -> StackConfig:
    executor_flags = [
        "--device",
        args.device,
        "--max-num-seqs",
        str(args.num_requests),
        "--max-num-batched-tokens",
        str(args.max_num_batched_tokens),
        "--kv-cache-gib",
        str(args.kv_cache_gib),
    ]
    return StackConfig(
        model=str(folder),
        port=free_port(),
        log_dir=folder / "logs",
        executor_flags=executor_flags,
        scheduler_flags=["--batch-window-ms", str(args.batch_window_ms)],
        gateway_flags=["--max-queue-len", str(4 * args.num_requests)],
    )


def measure(folder: Path, prompts: list[list[int]], args: argparse.Namespace) -> dict:
    """Throughput in process, then through the stack; then TTFT of both, taking turns.

    The in-process Engine gets the model threads the stack's executor gets.
    """
    torch.set_num_threads(co_located_torch_threads())
    engine = Engine(engine_config(folder, args))
    inprocess_tokens_per_s(engine, prompts[:4], 8)
    inprocess = inprocess_tokens_per_s(engine, prompts, args.output_len)
    stack = Stack(stack_config(folder, args))
    try:
        stack.start_all()
        grpc_tokens_per_s(stack.address, prompts[:4], 8)
        through_stack = grpc_tokens_per_s(stack.address, prompts, args.output_len)
        ttft_prompts = [prompts[i % len(prompts)] for i in range(args.ttft_requests)]
        ttft_inprocess, ttft_grpc = interleaved_ttft_ms(
            engine, stack.address, ttft_prompts, args.ttft_interval_s
        )
    finally:
        stack.stop_all()
    return {
        "inprocess_tokens_per_s": inprocess,
        "grpc_tokens_per_s": through_stack,
        "ttft_ms_inprocess": ttft_inprocess,
        "ttft_ms_grpc": ttft_grpc,
        "ttft_ms_grpc_floor": grpc_floor_ttft_ms(ttft_prompts, args.ttft_interval_s),
    }


def paired_overhead_ms(inprocess: list[float], grpc: list[float], window_ms: float) -> float:
    """The median over the TTFT pairs (taken half a second apart) of the stack's TTFT minus
    the window minus the in-process one: the stack's overhead, less moved than the difference
    of the two medians by how much one step's time varies from request to request."""
    if len(inprocess) != len(grpc) or not inprocess:
        raise ValueError(f"need pairs of TTFTs, got {len(inprocess)} and {len(grpc)}")
    return statistics.median(g - window_ms - i for i, g in zip(inprocess, grpc, strict=True))


def run(args: argparse.Namespace) -> dict:
    workload = Workload(args.num_requests, args.prompt_len, args.output_len)
    prompts = workload.prompts(BENCH_SHAPE["vocab_size"])
    with scratch_folder() as folder:
        write_model(folder)
        samples = measure(folder, prompts, args)
    ttft_inprocess = statistics.median(samples["ttft_ms_inprocess"])
    ttft_grpc = statistics.median(samples["ttft_ms_grpc"])
    return {
        "device": args.device,
        "workload": vars(workload),
        "batch_window_ms": args.batch_window_ms,
        "torch_threads": co_located_torch_threads(),
        "inprocess_tokens_per_s": samples["inprocess_tokens_per_s"],
        "grpc_tokens_per_s": samples["grpc_tokens_per_s"],
        "throughput_ratio": samples["grpc_tokens_per_s"] / samples["inprocess_tokens_per_s"],
        "ttft_p50_ms_inprocess": ttft_inprocess,
        "ttft_p50_ms_grpc": ttft_grpc,
        "ttft_p50_ms_grpc_minus_window_over_inprocess": (
            ttft_grpc - args.batch_window_ms - ttft_inprocess
        ),
        "ttft_p50_ms_grpc_floor": statistics.median(samples["ttft_ms_grpc_floor"]),
        "ttft_paired_p50_ms_grpc_minus_window_over_inprocess": paired_overhead_ms(
            samples["ttft_ms_inprocess"], samples["ttft_ms_grpc"], args.batch_window_ms
        ),
        "ttft_samples_ms": {
            key: samples[key] for key in ("ttft_ms_inprocess", "ttft_ms_grpc", "ttft_ms_grpc_floor")
        },
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--kv-cache-gib", type=float, default=1.0)
    parser.add_argument("--batch-window-ms", type=float, default=2.0)
    parser.add_argument(
        "--ttft-requests",
        type=int,
        default=120,
        help="TTFT samples per side: one step's time moves by several ms between requests",
    )
    parser.add_argument("--ttft-interval-s", type=float, default=1.0, help="1 request/s")
    parser.add_argument("--out", type=Path, default=Path("bench/results/serve.json"))
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    results = run(args)
    print(json.dumps(results, indent=2))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
