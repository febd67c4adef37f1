"""Quality of number formats against float32: weights and activations (`kvgate bench quality
weights`), and KV cache formats (`kvgate bench quality kv`).

Quality of a model in bfloat16, with weight-only int8 / int4, or with a 16-bit, int8 or fp8
KV cache (`kv-float16`, `kv-bfloat16`, `kv-int8`, `kv-fp8`) against the same model in float32.

The float32 engine's greedy continuation of each prompt (EOS ignored) is the reference. For each
variant, along that continuation:

- top-1 agreement: teacher-forced (the variant reads the float32 tokens), the fraction of
  positions where the variant's most likely next token is float32's greedy token;
- mean log-probability gap: the mean over those positions of log p_float32(token) minus
  log p_variant(token) (positive: the variant is less sure of float32's choice);
- identical greedy prefix: run freely, how many of the variant's own greedy tokens equal
  float32's before the first difference (mean and minimum over the prompts);
- token agreement: run freely, the fraction of all positions where the variant's greedy token
  equals float32's.

`float32` itself is measured too: its teacher-forced agreement with its own greedy decode is
not always 1.0 (a one-pass prefill sums in another order than step-by-step decode), which shows
where near-ties are. `smollm2_quality` is what the SmolLM2-135M-Instruct figures come from.

KV cache formats against the float32 cache, in one run per model: greedy agreement, KV
blocks per GiB and decode throughput.

For each model (a float32 engine on the CPU; stories260K with its story starts, SmolLM2-135M-
Instruct with bench.quality's chat questions):

- agreement: bench.quality's measures of each cache format against the float32 cache on 16
  prompts x 128 greedy tokens (EOS ignored): token agreement (the fraction of free-running
  greedy tokens equal to the float32 cache's), the identical greedy prefix, and teacher-forced
  top-1 agreement (--no-agreement leaves it out: decode speed alone, in a fraction of the
  time);
- blocks per GiB: the engine's own sizing with --kv-cache-gib 1 (an int8 or fp8 cache's
  scales counted), and its ratio to the float32 cache's;
- decode throughput: --batch streams decoding from --context tokens on, in --repeats rounds.
  A round makes a fresh engine per format, warms each up at the measured batch, prefills it,
  then takes --steps decode steps of every engine in turns (one step of each, each turn
  starting at the next format), so that the formats' steps are paired moment by moment on a
  machine whose other work comes and goes, and float32 does not always run first. A format's
  tokens/s is that of its median step; two ratios to the float32 cache: the best round's over
  float32's best ("x fp32"), and the median over the rounds of each round's median over the
  turns of float32's step time over the format's ("rounds": one lucky round or step of either
  side does not decide it). One torch thread by default: on a
  machine shared with other work, a parallel region waits for its slowest thread, and steps of
  two threads on two busy cores ran from 1 ms to 600 ms at random. --clock cpu times each step
  by the thread's CPU time instead (one thread: the whole step), which the machine's other
  work does not stretch, though it still shares the caches and memory bandwidth.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from bench.engine import decode_step_ms, start_decoding
from bench.harness import BenchFailure, Benchmark, add_model, add_repeats, add_threads, load_average
from common.model_files import default_gguf_path
from common.sampling_params import SamplingParams
from engine.config import EngineConfig
from engine.engine import Engine
from engine.host_memory import retain_freed_memory

VARIANTS = {
    "float32": {},
    "bfloat16": {"dtype": "bfloat16"},
    "int8": {"quantization": "int8"},
    "int4": {"quantization": "int4"},
    "int8-a8": {"quantization": "int8", "int8_activations": True},
    "int4-a8": {"quantization": "int4", "int8_activations": True},
    "kv-float16": {"kv_cache_dtype": "float16"},
    "kv-bfloat16": {"kv_cache_dtype": "bfloat16"},
    "kv-int8": {"kv_cache_dtype": "int8"},
    "kv-fp8": {"kv_cache_dtype": "fp8"},
}
CHAT_QUESTIONS = (
    "What is the capital of France?",
    "How do plants make food?",
    "Give me three tips for sleeping better.",
    "What is a prime number?",
    "Write a haiku about the sea.",
    "Why is the sky blue?",
    "How does a bicycle stay upright?",
    "Explain what a computer program is.",
    "What should I pack for a weekend hike?",
    "Who wrote Romeo and Juliet?",
    "How many legs does a spider have?",
    "What is the boiling point of water?",
    "Suggest a name for a friendly robot.",
    "What causes the seasons on Earth?",
    "How do I make a cup of tea?",
    "Tell me a fun fact about octopuses.",
)
STORY_STARTS = (
    "Once upon a time", "Lily and Tom went to the park", "The little dog was sad because",
    "One day, a big bird", "There was a girl named Sue who", "The sun was shining and",
    "Ben had a red ball", "In a small town, there lived", "Mom said it was time to",
    "The cat saw a mouse", "Tim wanted to play with", "It was a rainy day and",
    "The boy found a shiny rock", "Anna liked to draw", "A big truck came down the road",
    "The frog jumped into the pond",
)  # fmt: skip


def greedy_continuations(
    engine: Engine, prompts: list[list[int]], new_tokens: int
) -> list[list[int]]:
    """Each prompt's greedy continuation of `new_tokens` tokens (EOS ignored), run batched."""
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"quality-{i}", prompt, params)
    tokens: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
    return [tokens[f"quality-{i}"] for i in range(len(prompts))]


