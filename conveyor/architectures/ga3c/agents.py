"""GA3C's agent processes: the pool the learner starts, restarts and stops, and the agent loop.

Agents are plain ``subprocess`` children (``agent_main``) that import neither
torch nor the parent's ``__main__``; their spec arrives as JSON on stdin.
They ignore SIGINT (the parent stops them), stop cleanly between steps when
their ``stop`` flag is set (with no request outstanding), stop at once on the
``shutdown`` flag, and exit by themselves when the parent dies (end of file on
the reply pipe, or ``conveyor.procs.parent_gone``).

``AgentPool.check`` (the learner's main loop, every 0.1 s) tells deaths from
deliberate stops (``stop``: autotune removing agents; ``close``: the end of
the run; a death while ``ending()``, e.g. a SIGTERM to the process group,
counts as a stop): a dead agent is detached and restarted at once with the
same id, up to ``max_restarts`` restarts per run in all (the architecture
passes ``cfg.env.max_restarts``; the default here, 0, never restarts), each
reported through ``on_restart(dropped_steps)``. The death that would need
one restart more raises ``WorkerFailure`` (``conveyor.procs.RestartBudget``):
one line naming the agent, its pid, its exit reason and the fix. An agent whose env's ``make`` or
``reset`` raises (a ``step`` that raises only cuts the episode) writes why into its ``message`` row before it
exits: the line names the env and the call and ends with the exception's last line, and the traceback reaches
the run's ``errors.log`` (``WorkerFailure.details``). An agent
whose env has been in one call (make, reset, step) for longer than
``env_step_timeout_s`` (it stamps ``env_call_since``) is killed as hung and
counts as dead.

Seeds. Every episode is seeded: the ``e``-th episode played under agent id
``a`` (counted over all processes that held the id, in the shared
``episodes`` counter) starts with ``reset(seed=conveyor.envs.episode_seed(
cfg.seed, a, e))``. A restarted agent therefore goes on with the id's next
episode: it never replays an episode whose start its predecessor already
sent for training, and the episodes of each id are the same in every run.
"""

from __future__ import annotations

import os
import select
import subprocess
import sys
import time
import traceback
from typing import Any, Callable

import numpy as np

from conveyor.architectures.ga3c.queues import INDEX_DTYPE, Channels, IndexPipe, Reply
from conveyor.envs.shm_worker import EnvRaised, read_message, write_error, write_message
from conveyor.errors import error_line
from conveyor.procs import (CLOSE_GRACE_S, RestartBudget, array_specs_from_json, child_prologue, exit_reason,
                            parent_gone, reap, start_child)
from conveyor.storage.shm import SharedArrays

_AGENT_ENTRY = "from conveyor.architectures.ga3c.agents import agent_main; agent_main()"
_POLL_MS = 500
FAILED_EXIT = 1
"""An agent's exit code after an error it reported in its ``message`` row."""


