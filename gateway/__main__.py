"""`python -m gateway`: run one gateway (flags: `python -m gateway --help`)."""

from __future__ import annotations

import asyncio
import functools
import sys

from common.startup import start_process
from gateway.config import config_from_args
from gateway.metrics import GatewayMetrics
from gateway.server import ListenError, serve


def main(argv: list[str] | None = None) -> int:
    started = start_process("gateway", functools.partial(config_from_args, argv), GatewayMetrics)
    if started is None:
        return 2
    config, metrics = started
    try:
        asyncio.run(serve(config, metrics))
    except ListenError as error:
        print(f"gateway: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