def continuation_logprobs(
    engine: Engine, prompt: list[int], continuation: list[int]
) -> torch.Tensor:
    """[len(continuation), vocab] log-probabilities of each continuation token's position,
    teacher-forced along prompt + continuation."""
    logits = engine.prompt_logits(prompt + continuation[:-1])
    return torch.log_softmax(logits[len(prompt) - 1 :].float(), dim=-1)


def compare(
    reference: list[torch.Tensor],
    variant: list[torch.Tensor],
    continuations: list[list[int]],
    free_runs: list[list[int]] | None = None,
) -> dict:
    """The measures of one variant (see the module docstring); the free-run ones (token
    agreement, identical prefix) only when its `free_runs` are given."""
    agree = total = 0
    gaps: list[float] = []
    for ref_lp, var_lp, tokens in zip(reference, variant, continuations, strict=True):
        target = torch.tensor(tokens)
        agree += int((var_lp.argmax(dim=-1) == target).sum())
        total += len(tokens)
        picked = torch.arange(len(tokens))
        gaps.extend((ref_lp[picked, target] - var_lp[picked, target]).tolist())
    measures = {"top1_agreement": agree / total, "mean_logprob_gap": statistics.fmean(gaps)}
    if free_runs is None:
        return measures
    prefixes = [_common_prefix(a, b) for a, b in zip(continuations, free_runs, strict=True)]
    same = sum(x == y for a, b in zip(continuations, free_runs, strict=True)
               for x, y in zip(a, b, strict=True))  # fmt: skip
    return {
        "token_agreement": same / total,
        **measures,
        "identical_prefix_mean": statistics.fmean(prefixes),
        "identical_prefix_min": min(prefixes),
    }


def _common_prefix(a: list[int], b: list[int]) -> int:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return min(len(a), len(b))


def measure_quality(
    model: str,
    prompts: list[list[int]],
    new_tokens: int = 128,
    variants: tuple[str, ...] = ("bfloat16", "int8", "int4"),
    kv_cache_gib: float = 0.5,
    free_runs: bool = True,
) -> dict:
    """The quality measures of each variant against float32 (see the module docstring);
    without `free_runs` only the teacher-forced ones (no greedy run of each variant).

    Returns:
        {"num_prompts", "new_tokens", "variants": {name: {"top1_agreement", ...}}}.
    """

    def engine(name: str) -> Engine:
        return Engine(EngineConfig(model=model, kv_cache_gib=kv_cache_gib, **VARIANTS[name]))

    base = engine("float32")
    continuations = greedy_continuations(base, prompts, new_tokens)
    reference = [
        continuation_logprobs(base, p, c) for p, c in zip(prompts, continuations, strict=True)
    ]
    results = {"float32": compare(reference, reference, continuations, continuations)}
    results["float32"]["top1_agreement"] = _self_agreement(reference, continuations)
    del base
    for name in variants:
        variant = engine(name)
        runs = greedy_continuations(variant, prompts, new_tokens) if free_runs else None
        logprobs = [continuation_logprobs(variant, p, c)
                    for p, c in zip(prompts, continuations, strict=True)]  # fmt: skip
        results[name] = compare(reference, logprobs, continuations, runs)
        del variant
    return {"num_prompts": len(prompts), "new_tokens": new_tokens, "variants": results}


def _self_agreement(reference: list[torch.Tensor], continuations: list[list[int]]) -> float:
    agree = sum(
        int((lp.argmax(-1) == torch.tensor(c)).sum())
        for lp, c in zip(reference, continuations, strict=True)
    )
    return agree / sum(len(c) for c in continuations)


