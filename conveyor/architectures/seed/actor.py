"""``conveyor actor``: a SEED actor, a thin loop around envs that streams to a learner.

The actor knows nothing about the model. It opens one bidirectional gRPC
stream to the learner (``--learner HOST:PORT`` or ``unix:PATH``), says
Hello, builds the env the learner names in its Welcome (``--num-envs``
copies, stepped by ``--num-workers`` shared-memory worker processes), and
then loops: send every env's observation (with the previous step's reward,
terminated/truncated flags, the final observation of truncated episodes and
finished episodes' returns), receive the actions, step. Each episode gets a
random run id, so the learner can tell a continued episode from a broken one.

If the stream breaks (or the learner cancels it after waiting on it too
long), the actor retries with exponential backoff (up to ``--retry-s``
seconds without a learner) and resumes where its envs are: the learner has
dropped those envs' partial unrolls and starts new ones. Episodes go on
across a reconnect with their run ids, and their returns are counted here
(the env workers'), so a continued episode's return is whole; the first
Step of a new stream repeats the returns of the last Step that got no
reply, which the learner counts unless it already had them
(``inference``: reconnects). The envs are built
once per process, from the env config and seed of the first Welcome; a
restarted actor process builds them from its new Welcome, whose seed differs
from every earlier one (``seed.server.actor_env_seed``). A refused
token prints one line and exits 2; a learner that finished training ends
the stream with OK and the actor exits 0. SIGTERM (and Ctrl-C where the
actor is not a local one) closes the stream and the envs and exits 128 plus
the signal's number (``stop_on_signals``). An env worker that dies or hangs
(``--env-step-timeout-s``, from the learner's env config) prints one line
and exits 3. A local actor dies with the learner that started it.

``LocalActors`` starts the actor processes of ``conveyor train --arch seed``
(``--local-actors``), passing the token through the environment, and
restarts the ones that die, up to ``--max-restarts`` times per run.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Iterator

import numpy as np

from conveyor.config import EnvCfg
from conveyor.errors import ConfigError, WorkerFailure
from conveyor.files import open_append
from conveyor.architectures.seed.protocol import PROTOCOL_VERSION, auth_metadata, channel_options, read_token
from conveyor.procs import RestartBudget, SignalRelay, die_with_parent, exit_reason, reap, terminate

LOCAL_ACTOR_ENV = "CONVEYOR_LOCAL_ACTOR"
PARENT_PID_ENV = "CONVEYOR_PARENT_PID"
EXIT_REFUSED = 2
EXIT_LOST = 1
EXIT_ENVS_FAILED = 3
_MAX_BACKOFF_S = 5.0
STOP_GRACE_S = 10.0
"""After a stop signal, the seconds the actor has to close its stream and envs before it exits regardless (an env
step that hangs); its env workers die with it (``die_with_parent``)."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--learner", required=True, metavar="ADDR",
                        help="learner address: HOST:PORT or unix:PATH (printed by `conveyor train --arch seed`)")
    parser.add_argument("--num-envs", type=int, default=4, metavar="N", help="envs this actor steps (default: 4)")
    parser.add_argument("--num-workers", type=int, default=1, metavar="W",
                        help="env worker processes; must divide --num-envs (default: 1)")
    parser.add_argument("--token-file", default="", metavar="FILE",
                        help="file holding the learner's token (default: the CONVEYOR_TOKEN environment variable)")
    parser.add_argument("--tls-ca", default="", metavar="PEM",
                        help="CA certificate to verify a learner that serves TLS (--tls-cert on the learner)")
    parser.add_argument("--retry-s", type=float, default=60.0, metavar="S",
                        help="give up after this many seconds without reaching the learner (default: 60)")
    parser.add_argument("--max-message-bytes", type=int, default=16 * 1024 * 1024, metavar="N",
                        help="largest gRPC message (default: 16 MiB; match the learner's)")


