"""A local Redis Cluster of masters only, created with ``redis-cli --cluster create``."""

from __future__ import annotations

import shutil
import subprocess
import tempfile
from collections.abc import Sequence
from pathlib import Path

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
    """``masters`` cluster-enabled redis-server processes, each in a subdirectory of one
    directory, joined into one cluster that covers all 16384 slots (no replicas)."""

    def __init__(
        self,
        masters: int = 3,
        extra_args: Sequence[str] = (),
        directory: Path | None = None,
    ) -> None:
        if masters < 3:
            raise ValueError("redis-cli --cluster create needs at least 3 masters")
        if shutil.which("redis-cli") is None:
            raise RuntimeError("'redis-cli' is not on PATH: it creates the cluster")
        self.masters = masters
        self.extra_args = list(extra_args)
        self._owns_directory = directory is None
        self.directory = directory or Path(tempfile.mkdtemp(prefix="local-redis-cluster-"))
        self.nodes: list[RedisServer] = []

    @property
    def url(self) -> str:
        """The first node's URL: a cluster client finds the others from any one node."""
        return self.urls[0]

    @property
    def urls(self) -> list[str]:
        return [node.url for node in self.nodes]

    def start(self, timeout: float = 30.0) -> None:
        """Start the nodes, create the cluster, and return once every node sees all of it."""
        if self.nodes:
            raise RuntimeError("the cluster is already running")
        try:
            for index in range(self.masters):
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
        command = [
            "redis-cli",
            "--cluster",
            "create",
            *(f"{HOST}:{node.port}" for node in self.nodes),
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
        for node in self.nodes:
            with connect(node.port) as client:
                info = client.cluster("INFO")
            if not _cluster_ok(info, len(self.nodes)):
                return False
        return True

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


def _cluster_ok(info: object, count: int) -> bool:
    """``CLUSTER INFO`` (parsed into a dict by redis-py) says the node serves all slots and
    knows every node."""
    if not isinstance(info, dict):
        return False
    return info.get("cluster_state") == "ok" and info.get("cluster_known_nodes") == str(count)
