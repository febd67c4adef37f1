"""vLLM's gRPC engine API against kvgate.v1 on the same gateway, in the same run: TTFT of
single streams (taking turns, paired) and output tokens per second of N streams at once
(rounds alternating between the two APIs). The issue's bar: TTFT p50 within 1 ms of
kvgate.v1's, throughput at least 0.95 of it.

python -m bench.bench_vllm_api --out bench/results/vllm_api.json
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
from smg_grpc_proto.generated import vllm_engine_pb2, vllm_engine_pb2_grpc

from bench.bench_serve import grpc_tokens_per_s, grpc_ttft_once
from bench.stats import paired_median_ms, print_and_save
from common.model_text import ModelText
from deploy.models import SHARED_MODEL
from deploy.stack import Stack, StackConfig, free_port
from protos.kvgate.v1 import inference_pb2_grpc

PROMPTS = ["Once upon a time", "The little dog", "Lily and Ben went to the park", "One day"]


def vllm_request(prompt: list[int], max_tokens: int) -> vllm_engine_pb2.GenerateRequest:
    params = vllm_engine_pb2.SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return vllm_engine_pb2.GenerateRequest(
        tokenized=vllm_engine_pb2.TokenizedInput(input_ids=prompt),
        sampling_params=params,
        stream=True,
    )


def vllm_ttft_once(stub: vllm_engine_pb2_grpc.VllmEngineStub, prompt: list[int]) -> float:
    """TTFT in ms of one VllmEngine Generate, as its client sees it (then read to its end)."""
    start = time.perf_counter()
    responses = stub.Generate(vllm_request(prompt, 4), timeout=600)
    next(r for r in responses if r.WhichOneof("response") == "chunk")
    ttft = 1000 * (time.perf_counter() - start)
    list(responses)
    return ttft


def vllm_tokens_per_s(address: str, prompts: list[list[int]], output_len: int) -> float:
    """Output tokens per second of all `prompts` streamed at once through VllmEngine."""
    with ThreadPoolExecutor(len(prompts)) as pool, grpc.insecure_channel(address) as channel:
        stub = vllm_engine_pb2_grpc.VllmEngineStub(channel)

        def stream(prompt: list[int]) -> int:
            responses = stub.Generate(vllm_request(prompt, output_len), timeout=3600)
            return sum(len(r.chunk.token_ids) for r in responses)

        start = time.perf_counter()
        produced = sum(pool.map(stream, prompts))
    return produced / (time.perf_counter() - start)


def ttfts(address: str, prompts: list[list[int]], interval_s: float) -> dict[str, list[float]]:
    """Each prompt once through each API, taking turns `interval_s` apart."""
    samples: dict[str, list[float]] = {"kvgate": [], "vllm": []}
    with grpc.insecure_channel(address) as channel:
        kvgate = inference_pb2_grpc.InferenceStub(channel)
        vllm = vllm_engine_pb2_grpc.VllmEngineStub(channel)
        for prompt in prompts:
            time.sleep(interval_s)
            samples["kvgate"].append(grpc_ttft_once(kvgate, prompt))
            time.sleep(interval_s)
            samples["vllm"].append(vllm_ttft_once(vllm, prompt))
    return samples


def throughputs(address: str, prompts: list[list[int]], args: argparse.Namespace) -> dict:
    rounds: dict[str, list[float]] = {"kvgate": [], "vllm": []}
    for _ in range(args.rounds):
        rounds["kvgate"].append(
            grpc_tokens_per_s(lambda: grpc.insecure_channel(address), prompts, args.output_len)
        )
        rounds["vllm"].append(vllm_tokens_per_s(address, prompts, args.output_len))
    return rounds


def run(args: argparse.Namespace) -> dict:
    model_text = ModelText(args.model)
    token_ids = [model_text.encode(p) for p in PROMPTS]
    with tempfile.TemporaryDirectory() as logs:
        config = StackConfig(model=str(args.model), port=free_port(), log_dir=Path(logs))
        config.executor_flags = ["--max-num-seqs", str(max(64, args.streams))]
        stack = Stack(config)
        try:
            stack.start_all()
            address = stack.address
            ttfts(address, token_ids[:2], 0.0)  # warm-up, untimed
            prompts = [token_ids[i % len(token_ids)] for i in range(args.ttft_samples)]
            ttft = ttfts(address, prompts, args.interval_s)
            streams = [token_ids[i % len(token_ids)] for i in range(args.streams)]
            rounds = throughputs(address, streams, args)
        finally:
            stack.stop_all()
    kvgate_tps, vllm_tps = statistics.median(rounds["kvgate"]), statistics.median(rounds["vllm"])
    return {
        "model": str(args.model),
        "ttft_ms_p50": {api: statistics.median(s) for api, s in ttft.items()},
        "ttft_ms_vllm_minus_kvgate": paired_median_ms(ttft["vllm"], ttft["kvgate"]),
        "streams": args.streams,
        "output_len": args.output_len,
        "tokens_per_s_rounds": rounds,
        "tokens_per_s_ratio_vllm_to_kvgate": vllm_tps / kvgate_tps,
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=SHARED_MODEL)
    parser.add_argument("--ttft-samples", type=int, default=60)
    parser.add_argument("--interval-s", type=float, default=0.05)
    parser.add_argument("--streams", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path("bench/results/vllm_api.json"))
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    print_and_save(run(args), args.out)


if __name__ == "__main__":
    main()
