"""Starting and checkpointing a large model: peak memory per rank against the model's own bytes, and what an
asynchronous sharded save costs the training loop.

On 2 fork-started ranks, a Llama-style model (bf16 for the loading rows, fp32 for the others), each row measured
in its own rank processes (the kernel's high-water mark, reset first: hora.bench.peak_memory):

- from_pretrained shard by shard on every rank, then ``hvd.broadcast_parameters`` (the recipe) against a
  config-built model plus a state dict of every shard (``load_state_dict``);
- a model built on the meta device and ``hora.meta.materialize``d against one built eagerly and broadcast as a
  single flat buffer (``broadcast_parameters`` before its chunks);
- ``restore_sharded`` into the model's own storage against ``hora.checkpoint.restore`` of a whole state dict;
- ``save_sharded``'s time in the caller, synchronous against ``async_save=True`` (alternating, median of 5).

    python benchmarks/large_model_start.py            # ~90 M parameters; reports to benchmarks/results/
    python benchmarks/large_model_start.py --quick    # a smoke run
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import add_output_flags, fork_ranks, machine_info, markdown_table, output_dir, summarize, write_results  # noqa: E402

import hora as hvd  # noqa: E402
from hora import checkpoint  # noqa: E402
from hora.bench.peak_memory import PeakMemory  # noqa: E402
from hora.meta import materialize  # noqa: E402


def _config(hidden: int, layers: int) -> Any:
    import transformers

    return transformers.LlamaConfig(vocab_size=32000, hidden_size=hidden, intermediate_size=hidden * 8 // 3,
                                    num_hidden_layers=layers, num_attention_heads=8, num_key_value_heads=4,
                                    max_position_embeddings=128, use_cache=False)


def _prepare(rank: int, size: int, config: Any, tmp: str) -> int:
    """The saved forms the ranks start from: Hugging Face shards (bf16), a whole and a sharded checkpoint."""
    import transformers

    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    model.to(torch.bfloat16).save_pretrained(os.path.join(tmp, "hf"), max_shard_size="50MB")
    model.float()
    checkpoint.save(os.path.join(tmp, "whole"), 0, {"model": model.state_dict()})
    checkpoint.save_sharded(os.path.join(tmp, "sharded"), 0, model=model, rng=False)
    return sum(p.numel() for p in model.parameters())


def _bytes(model: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def _warm(config: Any) -> None:
    """The collectives' and the model code's own memory, before anything is measured."""
    import transformers

    hvd.allreduce(torch.zeros(1), name="warm-up")
    with torch.device("meta"):
        transformers.AutoModelForCausalLM.from_config(config)


def _load(rank: int, size: int, config: Any, saved: str, variant: str) -> dict[str, float]:
    import transformers
    from safetensors.torch import load_file

    hvd.init()
    _warm(config)
    with PeakMemory() as peak:
        if variant == "recipe":
            model = transformers.AutoModelForCausalLM.from_pretrained(saved, dtype=torch.bfloat16)
            hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        else:
            model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
            state: dict[str, torch.Tensor] = {}
            for shard in sorted(Path(saved).glob("*.safetensors")):
                state.update(load_file(shard))
            model.load_state_dict(state, strict=False)
    return {"growth": peak.growth, "model": _bytes(model)}


def _build(rank: int, size: int, config: Any, variant: str) -> dict[str, float]:
    import transformers

    from hora.api import functions

    hvd.init()
    _warm(config)
    with PeakMemory() as peak:
        if variant == "materialize":
            with torch.device("meta"):
                model = transformers.AutoModelForCausalLM.from_config(config)
            materialize(model, init=model.init_weights)
        else:
            functions.BROADCAST_CHUNK_BYTES = 1 << 62  # one flat buffer per dtype, as before the chunks
            model = transformers.AutoModelForCausalLM.from_config(config)
            hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    return {"growth": peak.growth, "model": _bytes(model)}


def _restore(rank: int, size: int, config: Any, where: str, variant: str) -> dict[str, float]:
    import transformers

    hvd.init()
    _warm(config)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    materialize(model, init=model.init_weights)
    with PeakMemory() as peak:
        if variant == "restore_sharded":
            checkpoint.restore_sharded(os.path.join(where, "sharded"), model=model, rng=False)
        else:
            state = checkpoint.restore(os.path.join(where, "whole"))
            model.load_state_dict(state["model"])
            del state
    return {"growth": peak.growth, "model": _bytes(model)}


def _save_times(rank: int, size: int, config: Any, where: str, repeats: int) -> dict[str, list[float]]:
    import transformers

    hvd.init()
    model = transformers.AutoModelForCausalLM.from_config(config)
    opt = hvd.DistributedOptimizer(torch.optim.AdamW(model.parameters()), named_parameters=model.named_parameters(),
                                   sharding="optimizer")
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()  # the AdamW state exists
    times: dict[str, list[float]] = {"sync": [], "async": [], "async_total": []}
    for i in range(repeats):
        for variant in ("sync", "async"):
            hvd.barrier()
            t0 = time.perf_counter()
            done = checkpoint.save_sharded(where, 2 * i + (variant == "async"), model=model, optimizer=opt, keep=2,
                                           async_save=variant == "async")
            times[variant].append(time.perf_counter() - t0)
            if isinstance(done, checkpoint.AsyncSave):
                done.wait()
                times["async_total"].append(time.perf_counter() - t0)
    return times


def _ranks(fn: Any, *args: Any) -> list[Any]:
    print(f"{fn.__name__} {args[1:]}", flush=True)
    return fork_ranks(fn, 2, *args, timeout=float(os.environ.get("LMS_TIMEOUT", "600")))


def _row(what: str, ours: list[dict[str, float]], theirs: list[dict[str, float]], names: tuple[str, str]) -> list[str]:
    mb = ours[0]["model"] / 2**20
    a = max(r["growth"] / r["model"] for r in ours)
    b = max(r["growth"] / r["model"] for r in theirs)
    return [what, f"{mb:.0f} MB", f"{names[0]}: {a:.2f}x", f"{names[1]}: {b:.2f}x", f"{a / b:.2f}"]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, default=768)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--repeats", type=int, default=5)
    add_output_flags(p, "a 2-layer, 128-wide model and 2 repeats")
    args = p.parse_args(argv)
    if args.quick:
        args.hidden, args.layers, args.repeats = 128, 2, 2
    config = _config(args.hidden, args.layers)
    load = [[round(x, 1) for x in os.getloadavg()]]
    with tempfile.TemporaryDirectory() as tmp:
        # in a process of its own: torch's thread pool, once started here, would hang the ranks forked later
        (params,) = fork_ranks(_prepare, 1, config, tmp)
        hf = os.path.join(tmp, "hf")
        rows = [
            _row("load pretrained (bf16)", _ranks(_load, config, hf, "recipe"), _ranks(_load, config, hf, "naive"),
                 ("from_pretrained + broadcast", "model + state dict")),
            _row("build from a config (fp32)", _ranks(_build, config, "materialize"), _ranks(_build, config, "flat"),
                 ("meta + materialize", "eager + flat broadcast")),
            _row("resume (fp32)", _ranks(_restore, config, tmp, "restore_sharded"),
                 _ranks(_restore, config, tmp, "restore"), ("restore_sharded", "restore + load_state_dict")),
        ]
        load.append([round(x, 1) for x in os.getloadavg()])
        times = _ranks(_save_times, config, os.path.join(tmp, "saves"), args.repeats)
        load.append([round(x, 1) for x in os.getloadavg()])
    sync, blocked, total = (summarize(times[0][k]) for k in ("sync", "async", "async_total"))
    md = (f"# Starting and checkpointing a large model\n\n{params / 1e6:.1f} M-parameter Llama-style model, 2 ranks on "
          f"{machine_info()['cpu']} ({os.cpu_count()} CPUs); load averages at the start of each phase: {load}.\n\n"
          "Peak resident memory a rank gained during each start, as a multiple of the model's own bytes (the worse "
          "rank):\n\n"
          + markdown_table(["start", "model", "hora's way", "the usual way", "ratio"], rows)
          + "\n\nsave_sharded on rank 0, the model and a sharded AdamW (ZeRO-1), median of "
          f"{args.repeats} alternating (spread min-max):\n\n"
          + markdown_table(["save", "time in the caller", "until written"], [
              ["synchronous", f"{sync['median']:.3f} s ({sync['min']:.3f}-{sync['max']:.3f})",
               f"{sync['median']:.3f} s"],
              ["async_save=True", f"{blocked['median']:.3f} s ({blocked['min']:.3f}-{blocked['max']:.3f})",
               f"{total['median']:.3f} s"]])
          + f"\n\nasync/sync time in the caller: {blocked['median'] / sync['median']:.2f}\n")
    out = output_dir(args)
    write_results("large_model_start", {"machine": machine_info(), "params": params, "rows": rows, "times": times,
                                        "load": load, "markdown": md}, md, out_dir=out)
    print(md)


if __name__ == "__main__":
    main()
