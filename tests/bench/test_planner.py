"""The planner's alpha-beta model: the fit recovers a link's latency and bandwidth, and predicts layouts it
was not fitted on (more ranks, other sizes, hierarchical, the parameter server) from that fit alone."""

from __future__ import annotations

import pytest

from hora.bench import planner
from hora.bench.cpu import CpuRates, pieces
from hora.bench.report import parse_sizes
from hora.bench.sweep import bus_factor
from hora.errors import ConfigError

ALPHA, BETA = 300e-6, 8 / 1e9  # 300 µs, 1 Gbit/s


def _ring(size: float, n: int, alpha: float = ALPHA, beta: float = BETA) -> float:
    return 2 * (n - 1) * alpha + 2 * (n - 1) / n * size * beta


def _sweep(sizes: list[int], hosts: int, per_host: int, jitter: float = 0.0) -> dict[str, object]:
    """A sweep record as ``hora bench allreduce --json`` writes it, timed by a known model (+- jitter)."""
    def t(i: int, base: float) -> float:
        return base * (1 + jitter * (1 if i % 2 else -1))

    n = hosts * per_host
    rows = [{"size": s, "ranks": n, "raw": {"time_s": t(i, _ring(s, n))}} for i, s in enumerate(sizes)]
    links = {"inter": [{"size": s, "ranks": hosts, "time_s": t(i, _ring(s, hosts))} for i, s in enumerate(sizes)]}
    if per_host > 1:
        links["intra"] = [{"size": s, "ranks": per_host, "time_s": t(i, _ring(s, per_host, 20e-6, 8 / 40e9))}
                          for i, s in enumerate(sizes)]
    return {"kind": "allreduce", "ranks": n, "hosts": hosts, "ranks_per_host": [per_host] * hosts,
            "rows": rows, "links": links}


def test_fit_recovers_alpha_and_beta() -> None:
    plan = planner.fit_sweep(_sweep(parse_sizes("64KB..64MB"), hosts=2, per_host=2))
    assert plan.inter is not None and plan.intra is not None
    assert plan.inter.alpha == pytest.approx(ALPHA, rel=1e-6)
    assert plan.inter.beta == pytest.approx(BETA, rel=1e-6)
    assert plan.inter.gbps == pytest.approx(1.0, rel=1e-6)
    assert plan.intra.gbps == pytest.approx(40.0, rel=1e-6)


def test_predictions_on_layouts_not_fitted_stay_within_15_percent_of_the_model() -> None:
    # fitted on 2 hosts with +-5% measurement noise, asked about 4 and 8 hosts and a size beyond the sweep
    plan = planner.fit_sweep(_sweep(parse_sizes("64KB..16MB"), hosts=2, per_host=1, jitter=0.05))
    for hosts in (4, 8):
        truth = _ring(100e6, hosts)
        assert plan.allreduce(100e6, hosts) == pytest.approx(truth, rel=0.15)
    # the parameter server: (N-1) S on the server's link, receive and send overlapped but for one chunk
    assert plan.parameter_server(100e6, 8, chunks=8) / plan.allreduce(100e6, 8) == pytest.approx(
        7 * 9 / 8 / (2 * 7 / 8), rel=0.05)
    # hierarchical on 3 hosts x 2: the network carries 2(h-1)/h of S instead of 2(n-1)/n
    plan2 = planner.fit_sweep(_sweep(parse_sizes("64KB..64MB"), hosts=2, per_host=2))
    flat, hier = plan2.allreduce(256e6, 3, 2), plan2.allreduce(256e6, 3, 2, hierarchical=True)
    assert flat / hier == pytest.approx((10 / 6) / (4 / 3), rel=0.05)


def test_step_time_and_scaling_efficiency() -> None:
    plan = planner.fit_sweep(_sweep(parse_sizes("64KB..64MB"), hosts=2, per_host=1))
    one = plan.step(0.2, 100e6, hosts=1)
    assert one == {"step_s": 0.2, "sync_s": 0.0, "efficiency": 1.0}
    four = plan.step(0.2, 100e6, hosts=4)
    assert four["sync_s"] == pytest.approx(sum(_ring(25e6, 4) for _ in range(4)), rel=1e-6)
    assert four["efficiency"] == pytest.approx(0.2 / (0.2 + four["sync_s"]))
    hidden = plan.step(0.2, 100e6, hosts=4, overlap=1.0)
    assert hidden["step_s"] == pytest.approx(max(0.2, four["sync_s"]))


def test_bad_input_says_what_to_do() -> None:
    with pytest.raises(ConfigError, match="hora bench allreduce --json"):
        planner.fit_sweep({"kind": "model"})
    with pytest.raises(ConfigError, match="at least two sizes"):
        planner.fit_sweep(_sweep([1 << 20], hosts=2, per_host=1))
    no_links = _sweep(parse_sizes("64KB..64MB"), hosts=2, per_host=2)
    no_links["links"] = {}  # hora bench allreduce --no-links
    with pytest.raises(ConfigError, match="without --no-links"):
        planner.fit_sweep(no_links)
    with pytest.raises(ConfigError, match="positive"):
        parse_sizes("0KB")


