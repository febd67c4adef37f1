"""Engine benchmarks of decoding features, each in one run on one Engine configuration.

`kvgate bench engine choices`: one request of n choices against n separate requests of the
same prompt. The n choices of one request prefill the prompt once and share its KV blocks
(copy on write); n separate requests sent together each prefill it. Both are sampled at
temperature 1 with EOS ignored, so both produce n * output_len tokens; the figure is their
tokens/s ratio, with the KV blocks each held at its peak. With prefix caching (the engine's
default) the separate requests admitted a step after the first ones reuse their prompt
blocks, so the group saves less there than against `--no-prefix-caching`.

`kvgate bench engine spec`: one stream's decode tokens/s with and without speculative
decoding (n-gram by default; any --speculative-config, a draft model's too), on a prompt the
model quotes back (the opening of Lewis Carroll's "Alice's Adventures in Wonderland", 1865,
public domain) and on one it answers with new text. Two engines of one configuration but
--speculative-config run the same greedy request in interleaved rounds; a round's rate counts
the tokens after the first one (the prompt's step is not decoding) over the time they took.
Both must produce the same tokens (else the command fails); the speculating engine's proposed
and accepted counts give the acceptance.
"""

from __future__ import annotations

import argparse
import time
from statistics import median

import torch

from bench import harness
from bench.engine import BENCH_SHAPE, Workload, benchmark_model, best_rates
from common.model_text import ModelText
from common.sampling_params import SamplingParams
from deploy.models import default_gguf_path
from engine.config import EngineConfig
from engine.engine import Engine
from engine.host_memory import retain_freed_memory
from engine.speculative_config import SpeculativeConfig

# ---- n choices against n requests ------------------------------------------------------


def _choices_params(args: argparse.Namespace, n: int) -> SamplingParams:
    return SamplingParams(max_tokens=args.output_len, ignore_eos=True, seed=args.seed, n=n)


def run_requests(engine: Engine, requests: list[tuple[list[int], SamplingParams]]) -> dict:
    """Add the requests at once and step until all finish: tokens per second of wall time and
    per second of this process's CPU time (which other work on a shared machine does not
    inflate), and the peak blocks held."""
    start, start_cpu = time.perf_counter(), time.process_time()
    for i, (prompt, params) in enumerate(requests):
        engine.add_request(f"bench-{i}", prompt, params)
    produced, peak_blocks = 0, 0
    while engine.has_unfinished():
        produced += sum(len(o.new_token_ids) for o in engine.step())
        stats = engine.stats()
        peak_blocks = max(peak_blocks, stats.num_total_blocks - stats.num_free_blocks)
    if engine.config.device == "cuda":
        torch.cuda.synchronize()
    return {
        "tokens_per_s": produced / (time.perf_counter() - start),
        "tokens_per_cpu_s": produced / (time.process_time() - start_cpu),
        "peak_blocks": peak_blocks,
    }


def choices_run(args: argparse.Namespace) -> dict:
    if args.device == "cpu":
        retain_freed_memory()  # as every CPU Engine sets it: both peers measure alike
    dtype = torch.float32 if args.device == "cpu" else torch.bfloat16
    with benchmark_model(args, dtype) as (engine_model, model):
        vocab_size = model.config.vocab_size
        del model
        config = EngineConfig(
            model=engine_model, device=args.device, max_num_seqs=max(args.n, 8),
            max_num_batched_tokens=args.max_num_batched_tokens, kv_cache_gib=args.kv_cache_gib,
            enable_prefix_caching=not args.no_prefix_caching,
        )  # fmt: skip
        engine = Engine(config)
        prompt_round = iter(range(1_000_000))

        def prompt() -> list[int]:  # a new prompt every round: nothing cached between rounds
            return Workload(1, args.prompt_len, 1, seed=next(prompt_round)).prompts(vocab_size)[0]

        peaks: dict[str, int] = {}
        per_cpu_s: dict[str, list[float]] = {"group": [], "separate": []}

        def measure(name: str, requests) -> float:
            result = run_requests(engine, requests)
            peaks[name] = max(peaks.get(name, 0), result["peak_blocks"])
            per_cpu_s[name].append(result["tokens_per_cpu_s"])
            return result["tokens_per_s"]

        run_requests(engine, [(prompt(), _choices_params(args, args.n))])  # warm-up
        best, samples = best_rates(
            {
                "group": lambda: measure("group", [(prompt(), _choices_params(args, args.n))]),
                "separate": lambda: measure(
                    "separate", [(p, _choices_params(args, 1)) for p in [prompt()] * args.n]
                ),
            },
            args.repeats,
        )
    result = _choices_result(args, engine_model, best, samples, peaks, engine.config.block_size)
    return result | {
        "samples_tokens_per_cpu_s": per_cpu_s,
        "group_over_separate_cpu_median": median(per_cpu_s["group"])
        / median(per_cpu_s["separate"]),
    }


