"""The counts of `workers: N` are written to the shared files once per turn of the event loop:
what a batch adds is what observing each request there would have added, and a scrape sees
every request that ended before it."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import textwrap

from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.parser import text_string_to_metric_families

from gateway.ops.metrics import _BOUNDS, LATENCY_BUCKETS, add_observations
from portcullis.histogram import PlainHistogram

# Values on bucket bounds, between them, below the first and above the last.
VALUES = (0.0, 0.001, 0.0011, 0.0025, 0.004, 0.02, 0.25, 1.0, 2.5, 9.9, 10.0, 45.0, 1e6)


def samples(registry: CollectorRegistry) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {
        (found.name, tuple(sorted(found.labels.items()))): found.value
        for family in registry.collect()
        for found in family.samples
        if not found.name.endswith("_created")
    }


def test_a_batch_adds_what_observing_each_value_adds():
    one_by_one, batched = CollectorRegistry(), CollectorRegistry()
    first = Histogram("latency", "", ["route"], registry=one_by_one, buckets=LATENCY_BUCKETS)
    second = Histogram("latency", "", ["route"], registry=batched, buckets=LATENCY_BUCKETS)
    for round_ in range(3):  # batches add up
        pending = PlainHistogram(_BOUNDS)
        for value in VALUES[round_:]:
            first.labels("orders").observe(value)
            pending.observe(value)
        add_observations(second.labels("orders"), pending)
        got, expected = samples(batched), samples(one_by_one)
        total = ("latency_sum", (("route", "orders"),))
        # The same values added in another order: equal but for the last bits of the sum.
        assert math.isclose(got.pop(total), expected.pop(total), rel_tol=1e-12)
        assert got == expected
    counted = samples(batched)
    assert counted[("latency_count", (("route", "orders"),))] == sum(
        len(VALUES[r:]) for r in range(3)
    )
    assert math.isclose(
        counted[("latency_sum", (("route", "orders"),))], sum(sum(VALUES[r:]) for r in range(3))
    )


# A worker's SharedMetrics in a process of its own (the directory must be named before
# prometheus-client is imported): requests end over several turns of the loop, some in
# the same turn, and a scrape after each turn counts every one of them.
WORKER = textwrap.dedent(
    """
    import asyncio, json, os, sys, tempfile
    directory = tempfile.mkdtemp()
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = directory
    from gateway.core.exchange import Exchange
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.multiprocess import MultiProcessCollector
    from gateway.ops.metrics import SharedMetrics, StateCounts
    files = CollectorRegistry()
    MultiProcessCollector(files, path=directory)

    def state():
        return StateCounts(
            issuers=[], token_cache_hits=0, token_cache_misses=0, token_cache_entries=0,
            rate_limit_backend="memory", rate_limit_backend_errors=0, websockets_open=0,
        )

    async def main():
        metrics = SharedMetrics(state, directory)
        scrapes = []
        ended = 0
        for turn, size in enumerate((1, 5, 0, 40, 3)):
            for n in range(size):
                exchange = Exchange(0.0, "id", "GET", "/orders/1")
                exchange.route = "orders"
                exchange.upstream_seconds = 0.002 * n
                if n % 3 == 0:
                    exchange.deny("no_token", False)
                    exchange.upstream_seconds = None
                if n == 4:
                    exchange.upstream_error = "timeout"
                metrics.observe(exchange, 401 if n % 3 == 0 else 200, 0.001 * (n + turn))
                ended += 1
            await asyncio.sleep(0)  # one turn of the loop
            # What another worker's scrape reads: the files alone.
            scrapes.append((ended, generate_latest(files).decode()))
        # A request that ends just before a scrape this worker answers, in the same turn.
        exchange = Exchange(0.0, "id", "GET", "/orders/1")
        exchange.route = "orders"
        metrics.observe(exchange, 200, 0.5)
        scrapes.append((ended + 1, metrics.exposition().decode()))
        await metrics.close()
        json.dump(scrapes, sys.stdout)

    asyncio.run(main())
    """
)


def test_a_scrape_counts_every_request_that_ended_before_it():
    result = subprocess.run(
        [sys.executable, "-c", WORKER], capture_output=True, text=True, timeout=60, check=True
    )
    scrapes = json.loads(result.stdout)
    assert [ended for ended, _ in scrapes] == [1, 6, 6, 46, 49, 50]
    # A denial for every third request of a turn (n = 0, 3, ...); the last request has none.
    for (ended, text), denied in zip(scrapes, (1, 3, 3, 17, 18, 18), strict=True):
        found = {
            (s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text)
            for s in family.samples
        }
        requests = sum(
            v for (name, _), v in found.items() if name == "portcullis_gateway_requests_total"
        )
        assert requests == ended
        durations = found[
            ("portcullis_gateway_request_duration_seconds_count", (("route", "orders"),))
        ]
        assert durations == ended
        denials = sum(
            v for (name, _), v in found.items() if name == "portcullis_gateway_denials_total"
        )
        assert denials == denied
    # An upstream error for the fifth request of the two turns that had one.
    errors = (
        "portcullis_gateway_upstream_errors_total",
        (("kind", "timeout"), ("route", "orders")),
    )
    assert found[errors] == 2
