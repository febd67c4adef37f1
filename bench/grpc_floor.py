"""A do-nothing Inference server: the floor of a Python gRPC streaming call on this machine.

    python -m bench.grpc_floor --port 50099

`Generate` answers at once with one chunk holding one token and a last chunk, on the same
grpc.aio server stack as the gateway (its interceptors included) and no Redis, scheduler or
model behind it. bench_serve times it with the client it times the stack with: the part of
the stack's TTFT that any Python gRPC front end pays before doing any work.
"""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import AsyncIterator

from grpc import aio

from gateway.errors import ErrorInterceptor
from gateway.metrics import GatewayMetrics, MetricsInterceptor
from protos.kvgate.v1 import inference_pb2, inference_pb2_grpc


class InstantInference(inference_pb2_grpc.InferenceServicer):
    async def Generate(  # noqa: N802 (gRPC method name)
        self, request: inference_pb2.GenerateRequest, context: aio.ServicerContext
    ) -> AsyncIterator[inference_pb2.GenerateResponse]:
        yield inference_pb2.GenerateResponse(request_id=request.request_id, token_ids=[1])
        yield inference_pb2.GenerateResponse(
            request_id=request.request_id, finish_reason=inference_pb2.FINISH_REASON_LENGTH
        )


async def serve(host: str, port: int) -> None:
    server = aio.server(interceptors=[MetricsInterceptor(GatewayMetrics()), ErrorInterceptor()])
    inference_pb2_grpc.add_InferenceServicer_to_server(InstantInference(), server)
    server.add_insecure_port(f"{host}:{port}")
    await server.start()
    await server.wait_for_termination()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args(argv)
    asyncio.run(serve(args.host, args.port))


if __name__ == "__main__":
    main()
