"""Chaos under load: random kill -9 of executors, schedulers, gateways and the Redis master
while clients stream, then what became of every request.

    python -m tests.chaos [--duration-s 600] [--clients 12] [--model DIR]   (make chaos)

The stack: Redis with a replica and three sentinels, two schedulers, two executors and two
gateways, kept up by make run's supervisor (a killed process is started again). Clients send
greedy and seeded Generate requests to either gateway, through KvgateClient (its retry
policy on). Every --kill-every-s seconds on average one process is killed: an executor, a
scheduler, a gateway, or the Redis master (only while its replica is in sync, so that there
is one to promote). At the end it prints requests completed, failed by status, and lost: a
call that got neither its last chunk nor a status from kvgate (it must be 0); "broken" counts
completions with the wrong number of tokens (it must be 0 too). The clients run in a process
of their own (tests/chaos_load.py).
"""

from __future__ import annotations

import argparse
import collections
import json
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import redis

from deploy.models import choose_model
from deploy.stack import ROOT, Stack, StackConfig, free_port
from deploy.supervise import Supervisor

KINDS = ("executor", "scheduler", "gateway", "redis master")


def summary(outcomes: dict[str, int], kills: dict[str, int], duration_s: float) -> dict:
    failed = {k.removeprefix("failed "): v for k, v in outcomes.items() if k.startswith("failed")}
    return {
        "duration_s": round(duration_s, 1),
        "kills": kills,
        "requests": sum(outcomes.values()),
        "completed": outcomes.get("completed", 0),
        "failed_by_status": dict(sorted(failed.items())),
        "lost": outcomes.get("lost", 0),
        "broken": outcomes.get("broken", 0),
    }


def replica_in_sync(stack: Stack) -> bool:
    """Whether the master has a connected replica the sentinels could promote."""
    try:
        info = stack.redis().info("replication")
    except redis.RedisError:
        return False
    return info.get("role") == "master" and info.get("connected_slaves", 0) >= 1


def pick_victim(stack: Stack, rng: random.Random) -> tuple[str, str] | None:
    """(kind, process name) to kill now, or None when the kind drawn has nothing to kill."""
    kind = rng.choice(KINDS)
    if kind == "redis master":
        name = stack.ha.master_name_now() if replica_in_sync(stack) else None
        return (kind, name) if name in stack.procs else None
    names = [n for n in stack.procs if n.startswith(kind) and stack.procs[n].poll() is None]
    return (kind, rng.choice(names)) if names else None


def build_stack(model: str, log_dir: Path) -> Stack:
    config = StackConfig(
        model=model,
        port=free_port(),
        log_dir=log_dir,
        redis_sentinels=3,
        executor_flags=["--kv-cache-gib", "0.25", "--max-num-seqs", "32"],
        log_format="text",
    )
    stack = Stack(config)
    stack.start_all(num_executors=2)
    stack.start_scheduler("scheduler-standby", wait=False)
    stack.start_gateway("gateway-2", free_port())
    return stack


def run(args: argparse.Namespace) -> dict[str, object]:
    model = args.model or str(choose_model())
    kills: collections.Counter[str] = collections.Counter()
    rng = random.Random(args.seed)
    stack = build_stack(model, args.log_dir)
    supervisor = Supervisor(stack, say=lambda line: print(f"  {line}", flush=True))
    targets = ",".join(f"127.0.0.1:{port}" for port in stack.gateway_ports.values())
    print(f"chaos on {model}: {args.duration_s:g} s, logs in {args.log_dir}", flush=True)
    load = subprocess.Popen(
        [sys.executable, "-m", "tests.chaos_load", "--targets", targets, "--clients",
         str(args.clients), "--duration-s", str(args.duration_s), "--seed", str(args.seed)],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    start = time.monotonic()
    try:
        next_kill = start + rng.expovariate(1 / args.kill_every_s)
        while load.poll() is None:
            supervisor.poll()
            if time.monotonic() >= next_kill and time.monotonic() - start < args.duration_s:
                kill_one(stack, rng, kills)
                next_kill = time.monotonic() + rng.expovariate(1 / args.kill_every_s)
            time.sleep(0.2)
        outcomes = json.loads(load.stdout.read())
    finally:
        if load.poll() is None:
            load.kill()
        stack.stop_all()
    return summary(outcomes, dict(kills), time.monotonic() - start)


def kill_one(stack: Stack, rng: random.Random, kills: collections.Counter) -> None:
    victim = pick_victim(stack, rng)
    if victim is not None:
        kind, name = victim
        stack.procs[name].send_signal(signal.SIGKILL)
        kills[kind] += 1
        print(f"  kill -9 {name} ({kind})", flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.chaos", description=__doc__)
    parser.add_argument("--duration-s", type=float, default=600.0)
    parser.add_argument("--clients", type=int, default=12)
    parser.add_argument("--kill-every-s", type=float, default=8.0)
    parser.add_argument("--model", default="", help="default: make run's model")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--log-dir", type=Path, default=ROOT / ".run" / "chaos")
    parser.add_argument("--out", type=Path, default=None, help="also write the summary here")
    args = parser.parse_args(argv)
    summary = run(args)
    text = json.dumps(summary, indent=2)
    print(text)
    if args.out is not None:
        args.out.write_text(text + "\n")
    return 0 if summary["lost"] == 0 and summary["broken"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
