"""`kvgate bench load` against a real stack, through kvgate.v1 and through the OpenAI HTTP
front: the results JSON and the PNG plots it writes; `kvgate bench serve fronts` on its own
stack; and the serving benchmark's do-nothing server and hop timings against their real peers."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from deploy.stack import ROOT, free_port
from tests.integration.conftest import MODEL, scrape

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
SUMMARY_KEYS = ("mean", "p50", "p90", "p99")


@pytest.fixture(scope="module")
def stack(stack_factory):
    return stack_factory()


@pytest.fixture(scope="module")
def http_stack(stack_factory):
    return stack_factory(http_port=free_port())


def kvgate_bench(*flags: str) -> subprocess.CompletedProcess:
    """Runs the `kvgate bench load` command line and fails the test when it exits non-zero."""
    argv = [sys.executable, "-m", "client.cli", "bench", "load", "--no-progress", *flags]
    done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"kvgate bench exited {done.returncode}:\n{done.stderr}"
    return done


def assert_is_png(path: Path) -> None:
    assert path.is_file(), f"expected the plot {path}; it was not written"
    assert path.read_bytes()[:8] == PNG_MAGIC, f"{path} is not a PNG"


def test_bench_writes_the_results_json_and_cdf_plot(stack, tmp_path):
    out = tmp_path / "run.json"
    kvgate_bench(
        "--target", stack.address, "--num-requests", "8", "--request-rate", "inf",
        "--input-len", "24", "--output-len", "6", "--slo", "ttft_ms=600000", "--out", str(out),
    )  # fmt: skip
    results = json.loads(out.read_text())
    assert (results["completed"], results["failed"]) == (8, 0), results["first_error"]
    assert results["total_output_tokens"] == 8 * 6, "ignore_eos + max_tokens: exact outputs"
    assert abs(results["total_prompt_tokens"] - 8 * 24) <= 8 * 4, "prompts near 24 tokens"
    for name in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        summary = results[name]
        assert set(summary) == set(SUMMARY_KEYS), f"{name}: {summary}"
        assert 0 <= summary["p50"] <= summary["p90"] <= summary["p99"], f"{name}: {summary}"
    assert results["ttft_ms"]["p99"] <= results["e2e_ms"]["p99"]
    assert results["request_throughput"] > 0 and results["output_token_throughput"] > 0
    assert results["goodput"] == results["request_throughput"], "a 600 s TTFT SLO: all good"
    assert results["workload"]["input_len"] == 24 and results["request_rate"] == "inf"
    assert_is_png(tmp_path / "run_cdf.png")


def test_bench_load_drives_the_openai_http_front(http_stack, tmp_path):
    out = tmp_path / "openai.json"
    kvgate_bench(
        "--api", "openai", "--target", http_stack.address, "--openai-url", http_stack.http_url,
        "--num-requests", "6", "--request-rate", "inf", "--input-len", "16", "--output-len", "5",
        "--out", str(out),
    )  # fmt: skip
    results = json.loads(out.read_text())
    assert (results["completed"], results["failed"]) == (6, 0), results["first_error"]
    assert (results["api"], results["target"]) == ("openai", http_stack.http_url), results
    assert results["total_output_tokens"] == 6 * 5, "the usage events' completion_tokens"
    assert abs(results["total_prompt_tokens"] - 6 * 16) <= 6 * 4, "prompts near 16 tokens"
    for name in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        summary = results[name]
        assert 0 < summary["p50"] <= summary["p99"], f"{name}: {summary}"
    assert results["ttft_ms"]["p99"] <= results["e2e_ms"]["p99"]
    served = re.search(
        r'kvgate_gateway_requests_total\{api="openai",code="OK",method="completions",'
        r'service="openai"\} ([0-9.]+)',
        scrape(http_stack, "gateway"),
    )
    assert served and float(served.group(1)) == 6, "the 6 requests went through the HTTP front"


def test_serve_fronts_times_the_three_fronts_of_one_gateway(tmp_path):
    out = tmp_path / "fronts.json"
    command = [sys.executable, "-m", "bench.cli", "serve", "fronts", "--model", str(MODEL)]
    command += ["--ttft-requests", "2", "--streams", "3", "--output-len", "4", "--repeats", "2"]
    command += ["--out", str(out)]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, (
        f"kvgate bench serve fronts exited {done.returncode}:\n{done.stderr}"
    )
    results = json.loads(out.read_text())
    fronts = ("kvgate", "vllm", "openai")
    assert all(len(results["ttft_samples_ms"][f]) == 2 for f in fronts), results["ttft_samples_ms"]
    assert all(results["ttft_ms_p50"][f] > 0 for f in fronts), results["ttft_ms_p50"]
    assert set(results["ttft_paired_ms_minus_kvgate"]) == {"vllm", "openai"}
    rounds = results["tokens_per_s_rounds"]
    assert all(len(rounds[f]) == 2 and min(rounds[f]) > 0 for f in fronts), rounds
    assert set(results["tokens_per_s_ratio_to_kvgate"]) == {"vllm", "openai"}
    assert results["http_client"].startswith("httpx"), results["http_client"]


def test_serve_structured_measures_schema_streams_beside_unconstrained_ones(tmp_path):
    """`kvgate bench serve structured` at a tiny size: both sides' rounds through the stack and
    the Engine, every stream run to --output-len (the command exits 1 otherwise), the
    schema's text held to it, and TTFT samples of the three kinds of request."""
    out = tmp_path / "structured.json"
    command = [sys.executable, "-m", "bench.cli", "serve", "structured", "--model", str(MODEL)]
    command += ["--streams", "3", "--output-len", "5", "--repeats", "1", "--ttft-requests", "2"]
    command += ["--ttft-interval-s", "0", "--kv-cache-gib", "0.05", "--out", str(out)]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"serve structured exited {done.returncode}:\n{done.stderr}"
    results = json.loads(out.read_text())
    for where in ("stack", "engine"):
        short = results[where]["short_ends"]
        assert short == {"unconstrained": [], "schema": []}, f"{where}: {short}"
        for rate in ("tokens_per_s", "tokens_per_cpu_s"):
            rounds = results[where]["rounds"][rate]
            assert all(len(r) == 1 and r[0] > 0 for r in rounds.values()), (where, rate, rounds)
            ratio = results["schema_over_unconstrained"][where][rate]
            assert set(ratio) == {"median", "best", "by_round"}, ratio
    text, head = results["stack"]["texts"]["schema"], '[{"name":"'  # the schema's only start
    assert len(text) >= 5 and text[: len(head)] == head[: len(text)], results["stack"]
    samples = results["ttft_samples_ms"]
    assert {side: len(values) for side, values in samples.items()} == {
        "unconstrained": 2, "cached_schema": 2, "first_use_schema": 2
    }, samples  # fmt: skip
    assert min(min(values) for values in samples.values()) > 0, samples