def tokenized_prompts(
    model: str, kind: str, num_prompts: int, vocab_size: int = 0
) -> list[list[int]]:
    """Prompt ids: `chat` (questions through the model's chat template), `story` (plain text
    starts) or `random` (seeded random ids, for a random-weight model without a tokenizer)."""
    if kind == "random":
        gen = torch.Generator().manual_seed(0)
        return torch.randint(3, vocab_size, (num_prompts, 32), generator=gen).tolist()
    from common.model_text import ModelText  # here: only prompts of text need it
    from common.templates import Message

    text = ModelText(model)  # the gateway's tokenizer and chat template
    if kind == "chat":
        return [text.encode_chat([Message("user", q)]) for q in CHAT_QUESTIONS[:num_prompts]]
    return [text.encode(start) for start in STORY_STARTS[:num_prompts]]


def smollm2_quality(model: str, new_tokens: int = 128) -> dict:
    """The figures for SmolLM2-135M-Instruct: its 16 chat prompts, bfloat16, int8 and int4."""
    prompts = tokenized_prompts(model, "chat", len(CHAT_QUESTIONS))
    return measure_quality(model, prompts, new_tokens)


def print_table(result: dict) -> None:
    print(f"{result['num_prompts']} prompts x {result['new_tokens']} tokens, against float32")
    print(f"{'variant':<12}{'top-1 agreement':>17}{'mean logprob gap':>18}{'token agreement':>17}"
          f"{'identical prefix':>26}")  # fmt: skip
    for name, m in result["variants"].items():
        prefix = f"{m['identical_prefix_mean']:.1f} mean, {m['identical_prefix_min']} min"
        print(f"{name:<12}{m['top1_agreement']:>17.3f}{m['mean_logprob_gap']:>18.4f}"
              f"{m['token_agreement']:>17.3f}{prefix:>26}")  # fmt: skip


def add_weights_arguments(parser: argparse.ArgumentParser) -> None:
    add_model(parser, None, "checkpoint folder (required)")
    parser.add_argument("--prompts", choices=("chat", "story", "random"), default="chat")
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--variants", nargs="+", default=["bfloat16", "int8", "int4"],
                        choices=[v for v in VARIANTS if v != "float32"])  # fmt: skip


def run_weights(args: argparse.Namespace) -> dict:
    """`kvgate bench quality weights`."""
    if not args.model:
        raise BenchFailure("--model is required: a checkpoint folder")
    vocab = (
        json.loads((Path(args.model) / "config.json").read_text())["vocab_size"]
        if args.prompts == "random"
        else 0
    )
    prompts = tokenized_prompts(args.model, args.prompts, args.num_prompts, vocab)
    result = measure_quality(args.model, prompts, args.new_tokens, tuple(args.variants))
    return result | {
        "model": args.model,
        "prompts": args.prompts,
        "load_average_at_end": load_average(),
    }


STORIES_260K = Path(__file__).resolve().parents[2] / "shared" / "models" / "stories260K"
MODELS = {"stories260K": (STORIES_260K, "story"), "smollm2": (None, "chat")}
CLOCKS = {"wall": time.perf_counter, "cpu": time.thread_time}
FORMATS = ["float16", "bfloat16", "int8", "fp8"]


def model_path(name: str) -> str:
    path, _ = MODELS[name]
    return str(path if path is not None else default_gguf_path())


def blocks_per_gib(model: str, kv_cache_dtype: str) -> int:
    engine = Engine(EngineConfig(model=model, kv_cache_gib=1.0, kv_cache_dtype=kv_cache_dtype))
    return engine.runner.num_blocks


def decode_round(model: str, formats: list[str], args: argparse.Namespace) -> dict:
    """One round of decode measures: a fresh engine per cache format, each warmed up at the
    measured batch and prefilled to --context tokens, then their decode steps taken in turn, one
    step of every engine before the next of any, each turn starting at the next format. Every
    format's steps thus see the same moments of the machine's other work, and none always
    runs first.

    Returns:
        format -> (tokens/s of its median step, the median over the turns of its step time
        over float32's in the same turn).
    """
    clock = CLOCKS[args.clock]
    engines = {}
    for fmt in formats:
        engines[fmt] = Engine(EngineConfig(model=model, kv_cache_gib=0.5, max_num_seqs=args.batch,
                                           kv_cache_dtype=fmt))  # fmt: skip
        # Up to cpu_decoder.one_call_rows streams a step is one C call, above that one call
        # per kernel: the warm-up runs the measured batch, so it warms the measured path.
        decode_step_ms(engines[fmt], 8, batch=args.batch, steps=2)
        start_decoding(engines[fmt], args.context, args.batch, args.steps)
    seconds: dict[str, list[float]] = {fmt: [] for fmt in formats}
    for turn in range(args.steps):
        first = turn % len(formats)
        for fmt in formats[first:] + formats[:first]:
            start = clock()
            engines[fmt].step()
            seconds[fmt].append(clock() - start)
    float32 = seconds["float32"]
    return {
        fmt: (
            args.batch / statistics.median(steps),
            statistics.median([a / b for a, b in zip(float32, steps, strict=True)]),
        )
        for fmt, steps in seconds.items()
    }


