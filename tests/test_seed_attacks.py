"""The SEED server under attack (issue 21): floods without the token, oversized fields, a token holder hogging
streams and env slots, a world-readable token file, and a fuzz of the gRPC service. In every case the learner
keeps its memory and keeps serving an honest actor.

The memory test runs the server in a process of its own (``tests.seed_attack serve``, no torch) and attacks it
from threads here; the other tests run an in-process server (``tests.test_seed.LiveServer``).
"""

from __future__ import annotations

import os
import queue
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import numpy as np
import pytest

from conveyor.architectures.seed import seed_pb2, wire
from conveyor.architectures.seed.actor import _drain
from conveyor.architectures.seed.protocol import PROTOCOL_VERSION, auth_metadata, read_token
from conveyor.architectures.seed.server import MAX_NAME_BYTES, MAX_PEER_ENV_SLOTS, MAX_PEER_STREAMS
from tests.seed_attack import IdleStreams, big_names, flood, hello, raw_act, raw_channel
from tests.test_seed import TOKEN, Client, LiveServer, live, wait_until  # noqa: F401 (live: a fixture)

REPO = Path(__file__).resolve().parent.parent
MiB = 1 << 20


class Honest:
    """An actor stepping as fast as the server answers, on a thread, until ``stop``; ``steps`` counts replies."""

    def __init__(self, address: str) -> None:
        self.client = Client(address)
        self.steps = 0
        self.error: BaseException | None = None
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            while not self._done.is_set():
                assert self.client.send([[1, 0], [2, 0]]).tolist() == [1, 2]
                self.steps += 1
        except BaseException as error:  # noqa: BLE001 - reported by progressed()
            self.error = error

    def progressed(self, since: int, what: str) -> int:
        """Wait until more than ``since`` steps are done (the actor is still served); returns the count."""
        wait_until(lambda: self.steps > since or self.error is not None, timeout_s=60, what=what)
        assert self.error is None, f"the honest actor failed: {self.error!r}"
        return self.steps

    def stop(self) -> None:
        self._done.set()
        self._thread.join(30)
        self.client.close()


# ---- rows 5 and 6: memory ------------------------------------------------------------------------

