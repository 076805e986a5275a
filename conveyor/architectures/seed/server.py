"""The learner's gRPC server for SEED actors: one bidirectional stream per actor.

Authentication comes before any payload: a server interceptor checks the
token (``authorization: Bearer <token>`` call metadata, constant-time
compare) when a call arrives, and refuses a call without it with
UNAUTHENTICATED before a single message of it is read, so an unauthenticated
client costs the learner no message memory however large what it sends.

A stream starts with the actor's ``Hello``; the server gives the stream env
slots and answers ``Welcome`` (slots, env config, env seed). Each following
``Step`` is validated (``wire.decode``: dtypes, shapes, row counts, the
stream's own slots; rewards and float observations finite) and submitted to
the ``Batcher``; the reply carries that step's actions. A malformed step ends
only its own stream (INVALID_ARGUMENT); gRPC refuses messages over
``max_message_bytes`` (RESOURCE_EXHAUSTED). When a stream ends for any
reason its slots are released through the batcher, after any of its steps
still queued, which drops only those envs' partial unrolls. When the learner
finishes, open streams end with status OK, which tells actors that training
is over.

Limits, so that one token holder cannot lock the others out: an actor (one
stream) takes at most ``max_actor_envs`` env slots (more: INVALID_ARGUMENT);
one client host holds at most ``MAX_PEER_STREAMS`` streams and
``MAX_PEER_ENV_SLOTS`` env slots, half of the learner's, and all hosts
together ``MAX_STREAMS`` and ``MAX_ENV_SLOTS`` (over a limit:
RESOURCE_EXHAUSTED, which actors retry); a Hello's ``actor_name`` is at most
``MAX_NAME_BYTES``. A stream keeps nothing of its messages between steps.

Env seeds: the stream that gets slots ``s, s+1, ...`` is the ``life``-th
to start at slot ``s`` and its Welcome carries
``actor_env_seed(base_seed, s, life)`` (a hash of the three). Slots go to
the lowest free ones, so the same run seed gives the same slot blocks the
same seeds whatever order actors connect in, and an actor restarted onto
its old slots (or any others) never repeats an earlier life's seed.

Slow and stalled actors: the batcher expects a request from every open
stream (``expected_envs``) but waits at most ``--inference-timeout-ms``.
When a batch closes on that deadline (``mark_late``), the streams with no
request waiting are late and no longer expected until they send again; so
a stalled actor costs one timeout, and the others are served at full rate.
A stream the learner has waited on for ``idle_timeout_s``
(``--actor-idle-timeout-s``: no Hello, or no next Step after a reply) is
cancelled (CANCELLED; counted as ``streams_closed_idle``), which releases its slots
and drops its partial unrolls; a live actor reconnects and goes on. The
learner taking long never counts: a stream waiting for its reply is never idle.

Reconnects: each Step goes to the batcher with its stream's actor name
and whether it is the stream's first, with which central inference
matches a reconnected actor's episodes to its earlier stream's (continued,
or cut: ``inference``).

``take_dropped(name)`` tells the run how many steps the streams of an actor
(named by its Hello: ``host:pid``) lost, once they are all released, so a
restarted local actor's dropped steps are counted with its restart; the
counts of the last ``_MAX_ENDED_NAMES`` actors that dropped steps are kept.
"""

from __future__ import annotations

import collections
import hmac
import secrets
import sys
import threading
import time
from concurrent import futures
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

import grpc
import numpy as np
from google.protobuf.message import DecodeError

from conveyor.config import ArchCfg
from conveyor.errors import ConfigError
from conveyor.architectures.seed import seed_pb2, wire
from conveyor.architectures.seed.protocol import (AUTH_KEY, KEEPALIVE_MS, PROTOCOL_VERSION, TOKEN_ENV, channel_options,
                                                  read_token)
from conveyor.architectures.seed.batcher import Batcher, EnvSteps, InferenceStats

