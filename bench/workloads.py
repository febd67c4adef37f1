"""What `kvgate bench load` sends: its flags, its validated config, and the workloads.

Workloads: what each request asks, built as text of a chosen token length.

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

import argparse
import json
import math
import shlex
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from bench.harness import RESULTS, add_model, add_output_len, plot_path
from bench.stats import parse_slos
from client.api import Credentials, default_target
from client.flags import add_credential_flags, credentials_from_args
from common.config import check_host_port
from common.gguf_metadata import GgufFile
from common.model_files import check_model_path, gguf_file, model_id
from deploy.models import ROOT, choose_model

WORKLOADS = ("random", "shared-prefix", "chat")
# The fronts `kvgate bench load` drives: kvgate.v1 over gRPC, or OpenAI HTTP (SSE streams).
APIS = ("kvgate", "openai")
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


DEFAULT_LOG_DIR = ROOT / ".run" / "bench-logs"
# The policies --sweep-policy compares: both the scheduler and the executor know them.
SWEPT_POLICIES = ("fcfs", "lpm")


@dataclass(slots=True)
class BenchConfig:
    """The flags of one `kvgate bench load`; validated in `__post_init__`."""

    target: str
    workload: WorkloadConfig
    api: str = "kvgate"  # kvgate: requests to --target; openai: to --openai-url (SSE)
    # The gateway's OpenAI base URL; --target still measures prompts (Tokenize)
    openai_url: str = "http://127.0.0.1:8000/v1"
    request_rate: float = math.inf  # requests per second; inf: all at once
    burstiness: float = 1.0  # gamma shape of the gaps; 1: Poisson
    max_concurrency: int | None = None  # None: no limit
    slos_ms: dict[str, float] = field(default_factory=dict)
    out: Path = RESULTS / "bench.json"
    out_key: str | None = None  # the key of --out's JSON object the results go under
    sweep_rates: list[float] = field(default_factory=list)
    sweep_windows_ms: list[float] = field(default_factory=list)
    sweep_policies: list[str] = field(default_factory=list)  # fcfs | lpm, one run each
    executor_flags: list[str] = field(default_factory=list)  # the sweeps' local executor's
    model: str = ""  # the served model's folder (--sweep-window, --sweep-policy, --compare-hf)
    prompt_words: str = "english"  # english | vocab (the words of --model's tokenizer)
    compare_hf: bool = False
    hf_sample: int = 4
    progress: bool = True
    log_dir: Path = DEFAULT_LOG_DIR  # where the sweeps' local stack logs
    credentials: Credentials = field(default_factory=Credentials)  # --api-key, --tls*

    def __post_init__(self) -> None:
        check_host_port("--target", self.target)
        if self.api not in APIS:
            raise ValueError(f"--api must be one of {', '.join(APIS)}, got {self.api!r}")
        if self.api == "openai" and not self.openai_url.startswith(("http://", "https://")):
            raise ValueError(f"--openai-url must be an http(s) URL, got {self.openai_url!r}")
        if self.api == "openai" and (self.sweep_windows_ms or self.sweep_policies):
            raise ValueError(
                "--api openai loads a running gateway: not with --sweep-window or --sweep-policy"
            )
        for rate in [self.request_rate, *self.sweep_rates]:
            if not rate > 0:
                raise ValueError(f"--request-rate and --sweep-rates must be > 0 or inf, got {rate}")
        if not (math.isfinite(self.burstiness) and self.burstiness > 0):
            raise ValueError(f"--burstiness must be a finite number > 0, got {self.burstiness}")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError(f"--max-concurrency must be >= 1, got {self.max_concurrency}")
        if not all(math.isfinite(window) and window >= 0 for window in self.sweep_windows_ms):
            raise ValueError(
                f"--sweep-window values must be finite and >= 0 ms, got {self.sweep_windows_ms}"
            )
        bad = [p for p in self.sweep_policies if p not in SWEPT_POLICIES]
        if bad:
            raise ValueError(f"--sweep-policy values must be fcfs or lpm, got {bad[0]!r}")
        sweeps = [self.sweep_rates, self.sweep_windows_ms, self.sweep_policies]
        if sum(bool(sweep) for sweep in sweeps) > 1:
            raise ValueError(
                "--sweep-rates, --sweep-window and --sweep-policy cannot be combined: pick one"
            )
        if self.compare_hf and any(sweeps):
            raise ValueError(
                "--compare-hf compares one run: leave out --sweep-rates/--sweep-window/"
                "--sweep-policy"
            )
        if self.compare_hf and self.workload.workload == "chat":
            raise ValueError("--compare-hf runs Generate workloads: use random or shared-prefix")
        if self.hf_sample < 1:
            raise ValueError(f"--hf-sample must be >= 1, got {self.hf_sample}")

    def plot_path(self, kind: str) -> Path:
        """Returns: OUT[_KEY]_kind.png next to the results JSON."""
        return plot_path(self.out, self.out_key, kind)


def served_model(config: BenchConfig) -> str:
    """--model, else the folder `make run` serves (KVGATE_MODEL, stories260K, ...)."""
    return config.model or str(choose_model())


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of `kvgate bench load` (--out is the CLI's)."""
    parser.add_argument("--target", default=default_target(), help="gateway HOST:PORT")
    add_credential_flags(parser)
    _add_load_flags(parser)
    _add_output_flags(parser.add_argument)
    add_model(parser, "", "served model folder (default: KVGATE_MODEL or make run's)")


