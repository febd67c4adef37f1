"""`kvgate bench scaling restart`: chat sessions through a rolling restart of two executors,
with KV moves on a drain against without them, in the same run.

A local stack with two executors serves `--sessions` chat sessions taking greedy turns on a few
workers: each turn's prompt is the previous prompt, its reply and a short new user message, sent
with the session's id. Once every session has taken `--warmup-turns` turns, executor-0 gets
SIGTERM; once it has exited it starts again, and once it serves executor-1 goes the same way.
The sessions keep taking turns until each has taken `--turns-after` more after the restart.

Both stacks run this: "moving" (the executors' KvTransfer on: a drain pushes each running turn's
and each idle session's KV to the peer) and "recompute" (`--kv-transfer-port -1`: a drain waits
for its running turns and the sessions' KV is lost). Per turn the JSON holds its status, prompt
and cached prompt tokens, and the session's executor after it (its SessionState in Redis). A
session's first turn after its executor changed is a turn after a move; its history is the
previous turn's prompt plus completion tokens, and what it re-prefilled is the history less its
cached prompt tokens (at least 0). Per side: failed turns, lost sessions (a turn after a move
that found under half its history cached, or a session gone from Redis), the mean re-prefilled
share of history over turns after a move, and each drain's seconds from the signal to the exit
with what moved (the executor's "moved to" log lines, the receiver's blocks in). It exits 1 when
the moving side failed a turn, lost a session or re-prefilled over 5% of history on average.
"""

from __future__ import annotations

import argparse
import queue
import re
import signal
import statistics
import threading
import time
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path

import grpc

from bench.harness import BenchFailure, Benchmark, add_model, load_average, scratch_folder
from client.api import Completion, KvgateClient, sampling_params
from common.model_files import default_gguf_path
from common.model_text import ModelText
from common.tenants import DEFAULT_TENANT
from deploy.models import SHARED_MODEL
from deploy.stack import Stack, StackConfig, free_port, wait_until
from protos.kvgate.v1 import inference_pb2, internal_pb2

SIDES = {"moving": [], "recompute": ["--kv-transfer-port", "-1"]}
EXECUTORS = ("executor-0", "executor-1")
MAX_REPREFILL_SHARE = 0.05  # the bar of the moving side
WORDS = ["cat", "dog", "ball", "tree", "sun", "boat", "bird", "cake", "park", "hat"]
DRAIN_TIMEOUT_S = 600.0
TURN_TIMEOUT_S = 300.0
MOVED_BLOCKS_IN = re.compile(
    r'^kvgate_executor_kv_moved_blocks_total\{direction="in"\} (\S+)$', re.MULTILINE
)


@dataclass(slots=True)
class Turn:
    """What one turn of a session gave."""

    session: int
    turn: int
    session_id: str  # the chat's id (a chat that outgrew the context starts over)
    ok: bool
    status: str  # "OK", a gRPC status code's name, or the finish reason of a cut turn
    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0
    completion_tokens: int = 0
    executor_id: str = ""  # the session's executor after the turn ("": gone from Redis)
    history_tokens: int = 0  # the previous turn's prompt plus completion tokens
    after_move: bool = False  # the session's first turn after its executor changed
    ttft_ms: float = 0.0  # time to first token, as the gateway timed it


@dataclass(slots=True)
class Session:
    """One chat: its id now, the token ids of its next turn's prompt, and its turns so far.
    A chat that would outgrow the model's context starts over under a new id."""

    index: int
    opening: list[int]
    session_id: str = ""
    prompt: list[int] = field(default_factory=list)
    turns: list[Turn] = field(default_factory=list)

    def start_over(self) -> None:
        self.session_id = f"restart-{self.index}-{time.time_ns() % 10**12}"
        self.prompt = list(self.opening)


