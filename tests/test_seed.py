"""SEED RL: wire format, partial unrolls, batching, the gRPC server's refusals, actors, learning.

Server tests run an in-process server with a deterministic fake policy (the
action is read off the observation), so each request's answer is checkable.
Actor tests run real ``conveyor actor`` processes against it.
"""

from __future__ import annotations

import dataclasses
import json
import os
import queue
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import numpy as np
import pytest
import torch

from conveyor.architectures.seed.actor import STOP_GRACE_S, _drain
from conveyor.config import EnvCfg
from conveyor.storage.schema import FieldSpec
from conveyor.storage.unrolls import PartialUnrolls, UnrollQueue
from conveyor.architectures.seed import seed_pb2, seed_pb2_grpc, wire
from conveyor.architectures.seed.batcher import Batcher, EnvSteps, InferenceStats
from conveyor.architectures.seed.inference import ActInput, ActOutput, CentralInference
from conveyor.architectures.seed.protocol import PROTOCOL_VERSION, auth_metadata
from conveyor.architectures.seed.server import SeedServer

REPO = Path(__file__).resolve().parent.parent
TOKEN = "test-token-1234"
torch.set_num_threads(1)


def wait_until(condition, timeout_s=60.0, what="condition"):
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


# ---- generated code ------------------------------------------------------------------------------

def test_checked_in_grpc_code_matches_the_proto(tmp_path):
    """Regenerate with the command at the top of seed.proto into a temp dir; the files must be equal."""
    from grpc_tools import protoc

    command = ["protoc", f"-I{REPO}", f"--python_out={tmp_path}", f"--grpc_python_out={tmp_path}",
               str(REPO / "conveyor/architectures/seed/seed.proto")]
    assert protoc.main(command) == 0
    for name in ("seed_pb2.py", "seed_pb2_grpc.py"):
        fresh = (tmp_path / "conveyor/architectures/seed" / name).read_text()
        assert fresh == (REPO / "conveyor/architectures/seed" / name).read_text(), (
            f"{name} is stale: regenerate it with the command at the top of conveyor/architectures/seed/seed.proto")
    assert "grpc_tools.protoc -I. --python_out=. --grpc_python_out=. conveyor/architectures/seed/seed.proto" in \
        (REPO / "conveyor/architectures/seed/seed.proto").read_text()



def test_declared_grpc_and_protobuf_bounds_match_the_generated_stubs():
    """The stubs raise at import on a runtime older than the one that generated them (grpcio) or of another
    major version (protobuf): pyproject's lower bounds must be those versions, and the pins must satisfy them."""
    import re
    import tomllib

    deps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    bound = {re.split(r"[<>=]", d)[0]: d for d in deps}
    grpc_stub = (REPO / "conveyor/architectures/seed/seed_pb2_grpc.py").read_text()
    grpc_generated = re.search(r"GRPC_GENERATED_VERSION = '([\d.]+)'", grpc_stub).group(1)
    pb2 = (REPO / "conveyor/architectures/seed/seed_pb2.py").read_text()
    major, minor, patch = re.search(r"Domain.PUBLIC,\s*(\d+),\s*(\d+),\s*(\d+),", pb2).groups()
    assert bound["grpcio"] == f"grpcio>={grpc_generated}"
    assert bound["protobuf"] == f"protobuf>={major}.{minor}.{patch},<{int(major) + 1}"
    pins = dict(line.split("==") for line in (REPO / "constraints.txt").read_text().splitlines()
                if "==" in line and not line.startswith("#"))
    as_tuple = lambda v: tuple(int(x) for x in v.split("."))  # noqa: E731
    assert as_tuple(pins["grpcio"]) >= as_tuple(grpc_generated)
    assert as_tuple(pins["protobuf"])[0] == int(major) and as_tuple(pins["protobuf"]) >= (int(major), int(minor), int(patch))


# ---- wire ----------------------------------------------------------------------------------------

