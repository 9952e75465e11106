"""A local Redis Cluster, created with ``redis-cli --cluster create``: masters only, or masters
with replicas that take over when a master dies (``kill_primary`` / ``wait_promoted``)."""

from __future__ import annotations

import shutil
import subprocess
import tempfile
from collections.abc import Sequence
from pathlib import Path

from redis.crc import key_slot

from mlx_redis_worker.local_redis.probe import connect, wait_until
from mlx_redis_worker.local_redis.server import HOST, PortTaken, RedisServer, free_port_pair

# The bus port sits this far above the client port (fixed by Redis Cluster).
BUS_PORT_OFFSET = 10000
CLUSTER_ARGS = (
    "--cluster-enabled",
    "yes",
    "--cluster-config-file",
    "nodes.conf",
    # Short, so a test that kills a node sees the cluster react within seconds.
    "--cluster-node-timeout",
    "2000",
)


class LocalCluster:
    """``masters`` cluster-enabled redis-server processes (plus ``replicas`` per master), each
    in a subdirectory of one directory, joined into one cluster that covers all 16384 slots.

    With replicas, a SIGKILLed master (``kill_primary``) is replaced by its replica after the
    node timeout, as in production: ``wait_promoted`` returns once every live node agrees."""

    def __init__(
        self,
        masters: int = 3,
        extra_args: Sequence[str] = (),
        directory: Path | None = None,
        replicas: int = 0,
    ) -> None:
        if masters < 1 or (masters < 3 and (masters != 1 or replicas)):
            # redis-cli --cluster create needs 3; a lone master takes every slot itself
            raise ValueError("a cluster has 1 master (no replicas) or at least 3 masters")
        if replicas < 0:
            raise ValueError("replicas (per master) must be 0 or more")
        if shutil.which("redis-cli") is None:
            raise RuntimeError("'redis-cli' is not on PATH: it creates the cluster")
        self.masters = masters
        self.replicas = replicas
        self.extra_args = list(extra_args)
        self._owns_directory = directory is None
        self.directory = directory or Path(tempfile.mkdtemp(prefix="local-redis-cluster-"))
        self.nodes: list[RedisServer] = []

    @property
    def url(self) -> str:
        """A live node's URL (the first node's while all run): a cluster client finds the
        others from any one node, and one connecting after ``kill_primary`` must not be sent
        to the dead node."""
        live = [node.url for node in self.nodes if node.process is not None]
        return (live or self.urls)[0]

    @property
    def urls(self) -> list[str]:
        return [node.url for node in self.nodes]

    def start(self, timeout: float = 30.0) -> None:
        """Start the nodes, create the cluster, and return once every node sees all of it."""
        if self.nodes:
            raise RuntimeError("the cluster is already running")
        try:
            for index in range(self.masters * (1 + self.replicas)):
                self.nodes.append(self._start_node(self.directory / f"node-{index}"))
            self._create(timeout)
            if not wait_until(self._settled, timeout):
                raise RuntimeError(
                    f"the cluster did not reach cluster_state:ok within {timeout} s\n"
                    + self._diagnosis()
                )
        except BaseException:
            self.stop()
            raise

    def _start_node(self, directory: Path) -> RedisServer:
        # RedisServer retries a taken port with a plain free port, which may lack room for the
        # bus port: retry here with a fresh pair instead.
        for _attempt in range(3):
            node = RedisServer(
                port=free_port_pair(BUS_PORT_OFFSET),
                extra_args=[*CLUSTER_ARGS, *self.extra_args],
                directory=directory,
            )
            try:
                node.start()
            except PortTaken:
                continue
            return node
        raise RuntimeError("a cluster node found no free port pair in 3 attempts")

    def _create(self, timeout: float) -> None:
        if self.masters == 1:
            # The baseline a Cluster's scaling is measured against: one node that serves all
            # 16384 slots, reached through the same cluster client as a larger one.
            with connect(self.nodes[0].port) as client:
                client.execute_command("CLUSTER", "ADDSLOTSRANGE", 0, 16383)  # type: ignore[no-untyped-call]
            return
        command = [
            "redis-cli",
            "--cluster",
            "create",
            *(f"{HOST}:{node.port}" for node in self.nodes),
            *(["--cluster-replicas", str(self.replicas)] if self.replicas else []),
            "--cluster-yes",
        ]
        try:
            result = subprocess.run(
                command, capture_output=True, text=True, timeout=timeout, check=False
            )
        except subprocess.TimeoutExpired as error:
            raise RuntimeError(
                f"redis-cli --cluster create did not finish within {timeout} s\n"
                + self._diagnosis()
            ) from error
        # redis-cli reports some refusals ("[ERR] Node ... is not empty") with exit status 0.
        output = result.stdout + result.stderr
        if result.returncode != 0 or "[ERR]" in output:
            raise RuntimeError(
                f"redis-cli --cluster create failed (exit {result.returncode}):\n{output}\n"
                + self._diagnosis()
            )

    def _settled(self) -> bool:
        """Every live node serves all slots and knows every node; every replica has its
        master's data (a replica still syncing could not take over)."""
        for node in self.live_nodes:
            with connect(node.port) as client:
                if not _cluster_ok(client.cluster("INFO"), len(self.nodes)):
                    return False
                replication = client.info("replication")
            if replication.get("role") == "slave" and replication.get("master_link_status") != "up":
                return False
        return True

    @property
    def live_nodes(self) -> list[RedisServer]:
        """The nodes still running (a killed one stays in ``nodes``, stopped)."""
        return [node for node in self.nodes if node.pid is not None]

    def replica_url(self) -> str:
        """The URL of a node that is a replica now: one that outlives ``kill_primary`` (a
        cluster client finds every node from it, as from any other)."""
        for node in self.live_nodes:
            with connect(node.port) as client:
                if client.role()[0] == "slave":
                    return node.url
        raise RuntimeError("no node of this cluster is a replica")

    def slot_owners(self) -> dict[int, int]:
        """slot -> port of the master serving it, as a live node sees it now."""
        with connect(self.live_nodes[0].port) as client:
            ranges = _slot_ranges(client.cluster("SLOTS"))
        owners: dict[int, int] = {}
        for start, end, port in ranges:
            owners.update(dict.fromkeys(range(start, end + 1), port))
        return owners

    def primary_port(self, key: str) -> int:
        """The port of the master serving ``key``'s hash slot now."""
        return self.slot_owners()[key_slot(key.encode())]

    def wait_replicated(self, key: str, timeout: float = 10.0) -> None:
        """Wait until every replica of ``key``'s master has all it was sent so far (its
        replication offset caught up): what was written before survives the master's death."""
        port = self.primary_port(key)

        def caught_up() -> bool:
            with connect(port) as client:
                replication = client.info("replication")
            offset = replication["master_repl_offset"]
            replicas = [value for name, value in replication.items() if name.startswith("slave")]
            return all(replica["offset"] >= offset for replica in replicas)

        if not wait_until(caught_up, timeout):
            raise RuntimeError(f"the replicas of port {port} did not catch up within {timeout} s")

    def kill_primary(self, key: str) -> int:
        """SIGKILL the master serving ``key`` (no goodbye to its peers); returns its port for
        ``wait_promoted``."""
        port = self.primary_port(key)
        self._node(port).kill()
        return port

    def wait_promoted(self, key: str, old_port: int, timeout: float = 30.0) -> int:
        """Wait until every live node says a node other than ``old_port`` serves ``key``'s slot,
        that node says it is a master, and the cluster is whole again; returns its port."""
        slot = key_slot(key.encode())
        promoted: list[int] = []

        def agreed() -> bool:
            ports = set()
            for node in self.live_nodes:
                with connect(node.port) as client:
                    if client.cluster("INFO").get("cluster_state") != "ok":
                        return False
                    ranges = _slot_ranges(client.cluster("SLOTS"))
                ports.add(next((port for a, b, port in ranges if a <= slot <= b), None))
            if len(ports) != 1 or old_port in ports or None in ports:
                return False
            (port,) = ports
            assert port is not None
            with connect(port) as client:
                if client.role()[0] != "master":
                    return False
            promoted.append(port)
            return True

        if not wait_until(agreed, timeout):
            raise RuntimeError(
                f"no replica took over slot {slot} from port {old_port} within {timeout} s\n"
                + self._diagnosis()
            )
        return promoted[0]

    def _node(self, port: int) -> RedisServer:
        for node in self.nodes:
            if node.port == port and node.pid is not None:
                return node
        raise RuntimeError(f"no running node of this cluster on port {port}")

    def _diagnosis(self) -> str:
        return "\n".join(f"--- node {node.port} log ---\n{node.log_tail()}" for node in self.nodes)

    def stop(self) -> None:
        """Stop every node (SIGTERM) and forget them; the directory stays."""
        nodes, self.nodes = self.nodes, []
        for node in nodes:
            node.close()

    def close(self) -> None:
        """Stop, and delete the directory if this object created it."""
        self.stop()
        if self._owns_directory:
            shutil.rmtree(self.directory, ignore_errors=True)

    def __enter__(self) -> LocalCluster:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def _slot_ranges(reply: object) -> list[tuple[int, int, int]]:
    """``(first slot, last slot, master port)`` of each range in a ``CLUSTER SLOTS`` reply."""
    assert isinstance(reply, list)
    return [(int(start), int(end), int(primary[1])) for start, end, primary, *_ in reply]


def _cluster_ok(info: object, count: int) -> bool:
    """``CLUSTER INFO`` (parsed into a dict by redis-py) says the node serves all slots and
    knows every node."""
    if not isinstance(info, dict):
        return False
    return info.get("cluster_state") == "ok" and info.get("cluster_known_nodes") == str(count)
