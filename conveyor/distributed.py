"""Data-parallel learners under torchrun (paac, hts): every rank a whole run with its own share of the envs.

``torchrun --nproc-per-node P -m conveyor train --arch paac ...`` starts P copies of one run; torchrun's
variables (``WORLD_SIZE``, ``RANK``, ...) tell them apart. ``Run`` builds a ``DataParallel`` only when
``WORLD_SIZE`` is set, and this module is the only one that uses ``torch.distributed``. The P copies make
one run with ``--num-envs`` envs in all (docs/design.md "Data-parallel learners"):

- rank r steps envs ``r B / P .. (r + 1) B / P - 1`` under their global indices (env seeds, episode seeds,
  HTS's uniforms), with ``--num-workers`` worker processes of its own;
- one flattened all-reduce between ``backward()`` and clipping (``Learner.compute_gradients``) sums the
  ranks' gradients weighted by their valid steps, so every rank steps with the gradient of the loss over the
  whole batch; the delayed HTS gradient stays exact (DDP would reduce at the wrong parameters);
- every rank draws the same random numbers for the whole batch (PAAC's actions, PPO's minibatch
  permutation) and keeps its own rows; statistics over a batch (PPO's advantage normalization per minibatch,
  the observation normalizer) are taken over the whole batch, its columns gathered;
- env steps, episodes, restarts and stop requests are exchanged once per update (``Run.share_progress``):
  every rank stops, checkpoints and anneals at the same update;
- rank 0 alone writes the run directory; its checkpoints hold every rank's env state.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import os
import sys
import time
from pathlib import Path
from typing import Any, Iterator, Sequence

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor

from conveyor.config import EnvCfg, RunCfg, flag_name, flag_value, flat_fields
from conveyor.errors import ConfigError, RunFailure
from conveyor.losses import advantage_moments
from conveyor.storage.rollout import env_columns, step_samples

ARCHS = ("paac", "hts")
"""The architectures whose learners run data-parallel under torchrun (synchronous: one batch per update)."""

RANK_LOCAL = frozenset({"env.num_workers", "env.backend", "arch.env_groups", "torch_threads"})
"""Config fields (``config.flat_fields`` keys) that may differ between ranks: how a rank steps its share of the
envs (the preset's workers follow its machine's CPUs, ``auto`` measures its backend) and its learner's threads.
Every other field must be rank 0's (``DataParallel.agree``)."""


class PeerLost(RunFailure):
    """A collective failed: another rank died or stopped. torchrun's ``--max-restarts`` resumes the group."""


def check_config(cfg: RunCfg, size: int) -> None:
    """Refuse, in one line, what a run of ``size`` ranks cannot do exactly as one process would."""
    arch = cfg.arch.name
    if arch == "ga3c":
        raise ConfigError("--arch ga3c does not run under torchrun: its learner is one process by design; to use "
                          "more machines run --arch seed, whose actors (conveyor actor) run anywhere")
    if arch not in ARCHS:
        raise ConfigError(f"--arch {arch} does not run under torchrun (data-parallel learners: "
                          f"{', '.join(ARCHS)}): run it without torchrun")
    if not cfg.out:
        raise ConfigError("under torchrun pass --out DIR: every rank, and every restart of the group, must name "
                          "the same run directory")
    if not (cfg.device == "cpu" or cfg.device == "cuda"):
        raise ConfigError(f"under torchrun pass --device cpu or cuda, got {cfg.device!r}: each rank takes the GPU "
                          "of its LOCAL_RANK")
    share = size * cfg.env.num_workers
    if cfg.env.num_envs % share:
        raise ConfigError(f"--num-envs {cfg.env.num_envs} is the whole batch under torchrun and must split into "
                          f"{size} ranks x {cfg.env.num_workers} workers: make it a multiple of {share}")


