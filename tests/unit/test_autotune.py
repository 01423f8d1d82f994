"""Autotune's search, without a job: warm-up samples discarded, the defaults tried first, the Bayesian search
(scikit-optimize) finding the best of a known score surface, explicit knobs held, hierarchical allreduce tried
last, and the CSV log in Horovod's columns."""

from __future__ import annotations

from pathlib import Path

import pytest

from hora.training.autotune import LOG_COLUMNS, START_POINTS, CsvLog, Search, Settings

DEFAULT = Settings(25.0, 64.0, False)


def _score(s: Settings) -> float:
    """A surface whose best (12 MB buckets, 20 MB fusion) is none of the starting points."""
    return 100.0 - ((s.bucket_cap_mb - 12.0) / 4) ** 2 - ((s.fusion_threshold_mb - 20.0) / 8) ** 2 + (
        5.0 if s.hierarchical_allreduce else 0.0)


def _run(search: Search, score=_score) -> list[Settings]:
    tried = []
    while True:
        tried.append(search.current)
        if search.record(score(search.current)) is None:
            return tried


def test_warm_up_samples_are_discarded_then_the_defaults_are_measured_first() -> None:
    search = Search(DEFAULT, frozenset(), False, warmups=2, max_samples=6, noise=0.8)
    tried = _run(search)
    assert tried[:3] == [DEFAULT, DEFAULT, DEFAULT]  # two warm-ups, then the first real sample
    assert [(s.bucket_cap_mb, s.fusion_threshold_mb) for s in tried[3:6]] == list(START_POINTS[1:4])
    assert len(tried) == 2 + 6


def test_the_bayesian_search_beats_the_defaults_on_a_surface_where_they_are_not_best() -> None:
    pytest.importorskip("skopt")
    search = Search(DEFAULT, frozenset(), False, warmups=0, max_samples=20, noise=0.8)  # Horovod's noise
    _run(search)
    assert _score(search.best) > max(_score(Settings(b, f, False)) for b, f in START_POINTS)
    assert abs(search.best.bucket_cap_mb - 12.0) < 4 and abs(search.best.fusion_threshold_mb - 20.0) < 10
    assert search.current == search.best and search.done


def test_explicit_knobs_are_held_and_hierarchical_is_tried_last() -> None:
    search = Search(DEFAULT, frozenset({"fusion_threshold_mb"}), True, warmups=0, max_samples=5, noise=0.8)
    tried = _run(search)
    assert all(s.fusion_threshold_mb == 64.0 for s in tried)
    assert [s.hierarchical_allreduce for s in tried] == [False] * 5 + [True]
    assert search.best.hierarchical_allreduce  # it scored higher here


def test_nothing_to_tune_ends_at_once() -> None:
    search = Search(DEFAULT, frozenset({"bucket_cap_mb", "fusion_threshold_mb", "hierarchical_allreduce"}), True,
                    warmups=0, max_samples=5, noise=0.8)
    assert search.done and search.record(1.0) is None and search.best == DEFAULT


def test_the_log_has_horovods_columns_and_the_best_last(tmp_path: Path) -> None:
    path = tmp_path / "autotune.csv"
    log = CsvLog(str(path), cache_enabled=True, cycle_time_ms=0.0)
    log.row(Settings(4.0, 8.5, True), 12.5)
    log.row(DEFAULT, 10.0)
    log.row(Settings(4.0, 8.5, True), 12.5)
    lines = path.read_text().splitlines()
    assert lines[0] == LOG_COLUMNS
    assert lines[0].split(",")[:7] == ["hierarchical_allreduce", "hierarchical_allgather", "torus_allreduce",
                                       "cache_enabled", "cycle_time_ms", "tensor_fusion_threshold", "score"]
    assert lines[1] == "1,0,0,1,0,8.5,12.5,4"
    assert lines[-1] == lines[1]