def _choices_result(
    args, model: str, best: dict, samples: dict, peaks: dict, block_size: int
) -> dict:
    return {
        "model": args.model
        or f"random llama {BENCH_SHAPE['hidden_size']}x{BENCH_SHAPE['num_hidden_layers']}",
        "device": args.device,
        "n": args.n,
        "prompt_len": args.prompt_len,
        "output_len": args.output_len,
        "repeats": args.repeats,
        "group_tokens_per_s": best["group"],
        "separate_tokens_per_s": best["separate"],
        "group_over_separate": best["group"] / best["separate"],
        "group_over_separate_median": median(samples["group"]) / median(samples["separate"]),
        "samples_tokens_per_s": samples,
        "prompt_blocks": -(-args.prompt_len // block_size),
        "peak_blocks": peaks,
        "loaded": model,
        "torch_threads": torch.get_num_threads(),
        "load_average": harness.load_average(),
    }


def choices_summarize(result: dict) -> None:
    n = result["n"]
    print(f"n={n}, {result['prompt_len']}-token prompt, {result['output_len']} tokens each")
    print(f"  one request, n={n}   {result['group_tokens_per_s']:10.1f} output tokens/s")
    print(f"  {n} separate requests {result['separate_tokens_per_s']:10.1f} output tokens/s")
    print(f"  ratio                {result['group_over_separate']:.2f}x best rounds, "
          f"{result['group_over_separate_median']:.2f}x median rounds, "
          f"{result['group_over_separate_cpu_median']:.2f}x per CPU second")  # fmt: skip
    peaks = result["peak_blocks"]
    print(f"  peak KV blocks: {peaks['group']} (group) vs {peaks['separate']} (separate); "
          f"the prompt takes {result['prompt_blocks']}")  # fmt: skip


def choices_add_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of `kvgate bench engine choices`."""
    harness.add_model(
        parser, "", "checkpoint folder, GGUF file or smollm2 (default: a seeded random Llama)"
    )
    harness.add_device(parser)
    harness.add_workload(parser, num_requests=1, prompt_len=1024, output_len=16)
    parser.add_argument("--n", type=int, default=4, help="choices of the one request")
    parser.add_argument("--seed", type=int, default=0, help="sampling seed of every request")
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--kv-cache-gib", type=float, default=1.0)
    parser.add_argument("--no-prefix-caching", action="store_true",
                        help="separate requests admitted a step apart then cannot reuse the "
                             "first ones' prompt blocks")  # fmt: skip
    harness.add_repeats(parser, 3)
    harness.add_threads(parser)


# ---- speculative decoding --------------------------------------------------------------

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


def spec_run(args: argparse.Namespace) -> dict:
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
        name: _spec_workload(engines, text.encode(p), params, args) for name, p in PROMPTS.items()
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


def _spec_workload(engines: dict, prompt: list[int], params: SamplingParams, args) -> dict:
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


def spec_summarize(result: dict) -> None:
    print(f"{result['model']}, one greedy stream of {result['output_len']} tokens, spec: "
          f"{result['speculative_config']}")  # fmt: skip
    for name, w in result["workloads"].items():
        print(f"  {name:<6} ({w['prompt_tokens']:4d}-token prompt) off "
              f"{w['off_tokens_per_s']:7.1f} tok/s, spec {w['spec_tokens_per_s']:7.1f} tok/s: "
              f"{w['speedup']:.2f}x best, {w['speedup_median']:.2f}x median; accepted "
              f"{w['accepted_tokens']}/{w['proposed_tokens']} "
              f"({w['acceptance_rate']:.0%}) in {w['drafts']} drafts")  # fmt: skip


def spec_failure(result: dict) -> str | None:
    differing = [name for name, w in result["workloads"].items() if not w["same_tokens"]]
    if differing:
        return f"speculation changed the greedy tokens of {', '.join(differing)}"
    return None


def spec_add_arguments(parser: argparse.ArgumentParser) -> None:
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


BENCHMARKS = {
    "engine choices": harness.Benchmark(
        choices_add_arguments, choices_run, "choices.json", choices_summarize
    ),
    "engine spec": harness.Benchmark(
        spec_add_arguments, spec_run, "spec.json", spec_summarize, spec_failure
    ),
}
