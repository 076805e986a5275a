"""SEED RL (Espeholt et al. 2020): central batched inference on the learner, thin actors over gRPC.

The learner process runs a gRPC server (``server``) with one
bidirectional stream per actor. Actors (``conveyor actor``, here or on other
machines; ``--local-actors`` of them are started by this run) only step
envs: every step they send observations and receive actions. On the
learner, three kinds of threads (paper figure 3):

1. inference: the batcher gathers steps from all streams (up to
   ``--inference-batch`` env rows or ``--inference-timeout-ms``) into one
   forward pass, keeps every env's partial unroll, and pushes finished
   ``--unroll``-step unrolls to a queue (``batcher``);
2. prefetch: builds batches of ``--batch-size`` unrolls
   (``storage.unrolls``);
3. training (this thread): V-trace updates. Parameters change under the
   inference thread's feet, so one unroll can mix policy versions; each
   step records its own, and the lag histogram shows the mix. A model with
   an LSTM core (``--lstm-size``) acts from each env slot's state; every
   unroll stores the state at its first step with ``first``, ``prev_action``
   and ``prev_reward``, and the update replays it from there
   (``acting.forward_unrolls``).

Only the parameter update and the acting forward pass hold the lock that
keeps them from interleaving.

Faults (``server``, ``inference``): an actor that
dies or disconnects loses only its envs' partial unrolls, which are never
trained on; a local actor that dies is restarted (``--max-restarts``, then
the run stops with one line) and counted once in ``restarts`` with the
steps it dropped in ``dropped_steps``. ``env_steps`` counts a step when the
unroll holding it goes to the unroll queue, so with V-trace it equals the
transitions handed to the learner (at most ``4 * batch_size`` unrolls of
them are still queued or prefetched when the run stops: the queue holds
``2 * batch_size``, the prefetch thread one batch ready and one in hand);
with R2D2 it counts distinct acted steps stored in replay. A stalled actor
costs one ``--inference-timeout-ms`` and is then left out of the batches
it holds up; the server cancels a stream it has waited on for
``--actor-idle-timeout-s``.

With ``--algo r2d2`` (``conveyor.architectures.seed.r2d2``) the policy acts epsilon-greedily
through an LSTM with per-actor epsilons, inference cuts each env's stream
into ``--seq-len`` sequences overlapping by half (each with the LSTM state it
started from), the sink is a prioritized replay on the learner, and the
training thread samples it once ``--min-replay`` sequences are stored and
writes the new priorities back after each update.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import threading
from typing import Any

from conveyor import algos
from conveyor.acting import GsdeNoise
from conveyor.architectures.seed.actor import LocalActors
from conveyor.architectures.seed.ray_actors import RayActors
from conveyor.ray_launcher import RayLauncher, check_available
from conveyor.config import RunCfg
from conveyor.errors import ConfigError
from conveyor.envs import env_spaces
from conveyor.files import write_text_atomic
from conveyor.models import make_model
from conveyor.architectures.seed.r2d2 import ReplayLearning
from conveyor.run import Run
from conveyor.storage.schema import observation_field
from conveyor.storage.unrolls import Prefetcher, UnrollQueue
from conveyor.architectures.seed.batcher import Batcher, InferenceStats
from conveyor.architectures.seed.inference import ActorCriticPolicy, CentralInference, unroll_schema
from conveyor.architectures.seed.server import (MAX_PEER_ENV_SLOTS, MAX_PEER_STREAMS, SeedServer, learner_token,
                                                 unix_socket_path)


def check_config(cfg: RunCfg) -> None:
    """Refuse what this host and the server's limits cannot run (the config's own values were checked by
    ``config.SeedFields``)."""
    if cfg.arch.launcher == "ray":
        check_available()
    if cfg.arch.listen.startswith("unix:") and len(unix_socket_path(cfg.arch.listen)) > 100:
        raise ConfigError(f"unix socket path {unix_socket_path(cfg.arch.listen)!r} is too long (unix sockets "
                          "allow about 100 characters): pick a shorter --listen unix:PATH")
    if cfg.arch.local_actors > MAX_PEER_STREAMS or cfg.arch.local_actors * cfg.env.num_envs > MAX_PEER_ENV_SLOTS:
        raise ConfigError(f"--local-actors {cfg.arch.local_actors} x --num-envs {cfg.env.num_envs} is more than one "
                          f"host may run ({MAX_PEER_STREAMS} actors, {MAX_PEER_ENV_SLOTS} envs): start fewer local "
                          "actors and the rest with `conveyor actor` on other hosts")


def run(cfg: RunCfg) -> dict[str, Any]:
    check_config(cfg)
    arch = cfg.arch
    with Run(cfg) as run:
        obs_space, action_space = env_spaces(cfg.env, cfg.seed)
        params_lock = threading.Lock()
        obs_spec = observation_field(obs_space)
        r2d2 = None
        if cfg.algo.name == "r2d2":
            env_slots = max(1, arch.local_actors) * cfg.env.num_envs  # per-actor epsilons over these
            r2d2 = ReplayLearning.build(run, obs_space, action_space, params_lock, env_slots)
            learner, policy = r2d2.learner, r2d2.policy
            unroll, overlap, sink = arch.seq_len, r2d2.replay.overlap, r2d2.sink
        else:
            learner = run.learner(make_model(cfg.model, obs_space, action_space), algos.make_loss(cfg))
            # A resumed run's noise is seeded apart from the earlier segments' (its slots count from 0 again).
            gsde = GsdeNoise.for_model(cfg.model, (cfg.seed, run.telemetry.env_steps))
            policy = ActorCriticPolicy(learner, params_lock, cfg.seed, gsde)
            unrolls = run.closing(UnrollQueue(arch.unroll, unroll_schema(policy, obs_spec).fields, 2 * arch.batch_size))
            unroll, overlap, sink = arch.unroll, 0, unrolls.put
        # Ray before the gRPC server: a local Ray forks its servers, which gRPC's threads make noisy.
        launcher = run.closing(RayLauncher(arch.ray_address, arch.ray_strategy, count=arch.local_actors,
                                           role="seed actor", out=run.out)) \
            if arch.launcher == "ray" else None
        stats = InferenceStats()
        inference = CentralInference(policy, obs_spec, unroll, cfg.algo.gamma, sink, overlap=overlap, stats=stats,
                                     on_steps=run.record_served_steps, on_episodes=run.record_served_episodes,
                                     timer=run.timer)
        batcher = run.closing(Batcher(inference.process, arch.inference_batch, arch.inference_timeout_ms / 1000.0,
                                      stats=stats))
        token = learner_token(arch.token_file, local_only=arch.local_actors > 0)
        server = run.closing(SeedServer(
            batcher, inference.release, listen=arch.listen, token=token,
            env_config_json=_env_json(run.cfg), obs_shape=obs_space.shape, obs_dtype=obs_space.dtype, base_seed=cfg.seed,
            max_message_bytes=arch.max_message_bytes, tls_cert=arch.tls_cert, tls_key=arch.tls_key, stats=stats,
            max_actor_envs=arch.max_actor_envs, idle_timeout_s=arch.actor_idle_timeout_s))
        batcher.expected_rows = lambda: server.expected_envs  # all but late streams waiting: go
        batcher.on_timeout = server.mark_late
        address = server.start()
        write_text_atomic(run.out / "learner_address", address + "\n")
        print(f"seed: learner listening on {address}; actors join with "
              f"`conveyor actor --learner {address} --num-envs N` and the token", file=sys.stderr)
        actors = None
        restarted: list[str] = []  # dead local actors whose dropped steps are not counted yet
        if launcher is not None:
            actors = RayActors(launcher, address, token, num_envs=cfg.env.num_envs, num_workers=cfg.env.num_workers,
                               tls_ca=arch.tls_cert, max_message_bytes=arch.max_message_bytes,
                               max_restarts=cfg.env.max_restarts)
        elif arch.local_actors:
            actors = run.closing(LocalActors(arch.local_actors, address, token, num_envs=cfg.env.num_envs,
                                             num_workers=cfg.env.num_workers, log_dir=run.out / "actors",
                                             tls_ca=arch.tls_cert, max_message_bytes=arch.max_message_bytes,
                                             max_restarts=cfg.env.max_restarts))
        prefetch = run.closing(r2d2 if r2d2 is not None else Prefetcher(unrolls, arch.batch_size, learner.device))
        while not run.should_stop():
            batcher.raise_if_failed()
            if actors is not None:
                restarted = _count_restarts(run, server, restarted + actors.restart_dead())
            run.telemetry.add_time("env", stats.take_env_time())
            run.telemetry.gauge("actors_connected", stats.actors_connected)
            run.telemetry.gauge("inference_batch_mean", stats.mean_batch)
            if r2d2 is not None:
                run.telemetry.gauge("replay_sequences", len(r2d2.replay))
            else:
                run.telemetry.gauge("unroll_queue", len(unrolls))
            with run.timer("wait"):
                batch = prefetch.get(timeout_s=0.2)
            if batch is None:
                run.telemetry.maybe_log()
                continue
            with run.timer("learn"):
                run.telemetry.add_lag(learner.version, batch["policy_version"].cpu().numpy())
                if r2d2 is not None:
                    metrics = r2d2.train(batch)
                else:
                    metrics, _ = learner.compute_gradients(batch)
                    with params_lock:
                        learner.apply_gradients(batch["obs"])
            run.after_update(learner, metrics)
        _count_restarts(run, server, restarted, final=True)
        return run.finish(learner, inference={**stats.summary(), "address": address})


def _count_restarts(run: Run, server: SeedServer, names: list[str], final: bool = False) -> list[str]:
    """``add_restart`` once per restarted actor, with the steps its streams dropped, as soon as the server
    has released them (``final``: now, counting what is known); returns the names still waiting."""
    waiting = []
    for name in names:
        dropped = server.take_dropped(name)
        if dropped is None and not final:
            waiting.append(name)
        else:
            run.telemetry.add_restart(dropped_steps=dropped or 0)
    return waiting


def _env_json(cfg: RunCfg) -> str:
    """The env config actors build (their own num_envs and num_workers replace these), and under ``gamma`` the
    run's discount (``EnvCfg.normalize_reward``)."""
    return json.dumps({**dataclasses.asdict(cfg.env), "gamma": cfg.algo.gamma})
