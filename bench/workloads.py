"""Benchmark workloads: what each request asks, built as text of a chosen token length.

- random: prompt and output lengths drawn uniformly from
  [len * (1 - range_ratio), len * (1 + range_ratio)] (range_ratio 0: every request the same);
- shared-prefix: num_prefixes prefixes of prefix_len tokens, each followed by
  num_requests / num_prefixes different suffixes of input_len tokens, in a shuffled order;
- chat: sessions of num_turns turns (num_requests / num_turns sessions); each turn appends
  a user message of input_len tokens to the conversation and asks for output_len tokens.

Prompts are random words: a built-in list of English words, or the words of the model's
tokenizer vocabulary (--prompt-words vocab, read from --model: for a tokenizer that makes
one unknown token of every English word). Their token count is measured with the served model's
tokenizer (the gateway's Tokenize call) and words are added or removed until it is the
requested length, or within one word of it. Outputs are exact: requests set ignore_eos and
max_tokens.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from common.gguf_metadata import GgufFile
from common.model_files import gguf_file

WORKLOADS = ("random", "shared-prefix", "chat")
WORDS = (
    "the a little girl boy dog cat bird tree house sun moon day night happy sad big small "
    "red blue green ran jumped played saw found liked wanted went came said asked looked "
    "friend mom dad ball toy park garden flower rain sky water fish cake box door window "
    "and then but so very too with on in under over near far away home again together "
    "once upon time lived named Lily Tom Ben Sue who was had would could every one two"
).split()
# Rounds of measuring and correcting a prompt's length before taking the closest found.
MAX_FIT_ROUNDS = 6

# The served model's token count of a prompt text, special tokens (BOS) included.
TokenCounter = Callable[[str], int]
# A random text of a token count; whole_prompt=False: not counting the BOS token.
TextMaker = Callable[..., str]


@dataclass(slots=True)
class WorkloadConfig:
    """The workload's parameters (written to the results JSON as they are)."""

    workload: str = "random"
    num_requests: int = 100
    input_len: int = 128  # prompt tokens (random), suffix tokens (shared-prefix), user turn (chat)
    output_len: int = 128
    range_ratio: float = 0.0
    prefix_len: int = 64  # shared-prefix only
    num_prefixes: int = 4  # shared-prefix only
    num_turns: int = 3  # chat only
    seed: int = 0

    def __post_init__(self) -> None:
        if self.workload not in WORKLOADS:
            raise ValueError(
                f"--workload must be one of {', '.join(WORKLOADS)}, got {self.workload!r}"
            )
        counts = {
            "--num-requests": self.num_requests,
            "--input-len": self.input_len,
            "--output-len": self.output_len,
            "--prefix-len": self.prefix_len,
            "--num-prefixes": self.num_prefixes,
            "--num-turns": self.num_turns,
        }
        for flag, value in counts.items():
            if value < 1:
                raise ValueError(f"{flag} must be >= 1, got {value}")
        if self.seed < 0:
            raise ValueError(f"--seed must be >= 0, got {self.seed}")
        if not 0 <= self.range_ratio < 1:
            raise ValueError(f"--range-ratio must be in [0, 1), got {self.range_ratio}")
        group = {"shared-prefix": "--num-prefixes", "chat": "--num-turns"}.get(self.workload)
        if group and self.num_requests % counts[group]:
            raise ValueError(
                f"--num-requests ({self.num_requests}) must be a multiple of {group} "
                f"({counts[group]}) for the {self.workload} workload"
            )


@dataclass(slots=True)
class GenerateJob:
    """One Generate request."""

    prompt: str
    output_len: int


@dataclass(slots=True)
class ChatJob:
    """One Chat session: its user turns, in order, and each reply's length."""

    turns: list[str]
    output_lens: list[int]


Job = GenerateJob | ChatJob


def sample_lengths(
    mean_len: int, range_ratio: float, count: int, rng: np.random.Generator
) -> list[int]:
    """Args: the central length, the relative half-width, how many, the generator.

    Returns: `count` integers uniform in [mean_len * (1 - r), mean_len * (1 + r)], at least 1.
    """
    low = max(1, int(mean_len * (1 - range_ratio)))
    high = max(low, int(mean_len * (1 + range_ratio)))
    return rng.integers(low, high + 1, size=count).tolist()


