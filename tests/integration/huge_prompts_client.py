"""Clients that each send one huge prompt, in a process of their own (so that their sending
does not take the GIL from the test's own streaming thread), and the cheapest server that
refuses them, for reference.

    python -m tests.integration.huge_prompts_client --target HOST:PORT --chars N --clients C

Prints one JSON line: a list of {"code": name, "details": text, "seconds": s} per client.

    python -m tests.integration.huge_prompts_client --serve

Serves the Inference service on a free port (printed on one line) with a Generate that
refuses every request at once, unparsed: what a refusal costs once gRPC has received the
message, on this machine, now. It stops when its stdin closes.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import threading
import time
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor

import grpc
from grpc import aio

from protos.kvgate.v1 import inference_pb2, inference_pb2_grpc


def huge_prompt(chars: int) -> str:
    return ("Once upon a time there was a little cat. " * (chars // 40 + 1))[:chars]


def send(
    target: str, request: inference_pb2.GenerateRequest, start_together: threading.Barrier
) -> dict[str, object]:
    """Connects (by a first small call: right after grpc.channel_ready_future, the next call
    took 200 ms more, grpcio 1.85), waits for every other client to have connected too, then
    sends `request`: its seconds count from the send to the status, not the handshake."""
    options = [("grpc.max_send_message_length", -1)]
    with grpc.insecure_channel(target, options) as channel:
        stub = inference_pb2_grpc.InferenceStub(channel)
        try:
            stub.GetModelInfo(inference_pb2.GetModelInfoRequest(), timeout=60)
        except grpc.RpcError as error:
            if error.code() == grpc.StatusCode.UNAVAILABLE:
                raise  # not connected (any answer of the server is a connection)
        start_together.wait(timeout=60)
        start = time.monotonic()
        try:
            list(stub.Generate(request, timeout=60))
            code, details = "OK", ""
        except grpc.RpcError as error:
            code, details = error.code().name, error.details()
    return {"code": code, "details": details[:200], "seconds": time.monotonic() - start}


async def refuse(request: bytes, context: aio.ServicerContext) -> AsyncIterator[bytes]:
    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "prompt: refused unread")
    yield b""


async def serve_refusing() -> None:
    generate = grpc.unary_stream_rpc_method_handler(refuse)
    handlers = grpc.method_handlers_generic_handler("kvgate.v1.Inference", {"Generate": generate})
    server = aio.server(options=[("grpc.max_receive_message_length", -1)])
    server.add_generic_rpc_handlers((handlers,))
    print(server.add_insecure_port("127.0.0.1:0"), flush=True)
    await server.start()
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
    await server.stop(0)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--serve", action="store_true")
    parser.add_argument("--target")
    parser.add_argument("--chars", type=int)
    parser.add_argument("--clients", type=int)
    args = parser.parse_args()
    if args.serve:
        asyncio.run(serve_refusing())
        return
    request = inference_pb2.GenerateRequest(prompt=huge_prompt(args.chars))
    start_together = threading.Barrier(args.clients)
    with ThreadPoolExecutor(args.clients) as pool:
        results = list(
            pool.map(lambda _: send(args.target, request, start_together), range(args.clients))
        )
    print(json.dumps(results), flush=True)


if __name__ == "__main__":
    main()
