"""``conveyor export``: a run's policy network as one file that runs without conveyor (TorchScript or ONNX).

What is exported is ``conveyor.policy.InferenceNet`` of ``load_policy``: the
model with its preprocessing (uint8 frames scaled to [0, 1], the observation
normalizer's statistics) and the deterministic action, computed exactly as
``Policy.act(..., deterministic=True)`` computes it (argmax of the logits or
of Q; the Gaussian mean clipped to the action bounds). The env's own
preprocessing (Atari frame skip, 84x84 grayscale, frame stack) is not in the
network: feed it observations of ``load_policy(run).make_env()``.

Inputs and outputs (``B``: any batch size):

- ``obs`` ``[B, *obs_shape]``, the env's dtype (uint8 frames, float32 vectors);
- ``action`` ``[B]`` int64, or ``[B, A]`` float32 (a row whose float observation holds NaN or inf: -1, or NaN:
  the file cannot raise, ``conveyor.policy.InferenceNet``); ``logits`` ``[B, A]`` (discrete actor-critic), ``mean``
  ``[B, A]`` (Gaussian, before clipping) or ``q`` ``[B, A]`` (R2D2's Q head); ``value`` ``[B]`` (max Q for a
  Q head);
- recurrent models (an LSTM core) also take ``state_h``, ``state_c`` ``[1, B, H]`` float32 (zeros at an
  episode's start), ``prev_action`` (the previous ``action`` output: ``[B]`` int64, or ``[B, A]`` float32
  for continuous actions; zeros at the start) and ``prev_reward`` ``[B]`` float32 (the env's raw reward of
  the previous step, 0 at the start), and return ``next_state_h``, ``next_state_c``.

TorchScript files come from ``torch.jit.trace`` (``torch.jit.load`` runs them;
``conveyor.json`` among their extra files describes them); ONNX files from
``torch.onnx.export(dynamo=True)`` (needs ``onnx`` and ``onnxscript``:
``pip install 'conveyor[export]'``), with the same description in the model's
metadata (``conveyor``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import warnings
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch

from conveyor.errors import ConfigError
from conveyor.files import check_output_file, exclusive_temp
from conveyor.policy import Policy, load_policy

FORMATS = ("torchscript", "onnx")
STATE_INPUTS = ("state_h", "state_c", "prev_action", "prev_reward")
STATE_OUTPUTS = ("next_state_h", "next_state_c")
EXAMPLE_BATCH = 2
"""Batch size of the example inputs the exporters trace (not 0 or 1, which tracers specialize on)."""


def input_names(policy: Policy) -> list[str]:
    return ["obs", *(STATE_INPUTS if policy.recurrent else ())]


def output_names(policy: Policy) -> list[str]:
    head = "q" if policy.q_head else "logits" if policy.net.discrete else "mean"
    return ["action", head, "value", *(STATE_OUTPUTS if policy.recurrent else ())]


def example_inputs(policy: Policy, batch: int = EXAMPLE_BATCH) -> tuple[torch.Tensor, ...]:
    space = policy.observation_space
    obs = torch.as_tensor(np.zeros((batch, *space.shape), dtype=space.dtype))
    if not policy.recurrent:
        return (obs,)
    h, c, prev_action = policy.initial_state(batch)  # type: ignore[misc]
    return obs, h, c, prev_action, torch.zeros(batch)


def description(policy: Policy, fmt: str) -> dict[str, Any]:
    """What the exported file holds and how to call it (stored in it as ``conveyor.json`` / ``conveyor``)."""
    space = policy.observation_space
    return {
        "format": fmt,
        "env": policy.cfg.env.id,
        "arch": policy.cfg.arch.name,
        "algo": policy.cfg.algo.name,
        "checkpoint": policy.checkpoint.name,
        "env_steps": policy.env_steps,
        "obs_shape": list(space.shape),
        "obs_dtype": str(np.dtype(space.dtype)),
        "action_space": str(policy.action_space),
        "inputs": input_names(policy),
        "outputs": output_names(policy),
        "lstm_size": int(policy.model.lstm_size or 0),
    }


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """Keep the exporters' deprecation warnings and progress logging off the console."""
    loggers = [logging.getLogger(name) for name in ("torch.onnx", "torch.export", "torch._dynamo", "onnxscript")]
    levels = [logger.level for logger in loggers]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for logger in loggers:
            logger.setLevel(logging.ERROR)
        try:
            yield
        finally:
            for logger, level in zip(loggers, levels):
                logger.setLevel(level)


@contextlib.contextmanager
def _partial(out: Path) -> Iterator[Path]:
    """The file an exporter writes: created exclusively beside ``out`` (never a planted link), renamed to ``out``
    when the block ends without an error and removed otherwise (no ``.NAME.partial`` is left behind)."""
    partial = exclusive_temp(out, out.suffix)
    try:
        yield partial
        os.replace(partial, out)
    finally:
        partial.unlink(missing_ok=True)