class DataParallel:
    """This rank's place among the ``size`` ranks torchrun started, and the collectives a run needs. Every
    method that says *collective* must be called at the same point of every rank's run."""

    def __init__(self, cfg: RunCfg) -> None:
        try:
            self.size, self.rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
        except (KeyError, ValueError):
            raise ConfigError(f"WORLD_SIZE is set ({os.environ['WORLD_SIZE']!r}) without a RANK beside it: start "
                              "the ranks with torchrun, or unset WORLD_SIZE for a run in one process") from None
        check_config(cfg, self.size)  # before the rendezvous: a refused config fails on every rank at once
        self.device = torch.device("cpu")
        if cfg.device == "cuda":
            self.device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
            torch.cuda.set_device(self.device)  # --device cuda is then this rank's GPU
        self.backend = "nccl" if self.device.type == "cuda" else "gloo"
        self.restarts = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
        # The env:// rendezvous torchrun set up. Its store outlives a restart of the group (--max-restarts) and
        # still holds the dead group's addresses: each attempt keeps its keys apart.
        try:
            store, _, _ = next(dist.rendezvous("env://"))
        except ValueError as error:  # a variable torchrun sets is missing
            raise ConfigError(f"{error}: start the ranks with torchrun, or unset WORLD_SIZE") from None
        store = dist.PrefixStore(f"conveyor/attempt-{self.restarts}", store)
        with self._together("joining them"):
            dist.init_process_group(self.backend, store=store, rank=self.rank, world_size=self.size)
        self.agree(cfg)  # the first collective: every later one has shapes the config decides
        self.local_envs = cfg.env.num_envs // self.size
        self.env_offset = self.rank * self.local_envs
        self.allreduce_s, self.allreduces = 0.0, 0  # the gradient all-reduces: time in them (waits included)

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()

    # ---- configuration -------------------------------------------------------------------
    def agree(self, cfg: RunCfg) -> None:
        """Collective: refuse, on every rank, a config that differs from rank 0's in a field outside
        ``RANK_LOCAL`` (ranks started with other flags would train apart, or break a collective): one line
        naming the first such field of the first such rank, and rank 0's value. Rank 0's config travels as
        JSON bytes (nothing is unpickled); each rank sends back the index of its first differing field."""
        fields = [[key, value] for key, value in flat_fields(cfg).items() if key not in RANK_LOCAL]
        mine = json.loads(json.dumps(fields, default=str))  # as JSON gives it back: tuples become lists
        data = torch.frombuffer(bytearray(json.dumps(mine).encode()), dtype=torch.uint8).to(self.device)
        with self._together("comparing their configs"):
            length = torch.tensor([data.numel()], dtype=torch.int64, device=self.device)
            dist.broadcast(length, src=0)
            if self.rank:
                data = torch.zeros(int(length), dtype=torch.uint8, device=self.device)
            dist.broadcast(data, src=0)
            theirs = json.loads(bytes(data.cpu().numpy()).decode())
            differ = next((i for i, (a, b) in enumerate(zip(mine, theirs)) if a != b), -1)
            if differ < 0 and len(mine) != len(theirs):  # fields one conveyor has and the other lacks
                differ = min(len(mine), len(theirs))
            first = torch.tensor([differ], dtype=torch.int64, device=self.device)
            firsts = [torch.empty_like(first) for _ in range(self.size)]
            dist.all_gather(firsts, first)
        refused = [(rank, int(index)) for rank, index in enumerate(firsts) if int(index) >= 0]
        if not refused:
            return
        rank, index = refused[0]
        if index >= len(theirs):
            problem = "a config of another conveyor version than rank 0's"
        else:
            key, value = theirs[index]
            section, _, name = key.rpartition(".")
            flag = flag_name(section or None, name)
            here = f" (here {flag_value(mine[index][1])})" if rank == self.rank and index < len(mine) else ""
            problem = f"another {flag} than rank 0's {flag_value(value)}{here}"
        self.close()
        raise ConfigError(f"torchrun rank {rank} of {self.size} was started with {problem}: start every rank with "
                          "the same flags (and the same conveyor)")

    def env_cfg(self, env: EnvCfg) -> EnvCfg:
        """This rank's envs: ``env.num_envs / size`` of them (global indices from ``env_offset``)."""
        return dataclasses.replace(env, num_envs=self.local_envs)

    def restarted(self, cfg: RunCfg) -> RunCfg:
        """``cfg``, resuming from its run directory's last checkpoint when torchrun restarted the group
        (``--max-restarts``) after one was written."""
        if not self.restarts or cfg.resume:
            return cfg
        found = bool(list(Path(cfg.out).glob("checkpoints/ckpt-*.pt")))
        if not self.exchange(np.array([found]))[0][0]:  # rank 0's directory decides for every rank
            self.say(f"torchrun restarted the group (restart {self.restarts}) before its first checkpoint: "
                     "starting over")
            return cfg
        self.say(f"torchrun restarted the group (restart {self.restarts}): resuming from {cfg.out}")
        return dataclasses.replace(cfg, resume=cfg.out)

    def say(self, line: str) -> None:
        if self.rank == 0:
            print(f"conveyor: {line}", file=sys.stderr)

    # ---- collectives ---------------------------------------------------------------------
    @contextlib.contextmanager
    def _together(self, what: str) -> Iterator[None]:
        try:
            yield
        except RuntimeError as error:  # gloo and nccl report a lost peer as RuntimeError (DistBackendError)
            first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
            raise PeerLost(f"rank {self.rank} of {self.size} lost the other ranks while {what} ({first[:200]}): "
                           "another rank failed or stopped (see its line above); under torchrun --max-restarts "
                           "the group resumes from the last checkpoint (--checkpoint-every)") from None

    def broadcast_(self, tensors: Sequence[Tensor]) -> None:
        """Collective: rank 0's values into ``tensors`` (the parameters every rank starts from)."""
        with self._together("taking rank 0's parameters"):
            for tensor in tensors:
                dist.broadcast(tensor.data, src=0)

    def average_gradients(self, params: Sequence[Tensor], weight: int, finite: bool) -> None:
        """Collective: set each parameter's ``.grad`` to the gradient of the whole batch's loss: the ranks'
        gradients, each weighted by ``weight`` (its valid steps: the loss is a mean over them), summed by one
        all-reduce of them flattened, divided by the total weight. A rank whose loss is not ``finite`` sends
        NaN, so every rank skips the step. One rank's average is its gradient, left as it is (bit for bit)."""
        if self.size == 1 and weight and finite:
            return
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        flat = torch.cat([grad.reshape(-1) for grad in grads] + [grads[0].new_ones(1)])
        if finite:
            flat.mul_(weight)
        else:
            flat.fill_(float("nan"))
        flat[-1] = weight
        start = time.perf_counter()
        with self._together("averaging gradients"):
            dist.all_reduce(flat)
        self.allreduce_s += time.perf_counter() - start
        self.allreduces += 1
        flat[:-1].div_(flat[-1].clamp(min=1))  # no valid step anywhere: zero, as masked_mean gives
        for p, grad in zip(params, flat[:-1].split([p.numel() for p in params])):
            p.grad = grad.view_as(p)

    def gather_columns(self, tensor: Tensor) -> Tensor:
        """Collective: the whole batch's ``[T, B, ...]`` tensor from every rank's ``[T, B / size, ...]``, env
        columns in rank order (on one rank, ``tensor`` itself)."""
        if self.size == 1:
            return tensor
        flag = tensor.dtype == torch.bool  # gloo gathers no bools
        part = (tensor.to(torch.uint8) if flag else tensor).contiguous()
        parts = [torch.empty_like(part) for _ in range(self.size)]
        with self._together("gathering a batch"):
            dist.all_gather(parts, part)
        whole = torch.cat(parts, dim=1)
        return whole.bool() if flag else whole

    def exchange(self, values: np.ndarray) -> list[np.ndarray]:
        """Collective: every rank's float64 ``values`` (the same length on every rank), in rank order."""
        part = torch.as_tensor(values, dtype=torch.float64).to(self.device)
        parts = [torch.empty_like(part) for _ in range(self.size)]
        with self._together("exchanging progress"):
            dist.all_gather(parts, part)
        return [p.cpu().numpy() for p in parts]

    def gather_states(self, state: dict[str, Any]) -> list[dict[str, Any]]:
        """Collective: every rank's ``state`` (tensors, lists, numbers: what a checkpoint holds), in rank order,
        on rank 0 (elsewhere an empty list). It travels as ``torch.save`` bytes and is read with
        ``weights_only=True``, as a checkpoint is: nothing is unpickled."""
        buffer = io.BytesIO()
        torch.save(state, buffer)
        data = torch.frombuffer(bytearray(buffer.getvalue()), dtype=torch.uint8)
        sizes = self.exchange(np.array([data.numel()]))
        longest = int(max(size[0] for size in sizes))
        part = torch.zeros(longest, dtype=torch.uint8)
        part[:data.numel()] = data
        part = part.to(self.device)
        parts = [torch.empty_like(part) for _ in range(self.size)]
        with self._together("gathering the checkpoint"):
            dist.all_gather(parts, part)
        if self.rank:
            return []
        return [torch.load(io.BytesIO(p.cpu().numpy()[:int(size[0])].tobytes()), weights_only=True)
                for p, size in zip(parts, sizes)]

    def summary(self, param_sha256: str) -> dict[str, Any]:
        """Collective: what ``summary.json`` says of the ranks: their final parameters' hashes, and this rank's
        mean time in a gradient all-reduce (ms; it includes waiting for the slowest rank's batch)."""
        mine = np.frombuffer(bytes.fromhex(param_sha256), dtype=np.uint8).astype(np.float64)
        hashes = [bytes(part.astype(np.uint8)).hex() for part in self.exchange(mine)]
        return {"world_size": self.size, "backend": self.backend, "param_sha256_per_rank": hashes,
                "allreduce_ms": 1000 * self.allreduce_s / max(self.allreduces, 1)}

    # ---- minibatches -----------------------------------------------------------------------
    def weight(self, batch: dict[str, Tensor]) -> int:
        """What this rank's (mini)batch weighs in the average: its valid steps."""
        valid = batch.get("valid")
        return int(valid.sum()) if valid is not None else batch["rewards"].numel()

    def minibatches(self, batch: dict[str, Tensor], steps: bool) -> "Minibatches":
        """Collective: this rank's part of each minibatch of the whole batch (``Learner.update_epochs``)."""
        return Minibatches(self, batch, steps)


