"""``conveyor enjoy``: watch a run's policy play, print each episode's return, optionally record a video.

Built on ``conveyor.load_policy`` (``conveyor/policy.py``): one fresh env
from the run's ``config.json`` (the same preprocessing as training; real games
and raw rewards, so each printed return is the env's score), episode ``k``
reset with seed ``seed + k``, the policy's actions sampled (its mode with
``--deterministic``), a recurrent state carried across the steps of an
episode and started afresh at the next. ``--env-arg KEY=VALUE`` plays in
other env settings than training's (``repeat_action_probability=0``: Atari
v5 without sticky actions).

``--video FILE.mp4`` records the env's own ``rgb_array`` frames from beneath
the preprocessing wrappers: for Atari the emulator's 210x160 RGB screen at
every emulator frame (60 fps, frame skip and no-op starts included), not the
84x84 grayscale network input. Each episode gives its reset frame and one
frame per env step, all episodes in one file. Frames are streamed to ffmpeg
(the binary of the ``imageio-ffmpeg`` package) as they come, so memory stays
flat however long the episodes are (gymnasium's ``RecordVideo`` keeps every
frame of a video in memory until it ends).
"""

from __future__ import annotations

import argparse
import math
import os
from pathlib import Path
from typing import Any, Callable

import gymnasium as gym
import numpy as np

from conveyor.config import check_seeds
from conveyor.errors import ConfigError
from conveyor.envs import EPISODE_KEY
from conveyor.files import check_output_file, exclusive_temp
from conveyor.evaluate import EVAL_SEED_OFFSET, add_env_arg_argument
from conveyor.policy import Policy, load_policy

VIDEO_SUFFIXES = (".mp4", ".mkv", ".mov")
"""Containers that take the H.264 stream the recorder writes."""
MIN_VIDEO_SIDE = 160
"""Frames smaller than this (MinAtar's 10x10) are scaled up by an integer factor, pixels kept square and sharp."""
ATARI_FPS = 60
"""The Atari emulator's frame rate: the recorder takes every emulator frame, so the video plays in real time."""


class VideoRecorder(gym.Wrapper):
    """Streams ``env.render()`` (an ``rgb_array`` env) into one H.264 video: a frame after every ``reset`` and
    every ``step``. ``close`` (or ``finish``) ends the file; it is written under a temporary name next to ``path``
    and renamed to ``path`` once complete."""

    def __init__(self, env: gym.Env, path: Path, fps: float):
        super().__init__(env)
        self.path = Path(path)
        self.fps = fps
        self.frames = 0
        self._partial: Path | None = None  # created exclusively when the first frame comes (never a planted link)
        self._writer: Any = None
        self._size: tuple[int, int] | None = None

    def reset(self, **kwargs: Any) -> tuple[Any, dict]:
        result = self.env.reset(**kwargs)
        self._capture()
        return result

    def step(self, action: Any) -> tuple[Any, Any, bool, bool, dict]:
        result = self.env.step(action)
        self._capture()
        return result

    @staticmethod
    def _rgb(frame: Any) -> np.ndarray:
        """A render as uint8 ``[H, W, 3]`` with even sides (H.264 in yuv420p needs them), tiny frames scaled up."""
        frame = np.asarray(frame)
        if frame.dtype != np.uint8:  # MinAtar renders floats in [0, 1]
            frame = (np.clip(frame, 0.0, 1.0) * 255.0).round().astype(np.uint8)
        if frame.ndim == 2:
            frame = np.repeat(frame[:, :, None], 3, axis=2)
        frame = frame[:, :, :3]
        scale = math.ceil(MIN_VIDEO_SIDE / max(frame.shape[:2]))
        if scale > 1:
            frame = frame.repeat(scale, axis=0).repeat(scale, axis=1)
        height, width = frame.shape[:2]
        if height % 2 or width % 2:
            frame = np.pad(frame, ((0, height % 2), (0, width % 2), (0, 0)))
        return np.ascontiguousarray(frame)

    def _capture(self) -> None:
        frame = self.env.render()
        if isinstance(frame, list):  # rgb_array_list
            frame = frame[-1] if frame else None
        if frame is None:
            raise ConfigError(f"{self.env.spec.id if self.env.spec else 'the env'} rendered no frame in rgb_array "
                              "mode: drop --video")
        frame = self._rgb(frame)
        if self._writer is None:
            import imageio_ffmpeg

            self._size = (frame.shape[1], frame.shape[0])
            self._partial = exclusive_temp(self.path, self.path.suffix)
            self._writer = imageio_ffmpeg.write_frames(str(self._partial), self._size, fps=self.fps, codec="libx264",
                                                       macro_block_size=1, ffmpeg_log_level="error")
            self._writer.send(None)  # start the generator (and ffmpeg)
        elif (frame.shape[1], frame.shape[0]) != self._size:
            raise ConfigError(f"the env's frames changed size from {self._size} to {frame.shape[1::-1]} mid-video: "
                              "drop --video")
        self._writer.send(frame.tobytes())
        self.frames += 1

    def finish(self) -> None:
        """End the video file (once); without frames, no file."""
        if self._writer is not None:
            writer, self._writer = self._writer, None
            writer.close()
            os.replace(self._partial, self.path)

    def close(self) -> None:
        try:
            self.finish()
        finally:
            super().close()