def main(args: argparse.Namespace) -> int:
    if args.num_envs <= 0 or args.num_workers <= 0 or args.num_envs % args.num_workers:
        raise ConfigError(f"--num-envs ({args.num_envs}) must be a positive multiple of --num-workers "
                          f"({args.num_workers})")
    token = read_token(args.token_file)
    if not token:
        raise ConfigError("no token: pass --token-file FILE or set CONVEYOR_TOKEN to the learner's token")
    tls_ca = b""
    if args.tls_ca:
        try:
            tls_ca = Path(args.tls_ca).read_bytes()
        except OSError as error:
            raise ConfigError(f"cannot read --tls-ca {args.tls_ca} ({error.strerror})") from None
    stop_signals = [signal.SIGTERM]
    if os.environ.get(LOCAL_ACTOR_ENV):
        for sig in (signal.SIGINT, signal.SIGHUP):  # the learner handles Ctrl-C and a closed terminal, and stops us
            signal.signal(sig, signal.SIG_IGN)
        die_with_parent(int(os.environ[PARENT_PID_ENV]))  # even while an env hangs (then ours die with us)
    else:
        stop_signals.append(signal.SIGINT)
    actor = Actor(args.learner, token, args.num_envs, args.num_workers, tls_ca=tls_ca, retry_s=args.retry_s,
                  max_message_bytes=args.max_message_bytes)
    relay = stop_on_signals(actor, stop_signals)
    try:
        return actor.run()
    except WorkerFailure as error:  # an env worker died or hung: a local actor is restarted by the learner
        print(f"conveyor actor: error: {error}", file=sys.stderr)
        return EXIT_ENVS_FAILED
    finally:
        relay.close()  # waits for a stop in progress: see stop_on_signals
        actor.close()


def actor_name(pid: int, hostname: str = "") -> str:
    """The name an actor process gives the learner in its Hello (``host:pid``; ``hostname``: this host's)."""
    return f"{hostname or socket.gethostname()}:{pid}"


def stop_on_signals(actor: Actor, signals: list[signal.Signals]) -> SignalRelay:
    """Make each of ``signals`` stop ``actor`` (its ``run`` returns 128 + the signal's number), and end the
    process ``STOP_GRACE_S`` later if it has not ended by then. The relay thread calls ``actor.stop``: in the
    signal handler it would take grpc's locks, which the main thread may hold there (``SignalRelay``).

    ``actor.stop`` closes the channel, which holds grpc's locks and can wait on one for ever, so the exit
    deadline is armed first. Close the returned relay before the main thread returns: that waits for a stop in
    progress. A relay thread still inside ``channel.close`` when the interpreter finalizes is frozen there with
    grpc's lock held, and grpc's ``__del__`` then waits for that lock for ever (an actor outlived its SIGTERM
    so, by hours, in make test beside two CPU hogs)."""

    def stop_then_exit(signum: int) -> None:
        # a daemon thread: the process ends before it fires when main() returns
        deadline = threading.Timer(STOP_GRACE_S, os._exit, args=(128 + signum,))
        deadline.daemon = True
        deadline.start()
        actor.stop(signum)

    return SignalRelay(signals, stop_then_exit)


class Refused(Exception):
    """The learner refused this actor (token, protocol, capacity, malformed data): do not retry."""