def export_torchscript(policy: Policy, out: Path) -> None:
    inputs = example_inputs(policy)
    info = json.dumps(description(policy, "torchscript"), indent=2)
    # Traced without autograd, as the net runs: with it, the built-in CNNs would take their channels-last training
    # layout (``ActorCritic._inputs``), and the tracer's check, run without it, would see another graph.
    with _partial(out) as partial, _quiet(), torch.no_grad():  # torch 2.13 deprecates torch.jit (for
        traced = torch.jit.trace(policy.net, inputs)  # torch.export); it still works
        torch.jit.save(traced, str(partial), _extra_files={"conveyor.json": info})


def export_onnx(policy: Policy, out: Path) -> None:
    try:
        import onnx
        import onnxscript  # noqa: F401  (torch.onnx.export(dynamo=True) needs it)
    except ModuleNotFoundError as error:
        raise ConfigError(f"ONNX export needs the {error.name} package: pip install 'conveyor[export]' (or "
                          "--format torchscript)") from None
    inputs = example_inputs(policy)
    batch = torch.export.Dim("batch", min=1)
    shapes: dict[str, Any] = {"obs": {0: batch}}
    if policy.recurrent:
        shapes.update({"state_h": {1: batch}, "state_c": {1: batch}, "prev_action": {0: batch},
                       "prev_reward": {0: batch}})
    with _partial(out) as partial:
        with _quiet():
            torch.onnx.export(policy.net, inputs, str(partial), input_names=input_names(policy),
                              output_names=output_names(policy), dynamic_shapes=shapes, dynamo=True,
                              external_data=False, verbose=False)
        model = onnx.load(str(partial))
        entry = model.metadata_props.add()
        entry.key, entry.value = "conveyor", json.dumps(description(policy, "onnx"))
        onnx.save(model, str(partial))


def export_policy(policy: Policy, fmt: str, out: Path | str) -> Path:
    """Write ``policy``'s network in ``fmt`` (``torchscript`` or ``onnx``) to ``out``; a file is replaced whole."""
    if fmt not in FORMATS:
        raise ConfigError(f"unknown export format {fmt!r}: choose one of {', '.join(FORMATS)}")
    out = Path(out)
    check_output_file("--out", out)
    policy.net.cpu().eval()
    try:
        (export_onnx if fmt == "onnx" else export_torchscript)(policy, out)
    except OSError as error:
        raise ConfigError(f"--out {out}: cannot write it ({error.strerror}); pass a writable path") from None
    return out


def signature(policy: Policy) -> str:
    """The exported function in one line: inputs and outputs with shapes and dtypes."""
    space = policy.observation_space
    obs = f"obs [B, {', '.join(map(str, space.shape))}] {np.dtype(space.dtype)}"
    A = policy.action_space.n if policy.net.discrete else policy.action_space.shape[0]  # type: ignore[attr-defined]
    action = "action [B] int64" if policy.net.discrete else f"action [B, {A}] float32"
    head = output_names(policy)[1]
    outputs = [action, f"{head} [B, {A}]", "value [B]"]
    inputs = [obs]
    if policy.recurrent:
        H = policy.model.lstm_size
        previous = "prev_action [B] int64" if policy.net.discrete else f"prev_action [B, {A}] float32"
        inputs += [f"state_h [1, B, {H}]", f"state_c [1, B, {H}]", previous, "prev_reward [B]"]
        outputs += [f"next_state_h [1, B, {H}]", f"next_state_c [1, B, {H}]"]
    return f"{', '.join(inputs)} -> {', '.join(outputs)}"


# ---- `conveyor export` ---------------------------------------------------------------------------
def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--run", required=True, type=Path, metavar="DIR", help="the run's --out directory")
    parser.add_argument("--format", required=True, choices=FORMATS,
                        help="torchscript (torch.jit.load) or onnx (onnxruntime; needs conveyor[export])")
    parser.add_argument("--out", required=True, type=Path, metavar="FILE", help="the file to write")
    parser.add_argument("--checkpoint", default="latest", metavar="N|latest|FILE",
                        help="the checkpoint to export: latest (default), the env steps N of "
                             "checkpoints/ckpt-N.pt, or a .pt file")


def main(args: argparse.Namespace) -> int:
    check_output_file("--out", args.out)  # before the (slower) load
    policy = load_policy(args.run, args.checkpoint, "cpu")
    export_policy(policy, args.format, args.out)
    print(f"exported {policy.describe()} to {args.out} ({args.format}): {signature(policy)}")
    return 0
