"""The learner: model, optimizer, version counter, checkpoints.

``Learner.update(batch)`` runs the configured loss on a batch, clips the
global gradient norm, steps the optimizer and increments ``version`` (the
update counter every architecture stamps on the actions it takes, so policy
lag is measurable). Then it folds the batch's observations into the model's
input statistics (``ModelCfg.normalize_obs``): after the step, so the
gradient is taken under the statistics the batch was collected with (PAAC
A2C with a CNN backpropagates through the acting forwards themselves; PPO's
first epoch starts at ratio 1), and the next forwards use the new ones.

A non-finite loss or gradient norm (a NaN from the env, an exploding
update) skips the optimizer step: the parameters, the optimizer state and
``version`` stay as they were, and ``skipped_updates`` counts it. A batch
on which every step was skipped is a bad batch; ``MAX_BAD_BATCHES`` in a
row stop the run (``RunFailure``, naming the loss or the gradient, the
loss terms and the batch fields that were not finite). Checkpoints are
never written from non-finite parameters, written atomically
(``conveyor/files.py``) and loaded with ``torch.load(weights_only=True)``:
nothing from disk is ever unpickled. A resumed run takes the newest
checkpoint that loads (``load_latest_checkpoint``).
"""

from __future__ import annotations

import errno
import hashlib
import math
import re
import shutil
import sys
import warnings
from pathlib import Path
from typing import Any, Callable

import torch
from torch import Tensor, nn

from conveyor.acting import forward_unrolls
from conveyor.config import RunCfg
from conveyor.errors import CheckpointError, RunFailure
from conveyor.optim import Adam, Optimizer, RMSprop
from conveyor.files import atomic_write
from conveyor.storage.rollout import env_columns, step_samples

MAX_BAD_BATCHES = 5
"""Batches in a row whose every update was skipped as non-finite before the run stops. More than one, so a
single bad batch (one env's transient NaN, one outlier) costs only itself; few, because a cause that persists
(an env that returns NaN from now on, parameters that no update can fix) would otherwise burn the rest of the
run's time learning nothing."""


class CheckpointGone(CheckpointError):
    """A checkpoint deleted between the listing that found it and its load: a run still writing its directory
    rotates old checkpoints away (``--keep-checkpoints``). Readers take the newest one still there."""


GONE = "was deleted before it could be read"
"""``_read_checkpoint``'s problem for a file that no longer exists."""


