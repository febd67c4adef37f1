"""Noisy neighbour: does a tenant sending 10x its request limit slow another tenant down?

    python -m bench.noisy_tenant --out bench/results/noisy_tenant.json

A local stack with API keys serves two tenants. "quiet" sends --quiet-rate requests per
second throughout and has no limit; "noisy" is limited to --noisy-limit requests per second
and sends, block after block in turn: nothing ("alone"), exactly its limit ("at_limit"), and
ten times it ("10x_limit": nine in ten are refused at the gateway). The blocks rotate
--rounds times so that every phase sees the machine at several moments. The noisy client is
a process of its own (as another team's service would be a client of its own), so that its
calls do not hold the quiet client's interpreter. Reported: quiet's TTFT per phase as its
client saw it and as the gateway measured it (the last chunk's timings), noisy's admitted
and refused calls, and the ratio of quiet's p99 TTFT at 10x over at the limit (target: at
most 1.2: the quota holds the noise back).
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc

from bench.bench_serve import grpc_request
from bench.scratch import scratch_folder
from bench.secure import key_metadata, tenant_key
from bench.stats import print_and_save, summarize_ms
from deploy.models import SHARED_MODEL
from deploy.stack import Stack, StackConfig, free_port
from protos.kvgate.v1 import inference_pb2_grpc

PHASES = {"alone": 0.0, "at_limit": 1.0, "10x_limit": 10.0}  # noisy's rate / its limit
# A block: its phase, when it starts (time.time()), its request rate for the sender.
Block = tuple[str, float, float]


class Sender:
    """Sends Generate calls at fixed rates, block by block, recording each outcome."""

    def __init__(self, address: str, api_key: str, prompt: list[int], max_tokens: int) -> None:
        self.channel = grpc.insecure_channel(address)
        self.stub = inference_pb2_grpc.InferenceStub(self.channel)
        self.metadata = key_metadata(api_key)
        self.request = grpc_request(prompt, max_tokens)
        self.pool = ThreadPoolExecutor(128)
        self.lock = threading.Lock()
        self.results: dict[str, dict[str, list]] = {}

    def one(self, phase: str) -> None:
        start = time.perf_counter()
        outcome = {"ttft_s": [], "gateway_ttft_s": [], "refused": []}
        try:
            chunks = self.stub.Generate(self.request, timeout=120, metadata=self.metadata)
            next(c for c in chunks if c.token_ids)
            outcome["ttft_s"].append(time.perf_counter() - start)
            outcome["gateway_ttft_s"].append(list(chunks)[-1].timings.ttft_ms / 1000)
        except grpc.RpcError as error:
            outcome["refused"].append(error.code().name)
        with self.lock:
            results = self.results.setdefault(phase, {name: [] for name in outcome})
            for name, values in outcome.items():
                results[name].extend(values)

    def run(self, blocks: list[Block], block_s: float) -> dict[str, dict[str, list]]:
        """Send each block's requests from its start for `block_s`; wait for all answers."""
        for phase, start_at, rate in blocks:
            time.sleep(max(0.0, start_at - time.time()))
            start = time.perf_counter()
            for index in range(int(rate * block_s)):
                time.sleep(max(0.0, start + index / rate - time.perf_counter()))
                self.pool.submit(self.one, phase)
        self.pool.shutdown(wait=True)
        self.channel.close()
        return self.results


def send_noisy(address, api_key, prompt, max_tokens, blocks, block_s, results) -> None:
    """The noisy client's process: send its blocks, put its results on `results`."""
    results.put(Sender(address, api_key, prompt, max_tokens).run(blocks, block_s))


def schedule(args: argparse.Namespace, start_at: float) -> tuple[list[Block], list[Block]]:
    """The quiet and noisy clients' blocks: every phase in turn, --rounds times, 1 s apart
    (the previous block's calls finish; the noisy tenant's bucket refills)."""
    quiet, noisy = [], []
    for index in range(args.rounds * len(PHASES)):
        phase, times_limit = list(PHASES.items())[index % len(PHASES)]
        begins = start_at + index * (args.block_s + 1.0)
        quiet.append((phase, begins, args.quiet_rate))
        noisy.append((phase, begins, times_limit * args.noisy_limit))
    return quiet, noisy


