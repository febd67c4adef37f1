"""`kvgate bench load` on bad input: one line naming the flag, exit status 2, no traceback; the
list of benchmarks; --out-key's writes into one results file; and the `kvgate` client, which
loads the benchmark only for `kvgate bench`; docs/bench.md names every command, and the docs
and bench/results/ name each other's files."""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys

import pytest

from bench.cli import COMMANDS
from bench.harness import plot_path, write_results
from client.cli import main
from deploy.stack import free_port
from tests.helpers import REPO, STORIES_260K

MODEL = STORIES_260K


def bench_error(capsys: pytest.CaptureFixture[str], *flags: str) -> str:
    """Runs `kvgate bench load FLAGS`; returns its stderr after checking it failed as bad input."""
    try:
        status = main(["bench", "load", "--no-progress", "--num-requests", "2", *flags])
    except SystemExit as exit_:  # argparse's own errors
        status = exit_.code
    stderr = capsys.readouterr().err
    assert status == 2, f"expected exit status 2 for {flags}, got {status}: {stderr}"
    assert "Traceback" not in stderr, stderr
    return stderr.strip().splitlines()[-1]


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        (("--seed", "-1"), "--seed"),
        (("--burstiness", "inf"), "--burstiness"),
        (("--burstiness", "nan"), "--burstiness"),
        (("--sweep-window", "0,inf"), "--sweep-window"),
        (("--sweep-rates", ""), "--sweep-rates"),
        (("--sweep-rates", "1,fast"), "--sweep-rates"),
        (("--sweep-policy", "fcfs,random"), "--sweep-policy"),
        (("--sweep-policy", "fcfs,lpm", "--sweep-window", "0,5"), "--sweep-policy"),
        (("--target", "no-port"), "--target"),
        (("--prompt-words", "vocab", "--model", "/nonexistent"), "--prompt-words"),
        (("--compare-hf", "--model", "/nonexistent"), "--model"),
    ],
)
def test_bad_flags_give_one_line_naming_the_flag(capsys, flags, named):
    line = bench_error(capsys, *flags)
    assert named in line, f"expected the error to name {named}, got {line!r}"


def test_out_naming_a_folder_is_refused_before_the_run(capsys, tmp_path):
    line = bench_error(capsys, "--target", f"127.0.0.1:{free_port()}", "--out", str(tmp_path))
    assert "--out" in line and "folder" in line, line


def test_runs_written_under_two_keys_keep_both_and_the_keys_already_there(tmp_path):
    out = tmp_path / "engine.json"
    out.write_text(json.dumps({"older": {"tokens_per_s": 1.0}}))
    write_results({"tokens_per_s": 2.0}, out, "llama56m")
    write_results({"tokens_per_s": 3.0}, out, "smollm2")
    write_results({"tokens_per_s": 4.0}, out, "smollm2")  # a rerun replaces its own key only
    assert json.loads(out.read_text()) == {
        "older": {"tokens_per_s": 1.0},
        "llama56m": {"tokens_per_s": 2.0},
        "smollm2": {"tokens_per_s": 4.0},
    }
    write_results({"tokens_per_s": 5.0}, out)  # without a key the file is the run's alone
    assert json.loads(out.read_text()) == {"tokens_per_s": 5.0}


def test_a_key_into_a_missing_file_makes_it_and_plots_are_named_by_the_key(tmp_path):
    out = tmp_path / "new" / "load.json"
    write_results({"ttft_ms": 1.0}, out, "policy")
    assert json.loads(out.read_text()) == {"policy": {"ttft_ms": 1.0}}
    assert plot_path(out, "policy", "windows") == tmp_path / "new" / "load_policy_windows.png"
    assert plot_path(out, None) == tmp_path / "new" / "load.png"


@pytest.mark.parametrize(
    ("held", "said"), [("[1, 2]", "holds a JSON list"), ("not json", "is not JSON")]
)
def test_a_key_into_a_file_that_is_not_a_json_object_is_refused_before_the_run(
    capsys, tmp_path, held, said
):
    out = tmp_path / "run.json"
    out.write_text(held)
    target = f"127.0.0.1:{free_port()}"  # nothing listens: the run itself would fail otherwise
    line = bench_error(capsys, "--target", target, "--out", str(out), "--out-key", "rates")
    assert line.startswith(f"kvgate bench: --out {out} {said}"), line
    assert out.read_text() == held, "the file is left as it was"


def test_an_unreachable_target_is_named_without_a_traceback(capsys, tmp_path):
    target = f"127.0.0.1:{free_port()}"
    line = bench_error(capsys, "--target", target, "--out", str(tmp_path / "run.json"))
    assert f"cannot reach --target {target}" in line, line
    assert not (tmp_path / "run.json").exists(), "no results from a run that did not happen"


@pytest.mark.skipif(not (MODEL / "config.json").is_file(), reason="needs stories260K")
def test_compare_hf_with_an_unreachable_target_says_so_before_running(capsys, tmp_path):
    target = f"127.0.0.1:{free_port()}"
    line = bench_error(
        capsys, "--target", target, "--compare-hf", "--model", str(MODEL),
        "--out", str(tmp_path / "run.json"),
    )  # fmt: skip
    assert f"cannot reach --target {target}" in line, line