def make_optimizer(params: Any, cfg: RunCfg) -> Optimizer:
    """``cfg.algo.optimizer`` over ``params`` with the run's resolved settings (``conveyor/presets.py``); torch's
    update rules without ``torch.optim`` (``conveyor/optim.py`` says why)."""
    algo = cfg.algo
    if algo.optimizer == "rmsprop":
        return RMSprop(params, lr=algo.lr, alpha=algo.rmsprop_alpha, eps=algo.rmsprop_eps)
    return Adam(params, lr=algo.lr, eps=algo.adam_eps)


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
        self.parameters = list(self.model.parameters())
        """The model's parameters, listed once: walking the modules for them costs a small model's update ~5%."""
        self.optimizer = make_optimizer(self.parameters, cfg)
        self.max_grad_norm = cfg.algo.max_grad_norm
        self.obs_normalizer = getattr(self.model, "obs_normalizer", None)  # None: the model keeps no statistics
        self.value_normalizer = getattr(self.model, "value_normalizer", None)
        self.version = 0
        self.skipped_updates = 0  # optimizer steps skipped as non-finite, over the run (kept in checkpoints)
        self._nonfinite = ""  # why the gradients computed last may not be applied ("" when they may)
        self._batch_stepped = False  # whether any step on the current batch was applied
        self._bad_batches = 0  # in a row
        self.data_parallel: Any = None
        """Under torchrun, the run's ``distributed.DataParallel``: gradients are averaged over the ranks between
        backward and clipping, minibatches drawn from the whole batch, input statistics taken over it."""

    def set_lr(self, lr: float) -> None:
        """The learning rate of every later step (a schedule's; saved with the optimizer in checkpoints)."""
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    def forward(self, batch: dict[str, Tensor]) -> Any:
        """The model on ``batch["obs"]``; a recurrent one replayed from each unroll's start state
        (``acting.forward_unrolls``)."""
        return forward_unrolls(self.model, batch)

    def compute_gradients(self, batch: dict[str, Tensor], model_out: Any = None) -> tuple[dict[str, float], float]:
        """Forward (unless ``model_out`` of the current parameters on ``batch["obs"]`` is given, graph
        attached), loss and backward into ``.grad`` (no optimizer step); returns metrics and grad norm.
        Data-parallel, ``.grad`` becomes the gradient over every rank's part of the batch before it is clipped
        (a rank that holds no step of a minibatch computes no loss and adds nothing)."""
        # zeroed in place: the optimizer's gradient buffer stays each parameter's .grad, and the backward adds into
        # it (torch's set_to_none=False: a parameter that gets no gradient is stepped with zero; every parameter
        # of conveyor's models gets one)
        self.optimizer.zero_grad(set_to_none=False)
        share = self.data_parallel
        weight = 1 if share is None else share.weight(batch)
        if weight:
            loss, metrics = self.loss_fn(self.forward(batch) if model_out is None else model_out, batch)
            loss.backward()
        else:
            loss, metrics = torch.zeros(()), {}
        if share is not None:
            share.average_gradients(self.parameters, weight, math.isfinite(float(loss.detach())))
        norm = self.optimizer.clip_grad_norm(self.max_grad_norm or None)
        names = [k for k, v in metrics.items() if v.dim() == 0]
        with torch.no_grad():  # one copy to Python floats, not one per metric (each a dispatched op, or a GPU sync)
            numbers = torch.stack([*(metrics[k] for k in names), loss,
                                   norm if norm.device == loss.device else norm.to(loss.device)]).tolist()
        values = dict(zip([*names, "loss", "grad_norm"], numbers))
        grad_norm = values["grad_norm"]
        finite = math.isfinite(values["loss"]) and math.isfinite(grad_norm)
        self._nonfinite = "" if finite else nonfinite_cause(values, batch)
        return values, grad_norm

    @property
    def nonfinite(self) -> bool:
        """Whether the gradients computed last are not finite (``apply_gradients`` skips them)."""
        return bool(self._nonfinite)

    def apply_gradients(self, observations: Tensor | None = None) -> None:
        """Step the optimizer and increment ``version``, unless the gradients are not finite (then count a skipped
        update); ``observations``, the observations of the batch the gradients came from (None while more steps
        on the same batch follow), end the batch: ``end_batch(observations)``."""
        if self._nonfinite:
            self.skipped_updates += 1
        else:
            self.optimizer.step()
            self.version += 1
            self._batch_stepped = True
        if observations is not None:
            self.end_batch(observations)

    def end_batch(self, observations: Tensor) -> None:
        """After the last step on a batch: stop the run (``RunFailure``) at ``MAX_BAD_BATCHES`` batches in a row
        whose every step was skipped; else ``observe(observations)``."""
        self._bad_batches = 0 if self._batch_stepped else self._bad_batches + 1
        self._batch_stepped = False
        if self._bad_batches >= MAX_BAD_BATCHES:
            raise RunFailure(f"{self._bad_batches} batches in a row gave a non-finite {self._nonfinite}, so their "
                             f"updates were skipped ({self.skipped_updates} in all; the parameters and checkpoints "
                             "stay finite): check the env's observations and rewards for NaN/inf, or lower --lr")
        self.observe(observations)

    def observe(self, observations: Tensor) -> None:
        """Fold ``observations`` into the model's input statistics (once per batch; see the module docstring).
        A batch holding NaN/inf is left out: it would make the statistics, and every forward after, NaN."""
        if self.obs_normalizer is None:
            return
        if self.data_parallel is not None:  # the whole batch's, on every rank
            observations = self.data_parallel.gather_columns(observations)
        if bool(torch.isfinite(observations).all()):
            self.obs_normalizer.update(observations)

    def update(self, batch: dict[str, Tensor], model_out: Any = None) -> dict[str, float]:
        """One optimizer step on ``batch`` (see ``compute_gradients`` for ``model_out``); increments ``version``."""
        metrics, _ = self.compute_gradients(batch, model_out)
        self.apply_gradients(batch["obs"])
        return metrics

    def update_epochs(self, batch: dict[str, Tensor], epochs: int, minibatches: int,
                      generator: torch.Generator | None = None, steps: bool = False) -> dict[str, float]:
        """``epochs`` passes over ``batch``, each split into ``minibatches`` random groups; one optimizer step
        per minibatch. A group is a set of env columns (time order kept), or with ``steps`` a set of single
        steps drawn from all of T x B as a ``[1, N]`` batch (feed-forward models, a batch whose per-step
        targets are fixed: ``algos.ppo.with_targets``), as CleanRL and SB3 sample PPO minibatches.
        A2C is ``epochs = minibatches = 1``."""
        if self.value_normalizer is not None:
            batch = self.fit_value_targets(batch)
        if epochs == 1 and minibatches == 1:
            return self.update(batch)
        T, num_envs = batch["rewards"].shape[:2]
        # Data-parallel: groups of the whole batch, each rank's steps of them (the same generator on every rank).
        split = None if self.data_parallel is None else self.data_parallel.minibatches(batch, steps)
        groups = split.groups if split is not None else T * num_envs if steps else num_envs
        if groups < minibatches:
            raise ValueError(f"{minibatches} minibatches need at least as many {'steps' if steps else 'envs'}, got "
                             f"{groups}: lower --ppo-minibatches or raise --num-envs")
        device = batch["rewards"].device
        metrics: dict[str, float] = {}
        for _ in range(epochs):
            order = torch.randperm(groups, generator=generator).to(device)
            for group in order.chunk(minibatches):
                if split is not None:
                    minibatch = split(group)
                else:
                    minibatch = step_samples(batch, group) if steps else env_columns(batch, group)
                metrics, _ = self.compute_gradients(minibatch)
                self.apply_gradients()
        self.end_batch(batch["obs"])
        return metrics

    def fit_value_targets(self, batch: dict[str, Tensor]) -> dict[str, Tensor]:
        """Fold the batch's value targets ``batch["returns"]`` (the valid ones; data-parallel, the whole batch's)
        into the model's ``ValueNormalizer``, before any step on the batch, and return the batch with the
        statistics the loss standardizes with, ``value_moments`` (the model's value head uses the same ones until
        the next batch)."""
        if "returns" not in batch:
            raise KeyError("normalize_values needs the batch's value targets, batch['returns'] "
                           "(algos.ppo.with_targets)")
        returns, valid = batch["returns"], batch.get("valid")
        if self.data_parallel is not None:
            returns = self.data_parallel.gather_columns(returns)
            valid = None if valid is None else self.data_parallel.gather_columns(valid)
        targets = returns if valid is None else returns[valid]
        if bool(torch.isfinite(targets).all()):  # as ``observe``: a NaN would poison every later value
            self.value_normalizer.update(targets)
        return {**batch, "value_moments": self.value_normalizer.moments()}

    def param_sha256(self) -> str:
        return param_sha256(self.model)

    def nonfinite_parameters(self) -> list[str]:
        """Names of the model's parameters and buffers that hold NaN or inf."""
        return [name for name, tensor in self.model.state_dict().items()
                if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all())]

    # ---- checkpoints ---------------------------------------------------------------------
    def state(self, **extra: Any) -> dict[str, Any]:
        return {
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "version": self.version,
            "skipped_updates": self.skipped_updates,
            **extra,
        }

    def save(self, path: Path, **extra: Any) -> None:
        """Write a checkpoint (``save_checkpoint``); refused (``RunFailure``) while a parameter is not finite, so
        the finite checkpoints already on disk stay the newest."""
        bad = self.nonfinite_parameters()
        if bad:
            raise RunFailure(f"parameters {', '.join(bad[:3])}{' ...' if len(bad) > 3 else ''} are not finite, so "
                             f"checkpoint {path} was not written (the earlier ones hold finite parameters): "
                             "lower --lr, or check the env's observations and rewards for NaN/inf")
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
            self.skipped_updates = int(state.get("skipped_updates", 0))
        except (KeyError, RuntimeError, ValueError) as error:
            first_line = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
            raise CheckpointError(f"checkpoint {path} does not fit this model ({first_line}): "
                                  "resume with the same --env and --model as the original run") from None


