"""Shared test helpers: the stories260K path, waiting for a condition, a private
redis-server, seeded random checkpoints, an engine, greedy parameters and runs, greedy
references."""

from __future__ import annotations

import json
import shutil
import subprocess
import time
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import pytest
import redis
import torch

REPO = Path(__file__).resolve().parent.parent
STORIES_260K = REPO.parent / "shared" / "models" / "stories260K"
NEAR_TIE = 1e-4  # a divergence is accepted only where the reference's top-2 logits are this close
WAIT_S = 10.0  # how long wait_for waits unless told
T = TypeVar("T")


def wait_for(probe: Callable[[], T], what: str, timeout_s: float = WAIT_S) -> T:
    """Polls `probe` until it returns something true, and returns that; fails the test naming
    `what` when it does not within `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while not (value := probe()):
        if time.monotonic() > deadline:
            pytest.fail(f"expected {what} within {timeout_s:g} s; it did not happen")
        time.sleep(0.01)
    return value


@contextmanager
def redis_server(folder: Path) -> Iterator[str]:
    """A private redis-server on a unix socket in `folder` (no TCP port to collide with).

    Yields: its URL.
    """
    binary = shutil.which("redis-server")
    assert binary, "redis-server is required (make redis)"
    socket_path = folder / "redis.sock"
    argv = [binary, "--port", "0", "--unixsocket", str(socket_path), "--save", "",
            "--appendonly", "no"]  # fmt: skip
    process = subprocess.Popen(argv, stdout=subprocess.DEVNULL)
    try:
        client = redis.Redis(unix_socket_path=str(socket_path))
        wait_for(lambda: _answers(client), "redis-server to answer")
        client.close()
        yield f"unix://{socket_path}"
    finally:
        process.terminate()
        process.wait()


def _answers(client: redis.Redis) -> bool:
    try:
        return bool(client.ping())
    except (redis.ConnectionError, FileNotFoundError):
        return False


@dataclass
class GreedyReference:
    token_ids: list[int]
    top2_gaps: list[float]  # logit gap between the best and second-best token at each step


def hf_greedy(model, prompt_ids: list[int], max_new_tokens: int) -> GreedyReference:
    """Greedy continuation by `transformers` with its KV cache, EOS ignored, with logit gaps.

    A plain loop over the model's forward rather than `generate`, so that no generation
    default (EOS stopping, min-length masking) can change the reference.
    """
    tokens: list[int] = []
    gaps: list[float] = []
    inputs = torch.tensor([prompt_ids])
    past = None
    with torch.no_grad():
        for _ in range(max_new_tokens):
            out = model(input_ids=inputs, cache=past, use_cache=True)
            past = out.cache
            logits = out.logits[0, -1].float()
            top2 = logits.topk(2)
            tokens.append(int(top2.indices[0]))
            gaps.append(float(top2.values[0] - top2.values[1]))
            inputs = torch.tensor([[tokens[-1]]])
    return GreedyReference(tokens, gaps)


def assert_greedy_matches(got: list[int], ref: GreedyReference, label: str) -> None:
    """Token-for-token equality; a divergence is tolerated only at a float32 near-tie.

    At such a step both tokens are correct answers, so comparison stops there and the
    divergence is reported as a warning.
    """
    for step, (g, r) in enumerate(zip(got, ref.token_ids, strict=False)):
        if g == r:
            continue
        if ref.top2_gaps[step] < NEAR_TIE:
            warnings.warn(
                f"{label}: diverged at step {step} on a near-tie (top-2 gap "
                f"{ref.top2_gaps[step]:.2e}); stopped comparing there",
                stacklevel=2,
            )
            return
        raise AssertionError(
            f"{label}: step {step} expected token {r} (top-2 gap {ref.top2_gaps[step]:.3g}), "
            f"got {g}\nexpected {ref.token_ids}\ngot      {got}"
        )
    assert len(got) == len(ref.token_ids), (
        f"{label}: expected {len(ref.token_ids)} tokens, got {len(got)}"
    )


def randomize_weights(model: torch.nn.Module, seed: int) -> None:
    """Give every parameter (biases and norm weights too) seeded random values."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=gen)
            if "norm" in name:
                param.copy_(1.0 + 0.1 * noise)
            elif name.endswith("bias"):
                param.copy_(0.1 * noise)
            else:
                param.copy_(0.05 * noise)


