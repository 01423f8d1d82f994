"""Autotune (``hora run --autotune``, ``HOROVOD_AUTOTUNE=1``): the settings hora's speed depends on, tuned on the
measured throughput of the first training steps, then the best kept (Horovod 0.28.1's parameter manager, on
hora's settings).

What is tuned (a knob set explicitly is held constant, as in Horovod):

* jointly, by Bayesian optimisation (a Gaussian process with expected improvement, from scikit-optimize, the
  ``hora[autotune]`` extra): the gradient bucket size (``HORA_BUCKET_CAP_MB``, 1 to 64 MB) and the fusion
  threshold (``HORA_FUSION_THRESHOLD``, 0 to 64 MB), starting from a few fixed points, the defaults first;
* then hierarchical allreduce on and off, where the job has several hosts with several ranks each.

How one sample is measured (rank 0): a *step* is one ``DistributedOptimizer.step()``; its score is the bytes of
gradient the optimizers reduce in a step over the step's wall time, in bytes per microsecond as Horovod's; a
sample's score is the median of ``HORA_AUTOTUNE_STEPS_PER_SAMPLE`` steps'. The first
``HORA_AUTOTUNE_WARMUP_SAMPLES`` samples are discarded; the Bayesian search takes
``HORA_AUTOTUNE_BAYES_OPT_MAX_SAMPLES`` samples.

How every rank switches together: rank 0 announces each new setting on the negotiator's ``autotune`` notice
channel (:mod:`hora.engine.scheduling.notices`). The fusion threshold and the hierarchical switch change in the round
that carries the announcement, on the round thread (the same round on every rank); the bucket size at the same
step boundary on every rank (a notice point every rank passes in ``step()``), where each optimizer's reducer
replans its buckets under a new generation of names. Rank 0 measures the next sample from that step on.

Rank 0 writes each sample to ``HORA_AUTOTUNE_LOG`` (``--autotune-log-file``) in Horovod's columns
(``hierarchical_allreduce,hierarchical_allgather,torus_allreduce,cache_enabled,cycle_time_ms,
tensor_fusion_threshold,score``, booleans as 0/1, the threshold in MB), with hora's bucket size as an eighth
column; the last row is the best, as in Horovod.
"""

from __future__ import annotations

import logging
import statistics
import time
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any, Protocol

from hora.common.knobs import Knobs
from hora.runtime import lifecycle as runtime

log = logging.getLogger(__name__)

CHANNEL = "autotune"  # the negotiator's notice channel the settings travel on
_MB = 1024 * 1024
BUCKET_MB = (1.0, 64.0)  # the bucket size's range in the search
FUSION_MB = (0.0, 64.0)  # the fusion threshold's range (Horovod's)
# The joint search's first points (bucket MB, fusion MB), as Horovod starts from fixed test points: the defaults
# first, then small, large and mixed sizes.
START_POINTS = ((25.0, 64.0), (4.0, 4.0), (64.0, 0.0), (8.0, 32.0))
# knob (Knobs attribute) -> the Settings field it fixes when set explicitly
_KNOB_OF_FIELD = {"bucket_cap_mb": "bucket_cap_mb", "fusion_threshold": "fusion_threshold_mb",
                  "hierarchical_allreduce": "hierarchical_allreduce"}
LOG_COLUMNS = ("hierarchical_allreduce,hierarchical_allgather,torus_allreduce,cache_enabled,cycle_time_ms,"
               "tensor_fusion_threshold,score,bucket_cap_mb")


@dataclass(frozen=True)
class Settings:
    """One point of the search: what a sample runs with."""

    bucket_cap_mb: float
    fusion_threshold_mb: float
    hierarchical_allreduce: bool

    def as_value(self, done: bool = False) -> list[Any]:
        """Plain values for a notice (the control plane carries no objects); ``done``: the search is over."""
        return [self.bucket_cap_mb, self.fusion_threshold_mb, self.hierarchical_allreduce, done]

    @classmethod
    def from_value(cls, value: Sequence[Any]) -> tuple[Settings, bool]:
        return cls(float(value[0]), float(value[1]), bool(value[2])), bool(value[3])