def nonfinite_cause(values: dict[str, float], batch: dict[str, Any]) -> str:
    """What was not finite in an update (its ``compute_gradients`` metrics): the loss and which of its terms,
    else the gradient norm; and the float fields of ``batch`` that hold NaN/inf (where it came from)."""
    if math.isfinite(values["loss"]):
        cause = f"gradient norm ({values['grad_norm']})"
    else:
        terms = [name for name, value in values.items()
                 if name not in ("loss", "grad_norm") and not math.isfinite(value)]
        cause = f"loss ({values['loss']}{'; terms ' + ', '.join(terms) if terms else ''})"
    inputs = [name for name, value in batch.items() if isinstance(value, Tensor) and value.is_floating_point()
              and not bool(torch.isfinite(value).all())]
    return cause + (f" from a batch whose {', '.join(inputs)} held NaN/inf" if inputs else "")


def save_checkpoint(path: Path, state: dict[str, Any]) -> None:
    """Write ``state`` atomically (``conveyor/files.py``): a crash leaves either the old file or the new one,
    never half of one. A write that fails (a full disk) leaves no temp file and stops the run with one line
    (``RunFailure``): for a full disk, the directory, its free space and the space the checkpoint needs."""
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with atomic_write(path) as f:
            torch.save(state, f)
    except OSError as error:
        if error.errno in (errno.ENOSPC, errno.EDQUOT):
            counter = _ByteCounter()
            torch.save(state, counter)
            raise RunFailure(f"no space left for checkpoint {path.name} in {path.parent}: "
                             f"{_mib(shutil.disk_usage(path.parent).free)} free, it needs {_mib(counter.size)}; "
                             "free space on that disk and continue with --resume") from None
        raise RunFailure(f"cannot write checkpoint {path} ({error.strerror or error}): make "
                         f"{path.parent} writable and continue with --resume") from None