CLOSE_GRACE_S = 5.0
"""How long ``SeedServer.close`` lets open streams run to their next message (an actor's env step) before it
cancels them."""
SERVICE = "conveyor.seed.Seed"
MAX_STREAMS = 256
"""Concurrent actor streams (each holds one server thread while open); more are refused."""
MAX_ENV_SLOTS = 4096
"""Env slots over all actors; the learner keeps a partial unroll per slot, so this bounds its memory."""
MAX_PEER_STREAMS = MAX_STREAMS // 2
"""Streams one client host (IP address; all unix socket clients together) may hold open."""
MAX_PEER_ENV_SLOTS = MAX_ENV_SLOTS // 2
"""Env slots the streams of one client host may hold."""
MAX_NAME_BYTES = 256
"""Longest ``actor_name`` (UTF-8) a Hello may carry."""
MAX_HELLO_BYTES = 1024
"""Largest serialized Hello: a bigger one is refused before any of its fields is read."""
_POLL_S = 0.1
_MAX_ENDED_NAMES = 4096
LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "::1")


def actor_env_seed(base_seed: int, first_slot: int, life: int) -> int:
    """The env seed of the ``life``-th stream (from 0) whose env slots start at ``first_slot``, in a run
    seeded ``base_seed`` (a 32-bit hash of all three; see the module docstring)."""
    return int(np.random.SeedSequence((base_seed, first_slot, life)).generate_state(1)[0])


def learner_token(token_file: str, local_only: bool) -> str:
    """The learner's token: the configured one, else a fresh random one when all actors are local."""
    token = read_token(token_file)
    if token:
        return token
    if local_only:
        return secrets.token_urlsafe(32)
    raise ConfigError(f"remote actors need a shared token: pass --token-file FILE or set {TOKEN_ENV}")


def unix_socket_path(address: str) -> str:
    """The file of a ``unix:PATH`` or ``unix:///PATH`` address; '' for TCP addresses."""
    if address.startswith("unix://"):
        return address[len("unix://"):]
    return address[len("unix:"):] if address.startswith("unix:") else ""


def peer_host(context: grpc.ServicerContext) -> str:
    """The client host of a call: its peer without the port (``ipv4:10.0.0.2``; ``unix`` for unix sockets)."""
    peer = context.peer()
    return peer.rpartition(":")[0] or peer


