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
``load_state_dict``; and ``clip_grad_norm``, the learner's clipping of the same gradients.

One buffer (``FlatBuffers``): parameters of one device and dtype are moved into one flat tensor, each
parameter a view of it (the same ``Parameter`` objects, the same numbers), and the state and the gradients get
buffers of the same layout. A rule's op then runs once on the buffer, where a foreach op on the CPU runs once per
parameter: a 64x64 MLP's RMSProp step (8 tensors) costs 70 us tensor by tensor and 23 us on the buffer, its clipping
33 us and 13 (CartPole's A2C update, 5 steps of 16 envs, is about 0.8 ms). The rules' ops are elementwise, so
each element gets the numbers of the per-tensor step, to the bit; the buffer's norm is torch's to rounding.
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
        self.flat = FlatBuffers.of(params, self.STATE)
        """The parameters, their gradients and state in one buffer each; None where they cannot share one."""

    def zero_grad(self, set_to_none: bool = True) -> None:
        """torch's: every ``.grad`` None, or (``set_to_none=False``) zero where there is one, which the buffers
        then do in one op and the next backward adds into in place (where None, autograd hands over a tensor
        that ``FlatBuffers.gather_grads`` copies into the buffer)."""
        if not set_to_none and self.flat is not None and self.flat.holds_grads():
            self.flat.grads.zero_()
            return
        for group in self.param_groups:
            for param in group["params"]:
                if set_to_none:
                    param.grad = None
                elif param.grad is not None:
                    param.grad.detach_().zero_()

    @torch.no_grad()
    def step(self) -> None:
        flat = self.flat
        if flat is not None and flat.steps_alike and flat.gather_grads():
            if len(self.state) < len(flat.owners):  # the buffer steps every parameter: each gets its state
                for param in flat.owners:
                    self._state_of(param)
            flat.steps.add_(1)
            self.update([flat.params], [flat.grads], [flat.rule_state()], self.param_groups[0])
            return
        for group in self.param_groups:
            params = [param for param in group["params"] if param.grad is not None]
            if not params:
                continue
            if flat is not None and len(params) < len(group["params"]):
                flat.steps_alike = False  # the step counts part: Adam's flat rule takes one
            states = [self._state_of(param) for param in params]
            torch._foreach_add_([state["step"] for state in states], 1)
            self.update(params, [param.grad for param in params], states, group)

    def _state_of(self, param: Tensor) -> dict[str, Tensor]:
        state = self.state.get(param)
        if state is None:
            if self.flat is not None:  # views of the buffers, whose parts start at zero
                state = self.flat.param_state(param)
            else:  # torch keeps the step count as a float32 scalar on the CPU
                state = {"step": torch.zeros((), dtype=torch.float32),
                         **{name: torch.zeros_like(param, memory_format=torch.preserve_format)
                            for name in self.STATE}}
            self.state[param] = state
        return state

    def clip_grad_norm(self, max_norm: float | None) -> Tensor:
        """``clip_grad_norm`` of the parameters' gradients; with the buffers, the norm of the gradient buffer (the
        same number to rounding: one op where the norm of each gradient and of their norms take three and a
        loop) and the gradients scaled there."""
        flat = self.flat
        if flat is not None and flat.gather_grads():
            return _clip([flat.grads], max_norm, torch.linalg.vector_norm(flat.grads))
        return clip_grad_norm(self._params(), max_norm)

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
        if self.flat is not None:  # into the buffers: every other parameter's part back to a fresh start
            self.flat.load(state)
            state = {param: self.flat.param_state(param) for param in state}
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
    return _clip(grads, max_norm, torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads, 2.0)), 2.0))


def _clip(grads: list[Tensor], max_norm: float | None, total: Tensor) -> Tensor:
    """Scale ``grads`` (one device and dtype) in place to a norm of at most ``max_norm`` (None: leave them), given
    their norm ``total``; returns it."""
    if max_norm is not None:
        torch._foreach_mul_(grads, torch.clamp(max_norm / (total + 1e-6), max=1.0))
    return total