class _ByteCounter:
    """A write-only file that only counts bytes: the size of a checkpoint that did not fit on the disk."""

    def __init__(self) -> None:
        self.size = 0

    def write(self, data: bytes) -> int:
        self.size += len(data)
        return len(data)

    def flush(self) -> None:
        pass


def _mib(size: int) -> str:
    return f"{size / 2**20:.1f} MiB"


def load_checkpoint(path: Path, device: torch.device | str = "cpu") -> dict[str, Any]:
    """The state of checkpoint ``path``, read without unpickling anything; a ``CheckpointError`` says in one
    line what is wrong with the file (``CheckpointGone``: it no longer exists)."""
    path = Path(path)
    if not path.exists() and not path.is_symlink():
        raise CheckpointGone(f"checkpoint {path} not found: pass a run directory that has checkpoints/*.pt, or "
                             "--checkpoint latest")
    state, problem = _read_checkpoint(path, device)
    if problem == GONE:
        raise CheckpointGone(f"checkpoint {path} {GONE} (the run writing it rotated it away, --keep-checkpoints): "
                             "pass --checkpoint latest, or one that is still there")
    if problem:
        own = path.parent.name == "checkpoints" and path.name.startswith("ckpt-") and path.suffix == ".pt"
        fix = ("delete it to fall back to an earlier one, or start a new run" if own else
               "pass --checkpoint latest, an env-step count, or a checkpoint a run wrote (DIR/checkpoints/ckpt-*.pt)")
        raise CheckpointError(f"checkpoint {path} {problem}: {fix}")
    return state


def checkpoint_name(env_steps: int) -> str:
    """The file name of a run's checkpoint at ``env_steps`` (zero-padded: names sort in step order)."""
    return f"ckpt-{env_steps:012d}.pt"


def checkpoint_file(run_dir: Path, checkpoint: str | int | None) -> Path | None:
    """The checkpoint file that ``checkpoint`` names in ``run_dir``: None for the latest (``latest``, None),
    ``checkpoints/ckpt-<N>.pt`` for an env-step count N, or a path to a ``.pt`` file."""
    if checkpoint is None or str(checkpoint) == "latest":
        return None
    text = str(checkpoint)
    if text.isdigit():
        path = run_dir / "checkpoints" / checkpoint_name(int(text))
        if not path.is_file():
            steps = sorted(int(p.stem.split("-")[1]) for p in run_dir.glob("checkpoints/ckpt-*.pt")
                           if p.stem.split("-")[1].isdigit())
            there = ", ".join(f"{s}" for s in steps) if steps else "none"
            raise CheckpointError(f"no checkpoint at {int(text)} env steps in {run_dir}/checkpoints (there are: "
                                  f"{there}): pass --checkpoint one of them, or latest")
        return path
    path = Path(text)
    if not path.is_file() and (run_dir / "checkpoints" / text).is_file():
        path = run_dir / "checkpoints" / text
    if not path.is_file():
        raise CheckpointError(f"checkpoint {text!r} not found: pass --checkpoint latest, an env-step count of a "
                              f"file in {run_dir}/checkpoints, or a path to a .pt file")
    return path


