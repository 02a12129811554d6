"""The Guard inside a Hugging Face ``transformers.Trainer``, in one line::

    trainer.add_callback(SDCCallback(trainer))

The Trainer owns the forward, backward, gradient accumulation, clipping, the GradScaler
and the optimizer step; the callback hooks in around them:

* at ``on_train_begin`` it creates the :class:`~sdc_agent.Guard` on the Trainer's DDP
  model and optimizer (settings from ``HYPERPOD_SDC_*``, overridden by keyword
  arguments);
* a forward hook on the DDP model gives the Guard each training micro-batch (the keyword
  arguments of the forward, ``num_items_in_batch`` included) and its loss (the model's
  own ``outputs.loss``): the replay audit recomputes ``model(**batch).loss``;
* ``on_pre_optimizer_step`` runs checks 1 and 2 (after the Trainer clipped), and a step
  they hold back changes nothing when the Trainer calls ``optimizer.step()`` (a fused
  optimizer, the Trainer's default ``adamw_torch_fused``, skips on the device);
* ``on_optimizer_step`` runs check 3 and reports.

Every step's :class:`~sdc_agent.StepResult` is kept in :attr:`SDCCallback.results` (the
last ``keep`` of them) and its verdicts in :attr:`SDCCallback.verdicts`. A Trainer that
computes its loss with ``compute_loss_func`` or a label smoother backpropagates
something other than ``outputs.loss``: give ``loss_fn`` (``loss_fn(model, batch)``
returning exactly what is backpropagated) for the audit to replay it.

Refused, with a :class:`~sdc_agent.errors.ConfigError` naming it: a Trainer set up for FSDP
(``TrainingArguments(fsdp=...)``, FSDP1 or ``fsdp_version: 2``), at ``SDCCallback(trainer)``,
and any model the Trainer wrapped in something other than DDP (an FSDP2 ``fully_shard``
module, FSDP1's ``FullyShardedDataParallel``), at ``on_train_begin``. The callback does not
guard the Trainer's FSDP path: on this project's CPU test machine accelerate runs such a
Trainer as DDP, so its FSDP2 path was never exercised here. Guard FSDP2 and HSDP in your own
loop instead (:class:`~sdc_agent.Guard` takes a ``fully_shard`` model:
``examples/train_fsdp.py``).
"""

from __future__ import annotations

import weakref
from collections import deque
from typing import Any

import torch
from torch import nn

from ..config import GuardConfig
from ..errors import ConfigError
from ..guard import Guard
from ..verdict import StepResult, Verdict

try:
    from transformers import TrainerCallback
except ImportError as exc:  # pragma: no cover - only without transformers
    raise ImportError(
        "sdc_agent.integrations.huggingface needs transformers (pip install transformers)"
    ) from exc

__all__ = ["SDCCallback", "model_loss"]


def model_loss(model: nn.Module, batch: dict[str, Any]) -> torch.Tensor:
    """The loss a Hugging Face model computes itself: ``model(**batch).loss``."""
    return model(**batch).loss


class SDCCallback(TrainerCallback):
    """See the module docstring. ``trainer``: the Trainer to guard."""

    def __init__(
        self,
        trainer: Any,
        *,
        loss_fn: Any = None,
        config: GuardConfig | None = None,
        keep: int = 1000,
        **overrides: Any,
    ) -> None:
        if config is not None and overrides:
            raise ConfigError("SDCCallback: pass either config or settings, not both")
        fsdp = _fsdp_setting(trainer)
        if fsdp:
            raise ConfigError(
                f"SDCCallback: the Trainer is set up for FSDP (TrainingArguments.fsdp: {fsdp}); "
                "the callback guards DDP Trainers only. Guard FSDP2 or HSDP training in your "
                "own loop: sdc_agent.Guard takes a fully_shard model (examples/train_fsdp.py)"
            )
        # Weakly once training begins (the Trainer holds its callbacks then): a callback
        # holding its Trainer would make a cycle that keeps the Trainer, its DDP model and
        # the model's process group alive past the training function until the garbage
        # collector runs, and destroy_process_group() could not end the group
        # (sdc_agent.guard._weakly). Strongly until then: nothing else may hold it yet.
        self._trainer: Any = trainer
        self.loss_fn = loss_fn if loss_fn is not None else model_loss
        self.config = config if config is not None else GuardConfig.from_env(**overrides)
        self.guard: Guard | None = None
        self.results: deque[StepResult] = deque(maxlen=keep)
        self.verdicts: list[Verdict] = []
        self._handle: Any = None

    @property
    def trainer(self) -> Any:
        """The Trainer this callback guards."""
        trainer = self._trainer
        if isinstance(trainer, weakref.ref):
            trainer = trainer()
            if trainer is None:
                raise ConfigError("SDCCallback: its Trainer is gone")
        return trainer

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        trainer = self.trainer
        self._trainer = weakref.ref(trainer)
        model = trainer.model_wrapped
        sharded = _sharded_kind(model)
        if sharded is not None:
            raise ConfigError(
                f"SDCCallback: the Trainer's model is {sharded}; the callback guards DDP "
                "Trainers only. Guard FSDP2 or HSDP training in your own loop: "
                "sdc_agent.Guard takes a fully_shard model (examples/train_fsdp.py)"
            )
        if not isinstance(model, torch.nn.parallel.DistributedDataParallel):
            raise ConfigError(
                "SDCCallback: the Trainer's model is not DistributedDataParallel (launch "
                "the training with torchrun on several processes)"
            )
        optimizer = getattr(trainer.optimizer, "optimizer", trainer.optimizer)
        scaler = getattr(getattr(trainer, "accelerator", None), "scaler", None)
        self.guard = Guard(model, optimizer, self.loss_fn, self.config, scaler=scaler)
        self._handle = model.register_forward_hook(self._forward, with_kwargs=True)

    def _forward(self, module: nn.Module, args: Any, kwargs: Any, output: Any) -> None:
        if self.guard is None or not torch.is_grad_enabled() or not module.training:
            return  # evaluation
        loss = getattr(output, "loss", None)
        if loss is None and isinstance(output, dict):
            loss = output.get("loss")
        if not isinstance(loss, torch.Tensor):
            raise ConfigError(
                "SDCCallback: the model's output has no loss (give the batch labels, or "
                "pass loss_fn)"
            )
        self.guard.before_backward(dict(kwargs), loss)

    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.guard is not None:
            self.guard.before_optimizer_step()

    def on_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.guard is None:
            return
        result = self.guard.after_optimizer_step()
        self.results.append(result)
        self.verdicts.extend(result.verdicts)

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None
        if self.guard is not None:
            self.guard.close()


def _fsdp_setting(trainer: Any) -> str:
    """What the Trainer's arguments ask of FSDP (``""``: nothing)."""
    args = getattr(trainer, "args", None)
    options = getattr(args, "fsdp", None) or []
    if isinstance(options, str):
        options = options.split()
    named = [str(getattr(o, "value", o)) for o in options]
    config = getattr(args, "fsdp_config", None) or {}
    version = config.get("version", config.get("fsdp_version"))  # transformers drops fsdp_
    if named and version is not None:
        named.append(f"fsdp_version {version}")
    return ", ".join(named)


def _sharded_kind(model: object) -> str | None:
    """``model``'s sharded data-parallel wrapper, named, or ``None``."""
    from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel

    if isinstance(model, FSDPModule):
        return f"an FSDP2 module (fully_shard: {type(model).__name__})"
    if isinstance(model, FullyShardedDataParallel):
        return "FSDP1 (FullyShardedDataParallel)"
    return None
