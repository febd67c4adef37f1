"""`python -m common.health`, the probe containers and preStop hooks run."""

from __future__ import annotations

import socket

from common.health import main


def closed_port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


def test_a_process_that_does_not_answer_is_not_serving(capsys) -> None:
    assert main([closed_port()]) == 1
    assert "UNREACHABLE" in capsys.readouterr().out


def test_waiting_for_a_drain_ends_when_the_process_has_already_exited(capsys) -> None:
    # An idle executor drains and exits at once on SIGTERM: its preStop hook must not wait
    # out --timeout-s and report a failure.
    assert main(["--until", "NOT_SERVING", "--timeout-s", "30", closed_port()]) == 0
    assert "exited, so drained" in capsys.readouterr().out


def test_waiting_for_serving_does_not_take_an_absent_process_for_one(capsys) -> None:
    assert main(["--until", "SERVING", "--timeout-s", "0.5", closed_port()]) == 1
