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
            params = [param for param in group["params"] if param.grad is not None]
            if not params:
                continue
            states = [self._state_of(param) for param in params]
            torch._foreach_add_([state["step"] for state in states], 1)
            self.update(params, [param.grad for param in params], states, group)

    def _state_of(self, param: Tensor) -> dict[str, Tensor]:
        state = self.state.get(param)
        if state is None:  # torch keeps the step count as a float32 scalar on the CPU
            state = {"step": torch.zeros((), dtype=torch.float32),
                     **{name: torch.zeros_like(param, memory_format=torch.preserve_format) for name in self.STATE}}
            self.state[param] = state
        return state

    def update(self, params: list[Tensor], grads: list[Tensor], states: list[dict[str, Tensor]],
               group: dict[str, Any]) -> None:
        """Apply the rule to every parameter of ``group`` that has a gradient, with ``torch._foreach_*`` ops: each
        runs torch's per-tensor kernel on every tensor of a list (the numbers of the single-tensor code) in one
        call, where a loop over 8 tensors of a small MLP costs a few hundred microseconds of dispatch a step."""
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

    def update(self, params: list[Tensor], grads: list[Tensor], states: list[dict[str, Tensor]],
               group: dict[str, Any]) -> None:
        alpha = group["alpha"]
        square_avgs = [state["square_avg"] for state in states]
        torch._foreach_mul_(square_avgs, alpha)
        torch._foreach_addcmul_(square_avgs, grads, grads, value=1 - alpha)
        denominators = torch._foreach_sqrt(square_avgs)
        torch._foreach_add_(denominators, group["eps"])
        torch._foreach_addcdiv_(params, grads, denominators, value=-group["lr"])


class Adam(Optimizer):
    """Adam (Kingma & Ba 2015), torch's: bias-corrected first and second moments,
    ``theta -= lr / (1 - b1^t) m / (sqrt(v) / sqrt(1 - b2^t) + eps)``."""

    STATE = ("exp_avg", "exp_avg_sq")

    def __init__(self, params: Iterable[Tensor], lr: float, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8) -> None:
        super().__init__(params, {"lr": lr, "betas": betas, "eps": eps, "weight_decay": 0, "amsgrad": False,
                                  "maximize": False, "foreach": None, "capturable": False, "differentiable": False,
                                  "fused": None, "decoupled_weight_decay": False})

    def update(self, params: list[Tensor], grads: list[Tensor], states: list[dict[str, Tensor]],
               group: dict[str, Any]) -> None:
        beta1, beta2 = group["betas"]
        exp_avgs, exp_avg_sqs = [state["exp_avg"] for state in states], [state["exp_avg_sq"] for state in states]
        torch._foreach_lerp_(exp_avgs, grads, 1 - beta1)
        torch._foreach_mul_(exp_avg_sqs, beta2)
        torch._foreach_addcmul_(exp_avg_sqs, grads, grads, value=1 - beta2)
        denominators = torch._foreach_sqrt(exp_avg_sqs)
        steps = {state["step"].item() for state in states}
        if len(steps) == 1:  # as always, unless the state was loaded from an optimizer that stepped some alone
            step = steps.pop()
            bias_correction1 = 1 - beta1**step
            torch._foreach_div_(denominators, (1 - beta2**step) ** 0.5)
            torch._foreach_add_(denominators, group["eps"])
            torch._foreach_addcdiv_(params, exp_avgs, denominators, value=-(group["lr"] / bias_correction1))
            return
        for denominator, exp_avg, param, state in zip(denominators, exp_avgs, params, states):
            step = state["step"].item()
            bias_correction1 = 1 - beta1**step
            denominator.div_((1 - beta2**step) ** 0.5).add_(group["eps"])
            param.addcdiv_(exp_avg, denominator, value=-(group["lr"] / bias_correction1))


@torch.no_grad()
def clip_grad_norm(params: Iterable[Tensor], max_norm: float | None) -> Tensor:
    """The 2-norm of all of ``params``' gradients as one vector; with ``max_norm``, the gradients scaled in place
    by ``min(max_norm / (norm + 1e-6), 1)``. ``torch.nn.utils.clip_grad_norm_``'s ops for gradients of one device
    and dtype (the same numbers), without its grouping of tensors by device and dtype, which costs a small model
    more than the norms do; gradients of several devices or dtypes go to torch's."""
    grads = [param.grad for param in params if param.grad is not None]
    if not grads:
        return torch.zeros(())
    if len({(grad.device, grad.dtype) for grad in grads}) > 1:
        if max_norm is None:
            return torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g).cpu() for g in grads]))
        return torch.nn.utils.clip_grad_norm_(grads, max_norm)  # scales the same tensors: they are the .grads
    total = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads, 2.0)), 2.0)
    if max_norm is not None:
        torch._foreach_mul_(grads, torch.clamp(max_norm / (total + 1e-6), max=1.0))
    return total