class FlatBuffers:
    """An optimizer's parameters in one flat buffer, each parameter (the same ``Parameter`` object) a view of its
    part, with buffers of the same layout for their gradients and each state tensor of the rule, and the step
    counts in one ``[P]`` float32 CPU tensor (torch's step is a CPU float32 scalar per parameter: here each is a
    view of its element). See the module docstring for why."""

    def __init__(self, params: list[Tensor], state_names: tuple[str, ...]) -> None:
        self.sizes = [param.numel() for param in params]
        self.index = {param: i for i, param in enumerate(params)}
        with torch.no_grad():
            self.params = torch.cat([param.detach().reshape(-1) for param in params])
        self.param_views = self._views(self.params, params)
        for param, view in zip(params, self.param_views):
            param.data = view
        self.grads = torch.zeros_like(self.params)
        self.grad_views = self._views(self.grads, params)
        self.owners = params
        self.state = {name: torch.zeros_like(self.params) for name in state_names}
        self.state_views = {name: self._views(buffer, params) for name, buffer in self.state.items()}
        self.steps = torch.zeros(len(params), dtype=torch.float32)
        self.steps_alike = True
        """Whether every parameter has stepped as often (Adam's rule takes one count for the buffer)."""

    @classmethod
    def of(cls, params: list[Tensor], state_names: tuple[str, ...]) -> FlatBuffers | None:
        """The buffers of ``params``, or None unless they are dense, contiguous, of one device and dtype and not in
        shared memory (another process would go on reading the old tensors)."""
        if len({(param.device, param.dtype) for param in params}) > 1 or any(
                param.is_sparse or not param.is_contiguous() or param.is_shared() for param in params):
            return None
        return cls(params, state_names)

    def _views(self, buffer: Tensor, params: list[Tensor]) -> list[Tensor]:
        return [part.view_as(param) for part, param in zip(buffer.split(self.sizes), params)]

    def holds_grads(self) -> bool:
        """Whether every parameter's ``.grad`` is its view of the gradient buffer."""
        return all(param.grad is view for param, view in zip(self.owners, self.grad_views))

    def gather_grads(self) -> bool:
        """Make each parameter's ``.grad`` its view of the gradient buffer, holding the gradient it had (autograd
        hands a new tensor to a ``.grad`` set to None); False, and nothing changed, when a parameter has no
        gradient or no longer lives in the buffer (its ``.data`` replaced)."""
        if self.holds_grads():
            return True
        owners, views = self.owners, self.grad_views
        grads = [param.grad for param in owners]
        if any(grad is None for grad in grads) or any(
                param.data_ptr() != view.data_ptr() for param, view in zip(owners, self.param_views)):
            return False
        with torch.no_grad():
            if any(grad is view for grad, view in zip(grads, views)):  # some already are: the others one by one
                for grad, view in zip(grads, views):
                    if grad is not view:
                        view.copy_(grad)
            else:
                torch.cat([grad.reshape(-1) for grad in grads], out=self.grads)
        for param, view in zip(owners, views):
            param.grad = view
        return True

    def param_state(self, param: Tensor) -> dict[str, Tensor]:
        """``param``'s state: views of its parts of the step counts and the state buffers."""
        i = self.index[param]
        return {"step": self.steps[i], **{name: views[i] for name, views in self.state_views.items()}}

    def rule_state(self) -> dict[str, Tensor]:
        """The state of the whole buffer for the rule: its step count (all alike) and the state buffers."""
        return {"step": self.steps[0], **self.state}

    def load(self, state: dict[Tensor, dict[str, Tensor]]) -> None:
        """Take ``state`` (per parameter, loaded) into the buffers; the parameters it lacks start afresh."""
        self.steps.zero_()
        for buffer in self.state.values():
            buffer.zero_()
        for param, saved in state.items():
            own = self.param_state(param)
            for name, tensor in saved.items():
                own[name].copy_(tensor)
        self.steps_alike = bool((self.steps == self.steps[0]).all())