def test_wire_round_trips_arrays_and_rejects_bad_ones():
    for array in (np.arange(12, dtype=np.float32).reshape(3, 4), np.array([True, False]),
                  np.arange(6, dtype=np.uint8).reshape(1, 2, 3), np.array([1, 2], dtype=">i8")):
        back = wire.decode(wire.encode(array, seed_pb2.Array()), "x")
        assert back.dtype.byteorder != ">" and np.array_equal(back, array) and back.shape == array.shape
    good = wire.encode(np.zeros((2, 4), np.float32), seed_pb2.Array())
    assert wire.decode(good, "x", dtype=np.float32, tail=(4,), length=2).shape == (2, 4)
    bad = {
        "dtype <i8 where <f4": dict(dtype=np.float32, message=wire.encode(np.zeros(2, np.int64), seed_pb2.Array())),
        "shape (2, 4) where [n, 3]": dict(tail=(3,), message=good),
        "2 rows where 5": dict(length=5, message=good),
        "bytes do not hold": dict(message=seed_pb2.Array(dtype="<f4", shape=[3], data=b"\0" * 11)),
        "not a little-endian": dict(message=seed_pb2.Array(dtype="|O", shape=[1], data=b"\0" * 8)),
        "unknown dtype": dict(message=seed_pb2.Array(dtype="nonsense", shape=[1], data=b"")),
        "a scalar": dict(message=seed_pb2.Array(dtype="<f4", shape=[], data=b"\0" * 4)),
        "invalid shape": dict(message=seed_pb2.Array(dtype="<f4", shape=[-1], data=b"")),
        "x holds NaN or infinity": dict(finite=True, message=wire.encode(np.array([1, np.nan], np.float32),
                                                                          seed_pb2.Array())),
    }
    for expected, kwargs in bad.items():
        with pytest.raises(wire.WireError, match=re.escape(expected)):
            wire.decode(kwargs.pop("message"), "x", **kwargs)
    with pytest.raises(wire.WireError):
        wire.encode(np.array(["text"]), seed_pb2.Array())
    assert wire.decode(wire.encode(np.array([np.inf]), seed_pb2.Array()), "x").tolist() == [np.inf]  # unless asked
    assert wire.decode(wire.encode(np.array([7]), seed_pb2.Array()), "x", finite=True).tolist() == [7]


# ---- partial unrolls and the queue ---------------------------------------------------------------

FIELDS = {"obs": FieldSpec((), torch.float32, "obs"), "actions": FieldSpec((), torch.int64, "step"),
          "h": FieldSpec((2,), torch.float32, "start")}


def drive(unrolls, slot, t):
    """One step of ``slot`` at time t: observation t (and its state), then the action 10 t."""
    index = torch.tensor([slot])
    unrolls.write("obs", index, torch.tensor([float(t)]))
    unrolls.write("h", index, torch.tensor([[t, -t]], dtype=torch.float32))
    unrolls.emit_full(index)
    unrolls.write("actions", index, torch.tensor([10 * t]))
    unrolls.advance(index)


@pytest.mark.parametrize("overlap", [0, 2])
def test_partial_unrolls_emit_full_unrolls_sharing_the_boundary(overlap):
    got = []
    unrolls = PartialUnrolls(4, FIELDS, lambda slot, u: got.append((slot, {k: v.clone() for k, v in u.items()})),
                             overlap=overlap, initial_slots=1)
    unrolls.grow(4)
    for t in range(12):
        drive(unrolls, 3, t)
    stride = 4 - overlap
    starts = list(range(0, 12 - 4, stride))
    assert [slot for slot, _ in got] == [3] * len(starts)
    for start, (_, unroll) in zip(starts, got):
        assert unroll["obs"].tolist() == [float(t) for t in range(start, start + 5)]  # T + 1 observations
        assert unroll["actions"].tolist() == [10 * t for t in range(start, start + 4)]
        assert unroll["h"].tolist() == [start, -start]  # the state the unroll starts from


def test_partial_unroll_reset_drops_only_that_slot():
    got = []
    unrolls = PartialUnrolls(3, FIELDS, lambda slot, u: got.append(slot), initial_slots=2)
    for t in range(2):
        drive(unrolls, 0, t)
        drive(unrolls, 1, t)
    assert unrolls.reset(torch.tensor([0])) == 1
    assert torch.isnan(unrolls.buffers["obs"][0]).all() and unrolls.steps(0) == 0 and unrolls.steps(1) == 2
    for t in range(2, 4):
        drive(unrolls, 0, t)
        drive(unrolls, 1, t)
    assert got == [1]


def test_unroll_queue_batches_time_major_and_recycles_slots():
    q = UnrollQueue(2, FIELDS, capacity=2)
    for i in range(4):
        unroll = {"obs": torch.full((3,), float(i)), "actions": torch.full((2,), i), "h": torch.tensor([i, i + 0.5])}
        assert q.put(0, unroll)
        if i % 2:
            batch = q.get_batch(2)
            assert batch["obs"].shape == (3, 2) and batch["actions"].shape == (2, 2) and batch["h"].shape == (2, 2)
            assert batch["obs"][0].tolist() == [i - 1, i]
    q.close()
    assert q.get_batch(1) is None and not q.put(0, unroll)


# ---- batcher -------------------------------------------------------------------------------------

