"""numpy arrays <-> raw bytes with dtype and shape, validated on the way in.

What crosses the network is never unpickled: an array travels as its dtype
string (``np.dtype(x).str``), its shape and its raw bytes (the ``Array``
message of ``seed.proto``). ``decode`` accepts only plain numeric and bool
dtypes, checks that the byte count matches the shape exactly, and checks the
caller's expectations (dtype, trailing shape, leading length, finite
floats), so a malformed message becomes a one-line ``WireError``, not a
crash, a misread buffer or a NaN in the learner.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

# Numeric kinds a message may carry: bool, signed and unsigned ints, floats. No objects,
# strings, structured or void dtypes (those could smuggle pointers or parse ambiguously).
ALLOWED_KINDS = frozenset("biuf")
MAX_DIMS = 8
MAX_DTYPE_CHARS = 8  # "<f8", "|b1": a longer dtype string is not one of ours


class WireError(ValueError):
    """A message whose array fields do not decode or do not have the expected dtype and shape."""


def encode(array: np.ndarray, message: Any) -> Any:
    """Fill the ``Array`` protobuf ``message`` with ``array`` (made little-endian and contiguous)."""
    array = np.asarray(array)
    if array.dtype.kind not in ALLOWED_KINDS:
        raise WireError(f"dtype {array.dtype} cannot go on the wire: send bool, integer or float arrays")
    if array.dtype.byteorder == ">":
        array = array.astype(array.dtype.newbyteorder("<"))
    message.dtype = array.dtype.str
    message.shape[:] = array.shape
    message.data = np.ascontiguousarray(array).tobytes()
    return message


def decode(message: Any, name: str, *, dtype: np.dtype | str | None = None,
           tail: Sequence[int] | None = None, length: int | None = None, finite: bool = False) -> np.ndarray:
    """The array in ``message`` (read-only view of its bytes), checked against the expectations.

    ``dtype``: the exact dtype required; ``tail``: the shape after the first axis;
    ``length``: the size of the first axis; ``finite``: a float array must hold no NaN or
    infinity. ``name`` names the field in errors.
    """
    if len(message.dtype) > MAX_DTYPE_CHARS:
        raise WireError(f"{name}: unknown dtype {message.dtype[:32]!r}")
    try:
        got = np.dtype(message.dtype)
    except TypeError:
        raise WireError(f"{name}: unknown dtype {message.dtype[:32]!r}") from None
    if got.kind not in ALLOWED_KINDS or got.str != message.dtype or got.byteorder == ">":
        raise WireError(f"{name}: dtype {message.dtype[:32]!r} is not a little-endian bool, integer or float dtype")
    if dtype is not None and got != np.dtype(dtype):
        raise WireError(f"{name}: dtype {got.str} where {np.dtype(dtype).str} is expected")
    shape = tuple(int(d) for d in message.shape)
    if len(shape) > MAX_DIMS or any(d < 0 for d in shape):
        raise WireError(f"{name}: invalid shape {shape[:MAX_DIMS + 1]}")
    if not shape:
        raise WireError(f"{name}: a scalar where an array with a leading axis is expected")
    count = 1
    for d in shape:
        count *= d
    if count * got.itemsize != len(message.data):
        raise WireError(f"{name}: {len(message.data)} bytes do not hold shape {shape} of {got.str} "
                        f"({count * got.itemsize} bytes)")
    if tail is not None and shape[1:] != tuple(tail):
        raise WireError(f"{name}: shape {shape} where [n, {', '.join(map(str, tail))}] is expected")
    if length is not None and shape[0] != length:
        raise WireError(f"{name}: {shape[0]} rows where {length} are expected")
    array = np.frombuffer(message.data, dtype=got).reshape(shape)
    if finite and got.kind == "f" and not np.isfinite(array).all():
        raise WireError(f"{name} holds NaN or infinity")
    return array