def load_latest_checkpoint(run_dir: Path | str, device: torch.device | str = "cpu") -> tuple[Path, dict[str, Any]]:
    """The newest checkpoint of ``run_dir`` that loads, and its state. Each newer one that does not (truncated,
    tampered with, a directory in its place) is skipped with one line on stderr naming it and why; temp files
    of interrupted writes never match, and one deleted while this reads (a run still writing ``run_dir``
    rotates old ones away) is passed over in silence. None that loads is a ``CheckpointError`` naming the
    newest."""
    for _ in range(MAX_LISTINGS):
        paths = sorted(Path(run_dir).glob("checkpoints/ckpt-*.pt"), reverse=True)
        if not paths:
            raise CheckpointError(f"no checkpoints in {run_dir}/checkpoints: pass the --out DIR of an earlier run")
        problems = []
        for path in paths:
            state, problem = _read_checkpoint(path, device)
            if not problem:
                for skipped, why in problems:
                    print(f"conveyor: skipped checkpoint {skipped}: it {why}; using {path.name}", file=sys.stderr)
                return path, state
            if problem != GONE:
                problems.append((path, problem))
        if problems:
            older = f" (and so do the {len(paths) - 1} older ones)" if len(paths) > 1 else ""
            raise CheckpointError(f"no usable checkpoint in {run_dir}/checkpoints: the newest, {problems[0][0].name}, "
                                  f"{problems[0][1]}{older}: start a new run")
        # Every one listed was rotated away as it was read: the run that writes them has newer ones by now.
    raise CheckpointError(f"the checkpoints in {run_dir}/checkpoints were deleted faster than they could be read "
                          f"({MAX_LISTINGS} listings): lower the run's checkpoint rate, or wait for it to end")


MAX_LISTINGS = 5
"""How often ``load_latest_checkpoint`` lists a run's checkpoints again when every one listed was deleted as it
read them."""


def _read_checkpoint(path: Path, device: torch.device | str) -> tuple[dict[str, Any], str]:
    """``(state, "")``, or ``({}, what is wrong with the file)``."""
    if not path.is_file():
        return {}, "is not a file" if path.exists() or path.is_symlink() else GONE
    try:
        with warnings.catch_warnings():
            # torch warns about the pickle protocol of files it is about to refuse: the refusal says it all.
            warnings.filterwarnings("ignore", category=UserWarning, module=r"torch\.")
            state = torch.load(path, map_location=device, weights_only=True)
    except FileNotFoundError:
        return {}, GONE
    except Exception as error:  # torch raises many types for corrupt zips and refused globals
        return {}, f"is corrupt or not a conveyor checkpoint ({_load_failure(error)})"
    if not isinstance(state, dict) or "model" not in state:
        return {}, "is not a conveyor checkpoint (it holds no model)"
    return state, ""


def _load_failure(error: Exception) -> str:
    """``torch.load``'s error in a few words: what a weights-only load refused to unpickle, else its first
    sentence."""
    text = re.sub(r"\x1b\[[0-9;]*m", "", str(error)).strip()  # torch bolds part of it with terminal escapes
    if text.startswith("Weights only load failed"):
        # Keep what it refused; drop torch's advice (load with weights_only=False, allowlist the global): never safe.
        detail = text.split("WeightsUnpickler error:", 1)[1] if "WeightsUnpickler error:" in text else (
            text.split("\n\n", 1)[-1])
        return f"a weights-only load refused it: {_first_sentence(detail.split('Check the documentation')[0])}"
    return _first_sentence(text.splitlines()[0] if text else type(error).__name__)


def _first_sentence(text: str) -> str:
    return " ".join(text.split()).split(". ")[0].rstrip(".")