def test_batcher_answers_every_request_with_its_own_reply_under_concurrency():
    stats = InferenceStats()
    batches = []

    def process(requests):
        batches.append(sum(len(r) for r in requests))
        return [r * 2 + 1 for r in requests]

    batcher = Batcher(process, max_rows=8, timeout_s=0.002, stats=stats)
    errors = []

    def client(c):
        for i in range(40):
            request = np.array([c, i, c * 1000 + i])
            pending = batcher.submit(request, rows=len(request))
            assert pending.wait(30.0)
            if not np.array_equal(pending.result, request * 2 + 1):
                errors.append((c, i, pending.result))

    threads = [threading.Thread(target=client, args=(c,)) for c in range(12)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60.0)
    batcher.close()
    assert not errors and sum(batches) == 12 * 40 * 3
    assert max(batches) <= 8  # never more rows than --inference-batch (each request has 3)
    assert stats.summary()["inference_batch"]["forwards"] == len(batches)


def test_batcher_runs_control_calls_in_order_and_reports_failures():
    order = []
    batcher = Batcher(lambda requests: [order.append(r) or r for r in requests], max_rows=4, timeout_s=0.0)
    first = batcher.submit("a", 1)
    batcher.call_soon(lambda: order.append("release"))
    second = batcher.submit("b", 1)
    assert first.wait(10) and second.wait(10)
    assert order == ["a", "release", "b"]
    broken = Batcher(lambda requests: 1 / 0, max_rows=4, timeout_s=0.0)
    pending = broken.submit("x", 1)
    assert pending.wait(10) and isinstance(pending.error, ZeroDivisionError)
    with pytest.raises(RuntimeError, match="inference thread failed"):
        broken.raise_if_failed()
    batcher.close()
    broken.close()


def test_a_batcher_closed_with_requests_queued_refuses_them_and_its_thread_ends():
    """Requests still queued at close get an error, not an empty ``process`` call in a loop that never ends
    (a leaked inference thread spinning on the GIL slowed every later test of its pytest worker)."""
    gate, calls = threading.Event(), []

    def process(requests):
        calls.append(len(requests))
        assert gate.wait(30.0)
        return requests

    batcher = Batcher(process, max_rows=1, timeout_s=0.0, name="closed-with-requests-queued")
    first = batcher.submit("a", 1)
    wait_until(lambda: calls, what="the first batch to be in process")
    second = batcher.submit("b", 1)  # queued behind the batch in process
    closer = threading.Thread(target=batcher.close)
    closer.start()
    wait_until(lambda: batcher.closed, what="the batcher to close")
    gate.set()
    closer.join(30.0)
    assert first.wait(10.0) and first.result == "a"
    assert second.wait(10.0) and "shutting down" in str(second.error)
    assert calls == [1] and batcher.failure is None
    assert not any(thread.name == "closed-with-requests-queued" for thread in threading.enumerate())


# ---- central inference ---------------------------------------------------------------------------

class EchoPolicy:
    """Action = int(obs[0]); value of a final observation = obs[1]; an optional counting 'recurrent state'."""

    action_spec = FieldSpec((), torch.int64)
    step_fields = ("behaviour_logp",)

    def __init__(self, recurrent=False):
        self.state_fields = {"count": FieldSpec((), torch.float32, "start")} if recurrent else {}
        self.version = 0
        self.seen_first = []

    def initial_state(self, n):
        return (torch.zeros(n),) if self.state_fields else ()

    def act(self, inputs: ActInput) -> ActOutput:
        self.seen_first.append(inputs.first.clone())
        state = (inputs.state[0] + 1,) if self.state_fields else ()
        return ActOutput(inputs.obs[:, 0].long(), self.version, {"behaviour_logp": -inputs.obs[:, 0]}, state)

    def bootstrap_values(self, inputs: ActInput):
        return inputs.obs[:, 1]


def env_steps(slots, obs, reward=None, terminated=None, truncated=None, final_obs=None, run_ids=None):
    k = len(slots)
    return EnvSteps(np.asarray(slots, np.int64), np.asarray(run_ids if run_ids is not None else [7] * k, np.int64),
                    np.asarray(obs, np.float32), np.asarray(reward if reward is not None else [0.0] * k, np.float32),
                    np.asarray(terminated if terminated is not None else [False] * k),
                    np.asarray(truncated if truncated is not None else [False] * k),
                    np.asarray(final_obs if final_obs is not None else np.zeros((0, 2)), np.float32),
                    np.full(k, np.nan, np.float32))


