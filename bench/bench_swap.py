"""The KV host tier on chat sessions that overflow the device: with it against without it,
in one process, in the same run.

    python -m bench.bench_swap --out bench/results/swap_smollm2.json
    python -m bench.bench_swap --model ../shared/models/stories260K --out ...

Twice as many sessions as the device KV cache holds take turns: every session's turn 1, then
every session's turn 2 (turn 1 with its reply, then a new user message). Without a host tier
the sessions evicted under pressure are dropped and their turn 2 prefills the whole history;
with one (`--swap-space-gib`) they were moved to host memory, and turn 2 copies them back
and prefills only the new message. Both engines run the same turns, interleaved turn by turn
so that other work on the machine falls on both alike. Reports per engine the turn-2 prefill
tokens (prompt minus cached) and time to first token, and checks the replies are the same.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

from common.model_files import default_gguf_path
from common.sampling_params import SamplingParams
from engine.config import EngineConfig
from engine.engine import Engine

ENGINES = ("host_tier", "no_host_tier")


def session_prompts(num_sessions: int, prompt_len: int, vocab_size: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(0)
    return torch.randint(3, vocab_size, (num_sessions, prompt_len), generator=gen).tolist()


def run_turn(engine: Engine, request_id: str, session_id: str, prompt: list[int], max_tokens: int):
    """One turn alone: (reply tokens, prefill tokens, seconds to the first token)."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    engine.add_request(request_id, prompt, params, session_id=session_id)
    reply, ttft_s, cached = [], None, 0
    while engine.has_unfinished():
        for out in engine.step():
            if ttft_s is None:
                ttft_s, cached = time.perf_counter() - start, out.num_cached_tokens
            reply.extend(out.new_token_ids)
    return reply, len(prompt) - cached, ttft_s


def build_engines(args: argparse.Namespace, model: str) -> dict[str, Engine]:
    common = dict(
        model=model,
        block_size=args.block_size,
        num_gpu_blocks=args.device_sessions * args.blocks_per_session,
        max_num_seqs=4,
    )
    return {
        "host_tier": Engine(EngineConfig(**common, swap_space_gib=args.swap_space_gib)),
        "no_host_tier": Engine(EngineConfig(**common)),
    }


def run(args: argparse.Namespace) -> dict:
    model = str(default_gguf_path()) if args.model == "smollm2" else args.model
    engines = build_engines(args, model)
    num_sessions = 2 * args.device_sessions
    vocab = engines["host_tier"].model_config.vocab_size
    turn1 = session_prompts(num_sessions, args.prompt_len, vocab)
    news = session_prompts(num_sessions, args.new_len, vocab)
    replies = {name: [] for name in ENGINES}
    for i, prompt in enumerate(turn1):  # every turn 1: the later half evicts the earlier
        for name in ENGINES:
            reply, _, _ = run_turn(engines[name], f"s{i}-1", f"s{i}", prompt, args.reply_len)
            replies[name].append(reply)
        print(f"session {i}: turn 1 done", file=sys.stderr, flush=True)
    if replies["host_tier"] != replies["no_host_tier"]:
        raise SystemExit("turn 1 replies differ between the engines")
    turn2 = {name: [] for name in ENGINES}
    for i in range(num_sessions):
        prompt = turn1[i] + replies["host_tier"][i] + news[i]
        for name in ENGINES:
            turn2[name].append(run_turn(engines[name], f"s{i}-2", f"s{i}", prompt, args.reply_len))
        print(f"session {i}: turn 2 done", file=sys.stderr, flush=True)
    same = turn2["host_tier"] and all(
        a[0] == b[0] for a, b in zip(turn2["host_tier"], turn2["no_host_tier"], strict=True)
    )
    return summarize(args, model, engines, turn2, same)


def summarize(args, model: str, engines: dict[str, Engine], turn2: dict, same: bool) -> dict:
    result = {
        "model": model,
        "sessions": 2 * args.device_sessions,
        "sessions_the_device_holds": args.device_sessions,
        "device_blocks": args.device_sessions * args.blocks_per_session,
        "block_size": args.block_size,
        "turn1_prompt_tokens": args.prompt_len,
        "reply_tokens": args.reply_len,
        "turn2_new_tokens": args.new_len,
        "swap_space_gib": args.swap_space_gib,
        "torch_threads": torch.get_num_threads(),
        "load_average_1m_at_end": os.getloadavg()[0],
        "turn2_replies_identical": bool(same),
    }
    for name, turns in turn2.items():
        stats = engines[name].stats()
        result[name] = {
            "turn2_prefill_tokens": sum(t[1] for t in turns),
            "turn2_ttft_s_median": statistics.median(t[2] for t in turns),
            "turn2_ttft_s_mean": statistics.fmean(t[2] for t in turns),
            "swapped_out_blocks": stats.num_swapped_out_blocks,
            "swapped_in_blocks": stats.num_swapped_in_blocks,
            "offloaded_sessions": stats.num_offloaded_sessions,
            "dropped_sessions": stats.num_evicted_sessions,
        }
    with_tier, without = result["host_tier"], result["no_host_tier"]
    result["prefill_tokens_ratio"] = (
        with_tier["turn2_prefill_tokens"] / without["turn2_prefill_tokens"]
    )
    result["ttft_median_ratio"] = with_tier["turn2_ttft_s_median"] / without["turn2_ttft_s_median"]
    return result


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.bench_swap", description=__doc__)
    add = parser.add_argument
    add("--model", default="smollm2", help="checkpoint folder, GGUF file or smollm2")
    add("--device-sessions", type=int, default=8, help="sessions the device KV cache holds")
    add("--prompt-len", type=int, default=256, help="turn 1 prompt tokens")
    add("--reply-len", type=int, default=32, help="reply tokens of each turn")
    add("--new-len", type=int, default=32, help="turn 2's new message tokens")
    add("--block-size", type=int, default=16)
    add("--swap-space-gib", type=float, default=1.0)
    add("--out", type=Path, default=None, help="write the results as JSON here")
    args = parser.parse_args(argv)
    turn2_len = args.prompt_len + 2 * args.reply_len + args.new_len
    args.blocks_per_session = -(-turn2_len // args.block_size)
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    result = run(args)
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