class AgentPool:
    """Starts, stops, watches and restarts agent processes, each holding one agent id of ``channels``.

    ``max_restarts`` bounds the restarts of dead agents over the run (0: a death raises ``WorkerFailure``);
    ``on_restart(dropped_steps)`` is called once per restart; ``ending()`` true means the run is ending,
    and an agent that dies then is only reaped; ``env_step_timeout_s`` (0: none) is how long an agent's env
    may spend in one call before the agent is killed as hung. ``abandoned_steps`` counts the steps that agents
    stopped on purpose (``stop``, ``close``) had written into segments they never finished.
    """

    def __init__(self, channels: Channels, cfg_dict: dict[str, Any], base_seed: int, *, max_restarts: int = 0,
                 on_restart: Callable[[int], Any] | None = None, ending: Callable[[], bool] | None = None,
                 env_step_timeout_s: float = 0.0):
        self.channels = channels
        self.env_step_timeout_s = env_step_timeout_s
        self.hung_pids: set[int] = set()
        """Agents killed as hung (their deaths say so)."""
        self.cfg_dict = cfg_dict
        self.base_seed = base_seed
        self.restart_budget = RestartBudget(max_restarts)
        self.on_restart = on_restart or (lambda dropped_steps: None)
        self.ending = ending or (lambda: False)
        self.started = 0
        self.dropped_steps = 0
        self.abandoned_steps = 0
        self.processes: dict[int, subprocess.Popen] = {}
        """Running agents by id, oldest first."""
        self.stopping: dict[int, subprocess.Popen] = {}
        """Agents asked to stop, until they have exited."""
        self.free_ids = list(range(channels.num_ids))

    def __len__(self) -> int:
        return len(self.processes)

    def resize(self, count: int) -> None:
        while len(self.processes) < count:
            self.start()
        while len(self.processes) > count:
            self.stop(next(reversed(self.processes)))

    def start(self) -> int:
        deadline = time.monotonic() + CLOSE_GRACE_S
        while not self.free_ids:  # wait for an agent that was asked to stop to give its id back
            if not self.stopping or time.monotonic() > deadline:
                raise RuntimeError(f"all {self.channels.num_ids} GA3C agent ids are in use")
            time.sleep(0.01)
            self.check()
        agent = self.free_ids.pop(0)
        self._launch(agent)
        return agent

    def _launch(self, agent: int) -> None:
        """Start a process holding id ``agent`` (free: no other process holds it, nothing is attached)."""
        channels = self.channels
        channels["stop"][agent] = False
        channels["env_call_since"][agent] = 0.0
        channels["message"][agent] = 0
        reply_read, reply_write = os.pipe()
        spec = {"cfg": self.cfg_dict, "seed": self.base_seed, **channels.agent_spec(agent, reply_read)}
        try:
            process = start_child(_AGENT_ENTRY, spec, (*channels.agent_fds(), reply_read))
        except BaseException:
            os.close(reply_write)
            raise
        finally:
            os.close(reply_read)
        channels.reply_fds[agent] = reply_write
        self.processes[agent] = process
        self.started += 1

    def stop(self, agent: int) -> None:
        """Ask ``agent`` to stop after its current step; its id is reused once it has exited."""
        self.channels["stop"][agent] = True
        self.stopping[agent] = self.processes.pop(agent)

    def check(self) -> None:
        """Kill hung agents; reap agents that stopped when asked; restart those that died (raise past
        ``max_restarts``)."""
        self._kill_hung()
        for agent, process in list(self.stopping.items()):
            if process.poll() is None:
                continue
            del self.stopping[agent]
            self.abandoned_steps += self.channels.detach(agent)
            self.free_ids.append(agent)
        for agent, process in list(self.processes.items()):
            if process.poll() is None:
                continue
            if self.ending():
                del self.processes[agent]
                self.abandoned_steps += self.channels.detach(agent)
                self.free_ids.append(agent)
                continue
            if process.pid in self.hung_pids:
                how = (f"hung: an env call did not return for {self.env_step_timeout_s:g} s "
                       "(--env-step-timeout-s; raise it if the env is that slow); killed it")
                details = ""
            else:
                line, details = read_message(self.channels["message"][agent])  # an agent that failed says why
                how = f"died ({exit_reason(process.returncode)})" + (f": {line}" if line else "")
            self.restart_budget.spend(f"GA3C agent {agent} (pid {process.pid}) {how}", details)
            dropped = self.channels.detach(agent)
            self.dropped_steps += dropped
            self._launch(agent)
            self.on_restart(dropped)

    def _kill_hung(self) -> None:
        """Kill the agents (running, or asked to stop) whose env call has lasted over ``env_step_timeout_s``."""
        since, now = self.channels["env_call_since"], time.monotonic()
        for agent, process in [*self.processes.items(), *self.stopping.items()]:
            began = since[agent]
            if self.env_step_timeout_s and began and now - began > self.env_step_timeout_s and process.poll() is None:
                process.kill()
                process.wait()
                self.hung_pids.add(process.pid)

    def pids(self) -> list[int]:
        return [p.pid for p in (*self.processes.values(), *self.stopping.values())]

    def close(self) -> None:
        """Stop every agent at once (politely, then by force) and take back their slots; idempotent."""
        self.channels["shutdown"][0] = True
        everyone = {**self.processes, **self.stopping}
        reap(list(everyone.values()))
        for agent in everyone:
            self.abandoned_steps += self.channels.detach(agent)
        self.processes.clear()
        self.stopping.clear()