def _add_load_flags(parser: argparse.ArgumentParser) -> None:
    """Arrivals and workload."""
    add = parser.add_argument
    add("--num-requests", type=int, default=100, help="requests (chat: turns) per run")
    add(
        "--request-rate",
        type=float,
        default=math.inf,
        help="requests/s (chat: sessions/s, each sending its turns in turn); inf: all at once",
    )
    add("--burstiness", type=float, default=1.0, help="gamma shape of the gaps; 1: Poisson")
    add(
        "--max-concurrency",
        type=int,
        default=None,
        help="most requests (chat: sessions) in flight",
    )
    add("--workload", choices=WORKLOADS, default="random")
    add("--api", choices=APIS, default="kvgate", help="kvgate.v1 gRPC, or the OpenAI HTTP front")
    add(
        "--openai-url",
        default="http://127.0.0.1:8000/v1",
        help="--api openai: the gateway's OpenAI base URL (--target still measures prompts)",
    )
    add(
        "--input-len",
        type=int,
        default=128,
        help="prompt tokens (shared-prefix: suffix; chat: turn)",
    )
    add_output_len(parser, 128)
    add(
        "--range-ratio",
        type=float,
        default=0.0,
        help="lengths uniform in [len*(1-r), len*(1+r)]; 0: fixed",
    )
    add("--prefix-len", type=int, default=64, help="shared-prefix: tokens of each prefix")
    add("--num-prefixes", type=int, default=4, help="shared-prefix: distinct prefixes")
    add("--num-turns", type=int, default=3, help="chat: turns per session")
    add(
        "--prompt-words",
        choices=("english", "vocab"),
        default="english",
        help="prompt text: built-in English words, or the words of --model's vocabulary",
    )
    add("--seed", type=int, default=0, help="seed of prompts, lengths and arrivals")


def _add_output_flags(add: Callable[..., object]) -> None:
    """Goodput bounds, results, sweeps and the transformers comparison."""
    add(
        "--slo",
        action="append",
        default=[],
        metavar="NAME=MS",
        help="ttft_ms=.., tpot_ms=.. or e2e_ms=.. (repeatable): goodput's bounds",
    )
    add("--sweep-rates", type=_float_list, default=[], help="e.g. 1,2,4,inf: one run per rate")
    add(
        "--sweep-window",
        type=_float_list,
        default=[],
        dest="sweep_windows_ms",
        help="e.g. 0,5,20,100: batch_window_ms per run, on a local stack of --model",
    )
    add(
        "--sweep-policy",
        type=_name_list,
        default=[],
        dest="sweep_policies",
        help="e.g. fcfs,lpm: --policy of the scheduler and executor per run (the same "
        "requests), on a local stack of --model",
    )
    add(
        "--executor-flags",
        type=shlex.split,
        default=[],
        help="--sweep-window/--sweep-policy: flags of the local stack's executor, "
        "e.g. '--num-gpu-blocks 64 --max-num-seqs 4'",
    )
    add(
        "--log-dir",
        type=Path,
        default=DEFAULT_LOG_DIR,
        help="--sweep-window/--sweep-policy: where the local stack's processes log",
    )
    add("--compare-hf", action="store_true", help="run the same requests through transformers")
    add("--hf-sample", type=int, default=4, help="requests transformers generate runs one by one")
    add("--no-progress", action="store_false", dest="progress", help="no progress bar")


