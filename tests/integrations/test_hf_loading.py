"""Starting a large Hugging Face model under hora without a second copy of its weights (docs/large-models.md):
``from_pretrained`` shard by shard on every rank, or a config-built model on the meta device, materialised."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="hora[hf] (transformers) is not installed")

import hora as hvd  # noqa: E402
from hora.bench.peak_memory import PeakMemory  # noqa: E402
from hora.meta import materialize  # noqa: E402
from tests.distributed.test_optimizer import run_tensors  # noqa: E402

VOCAB = 4096


def _config() -> transformers.LlamaConfig:
    return transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=512, intermediate_size=1024, num_hidden_layers=4,
                                    num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=64)


def _bytes(model: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def _load(rank: int, size: int, path: str) -> dict:
    from safetensors.torch import load_file

    from hora.api import functions

    functions.BROADCAST_CHUNK_BYTES = 1 << 20
    hvd.allreduce(torch.zeros(1), name="warm-up")
    with torch.device("meta"):  # imports the model's code before measuring
        transformers.AutoModelForCausalLM.from_config(_config())
    with PeakMemory() as recipe:  # the recipe: every rank reads the shards, then one in-place broadcast
        model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    with PeakMemory() as naive:  # the usual way: a model, and a state dict of every shard beside it
        other = transformers.AutoModelForCausalLM.from_config(_config(), dtype=torch.bfloat16)
        state = {}
        for shard in sorted(Path(path).glob("*.safetensors")):
            state.update(load_file(shard))
        other.load_state_dict(state, strict=False)
    nbytes = _bytes(model)
    return {"recipe": torch.tensor(recipe.growth / nbytes), "naive": torch.tensor(naive.growth / nbytes),
            "params": {k: v.float() for k, v in model.state_dict().items()}}


def test_from_pretrained_shard_by_shard_holds_one_copy_per_rank(tmp_path: Path) -> None:
    torch.manual_seed(0)
    saved = transformers.AutoModelForCausalLM.from_config(_config()).to(torch.bfloat16)
    saved.save_pretrained(tmp_path, max_shard_size="5MB")  # 26 MB of bf16 weights in several shards
    assert len(list(tmp_path.glob("*.safetensors"))) > 3
    results = run_tensors(_load, 2, str(tmp_path), timeout=180)
    want = {k: v.float() for k, v in saved.state_dict().items()}
    for r in results:
        for name, value in want.items():
            assert torch.equal(r["params"][name], value), name
        assert float(r["recipe"]) < 1.4, float(r["recipe"])  # the weights, once
        assert float(r["naive"]) > 1.8, float(r["naive"])  # what the measurement shows when there are two copies


def _meta_llama(rank: int, size: int) -> dict:
    torch.manual_seed(rank)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(_config())
    materialize(model, init=model.init_weights)
    ids = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(0))
    return {"params": dict(model.state_dict()), "buffers": dict(model.named_buffers()),
            "loss": model(input_ids=ids, labels=ids).loss.detach()}


def test_a_config_built_llama_on_the_meta_device_materialises_with_its_rotary_buffers() -> None:
    results = run_tensors(_meta_llama, 2, timeout=180)
    reference = transformers.AutoModelForCausalLM.from_config(_config())  # built the usual way
    for name, value in reference.named_buffers():  # computed at construction; init_weights recomputes them
        assert torch.equal(results[0]["buffers"][name], value), name
    for name, value in results[0]["params"].items():
        assert torch.equal(value, results[1]["params"][name]), name
    assert abs(float(results[0]["loss"]) - torch.log(torch.tensor(float(VOCAB)))) < 0.5  # an initialised model