class Search:
    """Rank 0's search: which settings to try next, from the scores so far (pure: no job needed).

    Args:
        start: the settings the job starts with (the knobs).
        fixed: names of :class:`Settings` fields held constant (set explicitly).
        hierarchical: whether hierarchical allreduce can be switched on here (several hosts of several ranks).
        warmups, max_samples, noise: Horovod's ``--autotune-warmup-samples``, ``--autotune-bayes-opt-max-samples``,
            ``--autotune-gaussian-process-noise``.
    """

    def __init__(self, start: Settings, fixed: frozenset[str], hierarchical: bool, *, warmups: int,
                 max_samples: int, noise: float, seed: int = 0) -> None:
        self.current = start
        self.best, self.best_score = start, float("-inf")
        self._warmups = warmups
        self._fixed = fixed
        self._dims = [name for name in ("bucket_cap_mb", "fusion_threshold_mb") if name not in fixed]
        self._points = [self._point(start)] + [p for p in (self._filter(s) for s in START_POINTS)
                                               if p != self._point(start)]
        self._max_samples = max(max_samples, 1) if self._dims else 0
        self._taken = 0  # samples of the joint phase so far
        self._try_hierarchical = hierarchical and "hierarchical_allreduce" not in fixed
        self._phase = "joint" if self._dims else "hierarchical" if self._try_hierarchical else "done"
        self._optimizer = _bayes(self._dims, noise, seed, len(self._points)) if self._dims else None
        if self._dims and self._optimizer is None:
            self._max_samples = min(self._max_samples, len(self._points))
        self._seen: set[tuple[float, ...]] = set()

    @property
    def done(self) -> bool:
        return self._phase == "done"

    @property
    def warming(self) -> bool:
        """The next sample recorded is a warm-up one (discarded, not logged)."""
        return self._warmups > 0

    def _filter(self, point: tuple[float, float]) -> tuple[float, ...]:
        values = dict(zip(("bucket_cap_mb", "fusion_threshold_mb"), point))
        return tuple(values[d] for d in self._dims)

    def _point(self, s: Settings) -> tuple[float, ...]:
        return tuple(float(getattr(s, d)) for d in self._dims)

    def _with(self, point: Sequence[float]) -> Settings:
        values: dict[str, Any] = {d: round(float(v), 3) for d, v in zip(self._dims, point)}
        return replace(self.current, **values)

    def record(self, score: float) -> Settings | None:
        """The score of a sample run with :attr:`current`; the settings to run next, or None when the search is
        over (:attr:`best` is then the one to keep, and :attr:`current` is set to it)."""
        if self._warmups > 0:
            self._warmups -= 1
            return self.current
        if score > self.best_score:
            self.best, self.best_score = self.current, score
        if self._phase == "joint":
            point = self._point(self.current)
            if self._optimizer is not None:
                self._optimizer.tell(list(point), -score)  # scikit-optimize minimises
            self._seen.add(point)
            self._taken += 1
            if self._taken < self._max_samples:
                self.current = self._with(self._next_point())
                return self.current
            self._phase = "hierarchical" if self._try_hierarchical else "done"
            self.current = self.best
            if self._phase == "hierarchical":
                self.current = replace(self.best, hierarchical_allreduce=not self.best.hierarchical_allreduce)
                return self.current
        elif self._phase == "hierarchical":
            self._phase = "done"
        self.current = self.best
        return None

    def _next_point(self) -> tuple[float, ...]:
        if self._taken < len(self._points):
            return self._points[self._taken]
        assert self._optimizer is not None
        return tuple(float(v) for v in self._optimizer.ask())


def _bayes(dims: list[str], noise: float, seed: int, starts: int) -> Any:
    """scikit-optimize's optimiser over ``dims`` (None when the extra is not installed)."""
    try:
        from skopt import Optimizer
        from skopt.learning import GaussianProcessRegressor
        from skopt.learning.gaussian_process.kernels import ConstantKernel, Matern
        from skopt.space import Real
    except ImportError:
        log.warning("autotune: scikit-optimize is not installed (pip install 'hora[autotune]'); trying the %d "
                    "starting points only, without the Bayesian search", starts)
        return None
    bounds = {"bucket_cap_mb": BUCKET_MB, "fusion_threshold_mb": FUSION_MB}
    space = [Real(*bounds[d], name=d) for d in dims]
    # scikit-optimize's own GP (its cook_estimator's kernel and bounds), with the noise fixed at Horovod's
    # --autotune-gaussian-process-noise instead of learned: the scores are normalised, as Horovod's are
    kernel = ConstantKernel(1.0, (0.01, 1000.0)) * Matern(length_scale=[1.0] * len(dims),
                                                           length_scale_bounds=[(0.01, 100.0)] * len(dims), nu=2.5)
    model = GaussianProcessRegressor(kernel=kernel, normalize_y=True, noise=max(noise, 1e-6),
                                     n_restarts_optimizer=2, random_state=seed)
    return Optimizer(space, base_estimator=model, acq_func="EI", n_initial_points=starts, random_state=seed)


class CsvLog:
    """``--autotune-log-file``: one row per sample in Horovod's columns, the best last."""

    def __init__(self, path: str, cache_enabled: bool, cycle_time_ms: float) -> None:
        self._path = path
        self._fixed = (0, 0, int(cache_enabled), cycle_time_ms)  # allgather, torus, cache, cycle: not tuned
        try:
            with open(path, "w") as f:
                f.write(LOG_COLUMNS + "\n")
        except OSError as e:
            log.warning("autotune: cannot write the log %s (%s); tuning without it", path, e.strerror or e)
            self._path = ""

    def row(self, s: Settings, score: float) -> None:
        if not self._path:
            return
        allgather, torus, cache, cycle = self._fixed
        line = (f"{int(s.hierarchical_allreduce)},{allgather},{torus},{cache},{cycle:g},{s.fusion_threshold_mb:g},"
                f"{score:.6g},{s.bucket_cap_mb:g}\n")
        with open(self._path, "a") as f:
            f.write(line)