def server_options(max_message_bytes: int, keepalive_ms: int = KEEPALIVE_MS) -> list[tuple[str, int]]:
    """``channel_options`` plus the server's acceptance of the actors' pings. By default a gRPC server takes a
    ping on a connection with no data flowing more often than every 5 minutes as a strike, and answers the
    third with GOAWAY "too_many_pings": an actor held back while the learner trains (R2D2 paces its actors by
    the replay ratio) lost its stream after 30 s of silence and was restarted."""
    return channel_options(max_message_bytes, keepalive_ms) + [
        ("grpc.http2.min_recv_ping_interval_without_data_ms", keepalive_ms // 2),
        ("grpc.http2.max_ping_strikes", 0)]


class SlotAllocator:
    """Env slot ids: each stream gets the lowest free ones (a restarted actor gets its old ones back)."""

    def __init__(self, capacity: int = MAX_ENV_SLOTS) -> None:
        self.capacity = capacity
        self._free = list(range(capacity))
        self._lock = threading.Lock()

    def allocate(self, count: int) -> list[int] | None:
        with self._lock:
            if count > len(self._free):
                return None
            self._free.sort()
            slots, self._free = self._free[:count], self._free[count:]
            return slots

    def free(self, slots: list[int]) -> None:
        with self._lock:
            self._free.extend(slots)


@dataclass(eq=False)
class _Stream:
    """The server's view of one open stream (guarded by ``SeedServer._lock``)."""

    context: Any
    idle_since: float  # monotonic: since when the learner waits on this stream
    host: str
    name: str = ""
    slots: list[int] = field(default_factory=list)
    waiting: bool = False  # a step of it is with the batcher
    late: bool = False  # missed a batch's deadline: not expected until it sends again
    cancelled: bool = False


class TokenCheck(grpc.ServerInterceptor):
    """Lets through only calls whose metadata carry ``authorization: Bearer <token>`` (constant-time compare);
    any other call, whatever its method, is answered UNAUTHENTICATED before any of its messages is read."""

    def __init__(self, token: str, stats: InferenceStats) -> None:
        self._expected = f"Bearer {token}".encode()
        self._stats = stats
        self._refuse = grpc.stream_stream_rpc_method_handler(self._refused)

    def intercept_service(self, continuation: Callable[[Any], Any], details: grpc.HandlerCallDetails) -> Any:
        for key, value in details.invocation_metadata or ():
            if key == AUTH_KEY:
                given = value.encode() if isinstance(value, str) else bytes(value)
                if hmac.compare_digest(given, self._expected):
                    return continuation(details)
                break
        self._stats.count("refused_unauthenticated")
        return self._refuse

    @staticmethod
    def _refused(request_iterator: Iterator[Any], context: grpc.ServicerContext) -> Iterator[Any]:
        context.abort(grpc.StatusCode.UNAUTHENTICATED,
                      f"the learner refused this actor's token: give the actor the learner's token "
                      f"(--token-file FILE or {TOKEN_ENV})")


class SeedServer:
    """gRPC server of one learner (see the module docstring).

    ``release(slots)`` is called on the inference thread when a stream ends
    (``CentralInference.release``; it may return the steps it dropped);
    ``env_config_json`` and the env seed (``actor_env_seed``) tell actors what
    to run; ``obs_shape``/``obs_dtype`` fix what a step must carry;
    ``max_actor_envs`` and ``idle_timeout_s`` are ``ArchCfg``'s. Wire the
    batcher to it with ``batcher.expected_rows = lambda: server.expected_envs``
    and ``batcher.on_timeout = server.mark_late``.
    """

    def __init__(self, batcher: Batcher, release: Callable[[list[int]], int | None], *, listen: str, token: str,
                 env_config_json: str, obs_shape: tuple[int, ...], obs_dtype: np.dtype, base_seed: int,
                 max_message_bytes: int, tls_cert: str = "", tls_key: str = "",
                 stats: InferenceStats | None = None, max_actor_envs: int = ArchCfg.max_actor_envs,
                 idle_timeout_s: float = ArchCfg.actor_idle_timeout_s) -> None:
        if not token:
            raise ConfigError(f"the SEED server needs a token: pass --token-file FILE or set {TOKEN_ENV}")
        self.batcher = batcher
        self.release = release
        self.listen = listen
        self.env_config_json = env_config_json
        self.obs_shape = tuple(obs_shape)
        self.obs_dtype = np.dtype(obs_dtype)
        self.base_seed = base_seed
        self.max_message_bytes = max_message_bytes
        self.stats = stats or InferenceStats()
        self.max_actor_envs = max_actor_envs
        self.idle_timeout_s = idle_timeout_s
        self.slots = SlotAllocator()
        self._lives: collections.Counter[int] = collections.Counter()  # streams started per first slot
        self._closing = threading.Event()
        self._lock = threading.Lock()
        self._streams: set[_Stream] = set()
        self._host_streams: collections.Counter[str] = collections.Counter()
        self._host_slots: collections.Counter[str] = collections.Counter()  # until the slots are released
        self._unreleased: collections.Counter[str] = collections.Counter()  # per actor name
        self._dropped: collections.OrderedDict[str, int] = collections.OrderedDict()  # per actor name
        self._watchdog: threading.Thread | None = None
        self.address = ""
        self._rpc_threads = futures.ThreadPoolExecutor(max_workers=MAX_STREAMS + 4, thread_name_prefix="seed-rpc")
        self._server = grpc.server(self._rpc_threads, options=server_options(max_message_bytes),
                                   interceptors=[TokenCheck(token, self.stats)], maximum_concurrent_rpcs=MAX_STREAMS)
        # Requests arrive as bytes and are parsed in serve_stream: a Hello's size is checked before parsing, and
        # bytes that do not parse end their stream with a message (gRPC would log a traceback for each).
        act = grpc.stream_stream_rpc_method_handler(self.serve_stream,
                                                    response_serializer=seed_pb2.LearnerMessage.SerializeToString)
        self._server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, {"Act": act}),))
        self._tls = (tls_cert, tls_key) if tls_cert else None

    # ---- lifecycle -----------------------------------------------------------------------
    def start(self) -> str:
        """Bind and serve; returns the address actors should dial (the real port when ``:0`` was asked)."""
        host, sep, port = self.listen.rpartition(":")
        if not self.listen.startswith("unix:") and (not sep or not port.isdigit() or not host):
            raise ConfigError(f"--listen {self.listen!r} is not HOST:PORT or unix:PATH: use e.g. localhost:0")
        try:
            if self._tls:
                cert, key = (Path(p).read_bytes() for p in self._tls)
                credentials = grpc.ssl_server_credentials([(key, cert)])
                bound = self._server.add_secure_port(self.listen, credentials)
            else:
                bound = self._server.add_insecure_port(self.listen)
        except (RuntimeError, OSError) as error:
            raise ConfigError(f"cannot listen on {self.listen} ({error}): pick a free port or another "
                              "address with --listen") from None
        if not bound:
            raise ConfigError(f"cannot listen on {self.listen}: pick a free port or another address with --listen")
        self.address = self.listen if self.listen.startswith("unix:") else f"{host}:{bound}"
        if not self._tls and host.strip("[]") not in LOOPBACK_HOSTS and not self.listen.startswith("unix:"):
            print(f"seed: warning: listening on {self.address} without TLS: the token and all data travel in "
                  "clear text; pass --tls-cert and --tls-key", file=sys.stderr)
        self._server.start()
        self._watchdog = threading.Thread(target=self._watch, name="seed-idle-watchdog", daemon=True)
        self._watchdog.start()
        return self.address

    def close(self, grace_s: float = CLOSE_GRACE_S) -> None:
        """End every stream with OK (actors take it as 'training finished') and stop serving.

        A stream ends with OK at its next message: at once for a step waiting for actions, after the actor's
        env step for one whose actor is stepping. A stream still open ``grace_s`` after the call is cancelled,
        and its actor takes that for a lost learner (it retries, then exits 1), so the grace must outlast an
        actor's env step on a busy machine; streams that end sooner do not make the learner wait."""
        self._closing.set()
        self._server.stop(grace_s).wait(grace_s + 5.0)
        self._rpc_threads.shutdown(wait=False)  # grpc leaves its executor's idle threads alive otherwise
        if self._watchdog is not None:
            self._watchdog.join(timeout=5.0)
        path = unix_socket_path(self.listen)
        if path:
            Path(path).unlink(missing_ok=True)

    # ---- what the batcher waits for --------------------------------------------------------
    @property
    def open_envs(self) -> int:
        """Env rows of all open streams."""
        with self._lock:
            return sum(len(stream.slots) for stream in self._streams)

    @property
    def expected_envs(self) -> int:
        """Env rows of the open streams worth waiting for: all but the late ones (``mark_late``)."""
        with self._lock:
            return sum(len(stream.slots) for stream in self._streams if stream.waiting or not stream.late)

    def mark_late(self) -> None:
        """A batch closed on its deadline: every stream with no step waiting is late until it sends one."""
        with self._lock:
            for stream in self._streams:
                if not stream.waiting:
                    stream.late = True

    def _watch(self) -> None:
        """Cancel streams the learner has waited on for longer than ``idle_timeout_s``."""
        poll_s = min(1.0, max(0.01, self.idle_timeout_s / 4))
        while not self._closing.wait(poll_s):
            now = time.monotonic()
            with self._lock:
                idle = [stream for stream in self._streams if not stream.waiting and not stream.cancelled
                        and now - stream.idle_since > self.idle_timeout_s]
                for stream in idle:
                    stream.cancelled = True
            for stream in idle:
                self.stats.count("streams_closed_idle")
                stream.context.cancel()  # its request iterator raises: serve_stream ends and releases

    # ---- dropped steps per actor -----------------------------------------------------------
    def take_dropped(self, actor_name: str) -> int | None:
        """Steps dropped with the released streams of the actor named ``actor_name`` (taken: a second call
        says 0); None while one of its streams is open or not yet released. An actor that never connected
        dropped 0."""
        with self._lock:
            if self._unreleased.get(actor_name, 0) > 0:
                return None
            return self._dropped.pop(actor_name, 0)

    # ---- one actor stream ----------------------------------------------------------------
    def serve_stream(self, request_iterator: Iterator[Any], context: grpc.ServicerContext) -> Iterator[Any]:
        stream = _Stream(context, time.monotonic(), peer_host(context))
        with self._lock:
            admitted = self._host_streams[stream.host] < MAX_PEER_STREAMS
            if admitted:
                self._streams.add(stream)
                self._host_streams[stream.host] += 1
        if not admitted:
            self.stats.count("refused_host_streams")
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                          f"client host {stream.host} already holds {MAX_PEER_STREAMS} streams, the most one host may "
                          "(half the learner's): end idle streams there or run actors on more hosts")
        try:
            yield from self._serve(stream, request_iterator, context)
        except grpc.RpcError:
            if not stream.cancelled:  # cancelled by the watchdog: end quietly; anything else is gRPC's
                raise
        finally:
            with self._lock:
                self._streams.discard(stream)
                _decrement(self._host_streams, stream.host)
            if stream.slots:
                slots, name, host = stream.slots, stream.name, stream.host

                def release() -> None:  # the actor counts as connected until its slots are free again
                    dropped = self.release(slots) or 0
                    self.slots.free(slots)
                    self.stats.connected(-1, -len(slots))
                    with self._lock:
                        _decrement(self._host_slots, host, len(slots))
                        _decrement(self._unreleased, name)
                        if dropped:
                            self._dropped[name] = self._dropped.pop(name, 0) + dropped
                        while len(self._dropped) > _MAX_ENDED_NAMES:  # names nobody asks for (remote actors)
                            self._dropped.popitem(last=False)

                self.batcher.call_soon(release)

    def _serve(self, stream: _Stream, request_iterator: Iterator[Any], context: grpc.ServicerContext) -> Iterator[Any]:
        num_envs, name = self._read_hello(request_iterator, context)
        slots = self._allocate(stream.host, num_envs, context)
        expected = np.asarray(slots, dtype=np.int64)
        with self._lock:
            life = self._lives[slots[0]]
            self._lives[slots[0]] += 1
            stream.name, stream.slots = name, slots
            stream.idle_since = time.monotonic()
            self._unreleased[stream.name] += 1
        self.stats.connected(1, len(slots))
        yield seed_pb2.LearnerMessage(welcome=seed_pb2.Welcome(
            env_ids=slots, env_config_json=self.env_config_json,
            env_seed=actor_env_seed(self.base_seed, slots[0], life)))
        start = True
        for data in request_iterator:
            # A closing learner ends the stream here, on a message, while the actor waits to read: right after
            # a reply the actor is writing its next step, and a connection closed under that write (the server
            # stops once no call is left) turned the OK into UNAVAILABLE, so the actor retried, then exited 1.
            if self._closing.is_set():
                return
            reply = self._act(stream, self._parse(data, context), expected, context, start)
            start = False
            del data  # hold nothing of a step while the actor steps its envs (or idles)
            if reply is None:
                return
            yield reply

    def _read_hello(self, request_iterator: Iterator[Any], context: grpc.ServicerContext) -> tuple[int, str]:
        """The stream's Hello, checked: (its num_envs, its actor_name)."""
        data = next(request_iterator, None)
        if data is not None and len(data) > MAX_HELLO_BYTES:
            self.stats.count("refused_malformed")
            context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                          f"a first message of {len(data)} bytes where a Hello of at most {MAX_HELLO_BYTES} is "
                          f"expected: name the actor host:pid (at most {MAX_NAME_BYTES} bytes)")
        first = None if data is None else self._parse(data, context)
        if first is None or first.WhichOneof("kind") != "hello":
            self.stats.count("refused_malformed")
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "a stream must start with Hello")
        hello = first.hello
        if hello.protocol != PROTOCOL_VERSION:
            self.stats.count("refused_protocol")
            context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                          f"actor speaks protocol {hello.protocol}, the learner {PROTOCOL_VERSION}: "
                          "run the same conveyor version on both")
        name_bytes = len(hello.actor_name.encode())
        if name_bytes > MAX_NAME_BYTES:
            self.stats.count("refused_malformed")
            context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                          f"actor_name has {name_bytes} bytes; the learner takes at most {MAX_NAME_BYTES} bytes: "
                          "name the actor host:pid")
        row_bytes = 2 * int(np.prod(self.obs_shape, dtype=np.int64)) * self.obs_dtype.itemsize + 64
        max_envs = min(self.max_actor_envs, MAX_PEER_ENV_SLOTS, max(1, self.max_message_bytes // row_bytes))
        if not 1 <= hello.num_envs <= max_envs:
            self.stats.count("refused_malformed")
            context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                          f"an actor may run 1 to {max_envs} envs (the learner's --max-actor-envs "
                          f"{self.max_actor_envs}, one host's {MAX_PEER_ENV_SLOTS} env slots, and a step must fit "
                          f"--max-message-bytes {self.max_message_bytes}), got {hello.num_envs}: "
                          "start the actor with fewer --num-envs")
        return hello.num_envs, hello.actor_name

    def _allocate(self, host: str, num_envs: int, context: grpc.ServicerContext) -> list[int]:
        """``num_envs`` free env slots for a stream from ``host``, within its host's share and the learner's."""
        with self._lock:
            held = self._host_slots[host]
            if held + num_envs <= MAX_PEER_ENV_SLOTS:
                self._host_slots[host] += num_envs
        if held + num_envs > MAX_PEER_ENV_SLOTS:
            self.stats.count("refused_host_slots")
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                          f"client host {host} holds {held} env slots and asks for {num_envs} more; one host may "
                          f"hold at most {MAX_PEER_ENV_SLOTS} (half the learner's): run actors on more hosts")
        slots = self.slots.allocate(num_envs)
        if slots is None:
            with self._lock:
                _decrement(self._host_slots, host, num_envs)
            self.stats.count("refused_no_slots")
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                          f"the learner has no {num_envs} free env slots (at most {MAX_ENV_SLOTS} envs over "
                          "all actors): start this actor with fewer --num-envs")
        return slots

    def _parse(self, data: bytes, context: grpc.ServicerContext) -> Any:
        """The ``ActorMessage`` in ``data``; bytes that are not one end the stream (INVALID_ARGUMENT)."""
        try:
            return seed_pb2.ActorMessage.FromString(data)
        except DecodeError:
            self.stats.count("refused_malformed")
            context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                          f"a message of {len(data)} bytes that is not a SEED ActorMessage: run `conveyor actor`")

    def _act(self, stream: _Stream, message: Any, env_ids: np.ndarray, context: grpc.ServicerContext,
             start: bool = False) -> Any:
        """The reply (actions) to one step message (``start``: the stream's first); None when the learner closes or
        the stream went away."""
        steps = self._decode_step(message, env_ids, context)
        steps.actor, steps.stream_start = stream.name, start
        with self._lock:
            stream.waiting, stream.late = True, False
        pending = self.batcher.submit(steps, len(env_ids))
        while not pending.wait(_POLL_S):
            if self._closing.is_set() or not context.is_active():
                return None
        with self._lock:
            stream.waiting, stream.idle_since = False, time.monotonic()
        if pending.error is not None:
            if self._closing.is_set() or self.batcher.closed:
                return None
            context.abort(grpc.StatusCode.INTERNAL, f"the learner failed to act: {pending.error!r}")
        reply = seed_pb2.LearnerMessage()
        wire.encode(pending.result, reply.actions.action)
        return reply

    def _decode_step(self, message: Any, env_ids: np.ndarray, context: grpc.ServicerContext) -> EnvSteps:
        try:
            if message.WhichOneof("kind") != "step":
                raise wire.WireError("expected a Step after Hello")
            step, k = message.step, len(env_ids)
            ids = wire.decode(step.env_ids, "env_ids", dtype=np.int64, tail=(), length=k)
            if not np.array_equal(ids, env_ids):
                raise wire.WireError("env_ids are not the slots the learner gave this stream")
            terminated = wire.decode(step.terminated, "terminated", dtype=np.bool_, tail=(), length=k)
            truncated = wire.decode(step.truncated, "truncated", dtype=np.bool_, tail=(), length=k)
            episode_return = wire.decode(step.episode_return, "episode_return", dtype=np.float32, tail=(), length=k)
            if np.isinf(episode_return).any():  # NaN means "no episode ended here"
                raise wire.WireError("episode_return holds infinity")
            steps = EnvSteps(
                env_ids=ids,
                run_ids=wire.decode(step.run_ids, "run_ids", dtype=np.int64, tail=(), length=k),
                obs=wire.decode(step.observation, "observation", dtype=self.obs_dtype, tail=self.obs_shape, length=k,
                                finite=True),
                reward=wire.decode(step.reward, "reward", dtype=np.float32, tail=(), length=k, finite=True),
                terminated=terminated,
                truncated=truncated,
                final_obs=wire.decode(step.final_observation, "final_observation", dtype=self.obs_dtype,
                                      tail=self.obs_shape, length=int((truncated & ~terminated).sum()), finite=True),
                episode_return=episode_return,
            )
        except wire.WireError as error:
            self.stats.count("refused_malformed")
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"malformed Step: {error}")
        if step.latency_s > 0:
            self.stats.add_actor_latency(step.latency_s)
        if step.env_time_s > 0:
            self.stats.add_env_time(step.env_time_s)
        return steps


def _decrement(counter: collections.Counter[str], key: str, amount: int = 1) -> None:
    """Take ``amount`` from ``counter[key]``, forgetting the key at zero."""
    counter[key] -= amount
    if counter[key] <= 0:
        del counter[key]
