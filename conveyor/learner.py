"""The learner: model, optimizer, version counter, checkpoints.

``Learner.update(batch)`` runs the configured loss on a batch, clips the
global gradient norm, steps the optimizer and increments ``version`` (the
update counter every architecture stamps on the actions it takes, so policy
lag is measurable). Then it folds the batch's observations into the model's
input statistics (``ModelCfg.normalize_obs``): after the step, so the
gradient is taken under the statistics the batch was collected with (PAAC
A2C backpropagates through the acting forwards themselves; PPO's first
epoch starts at ratio 1), and the next forwards use the new ones.
Checkpoints are written atomically (temp file, fsync, rename) and loaded
with ``torch.load(weights_only=True)``: nothing from disk is ever unpickled.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any, Callable

import torch
from torch import Tensor, nn

from conveyor.config import RunCfg
from conveyor.storage.rollout import env_columns


class CheckpointError(RuntimeError):
    """A checkpoint that is missing, truncated, tampered with, or from another model."""


def make_optimizer(params: Any, cfg: RunCfg) -> torch.optim.Optimizer:
    """``cfg.algo.optimizer`` over ``params`` with the run's resolved settings (``conveyor/presets.py``)."""
    algo = cfg.algo
    if algo.optimizer == "rmsprop":
        return torch.optim.RMSprop(params, lr=algo.lr, alpha=algo.rmsprop_alpha, eps=algo.rmsprop_eps)
    return torch.optim.Adam(params, lr=algo.lr, eps=algo.adam_eps)


