"""Offline generation with the in-process engine: no Redis, no gRPC.

    python -m engine.generate --model DIR|FILE.gguf --prompt TEXT [--prompt TEXT ...]
        --max-tokens N [--temperature T] [--ignore-eos] [engine flags]

The engine flags are the executor's (`python -m executor --help`: --block-size, --dtype,
--enable-prefix-caching, --kv-cache-gib, ...), so each can be tried without the stack.

Prints each completion's text, one block per prompt in the order given; a progress bar of
generated tokens goes to stderr. Prompts are tokenized as the gateway tokenizes them
(common/model_text.py), without a chat template.
"""

from __future__ import annotations

import argparse
import sys

from tqdm import tqdm

from common.model_files import check_model_path
from common.model_text import ModelText
from common.sampling_params import SamplingParams
from engine.config import add_engine_flags, check_device_present, pop_engine_config
from engine.engine import Engine


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


def build_parser() -> argparse.ArgumentParser:
    """The sampling flags, then every engine flag of `python -m executor`."""
    parser = argparse.ArgumentParser(
        prog="python -m engine.generate",
        description="Generate completions offline with kvgate's engine.",
    )
    add = parser.add_argument
    add("--prompt", action="append", required=True, help="repeat for more")
    add("--max-tokens", type=int, default=64)
    add("--temperature", type=float, default=0.0)
    add("--top-p", type=float, default=1.0)
    add("--seed", type=int, default=None)
    add("--ignore-eos", action="store_true")
    add_engine_flags(parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    flags = vars(build_parser().parse_args(argv))
    try:
        config = pop_engine_config(flags)
        check_model_path("--model", config.model, "config.json")
        check_device_present(config.device)
        prompts_text = flags.pop("prompt")
        params = SamplingParams(**flags)
        model_text = ModelText(config.model)
        engine = Engine(config)
        try:
            prompts = [model_text.encode(p) for p in prompts_text]
            completions = generate(engine, prompts, params)
        finally:
            engine.close()
    except (ValueError, FileNotFoundError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for token_ids in completions:
        print(model_text.tokenizer.decode(token_ids, skip_special_tokens=True))
        print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
