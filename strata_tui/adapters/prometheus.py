"""Prometheus text exposition, read for the few families the adapters need: samples by name with their
labels, sums over labels (data-parallel engines and ranks are labels), and quantiles of histograms from
their cumulative buckets (as PromQL's histogram_quantile interpolates them)."""

from __future__ import annotations

import math
import re
from collections import defaultdict
from dataclasses import dataclass

_SAMPLE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{(.*)\})?\s+(\S+)')
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


@dataclass(frozen=True)
class Sample:
    labels: dict[str, str]
    value: float


class Metrics:
    """One scrape: `samples[name]` is every sample of that exact name (counters keep their `_total`)."""

    def __init__(self, text: str) -> None:
        self.samples: dict[str, list[Sample]] = defaultdict(list)
        for line in text.splitlines():
            if not line or line.startswith("#"):
                continue
            match = _SAMPLE.match(line)
            if match is None:
                continue
            try:
                value = float(match.group(4))
            except ValueError:
                continue
            labels = dict(_LABEL.findall(match.group(3) or ""))
            self.samples[match.group(1)].append(Sample(labels, value))

    def first(self, *names: str) -> str | None:
        """The first of `names` this scrape has (a renamed metric: the new name, then the old)."""
        return next((n for n in names if n in self.samples), None)

    def sum(self, name: str | None) -> float | None:
        if name is None or name not in self.samples:
            return None
        return sum(s.value for s in self.samples[name])

    def mean(self, name: str | None) -> float | None:
        if name is None or name not in self.samples:
            return None
        values = [s.value for s in self.samples[name]]
        return sum(values) / len(values)

    def by_label(self, name: str, label: str) -> dict[str, float]:
        out: dict[str, float] = defaultdict(float)
        for sample in self.samples.get(name, ()):
            if label in sample.labels:
                out[sample.labels[label]] += sample.value
        return dict(out)

    def histogram(self, base: str) -> "Histogram | None":
        """`base`_bucket summed over every label set but `le`; None when the scrape has no such family."""
        buckets = self.samples.get(f"{base}_bucket")
        if not buckets:
            return None
        by_le: dict[float, float] = defaultdict(float)
        for sample in buckets:
            le = sample.labels.get("le")
            if le is None:
                continue
            by_le[math.inf if le in ("+Inf", "Inf") else float(le)] += sample.value
        count = self.sum(f"{base}_count")
        return Histogram(sorted(by_le.items()), count if count is not None else by_le.get(math.inf, 0.0),
                         self.sum(f"{base}_sum") or 0.0)


@dataclass(frozen=True)
class Histogram:
    buckets: list[tuple[float, float]]  # (upper bound, cumulative count), ascending
    count: float
    total: float

    def quantile(self, q: float) -> float | None:
        """Linear interpolation inside the bucket that holds rank q·count; None with no observations."""
        if self.count <= 0 or not self.buckets:
            return None
        rank = q * self.count
        lower_bound, lower_count = 0.0, 0.0
        for bound, cumulative in self.buckets:
            if cumulative >= rank:
                if math.isinf(bound):
                    return lower_bound  # past the last finite bucket: its bound is all that is known
                width = cumulative - lower_count
                return lower_bound + (bound - lower_bound) * ((rank - lower_count) / width if width else 1.0)
            lower_bound, lower_count = bound, cumulative
        return lower_bound

    def mean(self) -> float | None:
        return self.total / self.count if self.count > 0 else None
