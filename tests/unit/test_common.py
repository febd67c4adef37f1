"""common/ and the processes' config: Redis key names, config helpers and errors, prefix hashes, log
lines, metrics flags."""

from __future__ import annotations

import json
import logging

import pytest

from common.config import (
    check_host_port,
    check_positive,
    check_range,
    check_redis_url,
    env_bool,
    env_int,
    redacted_url,
)
from common.keys import RedisKeys
from common.logs import (
    JsonFormatter,
    TextFormatter,
    add_log_context,
    request_fields,
    setup_logging,
)
from common.metrics import METRICS_DISABLED, check_metrics_port
from common.prefix import block_hashes
from engine.config import EngineConfig, EngineConfigError
from executor.config import ExecutorConfig
from tests.helpers import STORIES_260K


def test_every_key_starts_with_the_prefix():
    keys = RedisKeys("tenantA:")
    names = [
        keys.requests,
        keys.executors,
        keys.executor_status("e1"),
        keys.executor_inbox("e1"),
        keys.session("acme", "s1"),
        keys.cancelled("r1"),
        keys.api_key("k1"),
        keys.api_key_ids,
        keys.tenant_limits("acme"),
        keys.tenant_buckets("acme"),
        keys.tenant_streams("acme"),
        keys.tenant_usage("acme", "2026-01-01"),
        keys.scheduler_leader,
    ]
    assert all(name.startswith("tenantA:") for name in names), names
    assert len(set(names)) == len(names), f"two keys share a name: {names}"


def test_an_empty_prefix_is_refused_naming_the_flag():
    with pytest.raises(ValueError, match="--redis-prefix"):
        RedisKeys("")