def test_central_inference_builds_unrolls_with_targets_versions_and_truncation_bootstrap():
    got = []
    policy = EchoPolicy()
    inference = CentralInference(policy, FieldSpec((2,), torch.float32, "obs"), unroll=3, gamma=0.5,
                                 sink=lambda slot, u, stored: got.append((slot, {k: v.clone() for k, v in u.items()})))
    # Two envs in two requests; env 1 is truncated after its 2nd step (final obs value 4), env 0 terminates.
    replies = inference.process([env_steps([0], [[1, 0]]), env_steps([1], [[2, 0]])])
    assert [r.tolist() for r in replies] == [[1], [2]]
    policy.version = 1
    inference.process([env_steps([0, 1], [[3, 0], [4, 0]], reward=[1, 2])])
    policy.version = 2
    inference.process([env_steps([0, 1], [[5, 0], [6, 0]], reward=[3, 4], terminated=[True, False],
                                 truncated=[False, True], final_obs=[[9, 4]], run_ids=[8, 8])])
    assert got == []
    inference.process([env_steps([0, 1], [[7, 0], [8, 0]], reward=[5, 6], run_ids=[8, 8])])
    assert [slot for slot, _ in got] == [0, 1]
    u0, u1 = got[0][1], got[1][1]
    assert u0["obs"][:, 0].tolist() == [1, 3, 5, 7] and u0["actions"].tolist() == [1, 3, 5]
    assert u0["rewards"].tolist() == [1, 3, 5] and u0["discounts"].tolist() == [0.5, 0.0, 0.5]
    assert u0["first"].tolist() == [True, False, True, False]
    assert u0["policy_version"].tolist() == [0, 1, 2]  # one unroll, three policies
    assert u0["behaviour_logp"].tolist() == [-1, -3, -5]
    # Truncated: reward 4 + gamma * V(final obs) = 4 + 0.5 * 4, discount 0.
    assert u1["rewards"].tolist() == [2, 4 + 0.5 * 4, 6] and u1["discounts"].tolist() == [0.5, 0.0, 0.5]
    assert not any(torch.isnan(u["rewards"]).any() for _, u in got)


def test_central_inference_drops_partial_unrolls_on_release_and_on_broken_run_ids():
    got = []
    stats = InferenceStats()
    policy = EchoPolicy(recurrent=True)
    inference = CentralInference(policy, FieldSpec((2,), torch.float32, "obs"), unroll=2, gamma=0.9,
                                 sink=lambda slot, u, stored: got.append((slot, {k: v.clone() for k, v in u.items()})),
                                 stats=stats)
    inference.process([env_steps([0, 1], [[1, 0], [1, 0]])])
    inference.release([0])  # env 0's actor went away mid-unroll
    inference.process([env_steps([0, 1], [[2, 0], [2, 0]])])
    # Env 1 continues under another run id without an episode end: the learner missed something.
    inference.process([env_steps([0, 1], [[3, 0], [3, 0]], run_ids=[7, 99])])
    inference.process([env_steps([0, 1], [[4, 0], [4, 0]], run_ids=[7, 99])])
    assert stats.counters["partial_unrolls_dropped"] == 2 and stats.counters["discontinuities"] == 1
    assert [(slot, u["obs"][:, 0].tolist()) for slot, u in got] == [(0, [2, 3, 4])]
    # The recurrent state restarted with each new episode start and the unroll records its start state.
    assert got[0][1]["count"].item() == 0 and got[0][1]["prev_action"].tolist() == [0, 2, 3]
    assert policy.seen_first[-1].tolist() == [False, False] and policy.seen_first[2].tolist() == [False, True]


# ---- the gRPC server -----------------------------------------------------------------------------

CARTPOLE_JSON = json.dumps(dataclasses.asdict(EnvCfg(id="CartPole-v1")))


class LiveServer:
    """An in-process SEED server around a fake policy, as the learner wires it. ``also_unix``: it serves a unix
    socket (``unix_address``) too, a second client 'host' beside a TCP ``listen``."""

    def __init__(self, tmp_path, *, obs_shape=(2,), unroll=5, listen="", max_message_bytes=1 << 16,
                 env_json=CARTPOLE_JSON, tls=None, also_unix=False):
        self.unrolls = []
        self.stats = InferenceStats()
        self.policy = EchoPolicy()
        self.inference = CentralInference(self.policy, FieldSpec(obs_shape, torch.float32, "obs"), unroll, 0.9,
                                          lambda slot, u, stored: self.unrolls.append(slot), stats=self.stats)
        self.batcher = Batcher(self.inference.process, 64, 0.002, stats=self.stats)
        self.server = SeedServer(self.batcher, self.inference.release, listen=listen or f"unix:{tmp_path}/s.sock",
                                 token=TOKEN, env_config_json=env_json, obs_shape=obs_shape, obs_dtype=np.float32,
                                 base_seed=0, max_message_bytes=max_message_bytes, stats=self.stats,
                                 tls_cert=tls[0] if tls else "", tls_key=tls[1] if tls else "")
        self.batcher.expected_rows = lambda: self.server.open_envs
        if also_unix:
            self.unix_address = f"unix:{tmp_path}/also.sock"
            self.server._server.add_insecure_port(self.unix_address)
        self.address = self.server.start()

    def close(self, grace_s=0.5):
        self.server.close(grace_s)
        self.batcher.close()

    def crash(self):
        """Go away without ending the streams with OK (a learner that died, not one that finished)."""
        self.server._server.stop(None).wait(10)
        self.batcher.close()


