"""Real multi-process Redis topologies on 127.0.0.1 for tests and load runs.

`sentinel_group()`: one primary, one replica and three sentinels (quorum 2), the way
production runs Sentinel, with a failover a second after the primary stops answering.
`redis_cluster()`: N masters with `cluster-enabled`, joined by `redis-cli --cluster create`.
`redis_shards()`: N independent redis-servers. Every process is stopped on exit, also when
the body raised.
"""

from __future__ import annotations

import contextlib
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import redis

from tests.support.harness import spare_port, wait_until

REDIS_SERVER = shutil.which("redis-server") or "redis-server"
REDIS_CLI = shutil.which("redis-cli") or "redis-cli"
MASTER_NAME = "mymaster"
# A primary silent this long is down for a sentinel; quorum 2 of 3 then fails it over.
DOWN_AFTER_MS = 1000
CLUSTER_BUS_OFFSET = 10000


@dataclass
class Node:
    """One redis-server (or sentinel) process with its own port and directory."""

    dir: Path
    args: list[str] = field(default_factory=list)
    is_sentinel: bool = False
    port: int = field(default_factory=spare_port)
    proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def client(self, **kwargs: object) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=2, **kwargs)

    def start(self, timeout_s: float = 15.0) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        argv = [REDIS_SERVER, *self._config(), *self.args]
        log = open(self.dir / "redis.log", "ab")  # noqa: SIM115 (owned by the process)
        self.proc = subprocess.Popen(argv, stdout=log, stderr=log, start_new_session=True)
        wait_until(self._answers, timeout_s, f"redis on port {self.port} ({self.dir}/redis.log)")

    def _config(self) -> list[str]:
        if self.is_sentinel:  # a sentinel rewrites its config file, so it needs one of its own
            return [str(self.dir / "sentinel.conf"), "--sentinel", "--port", str(self.port)]
        network = ["--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.dir)]
        return [*network, "--save", "", "--appendonly", "no"]

    def _answers(self) -> bool:
        assert self.proc is not None and self.proc.poll() is None, f"{self.dir} exited"
        try:
            return bool(self.client().ping())
        except (redis.RedisError, OSError):
            return False

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(sig)
            self.proc.wait(timeout=10)

    def pause(self, is_paused: bool = True) -> None:
        """SIGSTOP (or SIGCONT): the process holds its sockets but answers nothing."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGSTOP if is_paused else signal.SIGCONT)


@contextlib.contextmanager
def _nodes(base: Path | None) -> Iterator[tuple[Path, list[Node]]]:
    """A directory and a list to put nodes in; every node in it is stopped at the end."""
    nodes: list[Node] = []
    with contextlib.ExitStack() as stack:
        if base is None:
            base = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="ladle-topo-")))
        try:
            yield base, nodes
        finally:
            for node in nodes:
                with contextlib.suppress(OSError, subprocess.SubprocessError):
                    node.kill()


@dataclass
class SentinelGroup:
    primary: Node
    replica: Node
    sentinels: list[Node]
    data_nodes: list[Node]

    @property
    def url(self) -> str:
        hosts = ",".join(f"127.0.0.1:{s.port}" for s in self.sentinels)
        return f"redis+sentinel://{hosts}/{MASTER_NAME}/0"

    def primary_port(self) -> int | None:
        """The primary's port as the first sentinel that answers names it."""
        for sentinel in self.sentinels:
            with contextlib.suppress(redis.RedisError, OSError):
                address = sentinel.client().sentinel_get_master_addr_by_name(MASTER_NAME)
                if address:
                    return int(address[1])
        return None

    def current_primary(self) -> Node:
        port = self.primary_port()
        return next(node for node in self.data_nodes if node.port == port)

    def wait_in_sync(self, timeout_s: float = 30.0) -> None:
        """Until the primary reports an online replica and every sentinel knows all peers."""

        def synced() -> bool:
            info = self.current_primary().client().info("replication")
            if info.get("connected_slaves", 0) < 1:
                return False
            return all(
                int(s.client().sentinel_master(MASTER_NAME)["num-other-sentinels"]) == 2
                for s in self.sentinels
            )

        wait_until(synced, timeout_s, "replica in sync and sentinels aware of each other")

    def kill_primary(self, timeout_s: float = 30.0) -> float:
        """SIGKILL the primary; seconds until the sentinels name a new one."""
        old = self.current_primary()
        started = time.monotonic()
        old.kill()
        wait_until(
            lambda: self.primary_port() not in (None, old.port), timeout_s, "a Sentinel failover"
        )
        return time.monotonic() - started

    def restart_as_replica(self, node: Node) -> None:
        """Start a killed data node again; the sentinels make it a replica of the new primary."""
        node.start()


@contextlib.contextmanager
def sentinel_group(base: Path | None = None) -> Iterator[SentinelGroup]:
    with _nodes(base) as (root, nodes):
        primary = Node(root / "primary")
        nodes.append(primary)
        primary.start()
        replica = Node(root / "replica", ["--replicaof", "127.0.0.1", str(primary.port)])
        nodes.append(replica)
        replica.start()
        sentinels = [_sentinel(root / f"sentinel-{i}", primary.port) for i in range(3)]
        nodes += sentinels
        for sentinel in sentinels:
            sentinel.start()
        group = SentinelGroup(primary, replica, sentinels, [primary, replica])
        group.wait_in_sync()
        yield group


def _sentinel(directory: Path, primary_port: int) -> Node:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "sentinel.conf").write_text(
        "bind 127.0.0.1\n"
        f"dir {directory}\n"
        f"sentinel monitor {MASTER_NAME} 127.0.0.1 {primary_port} 2\n"
        f"sentinel down-after-milliseconds {MASTER_NAME} {DOWN_AFTER_MS}\n"
        f"sentinel failover-timeout {MASTER_NAME} 5000\n"
        f"sentinel parallel-syncs {MASTER_NAME} 1\n"
    )
    return Node(directory, is_sentinel=True)