@pytest.mark.slow
def test_floods_without_the_token_and_megabyte_names_leave_the_learner_memory_flat(tmp_path):
    """40 clients x 3 calls of 15 MiB without the token, 40 more with a wrong one, 30 Hellos with 10 MiB names
    and the token: each refused, the server's RSS flat, the honest actor served throughout. The server process
    returns freed large blocks to the system at once (a fixed glibc mmap threshold), so its RSS shows what it
    keeps, not what the allocator caches for reuse."""
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN)
    token_file.chmod(0o600)
    server = subprocess.Popen([sys.executable, "-m", "tests.seed_attack", "serve", "--token-file", str(token_file)],
                              cwd=REPO, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "MALLOC_MMAP_THRESHOLD_": str(128 * 1024)})
    honest = None
    try:
        address = server.stdout.readline().strip()
        assert address, "the server did not start"

        def rss_mb() -> float:
            return int(Path(f"/proc/{server.pid}/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE") / MiB

        honest = Honest(address)
        steps = honest.progressed(20, "the honest actor to start")
        start = rss_mb()
        attacks = {"no token": lambda: flood(address, clients=40, attempts=3),
                   "wrong token": lambda: flood(address, clients=40, attempts=1, token="wrong"),
                   "10 MiB names": lambda: big_names(address, TOKEN, count=30)}
        expected = {"no token": "UNAUTHENTICATED", "wrong token": "UNAUTHENTICATED", "10 MiB names": "INVALID_ARGUMENT"}
        for name, attack in attacks.items():
            before = rss_mb()
            codes = attack()
            after = rss_mb()
            print(f"{name}: learner RSS {before:.0f} MB -> {after:.0f} MB, {dict(codes)}")
            assert set(codes) == {expected[name]}, name
            assert after - start < 64, f"{name}: the learner's RSS grew from {start:.0f} to {after:.0f} MB"
            steps = honest.progressed(steps, f"the honest actor to be served after {name}")
    finally:
        if honest is not None:
            honest.stop()
        server.stdin.close()
        server.wait(30)


# ---- row 5: authentication before payload --------------------------------------------------------

def test_a_call_without_the_token_is_refused_before_its_message_is_read(live):
    """A message over --max-message-bytes without the token gets UNAUTHENTICATED, not RESOURCE_EXHAUSTED: the
    token is checked on the call's metadata before gRPC reads a message; so it is for any method name."""
    channel = raw_channel(live.address)
    try:
        oversized = hello(actor_name="x" * MiB)  # 1 MiB > the server's 64 KiB
        with pytest.raises(grpc.RpcError) as refused:
            list(raw_act(channel)(iter([oversized]), timeout=30))
        assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED and "token" in refused.value.details()
        with pytest.raises(grpc.RpcError) as refused:
            list(raw_act(channel)(iter([oversized]), metadata=auth_metadata(TOKEN), timeout=30))
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED  # with the token, gRPC reads it
        unknown = channel.stream_stream("/conveyor.seed.Seed/Other", request_serializer=None,
                                        response_deserializer=None)
        for metadata, code in ((None, grpc.StatusCode.UNAUTHENTICATED),
                               (auth_metadata(TOKEN), grpc.StatusCode.UNIMPLEMENTED)):
            with pytest.raises(grpc.RpcError) as refused:
                list(unknown(iter([b""]), metadata=metadata, timeout=30))
            assert refused.value.code() == code
        assert live.stats.counters["refused_unauthenticated"] == 2
    finally:
        channel.close()


# ---- row 6: bounded strings ----------------------------------------------------------------------

def test_a_long_actor_name_is_refused_and_a_closed_stream_leaves_nothing(live):
    channel = raw_channel(live.address)
    for name in ("x" * (MAX_NAME_BYTES + 1), "x" * 10_000):  # past the name limit; past the Hello size limit
        with pytest.raises(grpc.RpcError) as refused:
            list(raw_act(channel)(iter([hello(actor_name=name)]), metadata=auth_metadata(TOKEN), timeout=30))
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert f"at most {MAX_NAME_BYTES} bytes" in refused.value.details()
    channel.close()
    clients = [Client(live.address) for _ in range(3)]
    for client in clients:
        client.send([[1, 0], [2, 0]])
        client.close()
    server = live.server
    wait_until(lambda: live.stats.actors_connected == 0, what="the closed streams' release")
    assert not (server._streams or server._host_streams or server._host_slots or server._unreleased)
    assert server.open_envs == 0 and len(server._dropped) <= 3


# ---- row 7: per-host limits and the idle timeout --------------------------------------------------

def test_a_token_holder_cannot_lock_out_other_actors(tmp_path):
    """One host opens the most streams it may, idle, and asks for every env slot: actors from another host
    (here: the unix socket) get in at once, and once the idle streams time out, so does a restarted actor from
    the hogging host."""
    live = LiveServer(tmp_path, listen="localhost:0", also_unix=True)
    hog = greedy = honest = None
    try:
        tcp, unix = live.address, live.unix_address
        with pytest.raises(grpc.RpcError) as refused:
            Client(tcp, num_envs=4096)
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "--max-actor-envs 256" in refused.value.details()
        hog = IdleStreams(tcp, TOKEN, MAX_PEER_STREAMS)
        assert hog.first == {"WELCOME": MAX_PEER_STREAMS}
        with pytest.raises(grpc.RpcError) as refused:
            Client(tcp)
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED  # actors retry this one
        assert f"already holds {MAX_PEER_STREAMS} streams" in refused.value.details()
        honest = Honest(unix)  # another host is served while the first one is at its limit
        steps = honest.progressed(10, "the other host's actor")
        live.server.idle_timeout_s = 1.0  # the hog's streams have idled for longer than this
        wait_until(lambda: hog.ended() == {"CANCELLED": MAX_PEER_STREAMS}, timeout_s=60,
                   what="the idle streams to be cancelled")
        restarted = Client(tcp)  # the hogging host's restarted actor gets in
        restarted.send([[1, 0], [2, 0]])
        restarted.close()
        steps = honest.progressed(steps, "the other host's actor to go on")
        live.server.idle_timeout_s = 60.0
        # a closed stream's slots are released on the inference thread, after the stream ends: only then has the
        # hogging host none (the other host, a unix socket, is "unix")
        wait_until(lambda: set(live.server._host_slots) <= {"unix"}, what="the hogging host's slots to be released")
        greedy = IdleStreams(tcp, TOKEN, MAX_PEER_ENV_SLOTS // 256 + 1, num_envs=256)
        assert greedy.first == {"WELCOME": MAX_PEER_ENV_SLOTS // 256, "RESOURCE_EXHAUSTED": 1}
        with pytest.raises(grpc.RpcError) as refused:
            Client(tcp, num_envs=1)
        assert f"at most {MAX_PEER_ENV_SLOTS}" in refused.value.details()
        honest.progressed(steps, "the other host's actor to go on beside the slot hog")
    finally:
        for streams in (hog, greedy):
            if streams is not None:
                streams.close()
        if honest is not None:
            honest.stop()
        live.close()


# ---- row 13: the token file ----------------------------------------------------------------------

def test_a_token_file_others_can_read_gets_a_one_line_warning(tmp_path, capsys):
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    token_file.chmod(0o600)
    assert read_token(str(token_file)) == TOKEN
    assert capsys.readouterr().err == ""
    token_file.chmod(0o644)
    assert read_token(str(token_file)) == TOKEN
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and "0644" in err and f"chmod 600 {token_file}" in err


# ---- fuzz ----------------------------------------------------------------------------------------

DTYPES = ["<f4", "<f8", "<i8", "|b1", "|u1", ">f4", "|O", "<U4", "|V8", "", "nonsense", "<f4" * 20]
METADATA = [auth_metadata(TOKEN)] * 4 + [None, auth_metadata("wrong"), (("authorization", "Bearer"),)]


def fuzz_array(rng: np.random.Generator, message, rows: int | None) -> None:
    """Random dtype, shape and bytes; with ``rows``, a plausible float array of that many rows, some values odd."""
    if rows is not None and rng.random() < 0.5:
        values = (rng.normal(size=(rows, 2)) * 10.0 ** rng.integers(0, 6)).astype(np.float32)
        if rng.random() < 0.3:
            values[rng.integers(rows), rng.integers(2)] = rng.choice([np.nan, np.inf, -np.inf])
        wire.encode(values, message)
        return
    message.dtype = str(rng.choice(DTYPES))
    message.shape[:] = rng.integers(-2, 2**40 if rng.random() < 0.1 else 6, size=rng.integers(0, 10)).tolist()
    message.data = rng.bytes(int(rng.integers(0, 256)))


def fuzz_message(rng: np.random.Generator, env_ids: list[int] | None) -> bytes:
    """Random bytes, a Hello, a Step of random arrays, or (once welcomed) a mostly valid Step."""
    kind = rng.choice(5, p=[0.1, 0.1, 0.2, 0.3, 0.3] if env_ids else [0.2, 0.5, 0.3, 0.0, 0.0])
    if kind == 0:
        return rng.bytes(int(rng.integers(0, 512)))
    if kind == 1:
        return hello(num_envs=int(rng.choice([1, 2, 3, 0, 300, 2**32 - 1], p=[0.3, 0.3, 0.1, 0.1, 0.1, 0.1])),
                     actor_name=rng.bytes(int(rng.choice([8, 40, 400]))).decode("latin-1"),
                     protocol=int(rng.choice([PROTOCOL_VERSION, 0, 2**32 - 1], p=[0.8, 0.1, 0.1])))
    step = seed_pb2.Step(env_time_s=float(rng.choice([0.0, -1.0, np.nan, 1e300])), latency_s=float(rng.normal()))
    rows = len(env_ids) if env_ids else None
    if kind >= 3:  # mostly valid: the stream's own slots, right dtypes
        wire.encode(np.asarray(env_ids, np.int64), step.env_ids)
        wire.encode(np.full(rows, 7, np.int64), step.run_ids)
        wire.encode(rng.normal(size=rows).astype(np.float32), step.reward)
        wire.encode(rng.random(rows) < 0.3, step.terminated)
        wire.encode(np.zeros(rows, bool), step.truncated)
        wire.encode(np.zeros((0, 2), np.float32), step.final_observation)
        wire.encode(np.full(rows, np.nan, np.float32), step.episode_return)
        fuzz_array(rng, step.observation, rows)
        if kind == 4:  # one field made odd
            fuzz_array(rng, getattr(step, str(rng.choice(["env_ids", "reward", "terminated", "final_observation",
                                                          "episode_return"]))), None)
    else:
        for name in ("env_ids", "run_ids", "observation", "reward", "terminated", "truncated", "final_observation",
                     "episode_return"):
            if rng.random() < 0.7:
                fuzz_array(rng, getattr(step, name), rows)
    message = seed_pb2.ActorMessage(step=step).SerializeToString()
    return message + rng.bytes(int(rng.integers(0, 8))) if rng.random() < 0.1 else message


def fuzz_calls(address: str, seed: int, deadline: float, codes: list[str]) -> None:
    """Random calls (metadata, messages, order) until ``deadline``; each reply's kind and each call's status
    name go to ``codes``."""
    rng = np.random.default_rng(seed)
    channel = raw_channel(address)
    act = raw_act(channel)
    try:
        for _ in range(10_000):
            if time.monotonic() > deadline:
                return
            outbox: queue.Queue = queue.Queue()
            call = act(_drain(outbox), metadata=METADATA[rng.integers(len(METADATA))], timeout=1.0)
            env_ids = None
            try:
                for _ in range(int(rng.integers(1, 6))):
                    outbox.put(fuzz_message(rng, env_ids))
                    if rng.random() < 0.8:  # read the answer (else send on without reading)
                        reply = seed_pb2.LearnerMessage.FromString(next(call))
                        codes.append(reply.WhichOneof("kind"))
                        if reply.WhichOneof("kind") == "welcome":
                            env_ids = list(reply.welcome.env_ids)
                outbox.put(None)
                for _ in call:
                    pass
                codes.append("OK")
            except grpc.RpcError as error:
                codes.append(error.code().name)
            except StopIteration:
                codes.append("OK")
            finally:
                outbox.put(None)
                call.cancel()
    finally:
        channel.close()


@pytest.mark.slow  # 5 s of fuzzing; make test keeps each malformed call's own test above
def test_fuzzed_calls_never_stop_the_server_serving_an_honest_actor(live):
    """Four threads make random calls for 5 s: random bytes, random Hello and Step field values (NaN, huge
    shapes, junk dtypes), random orders, with the token, without it and with wrong ones. No call may break the
    server (UNKNOWN: an exception in its code), and the honest actor is served during and after."""
    honest = Honest(live.address)
    try:
        steps = honest.progressed(10, "the honest actor to start")
        codes: list[str] = []
        deadline = time.monotonic() + 5.0
        fuzzers = [threading.Thread(target=fuzz_calls, args=(live.address, seed, deadline, codes), daemon=True)
                   for seed in range(4)]
        for fuzzer in fuzzers:
            fuzzer.start()
        during = honest.progressed(steps, "the honest actor to be served during the fuzz")
        for fuzzer in fuzzers:
            fuzzer.join(60)
        assert not any(fuzzer.is_alive() for fuzzer in fuzzers)
        honest.progressed(max(during, honest.steps), "the honest actor to be served after the fuzz")
        print(f"{len(codes)} fuzzed calls: {dict(sorted((c, codes.count(c)) for c in set(codes)))}")
        assert "UNKNOWN" not in codes
        assert {"UNAUTHENTICATED", "INVALID_ARGUMENT", "welcome", "actions"} <= set(codes)
        assert live.server.open_envs == 2  # only the honest actor's envs are left
        fresh = Client(live.address)  # and a new actor still gets in
        fresh.send([[1, 0], [2, 0]])
        fresh.close()
    finally:
        honest.stop()
