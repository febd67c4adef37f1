"""`python -m gateway`: run one gateway (flags: `python -m gateway --help`)."""

from __future__ import annotations

import asyncio
import sys

from common.logs import setup_logging
from common.metrics import start_metrics_server
from gateway.config import config_from_args
from gateway.metrics import GatewayMetrics
from gateway.server import serve


def main(argv: list[str] | None = None) -> int:
    try:
        config = config_from_args(argv)
    except ValueError as error:
        print(f"gateway: {error}", file=sys.stderr)
        return 2
    setup_logging("gateway", config.log_level, config.log_format)
    metrics = GatewayMetrics()
    try:
        start_metrics_server(metrics.registry, config.metrics_host, config.metrics_port)
    except OSError as error:
        print(f"gateway: {error}", file=sys.stderr)
        return 2
    asyncio.run(serve(config, metrics))
    return 0


if __name__ == "__main__":
    sys.exit(main())
