"""SEED actors as Ray actors (``--launcher ray``): ``LocalActors``' job, on a Ray cluster's nodes.

Each Ray actor runs the same ``Actor`` loop as ``conveyor actor``: it dials
the learner's gRPC server, presents the run's token and steps
``--num-envs`` envs with ``--num-workers`` env worker processes on its node
(its placement-group bundle reserves that many CPUs). ``restart_dead``,
called by the training loop, finds actors whose loop ended (a killed
process, a lost learner, dead envs) and starts a new one in the same
bundle, up to ``--max-restarts`` over the run; the learner drops the dead
one's partial unrolls as for any actor. Where the actors run is in
``DIR/launcher.json``.

Actors on other nodes must reach the learner: with a loopback ``--listen``
such a placement is refused at start with the fix (``--listen
0.0.0.0:PORT``, the actors then dial this node's cluster address).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from conveyor.architectures.seed.actor import EXIT_ENVS_FAILED, Actor, actor_name
from conveyor.architectures.seed.server import LOOPBACK_HOSTS
from conveyor.errors import ConfigError, WorkerFailure
from conveyor.procs import RestartBudget
from conveyor.ray_launcher import RayLauncher, where


class SeedRayActor:
    """The body of one Ray actor: an ``Actor`` and its envs."""

    def __init__(self, address: str, token: str, num_envs: int, num_workers: int, tls_ca: bytes,
                 max_message_bytes: int) -> None:
        self.actor = Actor(address, token, num_envs, num_workers, tls_ca=tls_ca, retry_s=30.0,
                           max_message_bytes=max_message_bytes)

    def where(self) -> dict[str, Any]:
        return where()

    def run(self) -> int:
        """The actor loop until the learner ends the stream (0) or the actor gives up (its exit code)."""
        try:
            return self.actor.run()
        except WorkerFailure as error:  # an env worker died or hung
            print(f"conveyor actor: error: {error}", flush=True)
            return EXIT_ENVS_FAILED
        finally:
            self.actor.close()


class RayActors:
    """``launcher.count`` SEED actors as Ray actors dialing the learner at ``address`` (``LocalActors``'
    interface; ``launcher`` kills them when the run closes it)."""

    def __init__(self, launcher: RayLauncher, address: str, token: str, *, num_envs: int, num_workers: int,
                 tls_ca: str = "", max_message_bytes: int = 16 * 1024 * 1024, max_restarts: int = 10) -> None:
        self.launcher = launcher
        self.address = _dial_address(address, launcher.driver_ip, launcher.node_ips)
        self.args = (self.address, token, num_envs, num_workers, Path(tls_ca).read_bytes() if tls_ca else b"",
                     max_message_bytes)
        self.restart_budget = RestartBudget(max_restarts)
        started = launcher.start_all(SeedRayActor, {index: self.args for index in range(launcher.count)})
        self.runs = [started[index].run.remote() for index in range(launcher.count)]

    def restart_dead(self) -> list[str]:
        """Start a new Ray actor for every one whose loop ended; returns the dead ones' actor names. Raises
        ``WorkerFailure`` when that would exceed ``max_restarts``."""
        ray = self.launcher.ray
        ended, _ = ray.wait(self.runs, num_returns=len(self.runs), timeout=0)
        dead = []
        for run in ended:
            index = self.runs.index(run)
            try:
                reason = f"exit code {ray.get(run)}"
            except ray.exceptions.RayError as error:  # killed, or its node went away
                reason = type(error).__name__
            row = self.launcher.rows[index]
            self.restart_budget.spend(f"{self.launcher.describe(index)} ended ({reason})")
            dead.append(actor_name(row["pid"], row["hostname"]))
            self.runs[index] = self.launcher.start(index, SeedRayActor, *self.args).run.remote()
        return dead


def _dial_address(address: str, driver_ip: str, node_ips: list[str]) -> str:
    """The learner address actors dial: ``address``, with a wildcard host replaced by this node's cluster
    address; refused (ConfigError) when actors on other nodes could not reach it."""
    host, _, port = address.rpartition(":")
    host = host.strip("[]")
    if host in ("0.0.0.0", "::"):
        return f"{driver_ip}:{port}"
    remote = sorted({ip for ip in node_ips if ip != driver_ip})
    if remote and (address.startswith("unix:") or host in LOOPBACK_HOSTS):
        raise ConfigError(f"Ray placed seed actors on other nodes ({', '.join(remote)}), which cannot reach a "
                          f"learner listening on {address}: pass --listen 0.0.0.0:PORT (actors present the token; "
                          "add --tls-cert/--tls-key on untrusted networks)")
    return address
