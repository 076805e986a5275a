"""What both ends of a SEED stream agree on, apart from the messages (``seed.proto``, ``wire.py``).

The protocol version a Hello carries, the token (``read_token``: ``--token-file`` or ``$CONVEYOR_TOKEN``)
and how a call presents it (``auth_metadata``: ``authorization: Bearer <token>``), and the gRPC channel
arguments both ends use (``channel_options``: message limits, keepalive pings). The learner's side is
``server.py``, the actors' ``actor.py``; neither imports the other.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from conveyor.errors import ConfigError

PROTOCOL_VERSION = 1
TOKEN_ENV = "CONVEYOR_TOKEN"
AUTH_KEY = "authorization"
KEEPALIVE_MS = 10_000
"""Both ends ping an idle connection this often, so a dead peer is noticed within seconds, not hours."""


def channel_options(max_message_bytes: int, keepalive_ms: int = KEEPALIVE_MS) -> list[tuple[str, int]]:
    """Channel arguments of both ends: message limits and keepalive pings that go on while no data flows."""
    return [("grpc.max_receive_message_length", max_message_bytes),
            ("grpc.max_send_message_length", max_message_bytes),
            ("grpc.keepalive_time_ms", keepalive_ms), ("grpc.keepalive_timeout_ms", keepalive_ms // 2),
            ("grpc.http2.max_pings_without_data", 0), ("grpc.keepalive_permit_without_calls", 1)]


def read_token(token_file: str = "") -> str:
    """The shared actor token from ``token_file``, else ``$CONVEYOR_TOKEN``; '' when neither is set. Warns (one
    line on stderr) when users other than the owner may read or change ``token_file``."""
    if token_file:
        try:
            token = Path(token_file).read_text().strip()
            mode = os.stat(token_file).st_mode & 0o777
        except OSError as error:
            raise ConfigError(f"cannot read token file {token_file} ({error.strerror}): "
                              "pass --token-file a readable file holding the token") from None
        if mode & 0o077:  # as ssh checks private keys: only the owner may read or change it
            print(f"conveyor: warning: permissions {mode:04o} of token file {token_file} are too open (other "
                  f"users can read the token): chmod 600 {token_file}", file=sys.stderr)
        if not token:
            raise ConfigError(f"token file {token_file} is empty: write the shared token into it")
        return token
    return os.environ.get(TOKEN_ENV, "").strip()


def auth_metadata(token: str) -> tuple[tuple[str, str], ...]:
    return ((AUTH_KEY, f"Bearer {token}"),)