def new_sessions(count: int, text: ModelText) -> list[Session]:
    sessions = []
    for i in range(count):
        a, b = WORDS[i % 10], WORDS[(i // 10) % 10]
        opening = f"Once upon a time, there was a little {a} who loved the {b}. One day, the {a}"
        sessions.append(Session(i, text.encode(opening)))
        sessions[-1].start_over()
    return sessions


def session_executor(stack: Stack, session_id: str) -> str:
    """The executor of the session's last turn in Redis ("" when the session is gone)."""
    raw = stack.redis().get(stack.keys.session(DEFAULT_TENANT, session_id))
    return "" if raw is None else internal_pb2.SessionState.FromString(raw).executor_id


def take_turn(stack: Stack, session: Session, max_tokens: int) -> Turn:
    """Sends the session's next turn, greedy; its reply's token ids join the prompt."""
    params = sampling_params(max_tokens=max_tokens, temperature=0.0)
    completion = Completion()
    index, number = session.index, len(session.turns)
    try:
        request = inference_pb2.GenerateRequest(
            prompt_token_ids=session.prompt, params=params, session_id=session.session_id
        )
        with KvgateClient(stack.address, retry=False) as client:
            for chunk in client.stub.Generate(request, timeout=TURN_TIMEOUT_S):
                completion.add(chunk)
    except grpc.RpcError as error:
        return Turn(index, number, session.session_id, False,
                    f"{error.code().name}: {error.details()}")  # fmt: skip
    if completion.finish_reason not in ("stop", "length") or completion.usage is None:
        return Turn(index, number, session.session_id, False, completion.finish_reason or "none")
    usage = completion.usage
    session.prompt += completion.token_ids
    return Turn(index, number, session.session_id, True, "OK", usage.prompt_tokens,
                usage.cached_prompt_tokens, usage.completion_tokens,
                session_executor(stack, session.session_id),
                ttft_ms=completion.timings.ttft_ms)  # fmt: skip


def record(session: Session, turn: Turn) -> None:
    """Adds the turn, with its history and whether it is the chat's first after a move."""
    done = [t for t in session.turns if t.ok and t.session_id == turn.session_id]
    if turn.ok and done:
        turn.history_tokens = done[-1].prompt_tokens + done[-1].completion_tokens
        turn.after_move = turn.executor_id != done[-1].executor_id
    session.turns.append(turn)


def next_prompt(session: Session, text: ModelText, max_tokens: int) -> None:
    """Adds a short user message to the prompt; starts the chat over when the next turn would
    not fit the model's context."""
    word = WORDS[len(session.turns) % len(WORDS)]
    session.prompt += text.encode(f" Then the {word} said hello.", add_special_tokens=False)
    if len(session.prompt) + max_tokens > text.limits.max_model_len:
        session.start_over()


class Chats:
    """The sessions taking turns on `workers` threads, round robin, until stopped."""

    def __init__(self, stack: Stack, sessions: list[Session], text: ModelText, args) -> None:
        self.stack, self.sessions, self.text = stack, sessions, text
        self.max_tokens = args.max_tokens
        self.waiting: queue.Queue[int] = queue.Queue()
        for index in range(len(sessions)):
            self.waiting.put(index)
        self.stop = threading.Event()
        self.error: BaseException | None = None
        self.threads = [
            threading.Thread(target=self._work, daemon=True) for _ in range(args.workers)
        ]
        for thread in self.threads:
            thread.start()

    def _work(self) -> None:
        try:
            self._take_turns()
        except BaseException as error:  # noqa: BLE001 (raised again by wait_turns)
            self.error = error
            self.stop.set()

    def _take_turns(self) -> None:
        while not self.stop.is_set():
            try:
                index = self.waiting.get(timeout=0.1)
            except queue.Empty:
                continue
            session = self.sessions[index]
            turn = take_turn(self.stack, session, self.max_tokens)
            record(session, turn)
            if turn.ok:
                next_prompt(session, self.text, self.max_tokens)
            self.waiting.put(index)

    def fewest_turns(self) -> int:
        return min(len(s.turns) for s in self.sessions)

    def wait_turns(self, count: int, what: str) -> None:
        """Waits until every session has taken `count` turns. Raises: a worker's error."""
        wait_until(lambda: self.stop.is_set() or self.fewest_turns() >= count, 3600.0, what)
        if self.error is not None:
            raise self.error

    def join(self) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join()


def moved_blocks_in(stack: Stack, executor_id: str) -> float:
    """The executor's kvgate_executor_kv_moved_blocks_total{direction="in"} now."""
    url = f"http://127.0.0.1:{stack.metrics_ports[executor_id]}/metrics"
    with urllib.request.urlopen(url, timeout=10.0) as reply:
        match = MOVED_BLOCKS_IN.search(reply.read().decode())
    return float(match.group(1)) if match else 0.0


def moved_lines(log: Path, offset: int) -> dict[str, int]:
    """The "draining: KIND NAME moved to PEER" lines of the log after `offset`, by kind."""
    with open(log, "rb") as file:
        file.seek(offset)
        text = file.read().decode(errors="replace")
    found = re.findall(r"draining: (request|session) \S+ moved to", text)
    return {kind: found.count(kind) for kind in ("request", "session")}


def restart(stack: Stack, executor_id: str, peer: str, moving: bool) -> dict:
    """SIGTERM to the executor, its exit awaited and timed, then it starts again and serves."""
    log = stack.log_path(executor_id)
    offset = log.stat().st_size
    blocks_before = moved_blocks_in(stack, peer)
    proc = stack.procs[executor_id]
    start = time.perf_counter()
    proc.send_signal(signal.SIGTERM)
    status = proc.wait(timeout=DRAIN_TIMEOUT_S)
    drain_s = time.perf_counter() - start
    blocks_in = moved_blocks_in(stack, peer) - blocks_before
    stack.start_executor(executor_id)
    if moving:  # the next drain pushes to it: its KvTransfer address must be known
        wait_until(lambda: bool(getattr(stack.executor_status(executor_id),
                                        "kv_transfer_address", "")), 60.0, executor_id)  # fmt: skip
    moved = moved_lines(log, offset)
    return {"executor": executor_id, "exit_status": status, "drain_s": drain_s,
            "requests_moved": moved["request"], "sessions_moved": moved["session"],
            "blocks_in_at_peer": blocks_in}  # fmt: skip


def stack_config(args: argparse.Namespace, folder: Path, side: str) -> StackConfig:
    flags = ["--num-gpu-blocks", str(args.num_gpu_blocks), "--block-size", "16",
             "--max-num-seqs", "64", *SIDES[side]]  # fmt: skip
    return StackConfig(
        model=args.model_path,
        port=free_port(),
        log_dir=folder / side,
        executor_flags=flags,
        scheduler_flags=["--batch-window-ms", "2"],
    )


def run_side(args: argparse.Namespace, folder: Path, side: str) -> dict:
    """One stack through the warm-up, the rolling restart and the turns after it."""
    stack = Stack(stack_config(args, folder, side))
    chats = None
    try:
        stack.start_all(num_executors=2)
        text = ModelText(args.model_path)
        sessions = new_sessions(args.sessions, text)
        chats = Chats(stack, sessions, text, args)
        chats.wait_turns(args.warmup_turns, "the warm-up")
        start = time.perf_counter()
        drains = [restart(stack, EXECUTORS[0], EXECUTORS[1], side == "moving"),
                  restart(stack, EXECUTORS[1], EXECUTORS[0], side == "moving")]  # fmt: skip
        restart_s = time.perf_counter() - start
        after = chats.fewest_turns() + args.turns_after
        chats.wait_turns(after, "the turns after the restart")
        chats.join()
        gone = [
            s.session_id
            for s in sessions
            if chatted(s) and not session_executor(stack, s.session_id)
        ]
    finally:
        if chats is not None:
            chats.stop.set()
        stack.stop_all()
    return side_figures(sessions, drains, restart_s, gone)


def chatted(session: Session) -> bool:
    """Whether the session's chat now has a turn done (so a SessionState in Redis)."""
    return any(t.ok and t.session_id == session.session_id for t in session.turns)


def reprefill_share(turns: list[Turn]) -> float | None:
    """The mean over `turns` of history less cached prompt tokens (at least 0), over history."""
    shares = [max(t.history_tokens - t.cached_prompt_tokens, 0) / t.history_tokens for t in turns]
    return statistics.fmean(shares) if shares else None


def median_ttft(turns: list[Turn]) -> float | None:
    return statistics.median(t.ttft_ms for t in turns) if turns else None


def side_figures(
    sessions: list[Session], drains: list[dict], restart_s: float, gone: list[str]
) -> dict:
    turns = [t for s in sessions for t in s.turns]
    moved = [t for t in turns if t.after_move]
    stayed = [t for t in turns if t.history_tokens and not t.after_move]
    lost = {t.session for t in moved if t.cached_prompt_tokens < t.history_tokens / 2}
    lost |= {i for i, s in enumerate(sessions) if s.session_id in gone}
    failed = [t for t in turns if not t.ok]
    return {
        "turns": len(turns),
        "failed_turns": len(failed),
        "failures": sorted({t.status for t in failed}),
        "turns_after_a_move": len(moved),
        "lost_sessions": len(lost),
        "sessions_gone_from_redis": len(gone),
        "reprefill_share_after_move_mean": reprefill_share(moved),
        # the same over later turns of a chat that stayed on its executor: what a turn costs
        # with no move (the last reply token's KV is never computed)
        "reprefill_share_stayed_mean": reprefill_share(stayed),
        # TTFT of the turns after a move against the later turns that stayed, same run
        "ttft_ms_after_move_median": median_ttft(moved),
        "ttft_ms_stayed_median": median_ttft(stayed),
        "history_tokens_after_move_mean": (
            statistics.fmean(t.history_tokens for t in moved) if moved else None
        ),
        "drains": drains,
        "restart_s": restart_s,
        "lost_session_indices": sorted(lost),
        "turns_after_a_move_records": [asdict(t) for t in moved],
    }


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model(
        parser, str(SHARED_MODEL), "model folder, GGUF file or smollm2 (default: stories260K)"
    )
    add = parser.add_argument
    add("--sessions", type=int, default=64, help="chat sessions taking turns")
    add("--workers", type=int, default=4, help="turns at once")
    add("--max-tokens", type=int, default=32, help="reply tokens of a turn (greedy)")
    add("--warmup-turns", type=int, default=2, help="turns of every session before the restart")
    add("--turns-after", type=int, default=1, help="turns of every session after the restart")
    add("--num-gpu-blocks", type=int, default=2048, help="KV blocks of each executor")
    add("--log-dir", type=Path, default=None, help="keep the stacks' logs here (SIDE/NAME.log)")


POSITIVE_FLAGS = ("sessions", "workers", "max_tokens", "warmup_turns", "turns_after")


def run(args: argparse.Namespace) -> dict:
    """`kvgate bench scaling restart`. Raises: BenchFailure on a flag under 1."""
    for name in POSITIVE_FLAGS:
        if getattr(args, name) < 1:
            raise BenchFailure(f"--{name.replace('_', '-')} must be at least 1")
    args.model_path = str(default_gguf_path()) if args.model == "smollm2" else args.model
    flags = (*POSITIVE_FLAGS, "num_gpu_blocks")
    result: dict = {"model": args.model_path, **{name: getattr(args, name) for name in flags}}
    result["load_average_at_start"] = load_average()
    with scratch_folder("kvgate-restart-") as scratch:
        for side in SIDES:
            result[side] = run_side(args, args.log_dir or scratch, side)
    result["load_average_at_end"] = load_average()
    return result


ROWS = [("failed turns", "failed_turns"), ("lost sessions", "lost_sessions"),
        ("turns after a move", "turns_after_a_move"),
        ("re-prefilled share", "reprefill_share_after_move_mean"),
        ("(turns that stayed)", "reprefill_share_stayed_mean"),
        ("TTFT ms after a move", "ttft_ms_after_move_median"),
        ("(turns that stayed)", "ttft_ms_stayed_median"), ("turns", "turns")]  # fmt: skip


def summarize(result: dict) -> None:
    print(f"{'rolling restart':<24}{'moving':>12}{'recompute':>12}")
    for label, key in ROWS:
        cells = [result[side][key] for side in SIDES]
        print(f"{label:<24}" + "".join(f"{c:>12.3f}" if isinstance(c, float) else f"{c!s:>12}"
                                       for c in cells))  # fmt: skip
    for i, name in enumerate(EXECUTORS):
        drains = [result[side]["drains"][i] for side in SIDES]
        print(f"{name + ' drain s':<24}" + "".join(f"{d['drain_s']:>12.2f}" for d in drains))
        print(f"{name + ' moved':<24}" + "".join(
            f"{str(d['requests_moved']) + 'r ' + str(d['sessions_moved']) + 's':>12}"
            for d in drains))  # fmt: skip


def failure(result: dict) -> str | None:
    """The moving side failed a turn, lost a session or re-prefilled over the bar."""
    moving = result["moving"]
    share = moving["reprefill_share_after_move_mean"]
    if moving["failed_turns"]:
        return f"{moving['failed_turns']} failed turn(s) with KV moves: {moving['failures']}"
    if moving["lost_sessions"]:
        return f"{moving['lost_sessions']} session(s) lost with KV moves"
    if share is None:
        return "no turn came after a move: the restart moved no session"
    if share > MAX_REPREFILL_SHARE:
        return f"re-prefilled {share:.1%} of history after a move (the bar: 5%)"
    return None


BENCHMARKS = {
    "scaling restart": Benchmark(add_arguments, run, "restart.json", summarize, failure),
}