class Minibatches:
    """Minibatches drawn from the whole batch (single steps or env columns, indices as one process holding every
    env would number them), cut down to this rank's steps. With PPO's fixed ``advantages`` (single steps), each
    minibatch carries ``advantage_moments``, the mean and std the loss normalizes with, over the whole
    minibatch: the advantages of every rank are gathered once, here."""

    def __init__(self, share: DataParallel, batch: dict[str, Tensor], steps: bool) -> None:
        self.share, self.batch, self.steps = share, batch, steps
        self.T, self.envs = batch["rewards"].shape[:2]
        self.whole: dict[str, Tensor] | None = None
        if steps and "advantages" in batch:
            valid = batch.get("valid")  # every rank gathers a mask, also one whose batch has none (all valid)
            self.whole = {"rewards": share.gather_columns(batch["rewards"]),
                          "advantages": share.gather_columns(batch["advantages"]),
                          "valid": share.gather_columns(torch.ones_like(batch["rewards"], dtype=torch.bool)
                                                        if valid is None else valid)}

    @property
    def groups(self) -> int:
        """Steps (or env columns) of the whole batch."""
        envs = self.envs * self.share.size
        return self.T * envs if self.steps else envs

    def __call__(self, group: Tensor) -> dict[str, Tensor]:
        """This rank's part of minibatch ``group`` (indices into the whole batch), in the group's order."""
        whole_envs, first = self.envs * self.share.size, self.share.env_offset
        column = group % whole_envs if self.steps else group
        mine = group[(column >= first) & (column < first + self.envs)]
        if not self.steps:
            return env_columns(self.batch, mine - first)
        minibatch = step_samples(self.batch, (mine // whole_envs) * self.envs + mine % whole_envs - first)
        if self.whole is not None:
            samples = step_samples(self.whole, group)
            minibatch["advantage_moments"] = advantage_moments(samples["advantages"], samples["valid"])
        return minibatch