def decode_rates(model: str, formats: list[str], args: argparse.Namespace) -> dict:
    """--repeats rounds of decode_round, and each format's figures over them."""
    rounds = [decode_round(model, formats, args) for _ in range(args.repeats)]
    rates = {f: [r[f][0] for r in rounds] for f in formats}
    ratios = {f: [r[f][1] for r in rounds] for f in formats}
    return {
        "decode_tokens_per_s": {f: max(rates[f]) for f in formats},
        "decode_samples_tokens_per_s": rates,
        "decode_over_float32": {f: max(rates[f]) / max(rates["float32"]) for f in formats},
        "decode_over_float32_by_round": ratios,
        "decode_over_float32_median_round": {f: statistics.median(ratios[f]) for f in formats},
    }


def measure_model(name: str, formats: list[str], args: argparse.Namespace) -> dict:
    model, prompt_kind = model_path(name), MODELS[name][1]
    agreement = {}
    if args.agreement:
        prompts = tokenized_prompts(model, prompt_kind, 16)
        quality = measure_quality(model, prompts, 128, tuple(f"kv-{f}" for f in formats))
        agreement = {f: quality["variants"][f"kv-{f}"] for f in formats}
    every = ["float32", *formats]
    blocks = {f: blocks_per_gib(model, f) for f in every}
    return {
        "model": model,
        "prompts": prompt_kind,
        "agreement": agreement,
        "blocks_per_gib": blocks,
        "blocks_per_gib_over_float32": {f: blocks[f] / blocks["float32"] for f in every},
        **decode_rates(model, every, args),
    }


def print_model(name: str, result: dict) -> None:
    print(f"{name}: against the float32 cache")
    print(f"{'cache':<10}{'token agr.':>11}{'top-1 agr.':>11}{'prefix':>8}{'blocks/GiB':>12}"
          f"{'x fp32':>8}{'decode tok/s':>14}{'x fp32':>8}{'rounds':>8}")  # fmt: skip
    for fmt, blocks in result["blocks_per_gib"].items():
        agreement = result["agreement"].get(fmt)
        measures = (
            f"{agreement['token_agreement']:>11.3f}{agreement['top1_agreement']:>11.3f}"
            f"{agreement['identical_prefix_mean']:>8.1f}"
            if agreement
            else f"{'-':>11}{'-':>11}{'-':>8}"
        )
        print(f"{fmt:<10}{measures}{blocks:>12}{result['blocks_per_gib_over_float32'][fmt]:>8.2f}"
              f"{result['decode_tokens_per_s'][fmt]:>14.1f}"
              f"{result['decode_over_float32'][fmt]:>8.2f}"
              f"{result['decode_over_float32_median_round'][fmt]:>8.2f}")  # fmt: skip


def add_kv_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--formats", nargs="+", default=FORMATS, choices=FORMATS)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--context", type=int, default=256)
    add_repeats(parser, 3)
    parser.add_argument("--steps", type=int, default=32, help="decode steps of each engine a round")
    add_threads(parser, 1)
    parser.add_argument("--clock", choices=list(CLOCKS), default="wall",
                        help="time steps by the wall clock or this thread's CPU time")  # fmt: skip
    parser.add_argument("--no-agreement", dest="agreement", action="store_false",
                        help="measure blocks per GiB and decode speed only")  # fmt: skip


def run_kv(args: argparse.Namespace) -> dict:
    """`kvgate bench quality kv`: each model's results printed as it ends."""
    retain_freed_memory()
    result: dict = {"batch": args.batch, "context": args.context, "repeats": args.repeats,
                    "steps": args.steps, "clock": args.clock,
                    "load_average_at_start": load_average(),
                    "torch_threads": torch.get_num_threads(), "models": {}}  # fmt: skip
    for name in args.models:
        result["models"][name] = measure_model(name, args.formats, args)
        print_model(name, result["models"][name])
    return result | {"load_average_at_end": load_average()}


BENCHMARKS = {
    "quality weights": Benchmark(add_weights_arguments, run_weights, "quality.json", print_table),
    "quality kv": Benchmark(add_kv_arguments, run_kv, "kv_dtypes.json"),
}
