"""Misbehaving SEED clients, bounded in count and time, and a learner stand-in to aim them at.

The attacks (issue 21): ``flood``: many connections sending 15 MiB messages without the token (row 5);
``big_names``: Hellos whose ``actor_name`` is megabytes, with the token (row 6); ``IdleStreams``: a token
holder's streams that say Hello and then idle, or ask for every env slot (row 7).

    python -m tests.seed_attack serve --token-file FILE      # a SEED server (no torch); prints its address
    python -m tests.seed_attack attack --learner ADDR --token-file FILE --seconds 60

``serve`` acts as ``tests.test_seed.EchoPolicy`` (action = first observation column) and runs until its
stdin closes, so its RSS is the server's
own; ``attack`` runs the three attacks in turn until ``--seconds`` have passed (``benchmarks/soak.py
--attack`` runs it beside a training learner).
"""

from __future__ import annotations

import argparse
import collections
import itertools
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Iterator

import grpc
import numpy as np

from conveyor.architectures.seed import seed_pb2
from conveyor.architectures.seed.batcher import Batcher, InferenceStats
from conveyor.architectures.seed.protocol import PROTOCOL_VERSION, auth_metadata, read_token
from conveyor.architectures.seed.server import SERVICE, SeedServer

ACT = f"/{SERVICE}/Act"
MiB = 1 << 20
_names = itertools.count()  # every big name differs: a server that kept names would keep every one


def raw_channel(address: str, max_bytes: int = 32 * MiB) -> grpc.Channel:
    return grpc.insecure_channel(address, options=[("grpc.max_send_message_length", max_bytes),
                                                   ("grpc.max_receive_message_length", max_bytes)])


def raw_act(channel: grpc.Channel) -> Any:
    """The Act method on raw bytes: requests go out as given, replies come back unparsed."""
    return channel.stream_stream(ACT, request_serializer=None, response_deserializer=None)


def hello(num_envs: int = 1, actor_name: str = "attacker:0", protocol: int = PROTOCOL_VERSION) -> bytes:
    return seed_pb2.ActorMessage(hello=seed_pb2.Hello(protocol=protocol, num_envs=num_envs,
                                                      actor_name=actor_name)).SerializeToString()


def call_status(channel: grpc.Channel, messages: list[bytes], metadata: Any, timeout_s: float) -> str:
    """Send ``messages`` on one Act call and read its replies until it ends: the status code's name."""
    try:
        for _ in raw_act(channel)(iter(messages), metadata=metadata, timeout=timeout_s):
            pass
        return "OK"
    except grpc.RpcError as error:
        return error.code().name


def flood(address: str, *, clients: int = 40, attempts: int = 3, size: int = 15 * MiB,
          token: str | None = None) -> collections.Counter[str]:
    """``clients`` threads, each on a connection of its own, make ``attempts`` calls sending one ``size``-byte
    Hello each, without the token (``token``: a wrong one); the calls' status counts."""
    payload = hello(actor_name="x" * size)
    metadata = auth_metadata(token) if token else None

    def client(_: int) -> list[str]:
        channel = raw_channel(address, max_bytes=size + MiB)
        try:
            return [call_status(channel, [payload], metadata, 30.0) for _ in range(attempts)]
        finally:
            channel.close()

    with ThreadPoolExecutor(clients) as pool:
        return collections.Counter(code for codes in pool.map(client, range(clients)) for code in codes)


def big_names(address: str, token: str, *, count: int = 20, size: int = 10 * MiB) -> collections.Counter[str]:
    """``count`` calls in a row, each a Hello with the token whose ``actor_name`` is ``size`` bytes."""
    channel = raw_channel(address, max_bytes=size + MiB)
    try:
        return collections.Counter(call_status(channel, [hello(actor_name=f"{next(_names)}:" + "x" * size)],
                                               auth_metadata(token), 30.0) for _ in range(count))
    finally:
        channel.close()


class IdleStreams:
    """``count`` streams on one connection that say Hello for ``num_envs`` envs each and then send nothing
    (for at most ``hold_s``). ``first`` counts how each was answered: WELCOME or a status code's name."""

    def __init__(self, address: str, token: str, count: int, *, num_envs: int = 1, hold_s: float = 120.0) -> None:
        self.channel = raw_channel(address)
        self._stop = threading.Event()
        act, message = raw_act(self.channel), hello(num_envs)

        def requests() -> Iterator[bytes]:
            yield message
            self._stop.wait(hold_s)

        self.calls = [act(requests(), metadata=auth_metadata(token), timeout=hold_s) for _ in range(count)]
        self.first = collections.Counter(self._first_reply(call) for call in self.calls)

    @staticmethod
    def _first_reply(call: Any) -> str:
        try:
            next(call)
            return "WELCOME"
        except StopIteration:
            return "OK"
        except grpc.RpcError as error:
            return error.code().name

    def ended(self) -> collections.Counter[str]:
        """How the streams that have ended ended (status code names)."""
        return collections.Counter(call.code().name for call in self.calls if call.done())

    def close(self) -> None:
        self._stop.set()
        for call in self.calls:
            call.cancel()
        self.channel.close()


def attack(address: str, token: str, seconds: float, hold_s: float = 45.0) -> None:
    """Rows 5, 6 and 7 in turn until ``seconds`` have passed, idle streams held up to ``hold_s`` (past the
    learner's idle timeout) each round; one line of outcomes per round."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        outcomes = {"flood": flood(address, attempts=1), "wrong_token": flood(address, attempts=1, token="wrong"),
                    "big_names": big_names(address, token, count=5)}
        greedy, idle = IdleStreams(address, token, 1, num_envs=4096), IdleStreams(address, token, 300)
        outcomes.update(idle_streams=idle.first, all_slots=greedy.first)
        end = min(deadline, time.monotonic() + hold_s)
        while time.monotonic() < end and not all(call.done() for call in idle.calls):
            time.sleep(0.5)
        outcomes["idle_ended"] = idle.ended()
        idle.close()
        greedy.close()
        print(f"seed_attack: {time.strftime('%H:%M:%S')} " + "; ".join(
            f"{name} {dict(counts)}" for name, counts in outcomes.items()), flush=True)


def serve(token_file: str, listen: str, max_message_bytes: int) -> None:
    """A SEED server whose action is the first observation column; prints its address, serves until stdin
    closes."""
    stats = InferenceStats()
    batcher = Batcher(lambda requests: [r.obs[:, 0].astype(np.int64) for r in requests], 64, 0.002, stats=stats)
    server = SeedServer(batcher, lambda slots: 0, listen=listen, token=read_token(token_file), env_config_json="{}",
                        obs_shape=(2,), obs_dtype=np.float32, base_seed=0, max_message_bytes=max_message_bytes,
                        stats=stats)
    batcher.expected_rows = lambda: server.expected_envs
    batcher.on_timeout = server.mark_late
    print(server.start(), flush=True)
    sys.stdin.read()
    server.close(0.5)
    batcher.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    serving = commands.add_parser("serve")
    serving.add_argument("--token-file", required=True)
    serving.add_argument("--listen", default="localhost:0")
    serving.add_argument("--max-message-bytes", type=int, default=16 * MiB)
    attacking = commands.add_parser("attack")
    attacking.add_argument("--learner", required=True)
    attacking.add_argument("--token-file", required=True)
    attacking.add_argument("--seconds", type=float, default=60.0)
    args = parser.parse_args()
    if args.command == "serve":
        serve(args.token_file, args.listen, args.max_message_bytes)
    else:
        attack(args.learner, read_token(args.token_file), args.seconds)


if __name__ == "__main__":
    main()