@pytest.fixture
def live(tmp_path):
    server = LiveServer(tmp_path)
    yield server
    server.close()


class Client:
    """A raw stream, to send exactly what a test wants."""

    def __init__(self, address, num_envs=2, token=TOKEN, credentials=None):
        options = [("grpc.max_send_message_length", 1 << 22)]
        self.channel = (grpc.secure_channel(address, credentials, options=options) if credentials
                        else grpc.insecure_channel(address, options=options))
        self.outbox = queue.Queue()
        metadata = auth_metadata(token) if token is not None else None
        self.call = seed_pb2_grpc.SeedStub(self.channel).Act(_drain(self.outbox), metadata=metadata)
        self.replies = iter(self.call)
        self.outbox.put(seed_pb2.ActorMessage(hello=seed_pb2.Hello(protocol=PROTOCOL_VERSION, num_envs=num_envs)))
        self.welcome = next(self.replies).welcome
        self.env_ids = np.array(self.welcome.env_ids, np.int64)

    def send(self, obs, run_ids=None, obs_dtype=np.float32, **fields):
        k = len(self.env_ids)
        step = seed_pb2.Step()
        arrays = {"env_ids": self.env_ids, "run_ids": np.asarray(run_ids if run_ids is not None else [7] * k, np.int64),
                  "observation": np.asarray(obs, obs_dtype), "reward": np.zeros(k, np.float32),
                  "terminated": np.zeros(k, bool), "truncated": np.zeros(k, bool),
                  "final_observation": np.zeros((0, np.shape(obs)[1]), obs_dtype),
                  "episode_return": np.full(k, np.nan, np.float32), **fields}
        for name, array in arrays.items():
            wire.encode(array, getattr(step, name))
        self.outbox.put(seed_pb2.ActorMessage(step=step))
        return wire.decode(next(self.replies).actions.action, "action")

    def close(self):
        self.outbox.put(None)
        self.call.cancel()
        self.channel.close()