def insert_beneath_wrappers(env: gym.Env, wrap: Callable[[gym.Env], gym.Wrapper]) -> gym.Wrapper:
    """Put ``wrap(base env)`` right above the base env of ``env``, beneath every wrapper (preprocessing, time
    limit), so it sees each raw env step; returns the new wrapper."""
    outer = env
    while isinstance(outer, gym.Wrapper) and outer.env is not env.unwrapped:
        outer = outer.env
    if not isinstance(outer, gym.Wrapper):
        raise ValueError("the env has no wrapper to put a recorder beneath")
    inserted = wrap(outer.env)
    outer.env = inserted
    return inserted


def video_fps(policy: Policy, env: gym.Env) -> float:
    if policy.cfg.env.is_atari:
        return ATARI_FPS
    return float(env.metadata.get("render_fps") or 15)


def make_play_env(policy: Policy, seed: int, render: str | None, video: Path | None
                  ) -> tuple[gym.Env, VideoRecorder | None]:
    """The env to play in (``policy.make_env``), rendering as asked, with a recorder beneath its wrappers."""
    render_mode = "rgb_array" if video is not None else render
    if video is not None:  # offscreen frames need no display (SDL would complain of the missing one on stderr)
        os.environ.setdefault("SDL_VIDEODRIVER", "dummy")
    try:
        env = policy.make_env(seed=seed, render_mode=render_mode)
    except ConfigError as error:
        if render_mode and "render_mode" in str(error):
            raise ConfigError(f"{policy.cfg.env.id} cannot render frames (its constructor takes no render_mode): "
                              f"drop {'--video' if video is not None else '--render'}") from None
        raise
    except gym.error.DependencyNotInstalled as error:
        raise ConfigError(f"rendering {policy.cfg.env.id} needs a missing package ({error}): install it or drop "
                          f"{'--video' if video is not None else '--render'}") from None
    recorder = None
    if video is not None:
        recorder = insert_beneath_wrappers(env, lambda base: VideoRecorder(base, video, video_fps(policy, base)))
    return env, recorder


