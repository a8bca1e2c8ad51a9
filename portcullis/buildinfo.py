"""`portcullis_build_info{version}`: the gauge (always 1) both services put on /metrics, so a
dashboard can tell which version each process runs."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from .version import version


class BuildInfo(Collector):
    def describe(self) -> list[Metric]:
        return list(self.collect())

    def collect(self) -> Iterator[Metric]:
        family = GaugeMetricFamily(
            "portcullis_build_info", "The version this process runs (always 1).", labels=["version"]
        )
        family.add_metric([version()], 1)
        yield family
