"""SEED's gRPC keepalive: a stream on which no data flows for many ping intervals (an actor held back while
the R2D2 learner trains) stays open under the server's options, where a server with gRPC's default ping
policy answers the client's keepalive pings with GOAWAY "too_many_pings".

Both ends run with a 500 ms keepalive instead of 10 s so the silence lasts 10 intervals in 5 s (gRPC counted
the third strike after about 4 s of 500 ms pings here; at 300 ms its pings were throttled and no strike came).
"""

from __future__ import annotations

import threading
from concurrent import futures

import grpc
import pytest

from conveyor.architectures.seed.protocol import channel_options
from conveyor.architectures.seed.server import server_options

KEEPALIVE_MS = 500
SILENCE_S = 5.0
METHOD = "/test.Silent/Wait"


def _silent_call(options: list[tuple[str, int]]) -> grpc.StatusCode:
    """The status of one stream whose server holds its answer back for ``SILENCE_S`` (no data either way)."""
    released = threading.Event()

    def wait(requests, context):
        next(requests)
        released.wait(SILENCE_S)
        yield b"done"

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2), options=options)
    handler = grpc.stream_stream_rpc_method_handler(wait)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("test.Silent", {"Wait": handler}),))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}",
                                   options=channel_options(1 << 20, KEEPALIVE_MS)) as channel:
            call = channel.stream_stream(METHOD)(iter([b"hello"]), timeout=30)
            try:
                assert list(call) == [b"done"]
                return grpc.StatusCode.OK
            except grpc.RpcError as error:
                return error.code()
    finally:
        released.set()
        server.stop(grace=None)


@pytest.mark.slow  # waits out keepalive pings
def test_a_silent_stream_survives_keepalive_pings_under_the_server_options():
    assert _silent_call(server_options(1 << 20, KEEPALIVE_MS)) == grpc.StatusCode.OK


@pytest.mark.slow  # waits out keepalive pings
def test_a_default_server_drops_a_silent_stream_that_pings():
    """The failure the server options prevent (so the test above is not passing vacuously)."""
    status = _silent_call(channel_options(1 << 20, KEEPALIVE_MS))
    if status == grpc.StatusCode.OK:
        pytest.skip("this grpcio's server accepts idle pings by default")
    assert status == grpc.StatusCode.UNAVAILABLE
