"""Prometheus text exposition, read for the few families the adapters need: samples by name with their
labels, sums over labels (data-parallel engines and ranks are labels), and quantiles of histograms from
their cumulative buckets (as PromQL's histogram_quantile interpolates them).

The families the adapters read are counts, ratios and seconds: a sample that is NaN, infinite or below zero,
or a series given twice (a sum would count it twice), makes its family invalid: `invalid[name]` says why,
and every sum, mean or histogram of that family is NaN, which the adapters' range check shows as invalid. Only
the families read are reported (`reported`): a NaN in a family no panel shows (an empty summary's quantile)
is nobody's business."""

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
        self.invalid: dict[str, str] = {}  # family name -> why its values cannot be shown
        self.reported: dict[str, str] = {}  # the invalid families read so far (the adapters show these)
        seen: set[tuple[str, str]] = set()
        repeats: dict[str, int] = defaultdict(int)
        for line in text.splitlines():
            if not line or line.startswith("#"):
                continue
            match = _SAMPLE.match(line)
            if match is None:
                continue
            name, raw = match.group(1), match.group(4)
            try:
                value = float(raw)
            except ValueError:
                continue
            series = (name, match.group(3) or "")
            if series in seen:
                repeats[name] += 1
                continue
            seen.add(series)
            if not math.isfinite(value) or value < 0:
                self.invalid.setdefault(name, f"{name} is {raw[:24]}")
                continue
            labels = dict(_LABEL.findall(match.group(3) or ""))
            self.samples[name].append(Sample(labels, value))
        for name, count in repeats.items():
            self.invalid.setdefault(name, f"{name} repeats a series {count:,} times")

    def has(self, name: str) -> bool:
        return name in self.samples or name in self.invalid

    def _poisoned(self, name: str | None) -> bool:
        """Whether family `name` is invalid (and, read now, reported)."""
        if name is None or name not in self.invalid:
            return False
        self.reported[name] = self.invalid[name]
        return True

    def first(self, *names: str) -> str | None:
        """The first of `names` this scrape has (a renamed metric: the new name, then the old)."""
        return next((n for n in names if self.has(n)), None)

    def sum(self, name: str | None) -> float | None:
        if self._poisoned(name):
            return math.nan
        if name is None or name not in self.samples:
            return None
        return sum(s.value for s in self.samples[name])

    def mean(self, name: str | None) -> float | None:
        if self._poisoned(name):
            return math.nan
        if name is None or name not in self.samples:
            return None
        values = [s.value for s in self.samples[name]]
        return sum(values) / len(values)

    def by_label(self, name: str, label: str) -> dict[str, float]:
        out: dict[str, float] = defaultdict(float)
        for sample in self.samples.get(name, ()):
            if label in sample.labels:
                out[sample.labels[label]] += sample.value
        if self._poisoned(name):
            return {key: math.nan for key in out} or {"1": math.nan}
        return dict(out)

    def histogram(self, base: str) -> "Histogram | None":
        """`base`_bucket summed over every label set but `le`; None when the scrape has no such family (a
        family with invalid samples: a histogram whose count is NaN)."""
        if [part for part in ("bucket", "count", "sum") if self._poisoned(f"{base}_{part}")]:
            return Histogram([], math.nan, math.nan)
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
        """Linear interpolation inside the bucket that holds rank q·count; None with no observations (NaN
        from an invalid family)."""
        if math.isnan(self.count):
            return math.nan
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