def test_env_helpers_name_the_variable(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("KVGATE_PORT", "five")
    with pytest.raises(ValueError, match="KVGATE_PORT"):
        env_int("KVGATE_PORT", 50051)
    monkeypatch.setenv("KVGATE_FLAG", "yes")
    assert env_bool("KVGATE_FLAG", False) is True


def test_check_helpers_name_the_flag_and_range():
    with pytest.raises(ValueError, match=r"--max-queue-len must be in \[1, inf\], got 0"):
        check_range("--max-queue-len", 0, min_value=1)
    with pytest.raises(ValueError, match="--target"):
        check_host_port("--target", "localhost")
    check_host_port("--target", "127.0.0.1:50051")


def test_an_engine_field_out_of_range_is_named_by_its_field_and_by_its_flag():
    with pytest.raises(EngineConfigError, match=r"^block_size must be a power of two") as caught:
        EngineConfig(model="m", block_size=3)
    assert (caught.value.field, caught.value.value) == ("block_size", 3)
    model = str(STORIES_260K)
    with pytest.raises(ValueError, match=r"^--block-size must be a power of two .*, got 3$"):
        ExecutorConfig.from_args(["--model", model, "--block-size", "3"])
    with pytest.raises(ValueError, match=r"^--gpu-memory-utilization must be in \(0, 1\], got 2.0"):
        ExecutorConfig.from_args(["--model", model, "--gpu-memory-utilization", "2"])
    config = ExecutorConfig.from_args(["--model", model, "--max-model-len", "0"])
    assert config.engine.max_model_len is None and config.engine.num_gpu_blocks is None


def test_block_hashes_chain_and_are_salted_by_tenant():
    tokens = list(range(40))
    hashes = block_hashes(tokens, 16, salt="default")
    assert len(hashes) == 2, "only full blocks are hashed"
    assert block_hashes(tokens[:32], 16, salt="default") == hashes
    changed_first = block_hashes([99, *tokens[1:]], 16, salt="default")
    assert changed_first[1] != hashes[1], "a block's hash must cover the blocks before it"
    assert block_hashes(tokens, 16, salt="acme") != hashes, "tenants must not share hashes"
    assert all(0 <= h < 2**64 for h in hashes)


def _formatted(formatter: logging.Formatter, **extra: str) -> str:
    record = logging.LogRecord("kvgate.test", logging.INFO, __file__, 1, "turn %d done", (2,), None)
    record.__dict__.update(extra)
    return formatter.format(record)


def test_log_lines_carry_the_request_ids_as_fields():
    fields = request_fields("r-1", "s-1")
    entry = json.loads(_formatted(JsonFormatter("gateway"), **fields))
    assert entry["request_id"] == "r-1" and entry["session_id"] == "s-1", entry
    assert entry["msg"] == "turn 2 done" and entry["process"] == "gateway", entry
    text = _formatted(TextFormatter("gateway"), **fields)
    assert text.endswith("turn 2 done request_id=r-1 session_id=s-1"), text
    assert "session_id" not in request_fields("r-2", ""), "no session: no session_id field"
    assert "request_id" not in json.loads(_formatted(JsonFormatter("scheduler")))


def test_a_process_log_context_is_on_every_line(capsys: pytest.CaptureFixture[str]):
    root = logging.getLogger()
    saved = root.handlers[:], root.level
    try:
        setup_logging("executor", "info", "json")
        add_log_context(executor_id="exec-7")
        log = logging.getLogger("kvgate.test")
        log.info("step loop started")
        log.info("request admitted", extra=request_fields("r-1"))
        log.info("handed over", extra={"request_id": "r-2", "executor_id": "exec-9"})
    finally:
        root.handlers[:], level = saved
        root.setLevel(level)
    lines = [json.loads(line) for line in capsys.readouterr().err.splitlines()]
    assert [line.get("executor_id") for line in lines] == ["exec-7", "exec-7", "exec-9"], lines
    assert lines[1]["request_id"] == "r-1", lines[1]


def test_metrics_port_accepts_a_port_zero_or_disabled_and_names_the_flag():
    for port in (METRICS_DISABLED, 0, 9400):
        check_metrics_port(port)
    with pytest.raises(ValueError, match="--metrics-port"):
        check_metrics_port(-2)


def test_every_process_logs_json_lines_unless_told_text(monkeypatch: pytest.MonkeyPatch):
    from deploy.local import LauncherConfig
    from deploy.stack import StackConfig
    from gateway.config import config_from_args
    from scheduler.config import SchedulerConfig

    monkeypatch.delenv("KVGATE_LOG_FORMAT", raising=False)
    defaults = {
        "gateway": config_from_args([]).log_format,
        "scheduler": SchedulerConfig.from_args([]).log_format,
        "stack": StackConfig(model="m").log_format,
        "make run": LauncherConfig.from_args([]).log_format,
    }
    assert set(defaults.values()) == {"json"}, f"expected json everywhere, got {defaults}"
    monkeypatch.setenv("KVGATE_LOG_FORMAT", "text")
    from_env = {
        "scheduler": SchedulerConfig.from_args([]).log_format,
        "stack": StackConfig(model="m").log_format,
        "make run": LauncherConfig.from_args([]).log_format,
    }
    assert set(from_env.values()) == {"text"}, f"KVGATE_LOG_FORMAT=text ignored: {from_env}"
    assert LauncherConfig.from_args(["--log-format", "json"]).log_format == "json"
    with pytest.raises(ValueError, match="--log-format"):
        LauncherConfig.from_args(["--log-format", "xml"])


def test_redis_urls_are_shown_without_their_password():
    assert redacted_url("rediss://kvgate:s3cret@h:6380/0?ssl_ca_certs=/ca.pem") == (
        "rediss://kvgate:***@h:6380/0?ssl_ca_certs=/ca.pem"
    )
    assert redacted_url("unix:///r.sock?db=0&password=s3cret") == "unix:/r.sock?db=0&password=***"
    assert redacted_url("redis://h:6379/0") == "redis://h:6379/0"
    with pytest.raises(ValueError) as refused:
        check_redis_url("--redis-url", "http://kvgate:s3cret@h:6379")
    assert "s3cret" not in str(refused.value) and "--redis-url" in str(refused.value)


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_a_range_check_refuses_a_value_that_is_not_finite(value: float):
    """NaN fails every comparison, so `value < min_value` let it through and turned a bound
    such as --lpm-aging-ms's off."""
    for check in (
        lambda: check_range("--lpm-aging-ms", value, min_value=1),
        lambda: check_positive("--lpm-aging-ms", value),
    ):
        with pytest.raises(ValueError, match="--lpm-aging-ms must be a finite number"):
            check()


@pytest.mark.parametrize(
    ("field", "value"),
    [("max_receive_message_bytes", 500), ("max_receive_message_bytes", 3_000_000_000),
     ("max_concurrent_streams", 0), ("redis_max_connections", 0), ("tokenizer_threads", 65)],
)  # fmt: skip
def test_a_gateway_limit_out_of_range_names_its_flag(field: str, value: int):
    """3e9 receive bytes passed the check and crashed gRPC core's C-int channel argument."""
    from gateway.config import GatewayConfig

    flag = "--" + field.replace("_", "-")
    with pytest.raises(ValueError, match=flag):
        GatewayConfig(model=str(STORIES_260K), **{field: value})
