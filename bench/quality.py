"""Quality of a model in bfloat16, with weight-only int8 / int4, or with a 16-bit, int8 or fp8
KV cache (`kv-float16`, `kv-bfloat16`, `kv-int8`, `kv-fp8`) against the same model in float32.

    python -m bench.quality --model PATH [--prompts chat|story|random] [--num-prompts 16]
        [--new-tokens 128] [--variants bfloat16 int8 int4] [--out FILE.json]

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
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
from pathlib import Path

import torch

from common.sampling_params import SamplingParams
from engine.config import EngineConfig
from engine.engine import Engine

VARIANTS = {
    "float32": {},
    "bfloat16": {"dtype": "bfloat16"},
    "int8": {"quantization": "int8"},
    "int4": {"quantization": "int4"},
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


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--prompts", choices=("chat", "story", "random"), default="chat")
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--variants", nargs="+", default=["bfloat16", "int8", "int4"],
                        choices=[v for v in VARIANTS if v != "float32"])  # fmt: skip
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    vocab = (
        json.loads((Path(args.model) / "config.json").read_text())["vocab_size"]
        if args.prompts == "random"
        else 0
    )
    prompts = tokenized_prompts(args.model, args.prompts, args.num_prompts, vocab)
    result = measure_quality(args.model, prompts, args.new_tokens, tuple(args.variants))
    result |= {"model": args.model, "prompts": args.prompts, "load_average_at_end": os.getloadavg()}
    print_table(result)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
