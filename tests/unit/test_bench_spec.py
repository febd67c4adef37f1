"""`kvgate bench engine spec` end to end on stories260K: the JSON it writes holds both peers'
rates, the same tokens from both and the acceptance of the proposals (the speed itself is
docs/speculative.md's, never a test's)."""

from __future__ import annotations

import json

import pytest

from bench.cli import main
from tests.helpers import STORIES_260K


def test_spec_benchmark_writes_both_peers_and_the_acceptance(tmp_path, capsys):
    out = tmp_path / "spec.json"
    flags = ["--model", str(STORIES_260K), "--output-len", "32", "--repeats", "1"]
    status = main(["engine", "spec", *flags, "--out", str(out)])
    assert status == 0, capsys.readouterr().err
    workloads = json.loads(out.read_text())["workloads"]
    assert set(workloads) == {"quote", "story", "random_1", "random_64"}
    assert [workloads[f"random_{n}"]["streams"] for n in (1, 64)] == [1, 64]
    assert 100 < workloads["quote"]["prompt_tokens"] <= 512 - 32, "paragraphs that fit"
    for name, w in workloads.items():
        assert w["same_tokens"], f"{name}: speculation changed the tokens"
        assert w["off_tokens_per_s"] > 0 and w["spec_tokens_per_s"] > 0, w
    assert workloads["quote"]["accepted_tokens"] > 0, workloads["quote"]
    assert "accepted" in capsys.readouterr().out


def test_spec_benchmark_refuses_a_bad_config(tmp_path):
    out = tmp_path / "spec.json"
    flags = ["--model", str(STORIES_260K), "--speculative-config", '{"method": "medusa"}']
    with pytest.raises(ValueError, match="speculative_config.method"):
        main(["engine", "spec", *flags, "--out", str(out)])
    assert not out.exists()
