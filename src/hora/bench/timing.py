"""Alternating measurements and their summaries: every figure hora reports is a ratio of two variants timed
in the same run, A B C, B C A, C A B, ... so that drift of a shared machine falls on both sides.

Example:
    >>> samples = alternate({"a": lambda: 1.0, "b": lambda: 2.0}, repeats=5)
    >>> summarize(samples["b"])["median"]
    2.0
    >>> ratio_summary([2.0, 4.0], [1.0, 2.0])["median"]
    2.0
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Mapping, Sequence

__all__ = ["alternate", "difference_summary", "ratio_summary", "summarize"]


def alternate(variants: Mapping[str, Callable[[], float]], repeats: int, warmup: int = 1,
              after_each: Callable[[], None] | None = None) -> dict[str, list[float]]:
    """Call each variant in turn, ``repeats`` times after ``warmup`` untimed rounds, rotating which goes first:
    A B C, B C A, C A B, A B C ... Rotation cancels position effects (on a 2-core VM the variant that runs
    first in a cycle, right after the previous cycle's last one, measured ~5% faster than an identical copy of
    it placed later); every rank rotates the same way.

    Each callable returns one sample (seconds, or any measure); the result maps name -> samples in order,
    so the i-th samples of two variants come from the same cycle (``ratio_summary`` pairs them).
    ``after_each`` runs after every timed cycle (a progress bar).
    """
    names = list(variants)
    for _ in range(warmup):
        for fn in variants.values():
            fn()
    samples: dict[str, list[float]] = {name: [] for name in names}
    for i in range(repeats):
        k = i % len(names)
        for name in names[k:] + names[:k]:
            samples[name].append(variants[name]())
        if after_each is not None:
            after_each()
    return samples


def summarize(samples: Sequence[float]) -> dict[str, float]:
    """Median, min, max and spread ((max - min) / median) of the samples."""
    med = statistics.median(samples)
    return {"median": med, "min": min(samples), "max": max(samples),
            "spread": (max(samples) - min(samples)) / med if med else 0.0, "n": len(samples)}


def ratio_summary(numer: Sequence[float], denom: Sequence[float]) -> dict[str, float]:
    """Summary of the per-pair ratios numer[i] / denom[i] (pairs measured back to back)."""
    return summarize([a / b for a, b in zip(numer, denom) if b])


def difference_summary(a: Sequence[float], b: Sequence[float], scale: float = 1e6) -> dict[str, float]:
    """Summary of the per-pair differences (a[i] - b[i]) * scale: by default seconds -> microseconds."""
    return summarize([(x - y) * scale for x, y in zip(a, b)])