class Actor:
    """One actor process: envs plus a stream to the learner that survives reconnects."""

    def __init__(self, address: str, token: str, num_envs: int, num_workers: int, *, tls_ca: bytes = b"",
                 retry_s: float = 60.0, max_message_bytes: int = 16 * 1024 * 1024) -> None:
        import grpc

        from conveyor.architectures.seed import seed_pb2_grpc

        self.address = address
        self.token = token
        self.num_envs = num_envs
        self.num_workers = num_workers
        self.retry_s = retry_s
        options = channel_options(max_message_bytes)
        if tls_ca:
            self.channel = grpc.secure_channel(address, grpc.ssl_channel_credentials(tls_ca), options=options)
        else:
            self.channel = grpc.insecure_channel(address, options=options)
        self.stub = seed_pb2_grpc.SeedStub(self.channel)
        self.name = actor_name(os.getpid())
        self.venv: Any = None
        self.env_json = ""
        self.rng = np.random.default_rng()
        self.steps = 0
        self.unanswered_returns: np.ndarray | None = None  # of the last Step sent that got no reply yet
        self.stopping = threading.Event()
        self.stop_signal = 0  # the signal's number that stop() was given

    def stop(self, signum: int) -> None:
        """Make ``run`` return 128 + ``signum``: closing the channel ends the stream the main thread waits on.
        From another thread than ``run``'s, never from a signal handler (it takes grpc's locks)."""
        self.stop_signal = signum
        self.stopping.set()
        self.channel.close()

    def run(self) -> int:
        import grpc

        lost_since: float | None = None
        backoff = 0.1
        parent = int(os.environ.get(PARENT_PID_ENV, "0"))
        while not self.stopping.is_set():
            try:
                self._session()
                if not self.stopping.is_set():
                    return 0  # the learner ended the stream with OK: training is over
            except Refused as error:
                print(f"conveyor actor: error: {error}", file=sys.stderr)
                return EXIT_REFUSED
            except grpc.RpcError as error:
                code = error.code()
                if code in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED,
                            grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.INVALID_ARGUMENT):
                    print(f"conveyor actor: error: learner {self.address} refused this actor: {error.details()}",
                          file=sys.stderr)
                    return EXIT_REFUSED
                now = time.monotonic()
                lost_since = lost_since or now
                if now - lost_since > self.retry_s:
                    print(f"conveyor actor: error: lost learner {self.address} for {self.retry_s:.0f}s "
                          f"({code.name}: {error.details()}); giving up", file=sys.stderr)
                    return EXIT_LOST
                if parent and os.getppid() != parent:
                    return EXIT_LOST  # the learner that started us is gone
                self.stopping.wait(backoff * (1.0 + random.random()))
                backoff = min(2 * backoff, _MAX_BACKOFF_S)
                continue
            finally:
                if self.steps:  # this session made progress: a later loss starts a fresh backoff
                    lost_since, backoff, self.steps = None, 0.1, 0
        return 128 + self.stop_signal

    def _session(self) -> None:
        """One stream: Hello, Welcome, then step until the stream ends (returns) or breaks (raises)."""
        import grpc

        from conveyor.architectures.seed import seed_pb2, wire

        outbox: queue.Queue[Any] = queue.Queue()
        try:
            call = self.stub.Act(_drain(outbox), metadata=auth_metadata(self.token))
        except ValueError:  # "Cannot invoke RPC on closed channel!"
            if self.stopping.is_set():
                return
            raise
        try:
            outbox.put(seed_pb2.ActorMessage(hello=seed_pb2.Hello(
                protocol=PROTOCOL_VERSION, num_envs=self.num_envs, actor_name=self.name)))
            replies = iter(call)
            welcome = next(replies).welcome
            self._ensure_envs(welcome.env_config_json, int(welcome.env_seed))
            env_ids = np.asarray(welcome.env_ids, dtype=np.int64)
            if len(env_ids) != self.num_envs:
                raise Refused(f"learner gave {len(env_ids)} env slots for {self.num_envs} envs")
            message = self._step_message(env_ids, 0.0, 0.0, None)
            sent = time.perf_counter()
            outbox.put(message)
            for reply in replies:
                latency = time.perf_counter() - sent
                self.unanswered_returns = None  # a reply: the learner has acted on (and counted) that Step
                actions = wire.decode(reply.actions.action, "action", length=self.num_envs)
                start = time.perf_counter()
                result = self.venv.step(actions)
                env_time = time.perf_counter() - start
                self.steps += 1
                message = self._step_message(env_ids, env_time, latency, result)
                sent = time.perf_counter()
                outbox.put(message)
        except StopIteration:  # the stream closed before Welcome
            if self.stopping.is_set():
                return
            raise Refused("the learner closed the stream before welcoming this actor") from None
        except grpc.RpcError:
            if self.stopping.is_set():
                return  # stop() closed the channel under this stream
            raise
        finally:
            outbox.put(None)
            call.cancel()

    def _ensure_envs(self, env_json: str, seed: int) -> None:
        """Build the learner's env (again only when the learner names a different one)."""
        from conveyor.envs import make_vector_env

        if self.venv is not None and env_json == self.env_json:
            return
        self.close()
        try:
            fields = json.loads(env_json)
            gamma = fields.pop("gamma", None)
            fields["env_args"] = tuple(tuple(kv) for kv in fields.get("env_args", ()))
            fields.update(num_envs=self.num_envs, num_workers=self.num_workers)
            cfg = EnvCfg(**fields)
        except (ValueError, TypeError, ConfigError) as error:
            raise Refused(f"the learner's env config is unusable: {error}") from None
        self.venv = make_vector_env(cfg, seed, gamma=gamma)
        self.env_json = env_json
        self.obs = self.venv.reset()
        self.run_ids = self._new_run_ids(self.num_envs)
        self.unanswered_returns = None  # of other envs' episodes

    def _new_run_ids(self, count: int) -> np.ndarray:
        return self.rng.integers(0, np.iinfo(np.int64).max, size=count, dtype=np.int64)

    def _step_message(self, env_ids: np.ndarray, env_time: float, latency: float, result: Any) -> Any:
        """The Step for the current observations; ``result`` is the env step that produced them (None on a
        stream's first Step, whose reward and flags the learner ignores and whose returns are those of the last
        Step that got no reply, if any)."""
        from conveyor.architectures.seed import seed_pb2, wire

        k = self.num_envs
        if result is None:
            reward, terminated, truncated = np.zeros(k, np.float32), np.zeros(k, bool), np.zeros(k, bool)
            final_obs = self.obs[:0]
            returns = self.unanswered_returns if self.unanswered_returns is not None else np.full(k, np.nan, np.float32)
        else:
            self.obs = result.obs
            reward, terminated, truncated = result.reward, result.terminated, result.truncated
            final_obs = result.final_obs[truncated & ~terminated]
            returns = np.array(result.episode_return, np.float32)  # a copy: the workers reuse their buffers
            self.unanswered_returns = returns if not np.isnan(returns).all() else None
            ended = terminated | truncated
            if ended.any():
                self.run_ids[ended] = self._new_run_ids(int(ended.sum()))
        step = seed_pb2.Step(env_time_s=env_time, latency_s=latency)
        wire.encode(env_ids, step.env_ids)
        wire.encode(self.run_ids, step.run_ids)
        wire.encode(self.obs, step.observation)
        wire.encode(np.asarray(reward, np.float32), step.reward)
        wire.encode(np.asarray(terminated, bool), step.terminated)
        wire.encode(np.asarray(truncated, bool), step.truncated)
        wire.encode(final_obs, step.final_observation)
        wire.encode(np.asarray(returns, np.float32), step.episode_return)
        return seed_pb2.ActorMessage(step=step)

    def close(self) -> None:
        if self.venv is not None:
            self.venv.close()
            self.venv = None


