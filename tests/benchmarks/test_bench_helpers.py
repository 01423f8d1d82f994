"""The pure helpers every benchmark's figures rest on: the alternating order and the size argument."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import shaped_links  # noqa: E402
from allreduce_bench import _sizes  # noqa: E402
from common import alternate  # noqa: E402


def test_alternate_rotates_which_variant_goes_first_and_keeps_samples_per_cycle() -> None:
    order: list[str] = []

    def variant(name: str):  # type: ignore[no-untyped-def]
        def sample() -> float:
            order.append(name)
            return float((len(order) - 1) // 3)  # the cycle this sample was taken in

        return sample

    samples = alternate({n: variant(n) for n in "abc"}, repeats=4, warmup=0)
    assert order == list("abc" "bca" "cab" "abc")
    # the i-th samples of every variant come from cycle i, so per-pair ratios compare neighbours
    assert samples == {n: [0.0, 1.0, 2.0, 3.0] for n in "abc"}


def test_sizes_parses_units_and_rejects_what_is_not_a_float32_tensor() -> None:
    assert _sizes("4KB, 1MB,256mb,1024") == [4096, 1 << 20, 256 << 20, 1024]
    for bad in ("x", "3", "1.5XB", "2B"):
        with pytest.raises(argparse.ArgumentTypeError):
            _sizes(bad)


def test_shaped_links_report_rebuilds_from_its_own_record() -> None:
    """The shaped-link report (ratios, the planner beside each measurement) from the committed record."""
    record = json.loads((Path(__file__).resolve().parents[2] / "benchmarks" / "results" / "shaped_links.json")
                        .read_text())
    report = shaped_links.analyse(record)
    figures = report["figures"]
    assert set(figures) >= {"busbw_fraction_of_line", "ps", "planner_validation"}
    assert figures["ps"]["8"]["ratio"]["median"] == record["analysis"]["ps"]["8"]["ratio"]["median"]
    assert "| configuration | predicted | measured | error |" in report["markdown"]