def test_bus_factor_is_nccl_tests_allreduce_factor() -> None:
    assert [bus_factor(n) for n in (1, 2, 4, 8)] == [0.0, 1.0, 1.5, 1.75]


def test_a_sweep_without_a_bandwidth_limit_says_so() -> None:
    fit = planner.LinkFit.fit([(4096, 2, 0.004), (65536, 2, 0.003)])  # noise: bigger was faster
    assert "sweep larger sizes" in fit.note
    assert planner.LinkFit.fit([(1e6, 2, 0.0105), (4e6, 2, 0.0405)]).note == ""


def test_cpu_term_adds_hora_local_passes_to_the_wire() -> None:
    sweep = _sweep(parse_sizes("64KB..64MB"), hosts=2, per_host=1)
    rates = CpuRates(copy=3e-10, cast_down=2e-10, cast_up=2.5e-10, scale=1e-10)
    sweep["cpu"] = rates.as_dict()
    plan = planner.fit_sweep(sweep)
    assert plan.cpu == rates
    s = 100e6
    # out-of-place Average, uncompressed: the wire, a copy into a fresh tensor, the division
    assert plan.hora_allreduce(s, 2, call="out_of_place", average=True) == pytest.approx(
        _ring(s, 2) + s * 3e-10 + s * 1e-10)
    # fp16: half the wire, two casts (the division is folded into the cast back), overlapping the wire in 8
    # pieces but for one piece's
    assert plan.hora_allreduce(s, 2, compression="fp16", call="out_of_place", average=True) == pytest.approx(
        _ring(s / 2, 2) + s * 4.5e-10 / 8)
    # in place: the cast back goes into the caller's tensor (a record without that rate: the fresh one's)
    assert plan.hora_allreduce(s, 2, compression="bf16") == pytest.approx(_ring(s / 2, 2) + s * 4.5e-10 / 8)
    into = planner.fit_sweep({**sweep, "cpu": {**rates.as_dict(), "cast_up_into": 1.5e-10}})
    assert into.hora_allreduce(s, 2, compression="bf16", average=True) == pytest.approx(
        _ring(s / 2, 2) + s * 3.5e-10 / 8)
    # small: one piece, the casts in series with the wire; casts longer than the wire: they set the time
    assert plan.hora_allreduce(2e6, 2, compression="fp16", call="out_of_place") == pytest.approx(
        _ring(1e6, 2) + 2e6 * 4.5e-10)
    slow = planner.fit_sweep({**sweep, "cpu": CpuRates(copy=3e-10, cast_down=2e-8, cast_up=2.5e-8,
                                                        scale=1e-10).as_dict()})
    assert slow.hora_allreduce(s, 2, compression="fp16", call="out_of_place") == pytest.approx(s * 4.5e-8 * 9 / 8)
    # without the sweep's CPU timings the prediction is the wire alone
    assert planner.fit_sweep(_sweep(parse_sizes("64KB..64MB"), hosts=2, per_host=1)).hora_allreduce(
        s, 4, compression="bf16") == pytest.approx(_ring(s / 2, 4))
    # the DistributedOptimizer's reused buckets: no cast or copy of its own beyond backward's copy in
    step = plan.step(0.0, s, 2, compression="fp16", bucket_bytes=s)
    assert step["sync_s"] == pytest.approx(_ring(s / 2, 2))


def test_a_compressed_sweep_fits_the_16_bit_wire() -> None:
    sizes = parse_sizes("1MB..64MB")
    rates = CpuRates(copy=3e-10, cast_down=2e-10, cast_up=2.5e-10, scale=1e-10)
    sweep = _sweep(sizes, hosts=2, per_host=1)
    sweep.update(compression="fp16", cpu=rates.as_dict())
    for row in sweep["rows"]:  # type: ignore[attr-defined]
        # hora's fp16 allreduce: a 16-bit wire 20% slower per byte than float32's, plus its two casts, all but
        # one piece's overlapping the wire
        k = pieces(row["size"], "fp16", "out_of_place")
        row["hora"] = {"time_s": _ring(row["size"] / 2, 2, beta=1.2 * BETA) + row["size"] * 4.5e-10 / k}
    plan = planner.fit_sweep(sweep)
    assert plan.wire16 is not None and plan.wire16.beta == pytest.approx(1.2 * BETA, rel=1e-6)
    # a layout it was not fitted on: 4 hosts
    assert plan.hora_allreduce(100e6, 4, compression="fp16", call="out_of_place") == pytest.approx(
        _ring(50e6, 4, beta=1.2 * BETA) + 100e6 * 4.5e-10 / 8)
    assert planner.fit_sweep(_sweep(sizes, hosts=2, per_host=1)).wire16 is None  # an uncompressed sweep
