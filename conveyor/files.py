"""How a run writes its files: never through a link planted at a name it writes, and one writer per run directory.

``atomic_write(path)`` yields a file for ``path``'s new contents (checkpoints, ``config.json``, ``summary.json``,
``metrics.csv``, ``returns.csv``, ``learner_address``, ``eval.json``, plots). It is a temp file beside ``path``
with a random name, created exclusively (``O_CREAT | O_EXCL | O_NOFOLLOW``), so a file or symlink planted at a
guessable name is never written through. On success it is flushed, fsynced and renamed over ``path`` (the
rename replaces a symlink at ``path`` itself, never its target), then the directory is fsynced: a crash
leaves the old file or the new one, never half of one. On any error it is removed, so a failed write (a full
disk) leaves no partial file behind. ``exclusive_temp`` is that temp file for writers that open a path
themselves (ffmpeg, ``torch.onnx.export``); ``open_append`` appends (``metrics.csv`` rows, logs) to the file at
a name, replacing a symlink there rather than writing through it.

``check_output_file`` refuses in one line an output file (a video, an export) that ``exclusive_temp`` cannot
stand in for: a missing directory, a directory, a name too long for its temp file's.

``lock_run_dir`` takes the run directory's lock (``DIR/.lock``, ``fcntl.flock``): one process writes a run
directory at a time, a second one is refused with one line naming the holder; the kernel releases the lock when
the holder exits, however it ends.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import secrets
from pathlib import Path
from typing import IO, Any, Iterator

from conveyor.errors import ConfigError

LOCK_NAME = ".lock"
"""The run directory's lock file (it stays when the run ends: it holds the pid of its last holder)."""
_EXCLUSIVE = os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC


def _new_temp(path: Path, suffix: str = ".tmp") -> tuple[Path, int]:
    """A hidden file beside ``path`` with a random name (never matches ``ckpt-*.pt``), created exclusively and
    opened for writing."""
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(8)}{suffix}")
    return tmp, os.open(tmp, os.O_WRONLY | _EXCLUSIVE, 0o666)


@contextlib.contextmanager
def atomic_write(path: Path | str, text: bool = False) -> Iterator[IO[Any]]:
    """A binary (``text``: UTF-8 text, newlines untranslated) file that becomes ``path`` when the block ends
    without an error; see the module docstring."""
    path = Path(path)
    tmp, fd = _new_temp(path)
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


def write_text_atomic(path: Path | str, text: str) -> None:
    with atomic_write(path, text=True) as f:
        f.write(text)


def exclusive_temp(path: Path | str, suffix: str = "") -> Path:
    """An empty hidden file beside ``path`` with a random name ending in ``suffix``, created exclusively (never a
    planted link): for a writer that opens the file by its name; rename it over ``path`` once it is complete."""
    tmp, fd = _new_temp(Path(path), f".partial{suffix}")
    os.close(fd)
    return tmp


def open_append(path: Path | str, text: bool = False) -> IO[Any]:
    """``path`` opened for appending (created when missing; ``text``: UTF-8, newlines untranslated). A symlink
    at ``path`` is removed and a new file made in its place: its target is never written."""
    path = Path(path)
    if path.is_symlink():
        path.unlink()
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o666)
    return os.fdopen(fd, "a" if text else "ab", **({"encoding": "utf-8", "newline": ""} if text else {}))


def lock_run_dir(directory: Path | str) -> int:
    """Take ``directory``'s lock (``LOCK_NAME``, which then holds this process's pid) and return its file
    descriptor: the lock lasts until it is closed or this process exits. Held by another process: a
    ``ConfigError`` naming that process's pid and the fix."""
    path = Path(directory) / LOCK_NAME
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    except OSError as error:
        if error.errno == errno.ELOOP:
            raise ConfigError(f"{path} is a symbolic link, not a run directory's lock: remove it") from None
        raise
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
        os.close(fd)
        who = f"pid {holder}" if holder.isdigit() else "another process"
        raise ConfigError(f"run directory {directory} is being written by another conveyor run ({who} holds "
                          f"{path}): wait for it to end or stop it, or pass --out a new directory") from None
    except BaseException:
        os.close(fd)
        raise
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd


NAME_MAX = 255
"""The longest file name, in bytes, of Linux's file systems."""
TEMP_NAME_EXTRA = len(f"..{secrets.token_hex(8)}.partial")
"""What ``exclusive_temp`` adds to a name, besides the suffix it repeats."""


def check_output_file(flag: str, path: Path) -> None:
    """Refuse in one line (``ConfigError``) an output file ``path``, given as ``flag``, that cannot be written
    through ``exclusive_temp(path, path.suffix)``: a missing directory, a directory at ``path``, a name too long."""
    if not path.parent.resolve().is_dir():
        raise ConfigError(f"{flag} {path}: directory {path.parent} does not exist; create it or pass another path")
    if path.is_dir():
        raise ConfigError(f"{flag} {path} is a directory: pass a file name in it")
    length = len(os.fsencode(path.name))
    longest = NAME_MAX - TEMP_NAME_EXTRA - len(os.fsencode(path.suffix))
    if length > longest:
        raise ConfigError(f"{flag}: the file name is {length} bytes long, over the {longest} it may have here (file "
                          f"names have at most {NAME_MAX} bytes, and its temp file's adds "
                          f"{NAME_MAX - longest}): pass a shorter one")
