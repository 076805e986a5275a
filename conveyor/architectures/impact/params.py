"""Weight broadcast through shared memory: one writer (the learner), many readers.

A ``ParamBlock`` holds a model's state-dict tensors flattened to float32 in
one ``SharedArrays`` block, with the learner version they came from. The
learner ``publish``es; each reader process ``read_into``s its own copy of the
model when ``version`` says something newer is there (IMPACT workers do so
between batches). Nothing is pickled and nobody waits for anybody.

The block has two copies. ``publish`` writes the copy readers are not
pointed at, then points them at it, so a reader copying the published copy
only races a writer that has published twice since it started. Each copy
carries a sequence number (a seqlock): odd while being written, bumped again
when done; a reader that sees it change (or odd) during its copy retries.
This relies on the stores of one process becoming visible to others in
program order, which holds for aligned 8-byte stores on x86-64 (TSO).

The layout follows from the model, so a reader rebuilds the block from the
same model architecture and the inherited file descriptor:
``ParamBlock(model, fd)``.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from conveyor.storage.shm import ArraySpec, SharedArrays

_READ_ATTEMPTS = 100


def _state_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    state = model.state_dict()
    for name, tensor in state.items():
        if not tensor.is_floating_point():
            raise ValueError(f"ParamBlock carries floating-point tensors only; {name} is {tensor.dtype}")
    return state


class ParamBlock:
    """A model's parameters in shared memory, with the learner version that produced them."""

    def __init__(self, model: nn.Module, fd: int | None = None):
        state = _state_tensors(model)
        self.numel = sum(t.numel() for t in state.values())
        self.shared = SharedArrays([
            ArraySpec("params", (2, self.numel), "float32"),
            ArraySpec("seq", (2,), "int64"),
            ArraySpec("version", (2,), "int64"),
            ArraySpec("published", (1,), "int64"),
        ], fd)
        if fd is None:
            self.shared["published"][0] = -1  # nothing published yet
        self._scratch = np.empty(self.numel, np.float32)

    @property
    def fd(self) -> int:
        return self.shared.fd

    @property
    def version(self) -> int:
        """Version of the latest published parameters; -1 before the first ``publish``."""
        slot = int(self.shared["published"][0])
        return -1 if slot < 0 else int(self.shared["version"][slot])

    def publish(self, model: nn.Module, version: int) -> None:
        """Copy ``model``'s parameters in and make them the latest, tagged ``version`` (one writer only)."""
        published = int(self.shared["published"][0])
        slot = 1 if published == 0 else 0
        seq, flat = self.shared["seq"], torch.from_numpy(self.shared["params"][slot])
        seq[slot] += 1  # odd: being written
        offset = 0
        for tensor in _state_tensors(model).values():
            n = tensor.numel()
            flat[offset : offset + n].copy_(tensor.detach().reshape(-1))
            offset += n
        self.shared["version"][slot] = version
        seq[slot] += 1  # even: complete
        self.shared["published"][0] = slot

    def read_into(self, model: nn.Module) -> int:
        """Load the latest published parameters into ``model``; returns their version (-1: none yet)."""
        seq = self.shared["seq"]
        for _ in range(_READ_ATTEMPTS):
            slot = int(self.shared["published"][0])
            if slot < 0:
                return -1
            before = int(seq[slot])
            if before % 2:
                continue
            version = int(self.shared["version"][slot])
            np.copyto(self._scratch, self.shared["params"][slot])
            if int(seq[slot]) == before:
                break
        else:
            raise RuntimeError(f"ParamBlock: no consistent copy after {_READ_ATTEMPTS} attempts; "
                               "the writer publishes faster than this reader can copy")
        flat = torch.from_numpy(self._scratch)
        offset = 0
        with torch.no_grad():
            for tensor in _state_tensors(model).values():
                n = tensor.numel()
                tensor.copy_(flat[offset : offset + n].view_as(tensor))
                offset += n
        return version

    def close(self) -> None:
        self.shared.close()
