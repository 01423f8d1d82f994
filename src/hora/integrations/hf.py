"""Hugging Face ``transformers.Trainer`` on hora: :class:`HoraTrainer` (``pip install 'hora[hf]'``).

``HoraTrainer`` is a ``Trainer`` whose gradients are reduced by :func:`hora.DistributedOptimizer`, launched
with ``hora run -np N python train.py``. What it changes in the Trainer, and why:

* **accelerate keeps its world, not its DDP.** ``hvd.init()`` runs before ``TrainingArguments`` is built, so
  accelerate finds torch.distributed's default group already made (hora makes it) and uses it: it starts no
  process group of its own, shards each batch per rank (``args.process_index`` is ``hvd.rank()``), gathers
  metrics and lets only rank 0 save. Its ``prepare`` is told not to wrap the model in
  ``DistributedDataParallel``: hora reduces the gradients.
* **The optimizer is hora's.** ``create_optimizer`` wraps the Trainer's optimizer (AdamW by default, or the
  one passed in) in ``DistributedOptimizer(backward_passes_per_step=args.gradient_accumulation_steps,
  sharding=...)``, so the gradients of the accumulation steps add up locally and are reduced once, in the
  last backward, overlapped with it; every rank starts from rank 0's weights (``broadcast_parameters``).
* **Checkpoints keep the shards apart.** With ``sharding=...`` the Trainer's checkpoints hold the optimizer
  as a sharded checkpoint (:func:`hora.checkpoint.save_sharded`: each rank writes the state it owns), which
  ``resume_from_checkpoint`` reads back at any number of ranks.
* **Clipping sees reduced gradients.** Before the Trainer clips or measures the gradient norm, the
  optimizer's ``synchronize()`` finishes the reduction (with ``sharding="gradients"`` each rank holds only its
  own parameters' gradients, and the optimizer's ``clip_grad_norm_`` combines the norm over the ranks);
  ``step()`` then runs under ``skip_synchronize()``.

Example (``hora run -np 2 python train.py``):
    >>> import hora as hvd                                                              # doctest: +SKIP
    >>> from hora.integrations.hf import HoraTrainer                                    # doctest: +SKIP
    >>> hvd.init()                               # before TrainingArguments              # doctest: +SKIP
    >>> args = TrainingArguments("out", gradient_accumulation_steps=4, bf16=True)       # doctest: +SKIP
    >>> trainer = HoraTrainer(model=model, args=args, train_dataset=data)               # doctest: +SKIP
    >>> trainer.train()                                                                 # doctest: +SKIP

On a machine without GPUs pass ``TrainingArguments(use_cpu=True)``: accelerate only sees a distributed CPU job
when told to. docs/large-models.md has the whole recipe and its limits.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any

import torch

from hora.launcher.frameworks import require

require("transformers", "hf", "hora.integrations.hf")

import transformers  # noqa: E402

from hora.api.functions import broadcast_parameters  # noqa: E402
from hora.datapath.wire import Compression, Compressor  # noqa: E402
from hora.errors import ConfigError, NotInitializedError  # noqa: E402
from hora.runtime import lifecycle as runtime  # noqa: E402
from hora.sharded_checkpoint import restore_sharded, save_sharded, sharded_checkpoints  # noqa: E402
from hora.training.optimizer import DistributedOptimizer  # noqa: E402

__all__ = ["HoraTrainer"]

log = logging.getLogger(__name__)


class HoraTrainer(transformers.Trainer):
    """A ``transformers.Trainer`` whose gradients hora reduces (see the module's docstring).

    Args:
        *args: what ``transformers.Trainer`` takes.
        sharding: ``DistributedOptimizer``'s ``sharding`` (None: every rank keeps the whole optimizer state;
            ``"optimizer"``, ``"gradients"``: docs/large-models.md).
        compression: the gradients' wire format (``hvd.Compression.none``, ``fp16``, ``bf16``).
        **kwargs: what ``transformers.Trainer`` takes.

    Raises:
        NotInitializedError: ``hvd.init()`` was not called first.
        ConfigError: the Trainer's idea of the world is not hora's (``TrainingArguments`` built before
            ``hvd.init()``, or ``use_cpu=True`` missing on a machine without GPUs), or FSDP/DeepSpeed is
            configured (they reduce gradients themselves).
    """

    def __init__(self, *args: Any, sharding: str | None = None, compression: Compressor = Compression.none,
                 **kwargs: Any) -> None:
        if not runtime.is_initialized():
            raise NotInitializedError("HoraTrainer (call hvd.init() before building TrainingArguments)")
        self._hora_sharding = sharding
        self._hora_compression = compression
        self._hora_optimizer: torch.optim.Optimizer | None = None
        super().__init__(*args, **kwargs)
        _check_world(self.args)
        self.add_callback(_StepAfterSynchronize(self))

    def create_accelerator_and_postprocess(self) -> None:
        super().create_accelerator_and_postprocess()
        _leave_reduction_to_hora(self)

    def create_optimizer(self, model: torch.nn.Module | None = None) -> torch.optim.Optimizer:
        """The Trainer's optimizer wrapped in ``hvd.DistributedOptimizer`` (once); every rank gets rank 0's
        weights."""
        optimizer = super().create_optimizer(model) if model is not None else super().create_optimizer()
        if self._hora_optimizer is not None and optimizer is self._hora_optimizer:
            return optimizer
        target = model if model is not None else self.model
        if target is None:
            raise ValueError("HoraTrainer needs a model: pass model=... (or model_init=...) to the Trainer")
        options: dict[str, Any] = {}
        if self._hora_sharding is not None:
            options["sharding"] = self._hora_sharding
        wrapped = DistributedOptimizer(
            optimizer, named_parameters=target.named_parameters(), compression=self._hora_compression,
            backward_passes_per_step=self.args.gradient_accumulation_steps, **options,
        )
        broadcast_parameters(target.state_dict(), root_rank=0)
        self.optimizer = self._hora_optimizer = wrapped
        return wrapped

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        """With sharding, each rank writes its own optimizer shard (and rank 0 the scheduler) as a sharded
        checkpoint inside the Trainer's checkpoint folder: torch's full ``state_dict()`` of a sharded optimizer is
        a collective the Trainer would call on rank 0 alone, and would gather the whole state there."""
        if self._hora_sharding is None:
            super()._save_optimizer_and_scheduler(output_dir)
            return
        save_sharded(output_dir, self.state.global_step, optimizer=self._hora_optimizer, scheduler=self.lr_scheduler,
                     rng=False, keep=0)

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        if checkpoint is None or self._hora_sharding is None or not sharded_checkpoints(checkpoint):
            super()._load_optimizer_and_scheduler(checkpoint)
            return
        restore_sharded(checkpoint, optimizer=self._hora_optimizer, scheduler=self.lr_scheduler, rng=False)


def _check_world(args: Any) -> None:
    """The Trainer must see hora's world: same size, same rank, no other gradient reducer."""
    size, rank = runtime.size(), runtime.rank()
    if args.world_size != size or args.process_index != rank:
        raise ConfigError(
            f"rank {rank}: the Trainer sees a world of {args.world_size} process(es) with this one as number "
            f"{args.process_index}, but hora runs {size} ranks. Build TrainingArguments after hvd.init(), and "
            "on a machine without GPUs pass TrainingArguments(use_cpu=True) (accelerate only sees a "
            "distributed CPU job when told to)"
        )
    if args.fsdp or args.deepspeed:
        raise ConfigError(
            "HoraTrainer reduces gradients with hora's DistributedOptimizer; TrainingArguments also asks for "
            f"{'FSDP' if args.fsdp else 'DeepSpeed'}, which reduces them itself. Drop that option (hora's "
            "sharding=... shards the optimizer state and gradients) or use the plain Trainer"
        )


