"""A real executor process with --tensor-parallel-size 2 behind a real gateway and Redis: the
streams carry the greedy tokens of a one-rank engine, for stories260K and for a seeded random
Llama with biases on every projection; killing the executor with SIGKILL leaves
no follower rank behind; a follower that dies makes its executor exit (status 70, like a
crash), so the gateway moves its requests elsewhere."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest

from client.api import KvgateClient
from common.sampling_params import SamplingParams
from tests.helpers import make_engine, run_to_completion, save_random_llama, wait_for
from tests.integration.conftest import MODEL, generate

EXECUTOR = "executor-0"
PROMPTS = ["Once upon a time", "The little dog", "Lily and Ben went", "One day, a bird"]
MAX_TOKENS = 24


def one_rank_tokens(prompt_ids: list[list[int]], model: Path = MODEL) -> list[list[int]]:
    """Greedy tokens of an in-process one-rank engine, the prompts run concurrently."""
    engine = make_engine(model, num_gpu_blocks=512, block_size=16)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
    for i, ids in enumerate(prompt_ids):
        engine.add_request(str(i), ids, params)
    tokens = run_to_completion(engine)
    return [tokens[str(i)] for i in range(len(prompt_ids))]


def child_pids(pid: int) -> list[int]:
    """The live children of process `pid` (every thread's)."""
    children = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            children += [int(c) for c in (task / "children").read_text().split()]
        except FileNotFoundError:  # a thread that ended since the listing
            continue
    return children


def command_line(pid: int) -> str:
    return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()


def running(pid: int) -> bool:
    """Whether `pid` is alive (a zombie no parent has reaped yet counts as gone)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state not in ("Z", "X")


@pytest.fixture(scope="module")
def stack(stack_factory):
    return stack_factory(executor_flags=["--tensor-parallel-size", "2"])


def followers_of(proc: subprocess.Popen) -> list[int]:
    followers = [p for p in child_pids(proc.pid) if "engine.rank" in command_line(p)]
    assert len(followers) == 1, f"expected one follower rank under the executor, got {followers}"
    return followers


def assert_one_ranks_tokens(stack, model: Path) -> None:
    """The prompts, sent at once through the stack, stream a one-rank engine's greedy tokens."""
    with KvgateClient(stack.address, timeout_s=60) as client:
        prompt_ids = [client.tokenize(p) for p in PROMPTS]
    expected = one_rank_tokens(prompt_ids, model)
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        completions = list(
            pool.map(lambda p: generate(stack.address, p, max_tokens=MAX_TOKENS), PROMPTS)
        )
    got = [c.token_ids for c in completions]
    assert got == expected, f"two ranks through the stack gave {got}, one rank {expected}"


def test_two_ranks_serve_one_ranks_greedy_tokens_and_die_with_the_executor(stack):
    assert_one_ranks_tokens(stack, MODEL)

    followers = followers_of(stack.procs[EXECUTOR])
    stack.stop(EXECUTOR, signal.SIGKILL)
    wait_for(
        lambda: not any(running(p) for p in followers),
        f"follower ranks {followers} to exit after the executor's SIGKILL",
    )


def random_llama(folder: Path) -> Path:
    """Seeded random weights of 4 query and 2 key/value heads (head_dim 16), biases on every
    projection, stories260K's vocabulary and tokenizer (so the gateway can tokenize)."""
    save_random_llama(folder, vocab_size=512, hidden_size=64, intermediate_size=112,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=256, tie_word_embeddings=False,
                      attention_bias=True, mlp_bias=True)  # fmt: skip
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(MODEL / name, folder / name)
    return folder


def test_two_ranks_serve_a_random_llamas_one_rank_tokens(stack_factory, tmp_path_factory):
    model = random_llama(tmp_path_factory.mktemp("random-llama"))
    stack = stack_factory(model=model, executor_flags=["--tensor-parallel-size", "2"])
    assert_one_ranks_tokens(stack, model)
    stack.stop_all()  # two ranks fewer on the cores for the tests after this one


def send_until_exit(address: str, executor: subprocess.Popen) -> None:
    """Requests that make the executor step, one after another until it exits (no executor is
    left to answer them)."""
    while executor.poll() is None:
        try:
            generate(address, PROMPTS[0], timeout_s=30.0, max_tokens=4)
        except grpc.RpcError:
            pass


def test_a_dead_follower_makes_its_executor_exit_as_a_crash(stack):
    if EXECUTOR in stack.procs:
        stack.stop(EXECUTOR)
    # The requests below must reach the executor under test, not a dead one's heartbeat.
    wait_for(lambda: stack.executor_status(EXECUTOR) is None, f"{EXECUTOR}'s heartbeat gone", 30.0)
    stack.start_executor("executor-1")
    executor = stack.procs["executor-1"]
    (follower,) = followers_of(executor)
    os.kill(follower, signal.SIGKILL)
    threading.Thread(target=send_until_exit, args=(stack.address, executor), daemon=True).start()
    wait_for(lambda: executor.poll() is not None, "executor-1's exit after its follower's", 120.0)
    status = executor.returncode
    log = stack.log_path("executor-1").read_text()
    assert status == 70, f"expected exit status 70, got {status}; log tail: {log[-2000:]}"
    assert "tensor parallel: a step failed on the ranks" in log, log[-2000:]