def _float_list(text: str) -> list[float]:
    """An argparse type: comma-separated numbers (inf allowed), at least one."""
    try:
        values = [float(item) for item in text.split(",") if item.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected numbers like 1,2,4, got {text!r}") from None
    if not values:
        raise argparse.ArgumentTypeError(f"expected numbers like 1,2,4, got {text!r}")
    return values


def _name_list(text: str) -> list[str]:
    """An argparse type: comma-separated names, at least one."""
    names = [item.strip() for item in text.split(",") if item.strip()]
    if not names:
        raise argparse.ArgumentTypeError(f"expected names like fcfs,lpm, got {text!r}")
    return names


def config_from_args(args: argparse.Namespace) -> BenchConfig:
    """Raises: ValueError naming the flag when a value is out of range."""
    flags = vars(args)
    workload = WorkloadConfig(**{name: flags[name] for name in WorkloadConfig.__dataclass_fields__})
    return BenchConfig(
        target=args.target,
        workload=workload,
        api=args.api,
        openai_url=args.openai_url,
        request_rate=args.request_rate,
        burstiness=args.burstiness,
        max_concurrency=args.max_concurrency,
        slos_ms=parse_slos(args.slo),
        out=args.out,
        out_key=args.out_key,
        sweep_rates=args.sweep_rates,
        sweep_windows_ms=args.sweep_windows_ms,
        sweep_policies=args.sweep_policies,
        executor_flags=args.executor_flags,
        model=args.model,
        prompt_words=args.prompt_words,
        compare_hf=args.compare_hf,
        hf_sample=args.hf_sample,
        progress=args.progress,
        log_dir=args.log_dir,
        credentials=credentials_from_args(args),
    )


def check_inputs(config: BenchConfig) -> None:
    """Checks what the run will need before it starts, so a bad flag costs no run.

    Raises:
        ValueError naming the flag: --out is a folder, --model lacks the files a flag
            reads, or --compare-hf's --model is not the model --target serves.
        grpc.RpcError: --compare-hf could not ask --target for its model.
    """
    if config.out.is_dir():
        raise ValueError(f"--out must be a JSON file, got the folder {config.out}")
    model = served_model(config)
    if config.prompt_words == "vocab":
        try:
            check_model_path("--model", model, "tokenizer.json")
        except ValueError as error:
            raise ValueError(f"--prompt-words vocab reads --model's tokenizer: {error}") from None
    if config.compare_hf or config.sweep_windows_ms or config.sweep_policies:
        check_model_path("--model", model, "config.json")
    if config.compare_hf:
        with config.credentials.client(config.target, timeout_s=30.0) as client:
            served_id = client.model_info().model_id
        if model_id(model) != served_id:
            raise ValueError(f"--compare-hf: --target serves {served_id!r} but --model is {model}")


# The HTTP front's streams (`--api openai`): what a user's client sends and reads.
OPENAI_STREAM = {"stream": True, "stream_options": {"include_usage": True}}


def openai_body(model: str, output_len: int, **prompt: object) -> dict:
    """A streaming body of `prompt=` (/v1/completions: text or token ids) or `messages=`
    (/v1/chat/completions): greedy, exactly `output_len` tokens, its usage last."""
    return {
        "model": model,
        **prompt,
        "max_tokens": output_len,
        "temperature": 0.0,
        "ignore_eos": True,
        **OPENAI_STREAM,
    }