class AgentLink:
    """Agent side of the protocol, for agent id ``spec["agent"]``; see the module docstring."""

    def __init__(self, spec: dict[str, Any]):
        self.agent = int(spec["agent"])
        self.shared = SharedArrays(array_specs_from_json(spec["specs"]), spec["shm_fd"])
        self.reply_fd = spec["reply_fd"]
        pipes = spec["pipes"]
        self.requests = IndexPipe(tuple(pipes["requests"]))
        self.free_segments = IndexPipe(tuple(pipes["free_segments"]))
        self.full_segments = IndexPipe(tuple(pipes["full_segments"]))
        self.seq = int(self.shared["request_seq"][self.agent])
        self.segments_pushed = 0
        self._poller = select.poll()
        self._poller.register(self.reply_fd, select.POLLIN)

    def __getitem__(self, name: str) -> np.ndarray:
        return self.shared[name]

    def stop_requested(self) -> bool:
        return bool(self.shared["stop"][self.agent] or self.shared["shutdown"][0])

    def orphaned(self) -> bool:
        return bool(self.shared["shutdown"][0]) or parent_gone()

    def predict(self, obs: np.ndarray) -> Reply | None:
        """The answer for ``obs``; None when the run shuts down (or the parent died) first."""
        a, shared = self.agent, self.shared
        shared["obs"][a] = obs
        self.seq += 1
        shared["request_seq"][a] = self.seq  # after the observation: a predictor reads them in the other order
        start = time.perf_counter()
        self.requests.put(a)
        while shared["reply_seq"][a] != self.seq:
            if not self._poller.poll(_POLL_MS):
                if self.orphaned():
                    return None
                continue
            if not os.read(self.reply_fd, 64):  # end of file: the parent is gone
                return None
        shared["wait_time_s"][a] += time.perf_counter() - start
        return Reply(shared["action"][a].copy(), float(shared["logp"][a]), float(shared["value"][a]),
                     int(shared["version"][a]))

    def acquire_segment(self) -> int | None:
        """Claim a free segment slot (see the module docstring); None when asked to stop first."""
        a, shared = self.agent, self.shared
        record = shared["holding"][a:a + 1]
        while True:
            try:
                claimed = os.readv(self.free_segments.read_fd, [record]) == INDEX_DTYPE.itemsize
            except BlockingIOError:  # none free, or another agent was quicker
                claimed = False
            if claimed:
                break
            if self.stop_requested() or self.orphaned():
                return None
            self.free_segments.wait(_POLL_MS / 1000)
        slot = int(record[0])
        shared["seg_steps"][slot] = 0
        shared["holding_gen"][a] = shared["seg_gen"][slot]
        return slot

    def push_segment(self, slot: int) -> None:
        a, shared = self.agent, self.shared
        shared["seg_agent"][slot] = a
        shared["seg_number"][slot] = self.segments_pushed
        self.segments_pushed += 1
        self.full_segments.put(slot)
        shared["holding"][a] = -1  # first: (slot, no generation) would read as claimed and unwritten
        shared["holding_gen"][a] = -1

    def close(self) -> None:
        self.shared.close()


