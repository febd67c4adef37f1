"""Clients that each send one huge prompt, in a process of their own (so that their sending
does not take the GIL from the test's own streaming thread).

    python -m tests.integration.huge_prompts_client --target HOST:PORT --chars N --clients C

Prints one JSON line: a list of {"code": name, "details": text, "seconds": s} per client.
"""

from __future__ import annotations

import argparse
import json
import time
from concurrent.futures import ThreadPoolExecutor

import grpc

from protos.kvgate.v1 import inference_pb2, inference_pb2_grpc


def huge_prompt(chars: int) -> str:
    return ("Once upon a time there was a little cat. " * (chars // 40 + 1))[:chars]


def send(target: str, request: inference_pb2.GenerateRequest) -> dict[str, object]:
    with grpc.insecure_channel(target) as channel:
        stub = inference_pb2_grpc.InferenceStub(channel)
        start = time.monotonic()
        try:
            list(stub.Generate(request, timeout=60))
            code, details = "OK", ""
        except grpc.RpcError as error:
            code, details = error.code().name, error.details()
    return {"code": code, "details": details[:200], "seconds": time.monotonic() - start}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--target", required=True)
    parser.add_argument("--chars", type=int, required=True)
    parser.add_argument("--clients", type=int, required=True)
    args = parser.parse_args()
    request = inference_pb2.GenerateRequest(prompt=huge_prompt(args.chars))
    with ThreadPoolExecutor(args.clients) as pool:
        results = list(pool.map(lambda _: send(args.target, request), range(args.clients)))
    print(json.dumps(results), flush=True)


if __name__ == "__main__":
    main()
