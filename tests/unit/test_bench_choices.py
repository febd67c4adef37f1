"""`kvgate bench engine choices` end to end on stories260K: the JSON it writes holds both
peers' rates and the blocks each held (the speed itself is docs/benchmarks.md's, never a test's)."""

from __future__ import annotations

import json

from bench.cli import main
from tests.helpers import STORIES_260K


def test_choices_benchmark_writes_both_peers_and_their_blocks(tmp_path, capsys):
    out = tmp_path / "choices.json"
    flags = ["--model", str(STORIES_260K), "--prompt-len", "100", "--output-len", "4"]
    status = main(["engine", "choices", *flags, "--repeats", "1", "--out", str(out)])
    assert status == 0, capsys.readouterr().err
    result = json.loads(out.read_text())
    assert result["group_tokens_per_s"] > 0 and result["separate_tokens_per_s"] > 0, result
    assert result["prompt_blocks"] == 7, result
    peaks = result["peak_blocks"]
    assert peaks["group"] < peaks["separate"], f"the group must share the prompt: {peaks}"
    assert "ratio" in capsys.readouterr().out