def run_agent(env: Any, env_id: str, link: AgentLink, unroll: int, seed: int | None = None) -> None:
    """Play ``env`` (made from ``env_id``) in segments of ``unroll`` steps until asked to stop. With ``seed`` (the
    run's), episode ``e`` of this agent id starts with ``reset(seed=episode_seed(seed, agent, e))``; without,
    unseeded resets. A step that raises cuts the episode and is counted; a reset that raises ends the agent
    (``EnvRaised``)."""
    from conveyor.envs import EPISODE_KEY, episode_seed

    a = link.agent
    steps, env_time, env_errors, episodes = link["steps"], link["env_time_s"], link["env_errors"], link["episodes"]
    seg_steps, since = link["seg_steps"], link["env_call_since"]

    def reset() -> tuple[Any, dict]:
        episode = int(episodes[a])
        episodes[a] = episode + 1  # before any step of it is written: a successor never repeats it
        since[a] = time.monotonic()
        try:
            started = env.reset(seed=episode_seed(seed, a, episode)) if seed is not None else env.reset()
        except Exception as error:
            raise EnvRaised(f"env {a} ({env_id}) raised on reset: {error_line(error)}") from error
        since[a] = 0.0
        return started

    obs, _ = reset()
    slot, t = link.acquire_segment(), 0
    while slot is not None and not link.stop_requested():
        reply = link.predict(obs)
        if reply is None:
            break
        link["seg_obs"][slot, t] = obs
        link["seg_actions"][slot, t] = reply.action
        link["seg_behaviour_logp"][slot, t] = reply.logp
        link["seg_behaviour_value"][slot, t] = reply.value
        link["seg_policy_version"][slot, t] = reply.version
        start = time.perf_counter()
        action = reply.action.item() if reply.action.ndim == 0 else reply.action
        since[a] = time.monotonic()
        try:
            next_obs, reward, terminated, truncated, info = env.step(action)
        except Exception:  # an env bug must not stop the run: cut the episode, reset, and count it
            print(f"conveyor GA3C agent {a}: env {a} ({env_id}) raised on step:\n{traceback.format_exc()}",
                  file=sys.stderr)
            env_errors[a] += 1
            next_obs, reward, terminated, truncated, info = obs, 0.0, False, True, {}
        since[a] = 0.0
        episode = info.get(EPISODE_KEY)
        if terminated or truncated:
            link["seg_final_obs"][slot, t] = next_obs
            next_obs, reset_info = reset()
            episode = episode or reset_info.get(EPISODE_KEY)
        env_time[a] += time.perf_counter() - start
        link["seg_env_rewards"][slot, t] = reward
        link["seg_terminated"][slot, t] = terminated
        link["seg_truncated"][slot, t] = truncated
        link["seg_episode_return"][slot, t] = episode["r"] if episode else np.nan
        steps[a] += 1
        seg_steps[slot] = t + 1  # step t is written whole
        obs, t = next_obs, t + 1
        if t == unroll:
            link["seg_obs"][slot, t] = obs
            link.push_segment(slot)
            slot, t = link.acquire_segment(), 0
    # A slot still held goes back to the free pool when the learner detaches this agent.


def agent_main() -> None:
    """Entry point of an agent process: JSON spec on stdin, then ``run_agent`` until stopped."""
    spec = child_prologue()
    from conveyor.config import RunCfg
    from conveyor.envs import episode_seed, make_env

    cfg = RunCfg.from_dict(spec["cfg"])
    link = AgentLink(spec)
    agent, seed = link.agent, int(spec["seed"])
    message = link["message"][agent]  # what failed, for the learner's line about this agent's death
    link["env_call_since"][agent] = time.monotonic()
    try:
        env = make_env(cfg.env, episode_seed(seed, agent, int(link["episodes"][agent])), cfg.algo.gamma)
    except Exception as error:
        write_message(message, f"building its env ({cfg.env.id}) failed: {error_line(error)}", traceback.format_exc())
        link.close()
        sys.exit(FAILED_EXIT)
    link["env_call_since"][agent] = 0.0
    try:
        run_agent(env, cfg.env.id, link, cfg.arch.unroll, seed)
    except Exception as error:
        write_error(message, error)  # the traceback goes to the run's errors.log, not to the terminal
        sys.exit(FAILED_EXIT)
    finally:
        env.close()
        link.close()