@dataclass
class RedisCluster:
    masters: list[Node]

    @property
    def url(self) -> str:
        """A seed node's URL (a cluster client discovers the rest)."""
        return f"redis://127.0.0.1:{self.masters[0].port}/0"

    def client(self) -> redis.RedisCluster:
        return redis.RedisCluster(host="127.0.0.1", port=self.masters[0].port, socket_timeout=2)

    def keys_per_master(self, pattern: str) -> list[int]:
        return [sum(1 for _ in node.client().scan_iter(pattern)) for node in self.masters]

    def owner(self, slot: int) -> Node:
        ranges = self.masters[0].client().execute_command("CLUSTER", "SLOTS")
        port = next(int(r[2][1]) for r in ranges if int(r[0]) <= slot <= int(r[1]))
        return next(node for node in self.masters if node.port == port)

    def start_moving(self, slot: int, target: Node) -> Node:
        """Mark `slot` migrating to `target` and move its keys (redis-cli's reshard, first
        half): the old owner now answers ASK for them. Returns the old owner."""
        source = self.owner(slot)
        ids = {node.port: node.client().execute_command("CLUSTER", "MYID") for node in self.masters}
        target.client().execute_command("CLUSTER", "SETSLOT", slot, "IMPORTING", ids[source.port])
        source.client().execute_command("CLUSTER", "SETSLOT", slot, "MIGRATING", ids[target.port])
        keys = source.client().execute_command("CLUSTER", "GETKEYSINSLOT", slot, 1000)
        if keys:
            source.client().execute_command(
                "MIGRATE", "127.0.0.1", target.port, "", 0, 5000, "KEYS", *keys
            )
        return source

    def finish_moving(self, slot: int, target: Node) -> None:
        """Give `slot` to `target` on every master: the old owner now answers MOVED."""
        target_id = target.client().execute_command("CLUSTER", "MYID")
        for node in self.masters:
            node.client().execute_command("CLUSTER", "SETSLOT", slot, "NODE", target_id)


def spare_cluster_port() -> int:
    """A free port whose cluster bus port (port + 10000) is free and below 65536 too."""
    for _ in range(200):
        port = spare_port()
        if port + CLUSTER_BUS_OFFSET < 65536 and _is_free(port + CLUSTER_BUS_OFFSET):
            return port
    raise RuntimeError("no spare port pair for a cluster node")


def _is_free(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


@contextlib.contextmanager
def redis_cluster(
    num_masters: int = 3, base: Path | None = None, ports: list[int] | None = None
) -> Iterator[RedisCluster]:
    """`num_masters` (>= 3, as redis-cli requires) masters, no replicas, all slots covered."""
    with _nodes(base) as (root, nodes):
        for i in range(num_masters):
            node = Node(
                root / f"master-{i}",
                port=ports[i] if ports else spare_cluster_port(),
                args=["--cluster-enabled", "yes", "--cluster-node-timeout", "2000"]
                + ["--cluster-config-file", str(root / f"master-{i}" / "nodes.conf")],
            )
            nodes.append(node)
            node.start()
        addresses = [f"127.0.0.1:{node.port}" for node in nodes]
        subprocess.run(
            [REDIS_CLI, "--cluster", "create", *addresses, "--cluster-replicas", "0"]
            + ["--cluster-yes"],
            check=True,
            capture_output=True,
            timeout=60,
        )
        wait_until(lambda: all(_cluster_ok(node) for node in nodes), 30, "cluster_state:ok")
        yield RedisCluster(list(nodes))


def _cluster_ok(node: Node) -> bool:
    return node.client().cluster("info").get("cluster_state") == "ok"


@contextlib.contextmanager
def redis_shards(
    num_shards: int, base: Path | None = None, ports: list[int] | None = None
) -> Iterator[list[Node]]:
    """`num_shards` independent redis-servers (persistence off)."""
    with _nodes(base) as (root, nodes):
        for i in range(num_shards):
            node = Node(root / f"shard-{i}", port=ports[i]) if ports else Node(root / f"shard-{i}")
            nodes.append(node)
            node.start()
        yield list(nodes)
