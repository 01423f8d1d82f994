"""The ``hora bench`` command (also ``python -m hora bench``).

``allreduce`` and ``model`` measure, so they run on every rank under ``hora run`` (alone they run as one
rank); rank 0 prints a Markdown table on stdout and writes ``--json`` and ``--plot``. ``plan`` reads a
sweep's JSON and predicts; it needs no ranks.

Example:
    hora run -np 4 -H a:2,b:2 hora bench allreduce --sizes 1KB..256MB --json sweep.json --plot sweep.png
    hora run -np 4 -H a:2,b:2 hora bench model --model resnet50 --batch-size 32 --json model.json
    hora bench plan --sweep sweep.json --model-bytes 100MB --hosts 2,4,8 --compute-ms 250
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NoReturn

import hora as hvd
from hora.bench import model, planner, sweep
from hora.bench.report import parse_size, parse_sizes, write_json, write_plot
from hora.errors import ConfigError, HoraError
from hora.launch import output

log = logging.getLogger(__name__)

USAGE_EXIT = 2


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise ConfigError(message.replace("argument ", "", 1))


def _ints(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected comma-separated whole numbers, e.g. 1,2,4") from None


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="hora bench", description="Measure a cluster with hora (run it under hora run).")
    sub = p.add_subparsers(dest="what", required=True, parser_class=_Parser)
    common = _Parser(add_help=False)
    common.add_argument("--json", metavar="PATH", help="write the full record (every sample) as JSON")
    common.add_argument("--plot", metavar="PATH", help="write a PNG plot (needs matplotlib)")
    common.add_argument("--repeats", type=int, default=5, help="alternation cycles (default 5)")
    common.add_argument("--compression", choices=sorted(sweep.COMPRESSIONS), default="none",
                        help="hora's gradient compression (default none)")

    a = sub.add_parser("allreduce", parents=[common], help="allreduce sweep: algbw/busbw, hora against raw")
    a.add_argument("--sizes", default="1KB..256MB",
                   help="a range lo..hi (every 4th power of two between, both ends) or a list: 1MB,16MB")
    a.add_argument("--dtype", choices=sorted(sweep.DTYPES), default="float32")
    a.add_argument("--sample-seconds", type=float, default=0.2, help="length of one timed sample")
    a.add_argument("--no-links", action="store_true", help="skip the per-link-type (intra/inter host) sweep")

    m = sub.add_parser("model", parents=[common], help="synthetic training throughput and scaling efficiency")
    m.add_argument("--model", default="resnet50",
                   help="mlp, resnet18, resnet50 (built in) or a torchvision.models name (default resnet50)")
    m.add_argument("--batch-size", type=int, default=32, help="per rank (default 32)")
    m.add_argument("--image-size", type=int, default=224, help="synthetic image side (default 224)")
    m.add_argument("--np-list", type=_ints, help="rank counts to compare, e.g. 1,2,4 (default 1,2,4..size)")
    m.add_argument("--steps", type=int, default=5, help="timed steps per sample (default 5)")

    pl = sub.add_parser("plan", help="fit an alpha-beta model to a sweep and predict")
    pl.add_argument("--sweep", required=True, metavar="JSON", help="the --json of hora bench allreduce")
    pl.add_argument("--model-bytes", default="100MB", help="gradient bytes per step (default 100MB: ResNet-50)")
    pl.add_argument("--hosts", type=_ints, default=[2, 4, 8], help="host counts to predict (default 2,4,8)")
    pl.add_argument("--ranks-per-host", type=int, default=1)
    pl.add_argument("--compute-ms", type=float, help="one rank's step time without sync (hora bench model, 1 rank)")
    pl.add_argument("--overlap", type=float, default=0.0, help="fraction of compute that hides sync (0..1)")
    pl.add_argument("--min-bytes", default="0", help="fit only sizes from this one up")
    pl.add_argument("--compression", choices=sorted(sweep.COMPRESSIONS), default="none",
                    help="predict hora's allreduce and step with this compression (default none)")
    pl.add_argument("--json", metavar="PATH", help="write the fit and predictions as JSON")
    return p


def _measure(ns: argparse.Namespace) -> tuple[dict[str, Any], Callable[[dict[str, Any]], str],
                                             Callable[[dict[str, Any]], Callable[[Any], None]]]:
    if ns.repeats < 1:
        raise ConfigError("--repeats must be at least 1")
    sizes = parse_sizes(ns.sizes) if ns.what == "allreduce" else []  # usage errors before any rendezvous
    hvd.init()
    if hvd.size() == 1 and hvd.rank() == 0:
        log.warning("hora bench runs on one rank: start it with hora run -np N to measure communication")
    if ns.what == "allreduce":
        cfg = sweep.SweepConfig(sizes=sizes, dtype=ns.dtype, compression=ns.compression,
                                repeats=ns.repeats, sample_s=ns.sample_seconds, links=not ns.no_links)
        return sweep.run(cfg), sweep.markdown, sweep.plot
    cfg_m = model.ModelConfig(model=ns.model, batch_size=ns.batch_size, image_size=ns.image_size,
                              compression=ns.compression, np_list=ns.np_list or (), steps=ns.steps,
                              repeats=ns.repeats)
    return model.run(cfg_m), model.markdown, model.plot


def _plan(ns: argparse.Namespace) -> int:
    try:
        data = json.loads(Path(ns.sweep).read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"--sweep {ns.sweep}: cannot read it as JSON ({e})") from None
    fit = planner.fit_sweep(data, min_bytes=parse_size(ns.min_bytes))
    grad = parse_size(ns.model_bytes)
    compute = ns.compute_ms / 1e3 if ns.compute_ms is not None else None
    rows = planner.predictions(fit, grad, ns.hosts, ns.ranks_per_host, compute, ns.overlap, ns.compression)
    output.line(planner.markdown(fit, rows, grad).rstrip("\n"))
    if ns.json:
        write_json(ns.json, {"kind": "plan", "fit": planner.as_dict(fit), "gradient_bytes": grad, "rows": rows})
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """``hora bench``; returns the exit code."""
    logging.basicConfig(level=logging.WARNING, format="hora bench: %(levelname)s %(message)s", stream=sys.stderr)
    try:
        ns = build_parser().parse_args(list(sys.argv[1:] if argv is None else argv))
        if ns.what == "plan":
            return _plan(ns)
        result, to_markdown, to_plot = _measure(ns)
        if hvd.rank() == 0:
            output.line(to_markdown(result).rstrip("\n"))
            if ns.json:
                write_json(ns.json, result)
            if ns.plot:
                write_plot(ns.plot, to_plot(result))
        hvd.shutdown()
        return 0
    except ConfigError as exc:
        output.error_line("hora bench", str(exc))
        return USAGE_EXIT
    except HoraError as exc:
        output.error_line("hora bench", str(exc))
        return 1