def test_streams_get_their_own_actions_under_concurrency(live):
    errors = []

    def actor(c):
        client = Client(live.address, num_envs=3)
        for t in range(30):
            obs = [[c * 100 + t * 3 + e, 0] for e in range(3)]
            actions = client.send(obs)
            if actions.tolist() != [row[0] for row in obs]:
                errors.append((c, t, actions))
        client.close()

    threads = [threading.Thread(target=actor, args=(c,)) for c in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert not errors
    assert len(live.unrolls) == 6 * 3 * ((30 - 1) // 5)


@pytest.mark.parametrize("token", [None, "wrong-token"])
def test_wrong_or_missing_token_is_refused_and_others_keep_being_served(live, token):
    good = Client(live.address)
    good.send([[1, 0], [2, 0]])
    with pytest.raises(grpc.RpcError) as refused:
        Client(live.address, token=token)
    assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert "token" in refused.value.details()
    assert good.send([[3, 0], [4, 0]]).tolist() == [3, 4]
    assert live.stats.counters["refused_unauthenticated"] == 1
    good.close()


def test_malformed_or_oversized_steps_end_only_their_own_stream(live):
    good = Client(live.address)
    bad_messages = {
        "dtype": dict(obs=[[1, 0], [2, 0]], obs_dtype=np.float64),
        "shape": dict(obs=[[1, 0, 0], [2, 0, 0]]),
        "slots": dict(obs=[[1, 0], [2, 0]], env_ids=np.array([100, 101])),
        "final": dict(obs=[[1, 0], [2, 0]], truncated=np.array([True, False])),
        "nan": dict(obs=[[1, 0], [2, 0]], reward=np.array([np.nan, 0], np.float32)),
        "nan observation": dict(obs=[[np.nan, 0], [2, 0]]),
        "infinite observation": dict(obs=[[1, 0], [2, -np.inf]]),
        "infinite final observation": dict(obs=[[1, 0], [2, 0]], truncated=np.array([True, False]),
                                           final_observation=np.array([[np.inf, 0]], np.float32)),
        "infinite return": dict(obs=[[1, 0], [2, 0]], episode_return=np.array([np.inf, np.nan], np.float32)),
    }
    for case, fields in bad_messages.items():
        bad = Client(live.address)
        with pytest.raises(grpc.RpcError) as error:
            bad.send(**fields)
        assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT, case
        assert "malformed Step" in error.value.details()
        assert ("infinity" in error.value.details()) == case.startswith(("nan", "infinite")), case
        bad.close()
        assert good.send([[5, 0], [6, 0]]).tolist() == [5, 6]
    huge = Client(live.address)
    with pytest.raises(grpc.RpcError) as error:
        huge.send(np.zeros((2, 20_000)))  # 160 kB > max_message_bytes (64 kB)
    assert error.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    with pytest.raises(grpc.RpcError) as error:
        Client(live.address, num_envs=10**6)
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert good.send([[7, 0], [8, 0]]).tolist() == [7, 8]
    good.close()


def test_a_dropped_stream_loses_only_its_partial_unrolls_and_its_envs_rejoin(live):
    stay, leave = Client(live.address), Client(live.address)
    for t in range(3):  # 3 of 5 steps: both hold partial unrolls
        stay.send([[t, 0], [t, 0]])
        leave.send([[t, 0], [t, 0]])
    leave.close()
    wait_until(lambda: live.stats.counters["partial_unrolls_dropped"] == 2, what="the dropped stream's release")
    assert live.stats.actors_connected == 1
    back = Client(live.address)
    assert sorted(back.env_ids.tolist()) == sorted(leave.env_ids.tolist())  # the freed slots come back
    for t in range(3, 9):
        stay.send([[t, 0], [t, 0]])
        back.send([[t, 0], [t, 0]])
    # stay: steps 0..8 make one full unroll per env; back: 6 steps from a fresh start make one per env.
    assert sorted(live.unrolls) == sorted(stay.env_ids.tolist() + back.env_ids.tolist())
    assert live.stats.counters["partial_unrolls_dropped"] == 2
    stay.close()
    back.close()


def test_tls_serves_actors_that_trust_the_certificate(tmp_path):
    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed")
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=localhost",
                    "-addext", "subjectAltName=DNS:localhost", "-keyout", str(key), "-out", str(cert)],
                   check=True, capture_output=True, timeout=60)
    server = LiveServer(tmp_path, listen="localhost:0", tls=(str(cert), str(key)))
    try:
        client = Client(server.address, credentials=grpc.ssl_channel_credentials(cert.read_bytes()))
        assert client.send([[3, 0], [4, 0]]).tolist() == [3, 4]
        client.close()
    finally:
        server.close()


# ---- actor processes -----------------------------------------------------------------------------

def actor_process(address, *args, token=TOKEN, num_envs=2, module=("-m", "conveyor.architectures.seed.actor")):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("CONVEYOR_TOKEN", None)
    if token is not None:
        env["CONVEYOR_TOKEN"] = token
    return subprocess.Popen([sys.executable, *module, "--learner", address, "--num-envs", str(num_envs),
                             "--retry-s", "20", *args], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


@pytest.fixture
def cartpole_server(tmp_path):
    server = LiveServer(tmp_path, obs_shape=(4,))
    yield server
    server.close()


def test_actor_with_a_wrong_or_missing_token_prints_one_line_and_exits_2(cartpole_server):
    good = actor_process(cartpole_server.address)
    wait_until(lambda: cartpole_server.stats.counters["unrolls"] >= 2, what="the good actor's unrolls")
    for token in ("wrong", None):
        proc = actor_process(cartpole_server.address, token=token, module=("-m", "conveyor.cli", "actor"))
        _, err = proc.communicate(timeout=60)
        assert proc.returncode == 2, err
        assert len(err.strip().splitlines()) == 1 and "token" in err and "Traceback" not in err
    before = cartpole_server.stats.counters["unrolls"]
    wait_until(lambda: cartpole_server.stats.counters["unrolls"] > before, what="the good actor to keep going")
    good.terminate()
    good.communicate(timeout=30)


def test_sigterm_or_ctrl_c_mid_stream_ends_an_actor_with_128_plus_the_signal(cartpole_server):
    """A signal lands at any point of the step loop. A handler that raised there once left grpc's stream lock
    taken and the actor hung in ``call.cancel()``; now each actor closes its stream and envs and exits."""
    signals = [signal.SIGTERM, signal.SIGINT, signal.SIGTERM, signal.SIGINT]
    actors = [actor_process(cartpole_server.address) for _ in signals]
    wait_until(lambda: cartpole_server.stats.actors_connected == len(actors), what="every actor to connect")
    for index, (proc, sig) in enumerate(zip(actors, signals)):
        before = cartpole_server.stats.counters["unrolls"]
        wait_until(lambda: cartpole_server.stats.counters["unrolls"] > before, what="the actors to keep stepping")
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=STOP_GRACE_S + 30)
        assert proc.returncode == 128 + sig, err
        assert "Traceback" not in err, err
        wait_until(lambda: cartpole_server.stats.actors_connected == len(actors) - index - 1,
                   what="the stopped actor's stream to close")