def vocab_words(model: Path) -> list[str]:
    """The whole words of a model's tokenizer vocabulary (tokenizer.json, or a GGUF file's
    token list), without the word-start marks of SentencePiece and byte-level BPE.

    Args:
        model: the model folder or GGUF file.

    Returns:
        The distinct alphanumeric words, in vocabulary order.
    """
    gguf = gguf_file(model)
    if gguf is not None:
        tokens = GgufFile(gguf).value("tokenizer.ggml.tokens", [])
    else:
        vocab = json.loads((model / "tokenizer.json").read_text())["model"]["vocab"]
        tokens = vocab if isinstance(vocab, dict) else [token for token, _ in vocab]
    words = (token.lstrip("▁Ġ") for token in tokens)
    return list(dict.fromkeys(word for word in words if word.isalnum()))


def random_text(
    num_tokens: int,
    rng: np.random.Generator,
    count_tokens: TokenCounter,
    words: Sequence[str] = WORDS,
) -> str:
    """Random words whose token count is `num_tokens` (or within one word of it).

    Args:
        num_tokens: the token count wanted, as `count_tokens` counts.
        rng: where the words come from.
        count_tokens: the served model's token count of a text.
        words: the words to draw from.

    Returns:
        The text.
    """
    words = [str(w) for w in rng.choice(words, size=4 * num_tokens + 8)]
    num_words = num_tokens
    best = (num_tokens, num_words)  # (distance to num_tokens, words)
    for _ in range(MAX_FIT_ROUNDS):
        found = count_tokens(" ".join(words[:num_words]))
        best = min(best, (abs(found - num_tokens), num_words))
        if found == num_tokens:
            break
        tokens_per_word = max(found / num_words, 1e-3)
        step = round((num_tokens - found) / tokens_per_word) or (1 if found < num_tokens else -1)
        num_words = min(max(1, num_words + step), len(words))
    return " ".join(words[: best[1]])


def build_jobs(
    config: WorkloadConfig, count_tokens: TokenCounter, words: Sequence[str] = WORDS
) -> list[Job]:
    """Args: the workload, the served model's token counter, the words prompts are made of.

    Returns: the jobs in arrival order (a chat session is one job of num_turns requests).
    """
    rng = np.random.default_rng(config.seed)
    special = count_tokens("")  # the BOS token a whole prompt gets and a suffix or turn does not

    def text(num_tokens: int, whole_prompt: bool = True) -> str:
        wanted = num_tokens if whole_prompt else num_tokens + special
        return random_text(wanted, rng, count_tokens, words)

    builders = {"random": random_jobs, "shared-prefix": shared_prefix_jobs, "chat": chat_jobs}
    return builders[config.workload](config, rng, text)


def random_jobs(config: WorkloadConfig, rng: np.random.Generator, text: TextMaker) -> list[Job]:
    n = config.num_requests
    input_lens = sample_lengths(config.input_len, config.range_ratio, n, rng)
    output_lens = sample_lengths(config.output_len, config.range_ratio, n, rng)
    return [GenerateJob(text(i), o) for i, o in zip(input_lens, output_lens, strict=True)]


def shared_prefix_jobs(
    config: WorkloadConfig, rng: np.random.Generator, text: TextMaker
) -> list[Job]:
    prefixes = [text(config.prefix_len) for _ in range(config.num_prefixes)]
    n = config.num_requests
    suffix_lens = sample_lengths(config.input_len, config.range_ratio, n, rng)
    output_lens = sample_lengths(config.output_len, config.range_ratio, n, rng)
    jobs = [
        GenerateJob(f"{prefixes[i % len(prefixes)]} {text(s, whole_prompt=False)}", o)
        for i, (s, o) in enumerate(zip(suffix_lens, output_lens, strict=True))
    ]
    return [jobs[i] for i in rng.permutation(n)]


def chat_jobs(config: WorkloadConfig, rng: np.random.Generator, text: TextMaker) -> list[Job]:
    jobs: list[Job] = []
    k = config.num_turns
    for _ in range(config.num_requests // k):
        turn_lens = sample_lengths(config.input_len, config.range_ratio, k, rng)
        output_lens = sample_lengths(config.output_len, config.range_ratio, k, rng)
        turns = [text(t, whole_prompt=False) for t in turn_lens]
        jobs.append(ChatJob(turns, output_lens))
    return jobs


def num_requests(job: Job) -> int:
    """Returns: how many requests (Generate calls or chat turns) the job makes."""
    return len(job.turns) if isinstance(job, ChatJob) else 1
