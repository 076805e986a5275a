"""The learners' optimizers, RMSProp and Adam, stepped without ``torch.optim``.

Building or stepping any ``torch.optim`` optimizer imports ``torch._dynamo`` (its methods are wrapped to opt
out of ``torch.compile``), and that import is most of torch's: about a second of a 2-core machine's start-up,
an eighth of the default job's wall-clock (BENCHMARKS.md "Fastest to a trained agent"). conveyor never
compiles, so its learners step these instead. Each applies its update rule op for op as torch 2.13's
single-tensor implementation does on the CPU (``torch/optim/rmsprop.py``, ``adam.py``; no weight decay,
momentum, centering or amsgrad, which no preset uses), so a seeded run reaches the same parameters, and keeps
the same ``state_dict`` layout, so a checkpoint written by either loads into the other.

Both offer what the learner, checkpoints and SB3 (the bench peers' ``optimizer_class``) use of a torch
optimizer: ``param_groups`` (with ``lr``), ``state``, ``zero_grad``, ``step``, ``state_dict`` and
``load_state_dict``.
"""

from __future__ import annotations

from typing import Any, Iterable

import torch
from torch import Tensor


class Optimizer:
    """One parameter group and per-parameter state tensors; subclasses name their state and their update."""

    STATE: tuple[str, ...] = ()
    """The state tensors of a parameter besides ``step``, shaped like it."""

    def __init__(self, params: Iterable[Tensor], defaults: dict[str, Any]) -> None:
        params = list(params)
        if not params:
            raise ValueError("optimizer got an empty parameter list")
        self.defaults = defaults
        self.param_groups: list[dict[str, Any]] = [{**defaults, "params": params}]
        self.state: dict[Tensor, dict[str, Tensor]] = {}

    def zero_grad(self, set_to_none: bool = True) -> None:
        for group in self.param_groups:
            for param in group["params"]:
                if set_to_none:
                    param.grad = None
                elif param.grad is not None:
                    param.grad.detach_().zero_()

    @torch.no_grad()
    def step(self) -> None:
        for group in self.param_groups:
            for param in group["params"]:
                if param.grad is None:
                    continue
                state = self.state.get(param)
                if state is None:  # torch keeps the step count as a float32 scalar on the CPU
                    state = {"step": torch.zeros((), dtype=torch.float32),
                             **{name: torch.zeros_like(param, memory_format=torch.preserve_format)
                                for name in self.STATE}}
                    self.state[param] = state
                state["step"] += 1
                self.update(param, param.grad, state, group)

    def update(self, param: Tensor, grad: Tensor, state: dict[str, Tensor], group: dict[str, Any]) -> None:
        raise NotImplementedError

    def _params(self) -> list[Tensor]:
        return [param for group in self.param_groups for param in group["params"]]

    def state_dict(self) -> dict[str, Any]:
        """``{"state": {index: {name: tensor}}, "param_groups": [{settings, "params": [index]}]}``, as torch's."""
        index = {id(param): i for i, param in enumerate(self._params())}
        groups = [{**{k: v for k, v in group.items() if k != "params"},
                   "params": [index[id(param)] for param in group["params"]]} for group in self.param_groups]
        return {"state": {index[id(param)]: dict(state) for param, state in self.state.items()},
                "param_groups": groups}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Take the settings and state of ``state_dict`` (this class's or torch's of the same optimizer): each
        state tensor moves to its parameter's device and dtype, ``step`` stays a CPU float32. A layout that does
        not match these parameters raises ValueError."""
        groups, params = state_dict["param_groups"], self._params()
        sizes = [len(group["params"]) for group in groups]
        if sizes != [len(group["params"]) for group in self.param_groups]:
            raise ValueError(f"optimizer state of parameter groups sized {sizes} does not match this model's "
                             f"{[len(group['params']) for group in self.param_groups]}")
        state: dict[Tensor, dict[str, Tensor]] = {}
        for i, saved in state_dict["state"].items():
            param = params[int(i)]
            missing = {"step", *self.STATE} - set(saved)
            if missing:
                raise ValueError(f"optimizer state of parameter {i} lacks {', '.join(sorted(missing))}: it was "
                                 f"written by another optimizer than {type(self).__name__}")
            for name in self.STATE:
                if saved[name].shape != param.shape:
                    raise ValueError(f"optimizer state {name} of parameter {i} has shape "
                                     f"{tuple(saved[name].shape)}, the parameter {tuple(param.shape)}")
            state[param] = {"step": torch.as_tensor(saved["step"], dtype=torch.float32).cpu().clone(),
                            **{name: saved[name].to(param.device, param.dtype).clone() for name in self.STATE}}
        for group, saved in zip(self.param_groups, groups):
            group.update({k: v for k, v in saved.items() if k != "params"})
        self.state = state


class RMSprop(Optimizer):
    """Non-centered RMSProp, torch's: ``v = alpha v + (1 - alpha) g^2``, ``theta -= lr g / (sqrt(v) + eps)``."""

    STATE = ("square_avg",)

    def __init__(self, params: Iterable[Tensor], lr: float, alpha: float = 0.99, eps: float = 1e-8) -> None:
        super().__init__(params, {"lr": lr, "momentum": 0, "alpha": alpha, "eps": eps, "centered": False,
                                  "weight_decay": 0, "capturable": False, "foreach": None, "maximize": False,
                                  "differentiable": False})

    def update(self, param: Tensor, grad: Tensor, state: dict[str, Tensor], group: dict[str, Any]) -> None:
        alpha = group["alpha"]
        square_avg = state["square_avg"]
        square_avg.mul_(alpha).addcmul_(grad, grad, value=1 - alpha)
        param.addcdiv_(grad, square_avg.sqrt().add_(group["eps"]), value=-group["lr"])


class Adam(Optimizer):
    """Adam (Kingma & Ba 2015), torch's: bias-corrected first and second moments,
    ``theta -= lr / (1 - b1^t) m / (sqrt(v) / sqrt(1 - b2^t) + eps)``."""

    STATE = ("exp_avg", "exp_avg_sq")

    def __init__(self, params: Iterable[Tensor], lr: float, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8) -> None:
        super().__init__(params, {"lr": lr, "betas": betas, "eps": eps, "weight_decay": 0, "amsgrad": False,
                                  "maximize": False, "foreach": None, "capturable": False, "differentiable": False,
                                  "fused": None, "decoupled_weight_decay": False})

    def update(self, param: Tensor, grad: Tensor, state: dict[str, Tensor], group: dict[str, Any]) -> None:
        beta1, beta2 = group["betas"]
        exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
        exp_avg.lerp_(grad, 1 - beta1)
        exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        step = state["step"].item()
        bias_correction1 = 1 - beta1**step
        bias_correction2_sqrt = (1 - beta2**step) ** 0.5
        denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(group["eps"])
        param.addcdiv_(exp_avg, denom, value=-(group["lr"] / bias_correction1))
