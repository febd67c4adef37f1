"""Offline generation with the in-process engine: no Redis, no gRPC.

    python -m executor.generate --model DIR|FILE.gguf --prompt TEXT [--prompt TEXT ...]
        --max-tokens N [--temperature T] [--ignore-eos] [--dtype D] [--quantization Q]

Prints each completion's text, one block per prompt in the order given; a progress bar of
generated tokens goes to stderr. Prompts are tokenized as the gateway tokenizes them
(gateway/model_text.py), without a chat template.
"""

from __future__ import annotations

import argparse
import sys

from tqdm import tqdm

from common.sampling_params import SamplingParams
from executor.config import EngineConfig
from executor.engine import Engine
from gateway.model_text import ModelText


def generate(engine: Engine, prompts: list[list[int]], params: SamplingParams) -> list[list[int]]:
    """Run every prompt to completion; the generated token ids of each, in order."""
    outputs: list[list[int]] = [[] for _ in prompts]
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, params)
    with tqdm(total=len(prompts) * params.max_tokens, unit="tok", file=sys.stderr) as bar:
        while engine.has_unfinished():
            for out in engine.step():
                outputs[int(out.request_id)].extend(out.new_token_ids)
                bar.update(len(out.new_token_ids))
    return outputs


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="Generate completions offline with kvgate.")
    parser.add_argument("--model", required=True, help="checkpoint folder or GGUF file")
    parser.add_argument("--prompt", action="append", required=True, help="repeat for more")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--ignore-eos", action="store_true")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--kv-cache-gib", type=float, default=0.5)
    parser.add_argument("--dtype", default=None, help="float32 or bfloat16 (CPU)")
    parser.add_argument("--quantization", default="none", help="none, int8 or int4")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        params = SamplingParams(
            max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
            seed=args.seed, ignore_eos=args.ignore_eos,
        )  # fmt: skip
        model_text = ModelText(args.model)
        config = EngineConfig(model=args.model, device=args.device, kv_cache_gib=args.kv_cache_gib,
                              dtype=args.dtype, quantization=args.quantization)  # fmt: skip
        engine = Engine(config)
        prompts = [model_text.encode(p) for p in args.prompt]
        completions = generate(engine, prompts, params)
    except (ValueError, FileNotFoundError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for token_ids in completions:
        print(model_text.tokenizer.decode(token_ids, skip_special_tokens=True))
        print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