def run(args: argparse.Namespace) -> dict:
    load_at_start = os.getloadavg()
    with scratch_folder() as folder:
        config = StackConfig(
            model=str(args.model),
            port=free_port(),
            log_dir=folder / "logs",
            auth="keys",
            scheduler_flags=["--batch-window-ms", "2"],
            executor_flags=["--max-num-seqs", "64"],
        )
        stack = Stack(config)
        try:
            stack.start_all()
            return {"load_average_at_start": load_at_start, **measure(stack, args)}
        finally:
            stack.stop_all()


def measure(stack: Stack, args: argparse.Namespace) -> dict:
    quiet_key = tenant_key(stack, "quiet")
    noisy_key = tenant_key(stack, "noisy", {"requests_per_s": args.noisy_limit})
    prompt = [(i * 11) % 400 + 20 for i in range(args.prompt_len)]
    quiet_blocks, noisy_blocks = schedule(args, time.time() + 5.0)
    spawn = multiprocessing.get_context("spawn")
    noisy_results = spawn.Queue()
    noisy = spawn.Process(
        target=send_noisy,
        args=(stack.address, noisy_key, prompt, args.max_tokens, noisy_blocks, args.block_s,
              noisy_results),
    )  # fmt: skip
    noisy.start()
    warm_up = [("warm-up", time.time(), args.quiet_rate)]
    Sender(stack.address, quiet_key, prompt, args.max_tokens).run(warm_up, 3.0)
    quiet = Sender(stack.address, quiet_key, prompt, args.max_tokens)
    quiet_results = quiet.run(quiet_blocks, args.block_s)
    noisy_counts = noisy_results.get(timeout=600)
    noisy.join(60)
    return report(args, quiet_results, noisy_counts)


def report(args: argparse.Namespace, quiet: dict, noisy: dict) -> dict:
    phases = {
        phase: {
            "quiet_ttft_ms": summarize_ms(quiet[phase]["ttft_s"]),
            "quiet_gateway_ttft_ms": summarize_ms(quiet[phase]["gateway_ttft_s"]),
            "quiet_samples": len(quiet[phase]["ttft_s"]),
            "quiet_refused": len(quiet[phase]["refused"]),
            "noisy_admitted": len(noisy.get(phase, {}).get("ttft_s", [])),
            "noisy_refused": len(noisy.get(phase, {}).get("refused", [])),
        }
        for phase in PHASES
    }

    def p99_ratio(key: str, phase: str, baseline: str) -> float:
        return phases[phase][key]["p99"] / phases[baseline][key]["p99"]

    return {
        "model": Path(args.model).name,
        "quiet_rate": args.quiet_rate,
        "noisy_limit_requests_per_s": args.noisy_limit,
        "block_s": args.block_s,
        "rounds": args.rounds,
        "prompt_len": args.prompt_len,
        "max_tokens": args.max_tokens,
        "cpus": os.cpu_count(),
        "load_average_at_end": os.getloadavg(),
        "phases": phases,
        "quiet_p99_ttft_ratio_10x_over_at_limit": p99_ratio(
            "quiet_ttft_ms", "10x_limit", "at_limit"
        ),
        "quiet_p99_gateway_ttft_ratio_10x_over_at_limit": p99_ratio(
            "quiet_gateway_ttft_ms", "10x_limit", "at_limit"
        ),
        "quiet_p99_ttft_ratio_10x_over_alone": p99_ratio("quiet_ttft_ms", "10x_limit", "alone"),
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", type=Path, default=SHARED_MODEL)
    parser.add_argument("--quiet-rate", type=float, default=5.0, help="quiet's requests/s")
    parser.add_argument("--noisy-limit", type=float, default=5.0, help="noisy's requests/s")
    parser.add_argument("--block-s", type=float, default=15.0, help="seconds of each block")
    parser.add_argument("--rounds", type=int, default=8, help="times each phase comes round")
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--out", type=Path, default=Path("bench/results/noisy_tenant.json"))
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    print_and_save(run(args), args.out)


if __name__ == "__main__":
    main()
