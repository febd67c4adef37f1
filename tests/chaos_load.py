"""The clients of tests/chaos.py, in a process of their own (one that runs gRPC calls on
many threads must not also fork the stack's processes: gRPC's state does not survive a fork).

    python -m tests.chaos_load --targets HOST:PORT,HOST:PORT --clients N --duration-s S

Each client sends greedy and seeded Generate requests to a random gateway until the time is
up, through KvgateClient (its retry policy on). Prints one JSON object: how many requests
ended each way: completed, broken (the wrong number of tokens), lost (neither a last chunk
nor a status from kvgate), or "failed CODE".
"""

from __future__ import annotations

import argparse
import collections
import faulthandler
import json
import random
import signal
import sys
import threading
import time

import grpc

from client.api import KvgateClient, sampling_params

CALL_DEADLINE_S = 180.0  # a call with no answer from kvgate by then is lost
CLIENT_DEADLINE_DETAILS = "Deadline Exceeded"  # gRPC's words when the client's deadline ends it
PROMPTS = ["Once upon a time", "The cat", "A big red ball", "Tom had a toy", "The sun was"]


def one_request(address: str, rng: random.Random) -> str:
    """Sends one request; returns its outcome."""
    max_tokens = rng.randint(16, 96)
    seeded = rng.random() < 0.5
    params = sampling_params(
        max_tokens=max_tokens,
        temperature=0.8 if seeded else 0.0,
        seed=rng.randrange(2**31) if seeded else None,
        ignore_eos=True,
    )
    tokens, finished = 0, False
    try:
        with KvgateClient(address, timeout_s=CALL_DEADLINE_S) as client:
            for chunk in client.generate_stream(rng.choice(PROMPTS), params):
                tokens += len(chunk.token_ids)
                finished = finished or bool(chunk.finish_reason)
    except grpc.RpcError as error:
        if error.details() == CLIENT_DEADLINE_DETAILS:
            return "lost"  # the client's own deadline: kvgate never answered
        return f"failed {error.code().name}"
    if not finished:
        return "lost"  # the stream ended OK without its last chunk
    return "completed" if tokens == max_tokens else "broken"


def client_loop(
    targets: list[str], until_s: float, seed: int, outcomes: collections.Counter, lock
) -> None:
    rng = random.Random(seed)
    while time.monotonic() < until_s:
        outcome = one_request(rng.choice(targets), rng)
        with lock:
            outcomes[outcome] += 1


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m tests.chaos_load", description=__doc__)
    parser.add_argument("--targets", required=True, help="HOST:PORT,HOST:PORT")
    parser.add_argument("--clients", type=int, default=12)
    parser.add_argument("--duration-s", type=float, required=True)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    faulthandler.register(signal.SIGUSR1)  # kill -USR1 PID: every thread's stack, on stderr
    targets = args.targets.split(",")
    outcomes: collections.Counter[str] = collections.Counter()
    lock = threading.Lock()
    until_s = time.monotonic() + args.duration_s
    threads = [
        threading.Thread(target=client_loop, args=(targets, until_s, args.seed + i, outcomes, lock))
        for i in range(args.clients)
    ]
    for thread in threads:
        thread.start()
    while any(thread.is_alive() for thread in threads):
        time.sleep(10.0)
        with lock:
            so_far = dict(outcomes)
        running = sum(thread.is_alive() for thread in threads)
        print(f"  load: {so_far}, {running} clients still running", file=sys.stderr, flush=True)
    print(json.dumps(dict(outcomes)), flush=True)


if __name__ == "__main__":
    main()