def save_random_llama(folder: Path, seed: int = 16, **shape) -> torch.nn.Module:
    """A Llama of `shape` (LlamaConfig's fields) with seeded random weights
    (randomize_weights), saved to `folder` with save_pretrained.

    Returns: the model, in eval mode (a transformers reference for the same weights).
    """
    from transformers import LlamaConfig, LlamaForCausalLM  # slow import: only when used

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**shape))
    randomize_weights(model, seed=seed)
    model.eval().save_pretrained(folder)
    return model


def move_rope_theta_to_top_level(model_dir: Path) -> None:
    """Rewrite config.json the way older checkpoints spell it: rope_theta at top level."""
    path = model_dir / "config.json"
    config = json.loads(path.read_text())
    params = config.pop("rope_parameters", None) or {}
    config["rope_theta"] = params.get("rope_theta", 10000.0)
    scaling = {k: v for k, v in params.items() if k != "rope_theta"}
    if scaling.get("rope_type", "default") != "default":
        config["rope_scaling"] = scaling
    path.write_text(json.dumps(config, indent=2))


def make_engine(model: str | Path = STORIES_260K, **overrides):
    """An in-process Engine on `model` (stories260K unless told), with a 0.02 GiB KV cache
    unless `overrides` say otherwise (any EngineConfig field)."""
    from engine.config import EngineConfig  # here: most tests run no engine
    from engine.engine import Engine

    if "num_gpu_blocks" not in overrides:
        overrides.setdefault("kv_cache_gib", 0.02)
    return Engine(EngineConfig(model=str(model), **overrides))


def greedy(max_tokens: int, **fields):
    """Greedy SamplingParams that run all `max_tokens` (end-of-sequence ignored)."""
    from common.sampling_params import SamplingParams

    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **fields)


def step_outputs(engine, max_steps: int = 100_000) -> list:
    """Step the engine until every request finished; every step's outputs, in order."""
    outputs = []
    for _ in range(max_steps):
        if not engine.has_unfinished():
            return outputs
        outputs.extend(engine.step())
    raise AssertionError(f"engine still had unfinished requests after {max_steps} steps")


def run_to_completion(engine, max_steps: int = 100_000) -> dict[str, list[int]]:
    """Step the engine until every request finished; tokens per request id."""
    tokens: dict[str, list[int]] = {}
    for output in step_outputs(engine, max_steps):
        tokens.setdefault(output.request_id, []).extend(output.new_token_ids)
    return tokens


def greedy_tokens(engine, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """Each prompt's greedy continuation of `max_tokens` tokens, run together on `engine`."""
    for i, prompt in enumerate(prompts):
        engine.add_request(f"p{i}", prompt, greedy(max_tokens))
    tokens = run_to_completion(engine)
    return [tokens[f"p{i}"] for i in range(len(prompts))]


def hf_generate(model, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """Greedy tokens of `transformers` generate itself (stops early only at the model's EOS)."""
    ids = torch.tensor([prompt_ids])
    with torch.no_grad():
        out = model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
            do_sample=False, pad_token_id=0,
        )  # fmt: skip
    return out[0, len(prompt_ids) :].tolist()


@contextmanager
def one_torch_thread() -> Iterator[None]:
    """One torch thread inside the block. For tests of SmolLM2-sized models: on a shared
    2-core machine two threads that wait on each other at every matmul made an engine test 10x
    slower (a thin matmul took 16 ms instead of 0.55 ms at load 5); results do not depend on it.
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def chat_ids(tokenizer, messages: list[dict[str, str]]) -> list[int]:
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=False)