class Tunable(Protocol):
    """What autotune needs of a gradient reducer (:class:`hora.training.reducer.GradientReducer`)."""

    def replan(self, caps: tuple[int, int] | None) -> None: ...

    def step_bytes(self) -> int: ...


class Autotuner:
    """One per runtime on every rank: passes the ``autotune`` notice point at each step boundary and applies
    what comes out; on rank 0 also measures and searches (:class:`Search`)."""

    def __init__(self, rt: Any) -> None:
        knobs: Knobs = rt.knobs
        self.rank = rt.topo.rank
        self._negotiator = rt.negotiator
        self._hierarchy = rt.hierarchy  # switched on or off in the round that carries rank 0's setting
        self._reducers: weakref.WeakSet[Any] = weakref.WeakSet()
        self._caps: tuple[int, int] | None = None
        self.active = True  # until the last settings came out at a notice point on every rank
        self._pending = False  # rank 0: announced settings not yet in force
        self._last: float | None = None
        self._step_scores: list[float] = []
        self._steps_per_sample = max(knobs.autotune_steps_per_sample, 1)
        self._first_mb = knobs.first_bucket_mb
        built = self._hierarchy
        start = Settings(knobs.bucket_cap_mb, knobs.fusion_threshold / _MB,
                         bool(built is not None and built.enabled))
        fixed = frozenset(field for knob, field in _KNOB_OF_FIELD.items() if knob in knobs.explicit)
        self.search: Search | None = None
        self._log: CsvLog | None = None
        self._negotiator.listen(CHANNEL, self._in_round)
        if self.rank == 0:
            self.search = Search(start, fixed, built is not None, warmups=knobs.autotune_warmup_samples,
                                 max_samples=knobs.autotune_bayes_opt_max_samples,
                                 noise=knobs.autotune_gaussian_process_noise)
            if knobs.autotune_log:
                self._log = CsvLog(knobs.autotune_log, not knobs.disable_cache, knobs.cycle_time)
            log.info("autotune: tuning %s from %s", ", ".join(sorted({"bucket_cap_mb", "fusion_threshold_mb",
                     *(["hierarchical_allreduce"] if built is not None else [])} - fixed)) or "nothing", start)

    def attach(self, reducer: Tunable) -> None:
        self._reducers.add(reducer)
        reducer.replan(self._caps)  # this world's settings (a reducer may come from an elastic job's last world)

    def _in_round(self, value: Sequence[Any]) -> None:
        """The round thread, in the round that carries rank 0's announcement (the same round on every rank)."""
        settings, _ = Settings.from_value(value)
        self._negotiator.set_fusion_threshold(int(settings.fusion_threshold_mb * _MB))
        built = self._hierarchy
        if built is not None:
            built.enabled = settings.hierarchical_allreduce

    def step_boundary(self) -> None:
        """A ``DistributedOptimizer.step()`` ended (every rank, the same number of times)."""
        for value in self._negotiator.notice_point(CHANNEL):
            settings, done = Settings.from_value(value)
            self._caps = (int(min(self._first_mb, settings.bucket_cap_mb) * _MB), int(settings.bucket_cap_mb * _MB))
            for reducer in list(self._reducers):
                reducer.replan(self._caps)
            self._pending, self._last, self._step_scores = False, None, []
            if done:
                self.active = False
                if self.rank == 0:
                    log.info("autotune: done; keeping %s", settings)
        if self.search is not None and self.active and not self._pending:
            self._measure()

    def _measure(self) -> None:
        assert self.search is not None
        now = time.perf_counter()
        if self._last is not None and now > self._last:
            step_bytes = sum(r.step_bytes() for r in list(self._reducers))
            self._step_scores.append(step_bytes / ((now - self._last) * 1e6))
        self._last = now
        if len(self._step_scores) < self._steps_per_sample:
            return
        score = statistics.median(self._step_scores)
        tried, warming = self.search.current, self.search.warming
        nxt = self.search.record(score)
        if self._log is not None and not warming:
            self._log.row(tried, score)
        log.info("autotune: %s scored %.4g bytes/us", tried, score)
        self._step_scores, self._last = [], None
        if nxt is None:
            if self._log is not None:
                self._log.row(self.search.best, self.search.best_score)
            self._negotiator.announce(self.search.best.as_value(done=True), CHANNEL)
            self._pending = True
        elif nxt != tried:
            self._negotiator.announce(nxt.as_value(), CHANNEL)
            self._pending = True


_tuners: weakref.WeakKeyDictionary[Any, Autotuner] = weakref.WeakKeyDictionary()


def tuner_for(reducer: Tunable) -> Autotuner | None:
    """This runtime's autotuner when ``HORA_AUTOTUNE`` is on and there are ranks to tune with (made at the first
    call of a runtime; ``reducer`` is attached to it); None otherwise."""
    rt = runtime.state("autotune")
    if not rt.knobs.autotune or rt.topo.size < 2:
        return None
    tuner = _tuners.get(rt)
    if tuner is None:
        tuner = _tuners[rt] = Autotuner(rt)
    if reducer not in tuner._reducers:
        tuner.attach(reducer)
    return tuner

