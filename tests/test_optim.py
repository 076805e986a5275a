"""conveyor's RMSProp and Adam against torch.optim's: the same parameters bit for bit after many steps, the same
state_dict layout both ways, one-line refusals of a state that does not fit, and no torch._dynamo import;
``clip_grad_norm`` against torch's ``clip_grad_norm_``."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from torch import nn

from conveyor import optim


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 3))


PAIRS = {
    "rmsprop": (lambda p: optim.RMSprop(p, lr=7e-4, alpha=0.99, eps=1e-5),
                lambda p: torch.optim.RMSprop(p, lr=7e-4, alpha=0.99, eps=1e-5)),
    "adam": (lambda p: optim.Adam(p, lr=6e-4, eps=1e-3), lambda p: torch.optim.Adam(p, lr=6e-4, eps=1e-3)),
}


def train(net: nn.Module, optimizer, steps: int, seed: int = 1) -> None:
    generator = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randn(32, 4, generator=generator)
        optimizer.zero_grad(set_to_none=True)
        net(x).pow(2).mean().backward()
        optimizer.step()


@pytest.mark.parametrize("name", PAIRS)
def test_steps_match_torch_bit_for_bit(name):
    ours, theirs = model(), model()
    make_ours, make_theirs = PAIRS[name]
    opt_ours, opt_theirs = make_ours(ours.parameters()), make_theirs(theirs.parameters())
    for lr in (None, 3e-4):  # a schedule's new rate is read at the next step
        if lr is not None:
            for opt in (opt_ours, opt_theirs):
                opt.param_groups[0]["lr"] = lr
        train(ours, opt_ours, 50)
        train(theirs, opt_theirs, 50)
        for a, b in zip(ours.parameters(), theirs.parameters()):
            assert torch.equal(a, b)


def test_clip_grad_norm_is_torchs_to_the_bit():
    ours, theirs = model(), model()
    for max_norm in (1e-3, 1e3, None):  # scaled, left as they are (coefficient clamped to 1), only measured
        for net in (ours, theirs):
            net.zero_grad()
            net(torch.randn(32, 4, generator=torch.Generator().manual_seed(2))).pow(2).mean().backward()
        norm = optim.clip_grad_norm(ours.parameters(), max_norm)
        expected = torch.nn.utils.clip_grad_norm_(theirs.parameters(), max_norm if max_norm else float("inf"))
        assert torch.equal(norm, expected) and norm > 0
        for a, b in zip(ours.parameters(), theirs.parameters()):
            assert torch.equal(a.grad, b.grad)
    assert optim.clip_grad_norm(nn.Linear(2, 2).parameters(), 1.0) == 0  # no gradients yet


@pytest.mark.parametrize("name", PAIRS)
def test_state_dicts_load_both_ways_and_continue_alike(name):
    make_ours, make_theirs = PAIRS[name]
    first = model()
    opt = make_theirs(first.parameters())
    train(first, opt, 20)
    saved = opt.state_dict()
    ours_state = make_ours(first.parameters()).state_dict()
    assert ours_state["param_groups"][0].keys() == saved["param_groups"][0].keys()

    # torch's state into ours, ours back into torch's: both go on as one uninterrupted torch run.
    reference = model()
    reference.load_state_dict(first.state_dict())
    ref_opt = make_theirs(reference.parameters())
    ref_opt.load_state_dict(saved)
    resumed = model()
    resumed.load_state_dict(first.state_dict())
    ours = make_ours(resumed.parameters())
    ours.load_state_dict(saved)
    train(reference, ref_opt, 10, seed=2)
    train(resumed, ours, 10, seed=2)
    back = make_theirs(resumed.parameters())
    back.load_state_dict(ours.state_dict())
    train(reference, ref_opt, 10, seed=3)
    train(resumed, back, 10, seed=3)
    for a, b in zip(reference.parameters(), resumed.parameters()):
        assert torch.equal(a, b)
    assert ours.state_dict()["state"][0]["step"].dtype == torch.float32


def test_a_state_of_another_model_or_optimizer_is_refused():
    opt = optim.Adam(model().parameters(), lr=1e-3)
    small = nn.Linear(4, 3)
    other = optim.Adam(small.parameters(), lr=1e-3)
    train(nn.Sequential(small), other, 1)
    with pytest.raises(ValueError, match="parameter groups sized"):
        opt.load_state_dict(other.state_dict())
    rms = optim.RMSprop(model().parameters(), lr=1e-3)
    net = model()
    adam = optim.Adam(net.parameters(), lr=1e-3)
    train(net, adam, 1)
    with pytest.raises(ValueError, match="lacks square_avg"):
        rms.load_state_dict(adam.state_dict())


def test_a_learner_never_imports_torch_dynamo():
    code = ("import sys, torch; from torch import nn; from conveyor import optim\n"
            "net = nn.Linear(3, 2); opt = optim.RMSprop(net.parameters(), lr=1e-3)\n"
            "net(torch.ones(1, 3)).sum().backward(); opt.step(); opt.zero_grad(); opt.state_dict()\n"
            "print('torch._dynamo' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                          timeout=120).stdout.strip() == "False"


# ---------------------------------------------------------------- one buffer (FlatBuffers)

class TwoBranches(nn.Module):
    """A branch that takes part in a step only when asked: its parameters then get no gradient."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.trunk, self.branch = nn.Linear(4, 3), nn.Linear(4, 3)

    def forward(self, x: torch.Tensor, branch: bool) -> torch.Tensor:
        return self.trunk(x) + (self.branch(x) if branch else 0)