def test_the_client_command_loads_no_benchmark_code():
    probe = (
        "import sys, client.cli; "
        "print(sorted({m.split('.')[0] for m in sys.modules} & {'bench', 'numpy', 'deploy'}))"
    )
    done = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]", f"`kvgate generate` would load {done.stdout.strip()}"


def test_kvgate_bench_lists_every_benchmark_and_refuses_an_unknown_one(capsys):
    assert main(["bench", "--help"]) == 0
    listing = capsys.readouterr().out
    for words in ("load", "serve stack", "serve fronts", "engine throughput", "kernels linear",
                  "quality kv", "scaling swap"):  # fmt: skip
        assert f"  {words} " in listing, f"{words!r} missing from:\n{listing}"
    assert main(["bench", "warp"]) == 2
    error = capsys.readouterr().err
    assert "no benchmark 'warp'" in error and "usage: kvgate bench GROUP" in error, error


def test_a_group_without_a_name_lists_its_own_benchmarks_only(capsys):
    assert main(["bench", "engine"]) == 2
    error = capsys.readouterr().err
    assert "kvgate bench engine: name one of its benchmarks" in error, error
    assert "  engine spec " in error and "  serve stack " not in error, error
    assert main(["bench", "engine", "warp"]) == 2
    error = capsys.readouterr().err
    assert "no benchmark 'engine warp'" in error and "  kernels " not in error, error
    assert main(["bench", "engine", "--help"]) == 0
    assert "  engine throughput " in capsys.readouterr().out


def test_engine_steps_refuses_a_count_under_one_naming_the_flag(capsys):
    status = main(["bench", "engine", "steps", "--model", str(MODEL), "--steps", "0"])
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert status == 2 and "--steps must be at least 1, got 0" in line, (status, line)


def test_engine_steps_times_each_format_by_thread_cpu_time(tmp_path):
    out = tmp_path / "steps.json"
    flags = ["--model", str(MODEL), "--variants", "float32", "int8", "--streams", "2", "--steps",
             "3", "--prompt-len", "8", "--out", str(out)]  # fmt: skip
    assert main(["bench", "engine", "steps", *flags]) == 0
    result = json.loads(out.read_text())
    assert set(result["formats"]) == {"float32", "int8"} and result["streams"] == 2
    for name, f in result["formats"].items():
        assert 0 < f["step_cpu_ms_min"] <= f["step_cpu_ms_median"], (name, f)
        assert f["prefill_cpu_s"] > 0 and f["weight_bytes_per_step"] > 0, (name, f)
    assert result["cpu"]["kernels_isa"] is not None, "the results name the kernels' ISA level"
    run = result["run"]  # what made the file: the command, the date and the machine
    assert run["command"] == shlex.join(["kvgate", "bench", "engine", "steps", *flags]), run
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", run["date_utc"]), run
    assert run["cpu_isa"] in ("avx512", "avx2", "scalar") and run["cpu_model"], run
    assert run["cpus"] >= 1 and len(run["load_average"]) == 3, run


@pytest.mark.parametrize("command", COMMANDS, ids=lambda c: c.words)
def test_every_benchmark_parses_its_flags(command, capsys):
    """Each command of the list finds its benchmark and builds its parser."""
    with pytest.raises(SystemExit) as exited:
        main(["bench", *command.words.split(), "--help"])
    assert exited.value.code == 0
    assert f"usage: kvgate bench {command.words}" in capsys.readouterr().out


DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


def bench_md_commands() -> set[str]:
    """The commands docs/bench.md's table names: each row's first cell, `GROUP NAME`."""
    rows = (REPO / "docs" / "bench.md").read_text().splitlines()
    return {row.split("|")[1].strip().strip("`") for row in rows if row.startswith("| `")}


def results_named_in_docs() -> dict[str, list[str]]:
    """Every `bench/results/...` path the README and docs/*.md name, with the docs naming it."""
    named: dict[str, list[str]] = {}
    for doc in DOCS:
        for path in re.findall(r"bench/results/[\w.-]+", doc.read_text()):
            named.setdefault(path.rstrip("."), []).append(doc.name)
    return named


def test_docs_bench_md_names_every_kvgate_bench_command():
    missing = [command.words for command in COMMANDS if command.words not in bench_md_commands()]
    assert not missing, f"docs/bench.md's table does not name: {missing}"


def test_every_results_path_the_docs_name_exists():
    named = results_named_in_docs()
    missing = {path: docs for path, docs in named.items() if not (REPO / path).is_file()}
    assert not missing, f"named in the docs but not in bench/results/: {missing}"


def test_every_results_file_git_keeps_is_named_by_a_doc():
    """Files git keeps: a local `make bench` writes an untracked bench.json beside them."""
    named = results_named_in_docs()
    listed = subprocess.run(
        ["git", "ls-files", "bench/results"], cwd=REPO, capture_output=True, text=True, check=True
    )
    files = listed.stdout.split()
    assert files, "git keeps no file in bench/results/"
    unnamed = [path for path in files if path not in named]
    assert not unnamed, f"files in bench/results/ no doc names: {unnamed}"
