"""``--launcher ray``: SEED actors and IMPACT workers as Ray actors, on one host or a cluster.

Ray (an optional extra: ``pip install 'conveyor[ray]'``) only places and
supervises the processes; what they do is unchanged. A SEED actor still
streams to the learner over the gRPC server (``seed.ray_actors``); an IMPACT
worker fills the same batches as a local one and returns them through Ray's
object store, taking weights from it (``impact.ray_workers``).

``RayLauncher`` connects to the cluster (``--ray-address``): ``local`` starts a
one-node Ray inside this run, bound to the loopback interface; ``auto`` joins
the cluster a ``ray start`` made on this host; ``HOST:PORT`` joins the head
at that address (its GCS port). A cluster that does not answer, or refuses
our token (Ray's own token authentication), fails with one line: a
``HOST:PORT`` where nothing answers within 5 s, one that answers but is no
Ray head after Ray's own retries (about 20 s). It then reserves one
placement-group bundle per actor (``--ray-strategy`` pack, spread or
strict_spread: Ray's strategies), so a run either gets all its CPUs or fails
with one line saying what the cluster has: at once when its nodes could never
hold them, else after ``PLACEMENT_TIMEOUT_S`` (CPUs taken by other jobs); it
never waits silently for resources.

``RayLauncher.start(index, ...)`` creates actor ``index`` in bundle
``index``, so a restarted actor takes its predecessor's place (and node);
``start_all`` creates a run's actors together, so they start in parallel.
``DIR/launcher.json`` lists every actor's role, index, life (restarts of
that index), node id, node ip, hostname and pid, rewritten atomically at
each start: ``kill -9`` of a pid found there is how the fault tests kill
one.

What crosses Ray is trusted the way the cluster is: Ray pickles actor
arguments and results (the SEED token, the run config, IMPACT batches and
weights). Keep a Ray cluster on a private network with its token
authentication on; the SEED data stream still goes through conveyor's own
gRPC server with its token (and TLS where asked).
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import secrets
import socket
import sys
from pathlib import Path
from typing import Any, Iterator

from conveyor.errors import ConfigError, WorkerFailure
from conveyor.files import open_append, write_text_atomic

INSTALL_HINT = "pip install 'conveyor[ray]' (make venv installs it)"
CPUS_PER_ACTOR = 1
"""CPUs each actor reserves, whatever its envs (RLlib's default ``num_cpus_per_env_runner``); env worker processes
are the actor's own, unseen by Ray."""
PLACEMENT_TIMEOUT_S = 20.0
"""Longest wait for the cluster to reserve every actor's CPUs."""
_LOOPBACK_ONLY_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"
"""Set to 0 before Ray is imported, Ray takes this host's address to be 127.0.0.1: its servers bind to loopback."""


def check_available() -> None:
    """ConfigError with the install hint when Ray is not installed (checked before a run starts)."""
    if importlib.util.find_spec("ray") is None:
        raise ConfigError(f"--launcher ray needs Ray, which is not installed: {INSTALL_HINT}")


def where() -> dict[str, Any]:
    """Where the calling Ray actor runs (its row of ``launcher.json``)."""
    import ray

    return {"node_id": ray.get_runtime_context().get_node_id(), "node_ip": ray.util.get_node_ip_address(),
            "hostname": socket.gethostname(), "pid": os.getpid()}


class RayLauncher:
    """A run's Ray connection and placement group; starts, replaces and finally kills its actors.

    ``count`` bundles of ``CPUS_PER_ACTOR`` CPUs, placed with ``strategy``; ``role`` names the actors in messages
    and in ``launcher.json`` (written into ``out``).
    """

    def __init__(self, address: str, strategy: str, *, count: int, role: str, out: Path) -> None:
        check_available()
        self.address, self.strategy, self.role, self.path = address, strategy, role, Path(out) / "launcher.json"
        self.count = count
        # A local Ray offers at least the CPUs asked for: like child processes, its actors may share cores.
        self.ray = _connect(address, num_cpus=max(os.cpu_count() or 1, count * CPUS_PER_ACTOR),
                            log=Path(out) / "ray-init.log")
        ray = self.ray
        from ray.util.placement_group import placement_group

        self.placement = None
        self.actors: dict[int, Any] = {}
        self.rows: dict[int, dict[str, Any]] = {}
        self.lives: dict[int, int] = {}
        self.remote_classes: dict[type, Any] = {}
        try:
            if not _could_place(ray, count, strategy):  # would wait for nodes that are not there: say so now
                raise ConfigError(f"the Ray cluster at {address} cannot place {count} {role}s of {CPUS_PER_ACTOR} CPU "
                                  f"each with --ray-strategy {strategy} ({_resources(ray)}): ask for fewer, pick "
                                  "another --ray-strategy, or add nodes")
            self.placement = placement_group([{"CPU": CPUS_PER_ACTOR}] * count, strategy=strategy.upper())
            ready, _ = ray.wait([self.placement.ready()], timeout=PLACEMENT_TIMEOUT_S)
            if not ready:
                raise ConfigError(f"the Ray cluster at {address} could not place {count} {role}s of {CPUS_PER_ACTOR} CPU each "
                                  f"with --ray-strategy {strategy} within {PLACEMENT_TIMEOUT_S:.0f}s "
                                  f"({_resources(ray)}): ask for fewer, pick another --ray-strategy, or add nodes")
            self.node_ips = _bundle_node_ips(ray, self.placement)
        except BaseException:
            self.close()
            raise

    @property
    def driver_ip(self) -> str:
        """This process's node address in the cluster."""
        return self.ray.util.get_node_ip_address()

    def start(self, index: int, cls: type, *args: Any) -> Any:
        """Create ``cls(*args)`` as Ray actor ``index`` in bundle ``index`` (replacing one that died there: its
        life counts up), record where it runs and return its handle. ``cls`` has a ``where()`` method
        (``ray_launcher.where``)."""
        return self.start_all(cls, {index: args})[index]

    def start_all(self, cls: type, args: dict[int, tuple[Any, ...]]) -> dict[int, Any]:
        """``start`` for every index of ``args`` at once: all are created before any is waited for, so they
        construct in parallel (each imports torch and builds its envs: N start in about the time of one)."""
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        ray = self.ray
        if cls not in self.remote_classes:
            self.remote_classes[cls] = ray.remote(cls)
        remote_class = self.remote_classes[cls]
        for index, actor_args in args.items():
            old = self.actors.pop(index, None)
            if old is not None:
                ray.kill(old, no_restart=True)
            self.lives[index] = self.next_life(index)
            strategy = PlacementGroupSchedulingStrategy(self.placement, placement_group_bundle_index=index)
            self.actors[index] = remote_class.options(num_cpus=CPUS_PER_ACTOR, max_restarts=0,
                                                      scheduling_strategy=strategy).remote(*actor_args)
        places = {index: self.actors[index].where.remote() for index in args}
        for index, place in places.items():
            try:
                found = ray.get(place)
            except ray.exceptions.RayError as error:  # its constructor raised, or conveyor does not import there
                said = (str(error).strip().splitlines() or [type(error).__name__])[-1]
                raise WorkerFailure(f"{self.role} {index} could not start on the Ray cluster: {said}") from None
            self.rows[index] = {"role": self.role, "index": index, "life": self.lives[index], **found}
        self._write()
        return {index: self.actors[index] for index in args}

    def next_life(self, index: int) -> int:
        """The life the next ``start(index, ...)`` gives actor ``index``: 0, then one more per replacement."""
        return self.lives.get(index, -1) + 1

    def describe(self, index: int) -> str:
        """Actor ``index`` in a line: role, index, pid, node."""
        row = self.rows.get(index, {})
        return (f"{self.role} {index} (Ray actor, pid {row.get('pid', '?')} on node {row.get('node_ip', '?')} "
                f"{str(row.get('node_id', '?'))[:12]})")

    def _write(self) -> None:
        rows = [self.rows[index] for index in sorted(self.rows)]
        write_text_atomic(self.path, json.dumps({"launcher": "ray", "ray_address": self.address,
                                                 "ray_strategy": self.strategy, "actors": rows}, indent=2) + "\n")

    def close(self) -> None:
        """Kill every actor, release the placement group and disconnect (a ``local`` Ray shuts down)."""
        ray = self.ray
        for handle in self.actors.values():
            try:
                ray.kill(handle, no_restart=True)
            except Exception:  # already gone
                pass
        self.actors = {}
        if self.placement is not None:
            from ray.util.placement_group import remove_placement_group

            try:
                remove_placement_group(self.placement)
            except Exception:
                pass
            self.placement = None
        ray.shutdown()


def _connect(address: str, num_cpus: int, log: Path) -> Any:
    """``ray.init`` for ``--ray-address`` (a ``local`` Ray with ``num_cpus`` CPUs); a ConfigError naming the fix
    when it fails. What Ray's native code prints meanwhile goes to ``log``, not around our one line."""
    if address == "local":
        # A private one-node Ray for this run: bound to loopback like conveyor's own servers (read when Ray is
        # imported), behind a token of its own (Ray's processes inherit it) rather than one written to ~/.ray.
        if "ray" not in sys.modules:
            os.environ.setdefault(_LOOPBACK_ONLY_ENV, "0")
        os.environ.setdefault("RAY_AUTH_MODE", "token")
        if os.environ["RAY_AUTH_MODE"] == "token" and not os.environ.get("RAY_AUTH_TOKEN"):
            os.environ["RAY_AUTH_TOKEN"] = secrets.token_hex(32)
    import ray

    if address not in ("local", "auto"):
        host, _, port = address.rpartition(":")
        if not host or not port.isdigit():
            raise ConfigError(f"--ray-address {address!r} is not local, auto or HOST:PORT (the head's GCS port, "
                              "6379 unless `ray start --head --port` said otherwise)")
        try:
            socket.create_connection((host.strip("[]"), int(port)), timeout=5.0).close()
        except OSError as error:
            raise ConfigError(f"cannot reach a Ray cluster at {address} ({error.strerror or error}): start one "
                              "with `ray start --head`, or pass --ray-address local") from None
        if not _speaks_grpc(address):
            raise ConfigError(f"{address} accepts connections but is not a Ray cluster's GCS port (no gRPC answer "
                              f"in {GCS_PROBE_S:g} s): pass the head's GCS port, 6379 unless `ray start --head "
                              "--port` said otherwise (not the dashboard's 8265 or the Ray Client's 10001)")
    kwargs: dict[str, Any] = {"include_dashboard": False, "log_to_driver": False, "logging_level": "warning",
                              "configure_logging": False}
    if address == "local":
        kwargs["num_cpus"] = num_cpus
    else:
        kwargs["address"] = address
    try:
        # In this thread: the servers a local Ray starts die with the thread that started them (PR_SET_PDEATHSIG).
        with _stderr_to(log):
            ray.init(**kwargs)
    except Exception as error:  # noqa: BLE001 - Ray raises ConnectionError, RuntimeError, its own types
        raise ConfigError(f"{_connect_error(address, error)} (Ray's log: {log})") from None
    return ray


GCS_PROBE_S = 5.0
"""How long a --ray-address may take to finish a gRPC handshake (a live GCS answers in milliseconds)."""


def _speaks_grpc(address: str) -> bool:
    """Whether ``address`` completes an HTTP/2 (gRPC) handshake within ``GCS_PROBE_S``: a port that is open but
    is not Ray's GCS (the dashboard, some other server) would otherwise keep ``ray.init`` retrying for about
    half a minute before its error. Not probed when Ray talks TLS (``RAY_USE_TLS``): a plain channel cannot tell."""
    if os.environ.get("RAY_USE_TLS", "0").lower() in ("1", "true"):
        return True
    import grpc

    channel = grpc.insecure_channel(address)
    try:
        grpc.channel_ready_future(channel).result(timeout=GCS_PROBE_S)
        return True
    except grpc.FutureTimeoutError:
        return False
    finally:
        channel.close()


@contextlib.contextmanager
def _stderr_to(path: Path) -> Iterator[None]:
    """File descriptor 2 (native code's stderr too) appended to ``path`` for the block."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open_append(path) as log:
            os.dup2(log.fileno(), 2)
        yield
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)
        os.close(saved)


def _connect_error(address: str, error: Exception) -> str:
    """The one line for a failed ``ray.init``."""
    first = (str(error).strip().splitlines() or [type(error).__name__])[0][:160]
    if "auth" in first.lower() or "token" in first.lower():
        return (f"the Ray cluster at {address} refused this run's Ray token ({first}): set RAY_AUTH_TOKEN (or "
                "~/.ray/auth_token) to the cluster's token")
    if address == "auto":
        return f"no Ray cluster runs on this host ({first}): start one with `ray start --head`, or pass --ray-address local"
    return f"cannot join the Ray cluster at {address} ({first})"


def _could_place(ray: Any, count: int, strategy: str) -> bool:
    """Whether the cluster's nodes, all free, could hold ``count`` actors of ``CPUS_PER_ACTOR`` CPUs placed with
    ``strategy`` (``strict_spread``: each on a node of its own)."""
    slots = [int(node["Resources"].get("CPU", 0) // CPUS_PER_ACTOR) for node in ray.nodes() if node.get("Alive")]
    if strategy == "strict_spread":
        return sum(1 for slot in slots if slot > 0) >= count
    return sum(slots) >= count


def _resources(ray: Any) -> str:
    """What the cluster has, for the placement error: nodes, CPUs in all, CPUs free."""
    nodes = [node for node in ray.nodes() if node.get("Alive")]
    total = ray.cluster_resources().get("CPU", 0.0)
    free = ray.available_resources().get("CPU", 0.0)
    return f"{len(nodes)} node{'s' * (len(nodes) != 1)}, {total:g} CPUs, {free:g} free"


def _bundle_node_ips(ray: Any, placement: Any) -> list[str]:
    """The node address of each bundle of a ready placement group."""
    from ray.util.placement_group import placement_group_table

    node_ip = {node["NodeID"]: node["NodeManagerAddress"] for node in ray.nodes()}
    bundles = placement_group_table(placement)["bundles_to_node_id"]
    return [node_ip.get(bundles[index], "?") for index in sorted(bundles)]