def play(policy: Policy, episodes: int, seed: int, *, deterministic: bool = False, render: str | None = None,
         video: Path | str | None = None, max_steps: int | None = None,
         echo: Callable[[str], None] = print) -> list[tuple[float, int]]:
    """Play ``episodes`` episodes of ``policy`` (episode k reset with seed ``seed + k``), echoing one line each;
    returns ``(raw return, length in agent steps)`` per episode. An episode cut at ``max_steps`` counts its
    return so far."""
    policy.seed(seed)
    env, recorder = make_play_env(policy, seed, render, None if video is None else Path(video))
    results: list[tuple[float, int]] = []
    try:
        for k in range(episodes):
            obs, info = env.reset(seed=seed + k)
            state, reward = None, None
            total, length = 0.0, 0
            while True:
                action, state = policy.act(obs, state, deterministic, reward)
                obs, reward, terminated, truncated, info = env.step(action)
                total += float(reward)
                length += 1
                if terminated or truncated or (max_steps and length >= max_steps):
                    break
            if EPISODE_KEY in info:  # the env's own count of the game's raw return
                total = float(info[EPISODE_KEY]["r"])
            cut = "" if terminated or truncated else f" (cut at --max-steps {max_steps})"
            echo(f"episode {k + 1}: return {total:.1f}, length {length}{cut}")
            results.append((total, length))
    finally:
        if recorder is not None:
            recorder.finish()
        env.close()
    returns = [r for r, _ in results]
    episodes_text = "1 episode" if len(returns) == 1 else f"{len(returns)} episodes"
    echo(f"mean return {np.mean(returns):.1f} over {episodes_text} (min {min(returns):.1f}, max {max(returns):.1f})")
    if recorder is not None:
        echo(f"video: {video} ({recorder.frames} frames at {recorder.fps:g} fps)")
    return results


# ---- `conveyor enjoy` ----------------------------------------------------------------------------
def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--run", required=True, type=Path, metavar="DIR", help="the run's --out directory")
    parser.add_argument("--checkpoint", default="latest", metavar="N|latest|FILE",
                        help="the checkpoint to play: latest (default), the env steps N of checkpoints/ckpt-N.pt, "
                             "or a .pt file")
    parser.add_argument("--episodes", type=int, default=5, help="episodes to play (default: 5)")
    parser.add_argument("--deterministic", action="store_true",
                        help="take the policy's mode (argmax, Gaussian mean; Q heads: no exploration) instead of "
                             "sampling")
    parser.add_argument("--render", choices=["human"], default=None,
                        help="show the env in a window as it plays (render_mode human)")
    parser.add_argument("--video", type=Path, default=None, metavar="FILE.mp4",
                        help="record the episodes into one video (the env's rgb_array frames; Atari: the raw "
                             "210x160 RGB screen)")
    parser.add_argument("--seed", type=int, default=None,
                        help=f"episode k starts from env seed SEED + k (default: {EVAL_SEED_OFFSET:,} + the run's "
                             "seed, away from training's); also seeds the action sampling")
    parser.add_argument("--max-steps", type=int, default=None, metavar="N",
                        help="cut each episode after N agent steps (default: the env's own limit)")
    parser.add_argument("--device", default="cpu", help="torch device to act on (default: cpu)")
    add_env_arg_argument(parser)


def check_arguments(args: argparse.Namespace) -> None:
    if args.episodes <= 0:
        raise ConfigError(f"--episodes must be positive, got {args.episodes}")
    if args.max_steps is not None and args.max_steps <= 0:
        raise ConfigError(f"--max-steps must be positive, got {args.max_steps}")
    if args.video is not None and args.render is not None:
        raise ConfigError("--render human and --video each need the env's one render mode: choose one")
    if args.video is not None:
        if args.video.suffix.lower() not in VIDEO_SUFFIXES:
            raise ConfigError(f"--video {args.video}: name a {' or '.join(VIDEO_SUFFIXES)} file")
        check_output_file("--video", args.video)


def main(args: argparse.Namespace) -> int:
    check_arguments(args)
    policy = load_policy(args.run, args.checkpoint, args.device, env_args=tuple(args.env_args))
    seed = EVAL_SEED_OFFSET + policy.cfg.seed if args.seed is None else args.seed
    check_seeds(seed, args.episodes)
    how = "deterministic" if args.deterministic else "sampled"
    overrides = "".join(f", {key}={value!r}" for key, value in args.env_args)
    print(f"playing {args.run}: {policy.describe()}{overrides}; {how} actions, seed {seed}")
    play(policy, args.episodes, seed, deterministic=args.deterministic, render=args.render, video=args.video,
         max_steps=args.max_steps)
    return 0
