"""`python -m engine.rank`: one follower rank of a tensor-parallel executor, started by its
rank 0 (engine/ranks.py), never by hand. It loads its share of the model and KV cache, runs
rank 0's steps, and exits when rank 0 stops it or dies (SIGINT and SIGTERM are ignored)."""

from __future__ import annotations

import argparse
import json
import logging
import signal
import sys

import torch

from engine.config import EngineConfig
from engine.model_runner import ModelRunner
from engine.ranks import RankGroup, die_with_parent


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m engine.rank")
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--store-port", type=int, required=True)
    parser.add_argument("--parent-pid", type=int, required=True)
    parser.add_argument("--torch-threads", type=int, required=True)
    parser.add_argument("--engine-config", required=True, help="EngineConfig fields as JSON")
    args = parser.parse_args(argv)
    die_with_parent(args.parent_pid)
    # A follower lives exactly as long as rank 0, which stops it: a Ctrl-C at a terminal or a
    # SIGTERM to the process group drains rank 0, and its steps still need this rank.
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, signal.SIG_IGN)
    logging.basicConfig(level=logging.WARNING, format=f"rank {args.rank}: %(message)s")
    torch.set_num_threads(args.torch_threads)
    config = EngineConfig(**json.loads(args.engine_config))
    group = RankGroup.join(config, args.rank, args.store_port)
    ModelRunner(config, group).follow()
    group.leave()
    return 0


if __name__ == "__main__":
    sys.exit(main())
