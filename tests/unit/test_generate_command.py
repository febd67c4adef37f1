"""`python -m engine.generate`: one text block per prompt, the engine's greedy tokens."""

from __future__ import annotations

import subprocess
import sys

from tokenizers import Tokenizer

from engine.config import pop_engine_config
from engine.generate import build_parser, generate, main
from tests.helpers import REPO, STORIES_260K, greedy, make_engine

PROMPTS = ["Once upon a time", "The little dog"]


def test_the_command_prints_each_prompts_greedy_completion_in_order():
    argv = [sys.executable, "-m", "engine.generate", "--model", str(STORIES_260K)]
    for prompt in PROMPTS:
        argv += ["--prompt", prompt]
    argv += ["--max-tokens", "12", "--ignore-eos"]
    done = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    tokenizer = Tokenizer.from_file(str(STORIES_260K / "tokenizer.json"))
    engine = make_engine(kv_cache_gib=0.05)
    params = greedy(12)
    expected = generate(engine, [tokenizer.encode(p).ids for p in PROMPTS], params)
    blocks = [tokenizer.decode(ids, skip_special_tokens=True) for ids in expected]
    assert done.stdout == "".join(f"{text}\n\n" for text in blocks)
    assert "24/24" in done.stderr, "the progress bar counts every generated token"


def test_a_bad_flag_is_a_clear_error(capsys):
    """The command's own main, in this process (the test above runs it as a command)."""
    status = main(["--model", str(STORIES_260K), "--prompt", "hi", "--max-tokens", "0"])
    stderr = capsys.readouterr().err
    assert status == 2 and "max_tokens" in stderr, stderr


def test_the_command_takes_the_kv_cache_dtype_and_names_it_when_bad():
    argv = ["--model", str(STORIES_260K), "--prompt", "hi", "--kv-cache-dtype"]
    assert pop_engine_config(vars(build_parser().parse_args([*argv, "int8"]))).kv_cache_dtype \
        == "int8"  # fmt: skip
    assert main([*argv, "fp4"]) == 2