def test_max_concurrency_one_runs_requests_one_after_another(stack, tmp_path):
    out = tmp_path / "serial.json"
    kvgate_bench(
        "--target", stack.address, "--num-requests", "4", "--request-rate", "inf",
        "--max-concurrency", "1", "--input-len", "16", "--output-len", "8", "--out", str(out),
    )  # fmt: skip
    results = json.loads(out.read_text())
    assert results["completed"] == 4 and results["max_concurrency"] == 1
    # one at a time: the run lasts at least the sum of the requests' latencies
    serial_s = 4 * results["e2e_ms"]["mean"] / 1000.0
    assert results["duration_s"] >= 0.99 * serial_s, (
        f"4 requests took {results['duration_s']:.3f} s in all, less than the "
        f"{serial_s:.3f} s their latencies add up to: they overlapped"
    )


def test_bench_rate_sweep_plots_throughput_against_rate(stack, tmp_path):
    out = tmp_path / "rates.json"
    kvgate_bench(
        "--target", stack.address, "--workload", "chat", "--num-requests", "4",
        "--num-turns", "2", "--input-len", "8", "--output-len", "4",
        "--sweep-rates", "8,inf", "--out", str(out),
    )  # fmt: skip
    results = json.loads(out.read_text())
    assert [p["request_rate"] for p in results["points"]] == [8.0, "inf"]
    assert all(p["completed"] == 4 for p in results["points"]), "2 sessions x 2 turns per rate"
    assert_is_png(tmp_path / "rates_rates.png")


def test_bench_window_sweep_restarts_its_scheduler(tmp_path):
    out = tmp_path / "windows.json"
    log_dir = tmp_path / "logs"
    kvgate_bench(
        "--model", str(MODEL), "--sweep-window", "0,50", "--num-requests", "4",
        "--input-len", "8", "--output-len", "4", "--out", str(out), "--log-dir", str(log_dir),
    )  # fmt: skip
    results = json.loads(out.read_text())
    assert [p["batch_window_ms"] for p in results["points"]] == [0, 50]
    # Each scheduler the sweep started says, as it takes the lead, which window it runs with.
    scheduler_log = (log_dir / "scheduler.log").read_text()
    windows = re.findall(r"is the leader \(batch_window_ms=([0-9.]+)", scheduler_log)
    assert windows == ["0", "50"], f"expected schedulers with windows 0 then 50, got {windows}"
    assert all(p["completed"] == 4 for p in results["points"])
    assert_is_png(tmp_path / "windows_windows.png")


