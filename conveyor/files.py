"""Files replaced whole or not at all: checkpoints, ``config.json``, ``summary.json``, ``metrics.csv``; and
logs appended to (``append_text``: ``errors.log``).

``atomic_write(path)`` yields a file for ``path``'s new contents. It is a temp file beside ``path`` with a
random name, created exclusively (``O_CREAT | O_EXCL | O_NOFOLLOW``), so a file or symlink planted at a
guessable name is never written through. On success it is flushed, fsynced and renamed over ``path`` (the
rename replaces a symlink at ``path`` itself, never its target), then the directory is fsynced: a crash
leaves the old file or the new one, never half of one. On any error it is removed, so a failed write (a full
disk) leaves no partial file behind.
"""

from __future__ import annotations

import contextlib
import os
import secrets
from pathlib import Path
from typing import IO, Any, Iterator

from conveyor.errors import ConfigError

@contextlib.contextmanager
def atomic_write(path: Path | str, text: bool = False) -> Iterator[IO[Any]]:
    """A binary (``text``: UTF-8 text, newlines untranslated) file that becomes ``path`` when the block ends
    without an error; see the module docstring."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(8)}.tmp")  # hidden; never matches ckpt-*.pt
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o666)
    try:
        with os.fdopen(fd, "w" if text else "wb", **({"encoding": "utf-8", "newline": ""} if text else {})) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


NAME_MAX = 255
"""The longest file name, in bytes, of Linux's file systems."""


def partial_path(path: Path) -> Path:
    """The hidden temp name beside ``path`` that a file written by an outside library (a video, an exported
    network) gets until it is complete and renamed to ``path``."""
    return path.with_name(f".{path.stem}.partial{path.suffix}")


def check_output_file(flag: str, path: Path) -> None:
    """Refuse in one line (``ConfigError``) an output file ``path``, given as ``flag``, that cannot be written
    through ``partial_path``: a missing directory, a directory at ``path``, a name too long."""
    if not path.parent.resolve().is_dir():
        raise ConfigError(f"{flag} {path}: directory {path.parent} does not exist; create it or pass another path")
    if path.is_dir():
        raise ConfigError(f"{flag} {path} is a directory: pass a file name in it")
    length = len(os.fsencode(path.name))
    longest = NAME_MAX - (len(os.fsencode(partial_path(path).name)) - length)
    if length > longest:
        raise ConfigError(f"{flag}: the file name is {length} bytes long, over the {longest} it may have here (file "
                          "names have at most 255 bytes, and its temp file's adds 9): pass a shorter one")


def append_text(path: Path | str, text: str) -> None:
    """Append ``text`` (UTF-8) to the log file ``path``, creating it if need be; never through a symlink planted
    at ``path`` (``O_NOFOLLOW``: the write fails instead)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW | os.O_CLOEXEC, 0o666)
    with os.fdopen(fd, "a", encoding="utf-8", newline="") as f:
        f.write(text)


def write_text_atomic(path: Path | str, text: str) -> None:
    with atomic_write(path, text=True) as f:
        f.write(text)
