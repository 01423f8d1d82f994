"""`hora bench plan` validated on a shaped cluster, small settings: fitted on a sweep of 2 single-rank hosts
(raw float32 allreduces for the wire, hora's fp16 ones for the 16-bit wire, the CPU passes timed beside them),
it predicts configurations it was not fitted on (3 hosts: the raw ring, and hora's compressed out-of-place
allreduce) within 15% of what `hora bench allreduce` measures there.

The cables are limited with tc's token bucket filter (as benchmarks/shaped_links.py does) to a rate low
enough that the wire, not this machine's shared CPU, sets the times. Where root, iproute2 or the kernel's
tbf qdisc are missing the test skips and says which; it never fakes a link.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from hora.bench import planner
from tests.cluster import jobs, netns

pytestmark = pytest.mark.cluster

RATE_MBIT = 50.0  # 1 MB crosses a cable in 0.17 s: CPU noise on a loaded machine is a few ms
HORA = str(Path(sys.executable).parent / "hora")


def _sweep(cluster: netns.Cluster, hosts: int, sizes: str, extra: list[str], out: Path, work: Path) -> dict:
    flags = ["-np", str(hosts), "-H", ",".join(f"{h.addr}:1" for h in cluster.hosts[:hosts]),
             *jobs.hora_ssh_flags(cluster)]
    work.mkdir(parents=True, exist_ok=True)
    code, job = jobs.run_job(cluster, flags, [HORA, "bench", "allreduce", "--sizes", sizes, "--repeats", "2",
                                              "--no-links", "--json", str(out), *extra], work, timeout=240)
    assert code == 0, job.describe()
    return json.loads(out.read_text())  # type: ignore[no-any-return]


def test_plan_fitted_on_two_hosts_predicts_three_hosts_and_compression(hosts: netns.Cluster,
                                                                       tmp_path: Path) -> None:
    reason = netns.shaping_missing()
    if reason is not None:
        pytest.skip(f"links cannot be shaped here, so there is no slow wire to validate on: {reason}")
    hosts.shape(RATE_MBIT)
    try:
        fitted = _sweep(hosts, 2, "256KB,1MB,2MB", ["--compression", "fp16"], tmp_path / "fit.json",
                        tmp_path / "fit")
        unseen = _sweep(hosts, 3, "2MB", ["--compression", "fp16"], tmp_path / "three.json", tmp_path / "three")
    finally:
        hosts.unshape()
    plan = planner.fit_sweep(fitted)
    assert plan.inter is not None and plan.cpu is not None and plan.wire16 is not None
    assert 0.8 * RATE_MBIT < plan.inter.gbps * 1e3 < 1.05 * RATE_MBIT, planner.as_dict(plan)
    row = unseen["rows"][0]
    checks = {
        "raw ring allreduce, 3 hosts": (plan.allreduce(row["size"], 3), row["raw"]["time_s"]),
        "hvd.allreduce fp16 (out of place), 3 hosts": (
            plan.hora_allreduce(row["size"], 3, compression="fp16", call="out_of_place"), row["hora"]["time_s"]),
    }
    report = [f"{name}: predicted {p * 1e3:.1f} ms, measured {m * 1e3:.1f} ms, error {abs(p - m) / m:.1%}"
              for name, (p, m) in checks.items()]
    fit = [f"{r['size']}: raw {r['raw']['time_s'] * 1e3:.1f} ms, hora fp16 {r['hora']['time_s'] * 1e3:.1f} ms"
           for r in fitted["rows"]]
    print("\n".join(report))  # pytest -s shows the validation
    assert all(abs(p - m) / m <= 0.15 for p, m in checks.values()), "\n".join(report + fit)
