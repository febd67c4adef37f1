"""The client host of the multi-host test: concurrent greedy streams through several gateways.

    python -m tests.integration.multihost_client --targets A:P,B:P --streams N --max-tokens M

Stream i goes to target i % len(targets) with prompt PROMPTS[i % len(PROMPTS)]. Prints one
JSON line per event, flushed: {"event": "first", "stream": i} at a stream's first token, then
{"event": "done", "stream": i, "tokens": n, "finish_reason": r, "text": t} or
{"event": "failed", "stream": i, "code": c, "details": d}.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
from concurrent.futures import ThreadPoolExecutor

import grpc

from client.api import Completion, KvgateClient, sampling_params

PROMPTS = ["Once upon a time", "The cat", "A big red ball", "Tom had a toy", "The sun was"]
_print_lock = threading.Lock()


def say(**event: object) -> None:
    with _print_lock:
        print(json.dumps(event), flush=True)


def stream(index: int, target: str, max_tokens: int) -> None:
    completion = Completion()
    params = sampling_params(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    try:
        with KvgateClient(target, timeout_s=300.0) as client:
            for chunk in client.generate_stream(PROMPTS[index % len(PROMPTS)], params):
                if chunk.token_ids and not completion.token_ids:
                    say(event="first", stream=index)
                completion.add(chunk)
    except grpc.RpcError as error:
        say(event="failed", stream=index, code=error.code().name, details=error.details())
        return
    say(
        event="done",
        stream=index,
        tokens=len(completion.token_ids),
        finish_reason=completion.finish_reason,
        text=completion.text,
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.integration.multihost_client")
    parser.add_argument("--targets", required=True, help="comma-separated HOST:PORT")
    parser.add_argument("--streams", type=int, default=50)
    parser.add_argument("--max-tokens", type=int, default=480)
    args = parser.parse_args(argv)
    targets = args.targets.split(",")
    with ThreadPoolExecutor(args.streams) as pool:
        for index in range(args.streams):
            pool.submit(stream, index, targets[index % len(targets)], args.max_tokens)
    return 0


if __name__ == "__main__":
    sys.exit(main())
