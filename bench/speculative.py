"""`kvgate bench engine spec`: one stream's decode tokens/s with and without speculative
decoding (n-gram by default; any --speculative-config, a draft model's too), in one run, on a
prompt the model quotes back (the opening of Lewis Carroll's "Alice's Adventures in
Wonderland", 1865, public domain) and on one it answers with new text.

Two engines of one configuration but --speculative-config run the same greedy request in
interleaved rounds; a round's rate counts the tokens after the first one (the prompt's step
is not decoding) over the time they took. Both must produce the same tokens (else the
command fails); the speculating engine's proposed and accepted counts give the acceptance.
"""

from __future__ import annotations

import argparse
import time
from statistics import median

import torch

from bench import harness
from bench.engine import best_rates
from common.model_text import ModelText
from common.sampling_params import SamplingParams
from deploy.models import default_gguf_path
from engine.config import EngineConfig, SpeculativeConfig
from engine.engine import Engine
from engine.host_memory import retain_freed_memory

PASSAGE = (
    "Alice was beginning to get very tired of sitting by her sister on the bank, and of "
    "having nothing to do: once or twice she had peeped into the book her sister was "
    "reading, but it had no pictures or conversations in it, 'and what is the use of a "
    "book,' thought Alice 'without pictures or conversations?' So she was considering in "
    "her own mind (as well as she could, for the hot day made her feel very sleepy and "
    "stupid), whether the pleasure of making a daisy-chain would be worth the trouble of "
    "getting up and picking the daisies, when suddenly a White Rabbit with pink eyes ran "
    "close by her."
)
PROMPTS = {
    # the model copies text it was given: proposals from the prompt are accepted
    "quote": f"{PASSAGE}\n\nThe same text, copied word for word:\n\n{PASSAGE[:40]}",
    # the model writes new text: few proposals, the rule keeps it from paying for them
    "story": "Write a short story about a lighthouse keeper who finds a strange map.\n\n",
}


def decode_tokens(engine: Engine, prompt: list[int], params: SamplingParams) -> tuple:
    """(the tokens, decode tokens/s): the tokens after the first over the time they took."""
    engine.add_request("bench", prompt, params)
    tokens: list[int] = []
    start = 0.0
    while engine.has_unfinished():
        for out in engine.step():
            if not tokens:
                start = time.perf_counter()
            tokens += out.new_token_ids
    if engine.config.device.startswith("cuda"):
        torch.cuda.synchronize()
    return tokens, (len(tokens) - 1) / (time.perf_counter() - start)


def run(args: argparse.Namespace) -> dict:
    if args.device == "cpu":
        retain_freed_memory()  # as every CPU Engine sets it: both peers measure alike
    path = str(default_gguf_path()) if args.model == "smollm2" else args.model
    spec = SpeculativeConfig.from_json(args.speculative_config)
    engines = {
        name: Engine(EngineConfig(model=path, device=args.device, speculative_config=config))
        for name, config in (("off", None), ("spec", spec))
    }
    text = ModelText(path)
    params = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    workloads = {
        name: _workload(engines, text.encode(p), params, args) for name, p in PROMPTS.items()
    }
    return {
        "model": args.model,
        "device": args.device,
        "speculative_config": args.speculative_config,
        "output_len": args.output_len,
        "repeats": args.repeats,
        "workloads": workloads,
        "torch_threads": torch.get_num_threads(),
        "load_average": harness.load_average(),
    }


def _workload(engines: dict, prompt: list[int], params: SamplingParams, args) -> dict:
    outputs: dict[str, list[int]] = {}
    before = engines["spec"].stats()

    def measure(name: str) -> float:
        outputs[name], rate = decode_tokens(engines[name], prompt, params)
        return rate

    best, samples = best_rates({name: lambda n=name: measure(n) for name in engines}, args.repeats)
    after = engines["spec"].stats()
    proposed = after.num_spec_proposed_tokens - before.num_spec_proposed_tokens
    accepted = after.num_spec_accepted_tokens - before.num_spec_accepted_tokens
    return {
        "prompt_tokens": len(prompt),
        "off_tokens_per_s": best["off"],
        "spec_tokens_per_s": best["spec"],
        "speedup": best["spec"] / best["off"],
        "speedup_median": median(samples["spec"]) / median(samples["off"]),
        "samples_tokens_per_s": samples,
        "proposed_tokens": proposed,
        "accepted_tokens": accepted,
        "acceptance_rate": accepted / proposed if proposed else 0.0,
        "drafts": after.num_spec_drafts - before.num_spec_drafts,
        "same_tokens": outputs["off"] == outputs["spec"],
    }


def summarize(result: dict) -> None:
    print(f"{result['model']}, one greedy stream of {result['output_len']} tokens, spec: "
          f"{result['speculative_config']}")  # fmt: skip
    for name, w in result["workloads"].items():
        print(f"  {name:<6} ({w['prompt_tokens']:4d}-token prompt) off "
              f"{w['off_tokens_per_s']:7.1f} tok/s, spec {w['spec_tokens_per_s']:7.1f} tok/s: "
              f"{w['speedup']:.2f}x best, {w['speedup_median']:.2f}x median; accepted "
              f"{w['accepted_tokens']}/{w['proposed_tokens']} "
              f"({w['acceptance_rate']:.0%}) in {w['drafts']} drafts")  # fmt: skip


def failure(result: dict) -> str | None:
    differing = [name for name, w in result["workloads"].items() if not w["same_tokens"]]
    if differing:
        return f"speculation changed the greedy tokens of {', '.join(differing)}"
    return None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of `kvgate bench engine spec`."""
    harness.add_model(parser, "smollm2", "checkpoint folder, GGUF file or smollm2")
    harness.add_device(parser)
    parser.add_argument("--output-len", type=int, default=64, help="tokens of the stream")
    parser.add_argument(
        "--speculative-config",
        default='{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, '
        '"prompt_lookup_min": 2}',
        help="the speculating engine's --speculative-config",
    )
    harness.add_repeats(parser, 3)
    harness.add_threads(parser)


BENCHMARKS = {"engine spec": harness.Benchmark(add_arguments, run, "spec.json", summarize, failure)}