def test_bench_policy_sweep_runs_the_same_requests_under_each_policy(tmp_path):
    out = tmp_path / "policies.json"
    log_dir = tmp_path / "logs"
    kvgate_bench(
        "--model", str(MODEL), "--sweep-policy", "fcfs,lpm", "--workload", "shared-prefix",
        "--num-requests", "4", "--num-prefixes", "2", "--prefix-len", "40", "--input-len", "8",
        "--output-len", "4", "--executor-flags", "--block-size 4 --max-num-seqs 1",
        "--out", str(out), "--log-dir", str(log_dir),
    )  # fmt: skip
    points = json.loads(out.read_text())["points"]
    assert [p["policy"] for p in points] == ["fcfs", "lpm"]
    assert all(p["completed"] == 4 for p in points), [p["first_error"] for p in points]
    assert points[0]["total_prompt_tokens"] == points[1]["total_prompt_tokens"], "same requests"
    # one request at a time on a fresh cache: each prefix's later requests reuse at least
    # its 9 full blocks, whichever the order
    assert all(p["total_cached_prompt_tokens"] >= 2 * 36 for p in points), points
    assert all(0 < p["prefix_cache_hit_rate"] < 1 for p in points), points
    policies = re.findall(r"KV blocks, policy (\w+)", (log_dir / "executor-0.log").read_text())
    assert policies[-2:] == ["fcfs", "lpm"], f"executors started with {policies}"
    leaders = re.findall(r"policy (\w+)\)", (log_dir / "scheduler.log").read_text())
    assert leaders[-2:] == ["fcfs", "lpm"], f"schedulers led with {leaders}"


def test_the_grpc_floor_server_streams_a_token_to_the_bench_client():
    """bench.serve's do-nothing server: a real process answering Generate at once."""
    from bench.serve import grpc_floor_ttft_ms

    ttfts = grpc_floor_ttft_ms([[5, 6, 7], [8, 9]], interval_s=0.0)
    # grpc_ttft_ms stops its clock at the first chunk with tokens and fails without one.
    assert len(ttfts) == 2 and all(t > 0 for t in ttfts), ttfts


def test_secure_hops_times_every_hop_against_plain_and_tls_peers(tmp_path):
    """`kvgate bench serve hops` against its real redis-servers (plain, TLS with an ACL user) and
    gRPC servers (plain, TLS, mutual TLS): every hop has both sides' samples."""
    out = tmp_path / "hops.json"
    command = [sys.executable, "-m", "bench.cli", "serve", "hops", "--pairs", "3"]
    command += ["--out", str(out)]
    subprocess.run(command, cwd=ROOT, check=True, capture_output=True, timeout=120)
    results = json.loads(out.read_text())["hops"]  # its default --out-key (security.json)
    hops = {k: v for k, v in results.items() if isinstance(v, dict) and k != "run"}
    assert set(hops) == {
        "admission_three_round_trips",
        "admission_two_round_trips",
        "admission_one_round_trip",
        "blocking_client_round_trip",
        "grpc_call_tls",
        "grpc_call_mutual_tls",
    }, hops
    for name, hop in hops.items():
        assert hop["plain_p50_ms"] > 0 and hop["secured_p50_ms"] > 0, (name, hop)


def test_scaling_restart_runs_both_sides_through_a_rolling_restart(tmp_path):
    """A tiny `kvgate bench scaling restart`: both sides ran the restart, every turn of the
    moving side succeeded, and its drains moved KV to the peer; the command exits 0, or 1
    only for what the results show (a lost session or a re-prefill share over the bar)."""
    out = tmp_path / "restart.json"
    command = [sys.executable, "-m", "bench.cli", "scaling", "restart", "--model", str(MODEL)]
    command += ["--sessions", "6", "--workers", "2", "--max-tokens", "8", "--warmup-turns", "1"]
    command += ["--turns-after", "1", "--out", str(out)]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert out.is_file(), f"no results (exit {done.returncode}):\n{done.stderr}"
    results = json.loads(out.read_text())
    if done.returncode != 0:
        assert done.returncode == 1 and "kvgate bench: " in done.stderr, done.stderr
        assert "failed turn" not in done.stderr, done.stderr
    moving, recompute = results["moving"], results["recompute"]
    assert moving["failed_turns"] == 0, moving["failures"]
    for side in (moving, recompute):
        assert side["turns"] >= 6 * 3, side["turns"]  # warm-up, during, after the restart
        assert [d["executor"] for d in side["drains"]] == ["executor-0", "executor-1"]
        assert all(d["exit_status"] == 0 and d["drain_s"] > 0 for d in side["drains"])
        assert side["turns_after_a_move"] == len(side["turns_after_a_move_records"])
        for key in ("lost_sessions", "reprefill_share_after_move_mean", "restart_s"):
            assert key in side, key
        assert 0 <= side["ttft_pairs"] <= side["turns_after_a_move"], side["ttft_pairs"]
        if side["ttft_pairs"]:
            assert side["ttft_after_move_paired_ratio_median"] > 0
    assert sum(d["sessions_moved"] + d["requests_moved"] for d in moving["drains"]) > 0
    assert all(d["blocks_in_at_peer"] == 0 for d in recompute["drains"])
    assert recompute["reprefill_share_after_move_mean"] > moving["reprefill_share_after_move_mean"]