def _drain(outbox: queue.Queue[Any]) -> Iterator[Any]:
    """The request stream: messages from ``outbox`` until None."""
    while True:
        message = outbox.get()
        if message is None:
            return
        yield message


class LocalActors:
    """The actor processes ``conveyor train --arch seed`` starts itself; restarts ones that die.

    ``restart_dead`` (called by the training loop) starts a new process for each dead one, up to
    ``max_restarts`` over the run (``EnvCfg.max_restarts``; 0: never), and returns the dead processes'
    actor names, with which the learner finds the steps they dropped (``SeedServer.take_dropped``).
    One death more stops the run with a one-line ``WorkerFailure``.
    """

    def __init__(self, count: int, address: str, token: str, *, num_envs: int, num_workers: int,
                 log_dir: Path, tls_ca: str = "", max_message_bytes: int = 16 * 1024 * 1024,
                 max_restarts: int = 10) -> None:
        self.address = address
        self.num_envs = num_envs
        # ``-m conveyor.architectures.seed.actor`` rather than ``conveyor actor``: the CLI imports torch, an actor never needs it.
        self.args = [sys.executable, "-m", "conveyor.architectures.seed.actor", "--learner", address,
                     "--num-envs", str(num_envs), "--num-workers", str(num_workers), "--retry-s", "30",
                     "--max-message-bytes", str(max_message_bytes)]
        if tls_ca:
            self.args += ["--tls-ca", tls_ca]
        self.env = {**os.environ, "CONVEYOR_TOKEN": token, LOCAL_ACTOR_ENV: "1", PARENT_PID_ENV: str(os.getpid()),
                    "OMP_NUM_THREADS": "1"}
        self.log_dir = Path(log_dir)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.restart_budget = RestartBudget(max_restarts)
        self.processes: list[subprocess.Popen] = []
        for index in range(count):
            self.processes.append(self._start(index))

    def _start(self, index: int) -> subprocess.Popen:
        with open_append(self.log_dir / f"actor-{index}.log") as log:
            return subprocess.Popen(self.args, env=self.env, stdin=subprocess.DEVNULL, stdout=log, stderr=log)

    def restart_dead(self) -> list[str]:
        """Start a new process for every actor that exited; returns the dead ones' actor names. Raises
        ``WorkerFailure`` when that would exceed ``max_restarts``."""
        dead = []
        for index, process in enumerate(self.processes):
            if process.poll() is None:
                continue
            self.restart_budget.spend(f"local actor {index} (pid {process.pid}, {self.num_envs} envs, log "
                                      f"{self.log_dir / f'actor-{index}.log'}) died ({exit_reason(process.returncode)})")
            self.processes[index] = self._start(index)
            dead.append(actor_name(process.pid))
        return dead

    def close(self) -> None:
        terminate(self.processes)
        reap(self.processes)


if __name__ == "__main__":
    _parser = argparse.ArgumentParser(prog="conveyor actor", description=__doc__.splitlines()[0])
    add_arguments(_parser)
    try:
        sys.exit(main(_parser.parse_args()))
    except ConfigError as _error:
        print(f"conveyor actor: error: {_error}", file=sys.stderr)
        sys.exit(EXIT_REFUSED)