def _leave_reduction_to_hora(trainer: HoraTrainer) -> None:
    """accelerate's ``prepare`` places the model and sets up autocast but wraps no DDP (its evaluation-mode
    preparation: everything but the wrapper); its ``clip_grad_norm_`` (the Trainer's clipping and gradient
    norm) first finishes hora's reduction."""
    accelerator = trainer.accelerator
    prepare_model = accelerator.prepare_model
    clip_grad_norm = accelerator.clip_grad_norm_

    def prepare_model_without_ddp(model: torch.nn.Module, device_placement: bool | None = None,
                                  evaluation_mode: bool = False) -> torch.nn.Module:
        return prepare_model(model, device_placement=device_placement, evaluation_mode=True)

    def clip_grad_norm_after_synchronize(parameters: Any, max_norm: float, norm_type: float = 2) -> torch.Tensor:
        optimizer: Any = trainer._hora_optimizer
        if optimizer is None:
            return clip_grad_norm(parameters, max_norm, norm_type)
        optimizer.synchronize()
        if optimizer.sharding != "gradients":  # every rank holds every reduced gradient
            return clip_grad_norm(parameters, max_norm, norm_type)
        accelerator.unscale_gradients()  # fp16's GradScaler, on the owned gradients
        return optimizer.clip_grad_norm_(max_norm, norm_type)  # each rank holds its own: the norm over ranks

    accelerator.prepare_model = prepare_model_without_ddp
    accelerator.clip_grad_norm_ = clip_grad_norm_after_synchronize


class _StepAfterSynchronize(transformers.TrainerCallback):
    """Around the Trainer's ``optimizer.step()``: the reduction finished (a no-op when clipping already did
    it), then the step under ``skip_synchronize()``, so it neither reduces again nor warns."""

    def __init__(self, trainer: HoraTrainer) -> None:
        self._trainer = trainer
        self._skip = contextlib.ExitStack()

    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        optimizer = self._trainer._hora_optimizer
        if optimizer is None:
            return
        optimizer.synchronize()  # type: ignore[attr-defined]
        self._skip.enter_context(optimizer.skip_synchronize())  # type: ignore[attr-defined]

    def on_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._skip.close()