def param_sha256(model: nn.Module) -> str:
    """SHA-256 of the parameters' bytes in state-dict order (the run's reproducibility fingerprint)."""
    digest = hashlib.sha256()
    for name, tensor in model.state_dict().items():
        digest.update(name.encode())
        digest.update(tensor.detach().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()


LossFn = Callable[[Any, dict[str, Tensor]], tuple[Tensor, dict[str, Tensor]]]


class Learner:
    def __init__(self, model: nn.Module, loss_fn: LossFn, cfg: RunCfg):
        self.cfg = cfg
        self.device = torch.device(cfg.device)
        self.model = model.to(self.device)
        self.loss_fn = loss_fn
        self.optimizer = make_optimizer(self.model.parameters(), cfg)
        self.max_grad_norm = cfg.algo.max_grad_norm
        self.obs_normalizer = getattr(self.model, "obs_normalizer", None)  # None: the model keeps no statistics
        self.version = 0

    def forward(self, batch: dict[str, Tensor]) -> Any:
        return self.model(batch["obs"])

    def compute_gradients(self, batch: dict[str, Tensor], model_out: Any = None) -> tuple[dict[str, float], float]:
        """Forward (unless ``model_out`` of the current parameters on ``batch["obs"]`` is given, graph
        attached), loss and backward into ``.grad`` (no optimizer step); returns metrics and grad norm."""
        self.optimizer.zero_grad(set_to_none=True)
        loss, metrics = self.loss_fn(self.forward(batch) if model_out is None else model_out, batch)
        loss.backward()
        if self.max_grad_norm:
            grad_norm = float(nn.utils.clip_grad_norm_(self.model.parameters(), self.max_grad_norm))
        else:
            grad_norm = float(torch.norm(torch.stack([p.grad.norm() for p in self.model.parameters()
                                                      if p.grad is not None])))
        values = {k: float(v) for k, v in metrics.items() if v.dim() == 0}
        values["loss"] = float(loss.detach())
        values["grad_norm"] = grad_norm
        return values, grad_norm

    def apply_gradients(self, observations: Tensor | None = None) -> None:
        """Step the optimizer, increment ``version``, then ``observe(observations)`` (the observations of the
        batch the gradients came from; None while more steps on the same batch follow)."""
        self.optimizer.step()
        self.version += 1
        if observations is not None:
            self.observe(observations)

    def observe(self, observations: Tensor) -> None:
        """Fold ``observations`` into the model's input statistics (once per batch; see the module docstring)."""
        if self.obs_normalizer is not None:
            self.obs_normalizer.update(observations)

    def update(self, batch: dict[str, Tensor], model_out: Any = None) -> dict[str, float]:
        """One optimizer step on ``batch`` (see ``compute_gradients`` for ``model_out``); increments ``version``."""
        metrics, _ = self.compute_gradients(batch, model_out)
        self.apply_gradients(batch["obs"])
        return metrics

    def update_epochs(self, batch: dict[str, Tensor], epochs: int, minibatches: int,
                      generator: torch.Generator | None = None) -> dict[str, float]:
        """``epochs`` passes over ``batch``, each split into ``minibatches`` random groups of env columns
        (time order kept); one optimizer step per minibatch. A2C is ``epochs = minibatches = 1``."""
        if epochs == 1 and minibatches == 1:
            return self.update(batch)
        num_envs = batch["rewards"].shape[1]
        if num_envs < minibatches:
            raise ValueError(f"{minibatches} minibatches need at least as many envs, got {num_envs}: "
                             "lower --ppo-minibatches or raise --num-envs")
        metrics: dict[str, float] = {}
        for _ in range(epochs):
            order = torch.randperm(num_envs, generator=generator)
            for columns in order.chunk(minibatches):
                metrics, _ = self.compute_gradients(env_columns(batch, columns.to(batch["rewards"].device)))
                self.apply_gradients()
        self.observe(batch["obs"])
        return metrics

    def param_sha256(self) -> str:
        return param_sha256(self.model)

    # ---- checkpoints ---------------------------------------------------------------------
    def state(self, **extra: Any) -> dict[str, Any]:
        return {
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "version": self.version,
            **extra,
        }

    def save(self, path: Path, **extra: Any) -> None:
        save_checkpoint(path, self.state(**extra))

    def load(self, path: Path) -> dict[str, Any]:
        """Restore model, optimizer and version; returns the whole checkpoint dict for the caller's extras."""
        state = load_checkpoint(path, self.device)
        self.restore(state, path)
        return state

    def restore(self, state: dict[str, Any], path: Path | str = "checkpoint") -> None:
        """Restore model, optimizer and version from a loaded checkpoint dict."""
        try:
            self.model.load_state_dict(state["model"])
            self.optimizer.load_state_dict(state["optimizer"])
            self.version = int(state["version"])
        except (KeyError, RuntimeError, ValueError) as error:
            first_line = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
            raise CheckpointError(f"checkpoint {path} does not fit this model ({first_line}): "
                                  "resume with the same --env and --model as the original run") from None


def save_checkpoint(path: Path, state: dict[str, Any]) -> None:
    """Write ``state`` atomically: a crash leaves either the old file or the new one, never half of one."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def load_checkpoint(path: Path, device: torch.device | str = "cpu") -> dict[str, Any]:
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"checkpoint {path} not found: pass a run directory that has checkpoints/*.pt")
    try:
        state = torch.load(path, map_location=device, weights_only=True)
    except Exception as error:  # torch raises many types for corrupt zips and refused globals
        reason = str(error).strip().splitlines()[0][:160] if str(error).strip() else type(error).__name__
        raise CheckpointError(f"checkpoint {path} is corrupt or not a conveyor checkpoint ({reason}): "
                              "delete it to fall back to an earlier one, or start a new run") from None
    if not isinstance(state, dict) or "model" not in state:
        raise CheckpointError(f"checkpoint {path} is not a conveyor checkpoint: start a new run")
    return state


def latest_checkpoint(run_dir: Path) -> Path:
    ckpts = sorted(Path(run_dir).glob("checkpoints/*.pt"))
    if not ckpts:
        raise CheckpointError(f"no checkpoints in {run_dir}/checkpoints: pass the --out DIR of an earlier run")
    return ckpts[-1]