STUCK_STOP_SCRIPT = """
import signal, threading
from conveyor.architectures.seed import actor
actor.STOP_GRACE_S = 0.5
class StuckActor:  # fault injection: its stop waits for ever, as a lock of grpc's can in channel.close()
    def stop(self, signum):
        threading.Event().wait()
actor.stop_on_signals(StuckActor(), [signal.SIGTERM])
print("ready", flush=True)
threading.Event().wait()
"""


def test_an_actor_whose_stop_hangs_still_exits_with_128_plus_the_signal_after_the_grace():
    proc = subprocess.Popen([sys.executable, "-c", STUCK_STOP_SCRIPT], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline() == "ready\n"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 128 + signal.SIGTERM
    finally:
        proc.kill()  # a failing run leaves nothing behind
        proc.wait()
        proc.stdout.close()


SLOW_STOP_SCRIPT = """
import os, signal, threading, time
from conveyor.architectures.seed import actor
entered, finished = threading.Event(), threading.Event()
class SlowStopActor:  # its stop holds its thread a while, as channel.close can
    def stop(self, signum):
        entered.set()
        time.sleep(1.0)
        finished.set()
relay = actor.stop_on_signals(SlowStopActor(), [signal.SIGTERM])
os.kill(os.getpid(), signal.SIGTERM)
entered.wait()
relay.close()
print("finished" if finished.is_set() else "still stopping", flush=True)
"""


def test_closing_the_signal_relay_waits_for_a_stop_in_progress():
    """The main thread must not finalize the interpreter while the relay thread is inside ``actor.stop``: a thread
    frozen there by finalization keeps grpc's lock, and grpc's ``__del__`` then waits for it for ever."""
    done = subprocess.run([sys.executable, "-c", SLOW_STOP_SCRIPT], capture_output=True, text=True, timeout=60)
    assert (done.returncode, done.stdout) == (0, "finished\n"), done.stderr


def test_killed_actor_loses_only_its_partial_unrolls_and_a_restarted_one_rejoins(cartpole_server):
    stats = cartpole_server.stats
    first, second = actor_process(cartpole_server.address), actor_process(cartpole_server.address)
    wait_until(lambda: stats.actors_connected == 2 and stats.counters["unrolls"] >= 8, what="two actors")
    os.kill(first.pid, signal.SIGKILL)
    first.communicate(timeout=30)
    wait_until(lambda: stats.actors_connected == 1, what="the killed actor's stream to close")
    assert stats.counters["partial_unrolls_dropped"] <= 2  # at most its 2 envs' partial unrolls
    dropped = stats.counters["partial_unrolls_dropped"]
    before = stats.counters["unrolls"]
    wait_until(lambda: stats.counters["unrolls"] >= before + 4, what="the other actor to keep going")
    restarted = actor_process(cartpole_server.address)
    wait_until(lambda: stats.actors_connected == 2, what="the restarted actor to rejoin")
    before = stats.counters["unrolls"]
    wait_until(lambda: stats.counters["unrolls"] >= before + 8, what="both actors to make unrolls")
    assert stats.counters["partial_unrolls_dropped"] == dropped
    for proc in (second, restarted):
        proc.terminate()
        proc.communicate(timeout=30)


def test_actor_reconnects_to_a_restarted_learner_and_exits_0_when_training_ends(tmp_path):
    server = LiveServer(tmp_path, obs_shape=(4,))
    proc = actor_process(server.address)
    try:
        wait_until(lambda: server.stats.counters["unrolls"] >= 2, what="the actor's first unrolls")
        server.crash()  # the learner goes away (its streams break)...
        # ...and a new one comes up on the same address: the actor retries with backoff and resumes.
        server = LiveServer(tmp_path, obs_shape=(4,))
        wait_until(lambda: server.stats.counters["unrolls"] >= 2, what="the actor to resume")
        # The stream ends with OK at the actor's next step (it is likely stepping its env now); 30 s of grace
        # outlasts that on a busy machine, where 0.5 s did not (the stream was cancelled, and the actor exited 1).
        server.close(grace_s=30)
        # A learner that finishes ends the stream with OK: the actor exits 0.
        assert proc.wait(timeout=60) == 0, proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
        server.close()


# ---- end to end ----------------------------------------------------------------------------------

# Slow (about 40 s idle, 100 s loaded): `make test` keeps SEED learning over the same gRPC path through
# tests/test_learns_by_default.py (local actors are `conveyor actor` processes too) and external actors
# through the token, reconnect and fault tests.
@pytest.mark.slow
def test_learner_with_two_external_actors_learns_cartpole(tmp_path):
    """`conveyor train --arch seed --local-actors 0` plus two `conveyor actor` processes on loopback TCP."""
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN)
    token_file.chmod(0o600)
    out = tmp_path / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("CONVEYOR_TOKEN", None)
    learner = subprocess.Popen(
        [sys.executable, "-m", "conveyor.cli", "train", "--arch", "seed", "--algo", "vtrace", "--env", "CartPole-v1",
         "--local-actors", "0", "--listen", "localhost:0", "--token-file", str(token_file), "--out", str(out),
         "--unroll", "20", "--batch-size", "8", "--optimizer", "adam", "--lr", "0.002", "--target-return", "195",
         "--total-steps", "600000", "--time-limit-s", "240", "--torch-threads", "1", "--no-progress", "--seed", "0"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    actors = []
    try:
        wait_until(lambda: (out / "learner_address").is_file() or learner.poll() is not None, what="the learner")
        address = (out / "learner_address").read_text().strip()
        assert address.startswith("localhost:")
        actors = [subprocess.Popen([sys.executable, "-m", "conveyor.cli", "actor", "--learner", address,
                                    "--num-envs", "8", "--token-file", str(token_file)],
                                   env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                  for _ in range(2)]
        _, err = learner.communicate(timeout=300)
        assert learner.returncode == 0, err
        # The learner ended the streams with OK: the actors exit 0 by themselves.
        assert [actor.wait(timeout=60) for actor in actors] == [0, 0]
    finally:
        for proc in (learner, *actors):
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
    summary = json.loads((out / "summary.json").read_text())
    assert summary["stop_reason"] == "target_return reached"
    assert summary["return_mean_last100"] >= 195
    seed = summary["inference"]
    assert seed["actors_connected_max"] == 2 and seed["inference_batch"]["mean"] > 1
    latency = seed["inference_latency_ms"]
    assert 0 < latency["p50"] <= latency["p99"]
    lag = summary["policy_lag"]
    assert sum(lag["histogram"].values()) == summary["updates"] * 8 * 20  # every trained step's version counted
    assert summary["time_split"]["env"] > 0 and summary["time_split"]["act"] > 0


def test_what_actors_serve_after_the_stop_decision_is_counted_apart_from_the_run(tmp_path):
    """The inference thread reports steps and episodes on its own: once the run has decided to stop (here: its
    target return), an episode ending while the learner shuts down must not move summary.json's return below
    the target that stopped it, and steps no update will use must not count as the run's."""
    from conveyor.config import RunCfg
    from conveyor.run import Run

    cfg = RunCfg(out=str(tmp_path / "run"), target_return=195.0, total_steps=10**6, progress=False)
    with Run(cfg) as run:
        for _ in range(100):
            run.record_served_steps(200)
            run.record_served_episodes(np.array([200.0, np.nan]))
        assert run.should_stop() and run.stop_reason == "target_return reached"
        run.record_served_steps(16)
        run.record_served_episodes(np.array([9.0, 12.0, np.nan]))
        tel = run.telemetry
        assert (tel.env_steps, tel.episodes, tel.return_mean_last100) == (20_000, 100, 200.0)
        assert (tel.counters["steps_after_stop"], tel.counters["episodes_after_stop"]) == (16, 2)


@pytest.mark.parametrize("args, message", [
    (["--local-actors", "0"], "remote actors need a shared token"),
    (["--listen", "nohostport"], "is not HOST:PORT or unix:PATH"),
    (["--token-file", "/nonexistent/token"], "cannot read token file"),
    (["--num-envs", "300"], "would be refused by --max-actor-envs 256"),
    (["--local-actors", "200"], "is more than one host may run"),
])
def test_bad_seed_settings_are_one_line_and_exit_2(capsys, monkeypatch, tmp_path, args, message):
    from conveyor.cli import main

    monkeypatch.delenv("CONVEYOR_TOKEN", raising=False)
    assert main(["train", "--arch", "seed", "--algo", "vtrace", "--out", str(tmp_path / "run"), "--no-progress",
                 *args]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1
