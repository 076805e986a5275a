"""What a recorded video holds, read by the ffmpeg binary of ``imageio-ffmpeg`` in a plain child process.

imageio-ffmpeg's own readers start ffmpeg with a ``preexec_fn``, which makes Python ``fork()`` rather than
``vfork()``: in a test process that ran a gRPC server, gRPC's fork handlers then ran in the child, and once
under load that child died before ffmpeg printed its header ("Could not load meta information").
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import imageio_ffmpeg


def video_size_and_frames(path: Path | str) -> tuple[tuple[int, int], int]:
    """``((width, height), frames)`` of the first video stream of ``path`` (its packets counted, not decoded)."""
    command = [imageio_ffmpeg.get_ffmpeg_exe(), "-hide_banner", "-nostdin", "-i", str(path), "-map", "0:v:0",
               "-c", "copy", "-f", "null", "-"]
    log = subprocess.run(command, capture_output=True, text=True, timeout=120).stderr
    size = re.search(r"Stream #0:0.*: Video: .*?, (\d+)x(\d+)", log)
    frames = re.findall(r"frame=\s*(\d+)", log)
    assert size and frames, f"ffmpeg could not read {path}:\n{log}"
    return (int(size.group(1)), int(size.group(2))), int(frames[-1])