@pytest.mark.parametrize("name", PAIRS)
def test_the_buffers_hold_the_parameters_and_step_them_as_torch_with_gradients_zeroed_in_place(name):
    ours, theirs = model(), model()
    params = list(ours.parameters())
    make_ours, make_theirs = PAIRS[name]
    opt_ours, opt_theirs = make_ours(ours.parameters()), make_theirs(theirs.parameters())
    flat = opt_ours.flat
    assert flat is not None and list(ours.parameters()) == params  # the same Parameter objects, now views
    assert all(p.data_ptr() == v.data_ptr() for p, v in zip(params, flat.param_views))
    generator = torch.Generator().manual_seed(4)
    for _ in range(30):
        x = torch.randn(32, 4, generator=generator)
        for net, opt in ((ours, opt_ours), (theirs, opt_theirs)):
            opt.zero_grad(set_to_none=False)
            net(x).pow(2).mean().backward()
            opt.step()
    assert flat.holds_grads()  # the backward added into the buffer: no copy
    for a, b in zip(ours.parameters(), theirs.parameters()):
        assert torch.equal(a, b)
    assert torch.equal(flat.params, torch.cat([p.detach().reshape(-1) for p in theirs.parameters()]))


@pytest.mark.parametrize("name", PAIRS)
def test_parameters_without_a_gradient_are_stepped_as_torch_steps_them(name):
    """A step where a parameter has no gradient leaves it and its state as they are (torch's rule); the step
    counts part, and Adam goes on parameter by parameter, still torch's numbers."""
    ours, theirs = TwoBranches(), TwoBranches()
    make_ours, make_theirs = PAIRS[name]
    opt_ours, opt_theirs = make_ours(ours.parameters()), make_theirs(theirs.parameters())
    generator = torch.Generator().manual_seed(5)
    for step in range(12):
        x = torch.randn(16, 4, generator=generator)
        for net, opt in ((ours, opt_ours), (theirs, opt_theirs)):
            opt.zero_grad(set_to_none=True)
            net(x, branch=step % 3 != 1).pow(2).mean().backward()
            opt.step()
    for a, b in zip(ours.parameters(), theirs.parameters()):
        assert torch.equal(a, b)
    assert not opt_ours.flat.steps_alike
    assert [s["step"].item() for s in opt_ours.state_dict()["state"].values()] == [12.0, 12.0, 8.0, 8.0]


def test_a_parameter_moved_out_of_the_buffer_is_still_stepped_as_torch_steps_it():
    ours, theirs = model(), model()
    opt_ours, opt_theirs = PAIRS["rmsprop"][0](ours.parameters()), PAIRS["rmsprop"][1](theirs.parameters())
    ours[0].weight.data = ours[0].weight.data.clone()  # no longer a view: the buffer must not be stepped
    train(ours, opt_ours, 5)
    train(theirs, opt_theirs, 5)
    assert not opt_ours.flat.gather_grads()
    for a, b in zip(ours.parameters(), theirs.parameters()):
        assert torch.equal(a, b)


def test_the_optimizers_clipping_is_torchs_to_rounding_and_scales_the_gradients():
    ours, theirs = model(), model()
    opt = PAIRS["rmsprop"][0](ours.parameters())
    for max_norm in (1e-3, 1e3, None):
        for net in (ours, theirs):
            net.zero_grad()
            net(torch.randn(32, 4, generator=torch.Generator().manual_seed(2))).pow(2).mean().backward()
        norm = opt.clip_grad_norm(max_norm)
        expected = torch.nn.utils.clip_grad_norm_(theirs.parameters(), max_norm if max_norm else float("inf"))
        torch.testing.assert_close(norm, expected, rtol=1e-6, atol=0)
        for a, b in zip(ours.parameters(), theirs.parameters()):
            torch.testing.assert_close(a.grad, b.grad, rtol=1e-6, atol=1e-12)
        assert opt.flat.holds_grads()


def test_a_state_for_some_parameters_loads_into_the_buffers_and_the_rest_start_afresh():
    first, reference = TwoBranches(), TwoBranches()
    theirs = torch.optim.Adam(first.parameters(), lr=1e-2)
    generator = torch.Generator().manual_seed(6)
    for _ in range(3):  # the branch never takes part: its parameters have no state
        theirs.zero_grad()
        first(torch.randn(8, 4, generator=generator), branch=False).pow(2).mean().backward()
        theirs.step()
    reference.load_state_dict(first.state_dict())
    resumed = TwoBranches()
    ref_opt, ours = torch.optim.Adam(reference.parameters(), lr=1e-2), optim.Adam(resumed.parameters(), lr=1e-2)
    resumed(torch.ones(1, 4), branch=True).sum().backward()
    ours.step()  # state in every part of the buffers, which must not survive the load
    resumed.load_state_dict(first.state_dict())
    ref_opt.load_state_dict(theirs.state_dict())
    ours.load_state_dict(theirs.state_dict())
    assert sorted(ours.state_dict()["state"]) == [0, 1] and not ours.flat.steps_alike
    for _ in range(4):
        x = torch.randn(8, 4, generator=generator)
        for net, opt in ((reference, ref_opt), (resumed, ours)):
            opt.zero_grad()
            net(x, branch=True).pow(2).mean().backward()
            opt.step()
    for a, b in zip(reference.parameters(), resumed.parameters()):
        assert torch.equal(a, b)


def test_no_buffer_for_parameters_of_several_dtypes():
    net = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2).double())
    assert optim.RMSprop(net.parameters(), lr=1e-3).flat is None
