"""common.metrics.ScrapeWatch behind the real /metrics server: a process waiting for a scrape
to read its last counts is let go by a scrape that began after it asked, never by one that
was already under way (it may have read the counts before they changed)."""

from __future__ import annotations

import threading
import urllib.request
from collections.abc import Iterator

import pytest
from prometheus_client import Counter
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from common.metrics import ProcessMetrics, start_metrics_server
from tests.helpers import WAIT_S


class Gate(Collector):
    """Holds a scrape in the middle of its collect until `release` is set."""

    def __init__(self) -> None:
        self.entered = threading.Event()
        self.release = threading.Event()

    def collect(self) -> Iterator[GaugeMetricFamily]:
        self.entered.set()
        assert self.release.wait(WAIT_S), "the test never let the scrape go on"
        yield GaugeMetricFamily("kvgate_test_gate", "a scrape passed the gate", value=1)


@pytest.fixture
def served() -> tuple[ProcessMetrics, Counter, str]:
    metrics = ProcessMetrics("kvgate_test_")
    moves = Counter("kvgate_test_moves", "moves", registry=metrics.registry)
    port = start_metrics_server(metrics.scrapes, "127.0.0.1", 0)
    return metrics, moves, f"http://127.0.0.1:{port}/metrics"


def scrape(url: str) -> str:
    with urllib.request.urlopen(url, timeout=WAIT_S) as response:
        return response.read().decode()


def test_a_scrape_begun_after_the_ticket_reads_the_last_counts(served):
    metrics, moves, url = served
    moves.inc(3)
    ticket = metrics.scrapes.next_scrape()
    assert not metrics.scrapes.wait(ticket, 0.0), "no scrape yet"
    assert "kvgate_test_moves_total 3.0" in scrape(url)
    assert metrics.scrapes.wait(ticket, WAIT_S)


def test_a_scrape_under_way_when_the_ticket_is_taken_does_not_count(served):
    metrics, moves, url = served
    gate = Gate()
    metrics.registry.register(gate)
    held = threading.Thread(target=scrape, args=(url,), daemon=True)
    held.start()
    assert gate.entered.wait(WAIT_S), "the first scrape never reached the gate"
    moves.inc()  # after the held scrape may have read the counter
    ticket = metrics.scrapes.next_scrape()
    gate.release.set()
    held.join(WAIT_S)
    assert not held.is_alive()
    assert not metrics.scrapes.wait(ticket, 0.0), "the scrape under way counted"
    assert "kvgate_test_moves_total 1.0" in scrape(url)
    assert metrics.scrapes.wait(ticket, 0.0)


def test_the_name_filter_of_metrics_still_works(served):
    metrics, moves, url = served
    Counter("kvgate_test_other", "another", registry=metrics.registry).inc()
    assert "kvgate_test_other_total 1.0" in scrape(url)
    text = scrape(url + "?name[]=kvgate_test_moves_total")
    assert "kvgate_test_moves_total" in text and "kvgate_test_other" not in text, text
