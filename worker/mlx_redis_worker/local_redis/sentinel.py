"""A local Sentinel set: a master, one replica, and one Sentinel watching them (quorum 1)."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

from mlx_redis_worker.local_redis.probe import connect, wait_until
from mlx_redis_worker.local_redis.server import HOST, RedisServer

# Short timings so a test sees a failover in seconds (about 3 s from kill to switch here).
DOWN_AFTER_MS = 1000
FAILOVER_TIMEOUT_MS = 5000


class LocalSentinel:
    """``master``, ``replica`` and ``sentinel`` are the servers as started; after a failover
    the roles of the first two swap, and ``master_port()`` says which one is master now."""

    def __init__(self, service: str = "mymaster", directory: Path | None = None) -> None:
        self.service = service
        self._owns_directory = directory is None
        self.directory = directory or Path(tempfile.mkdtemp(prefix="local-redis-sentinel-"))
        self._master: RedisServer | None = None
        self._replica: RedisServer | None = None
        self._sentinel: RedisServer | None = None

    @property
    def master(self) -> RedisServer:
        return _started(self._master, "master")

    @property
    def replica(self) -> RedisServer:
        return _started(self._replica, "replica")

    @property
    def sentinel(self) -> RedisServer:
        return _started(self._sentinel, "sentinel")

    @property
    def url(self) -> str:
        return f"redis+sentinel://{HOST}:{self.sentinel.port}/{self.service}/0"

    def start(self, timeout: float = 30.0) -> None:
        """Start master, replica and Sentinel; return once the replica is in sync and the
        Sentinel knows it (without that, a failover would find nobody to promote)."""
        if self._master is not None:
            raise RuntimeError("the sentinel set is already running")
        try:
            # Diskless sync would wait 5 s for more replicas before the first full sync.
            self._master = RedisServer(
                extra_args=["--repl-diskless-sync-delay", "0"],
                directory=self.directory / "master",
            )
            self._master.start()
            self._replica = RedisServer(
                extra_args=["--replicaof", HOST, str(self._master.port)],
                directory=self.directory / "replica",
            )
            self._replica.start()
            if not wait_until(self._replica_in_sync, timeout):
                raise RuntimeError(
                    f"the replica did not sync with the master within {timeout} s\n"
                    + self._diagnosis()
                )
            # Started last, so its first INFO to the master already lists the replica.
            self._sentinel = self._start_sentinel(self._master.port)
            if not wait_until(self._sentinel_sees_replica, timeout):
                raise RuntimeError(
                    f"the sentinel did not list the replica within {timeout} s\n"
                    + self._diagnosis()
                )
        except BaseException:
            self.stop()
            raise

    def _start_sentinel(self, master_port: int) -> RedisServer:
        directory = self.directory / "sentinel"
        directory.mkdir(parents=True, exist_ok=True)
        # Sentinel refuses to start without a config file it can rewrite (it records what it
        # learns there). Port, bind and dir come as arguments after the file, like any server.
        config = directory / "sentinel.conf"
        name = self.service
        config.write_text(
            f"sentinel monitor {name} {HOST} {master_port} 1\n"
            f"sentinel down-after-milliseconds {name} {DOWN_AFTER_MS}\n"
            f"sentinel failover-timeout {name} {FAILOVER_TIMEOUT_MS}\n"
            f"sentinel parallel-syncs {name} 1\n"
        )
        sentinel = RedisServer(directory=directory, config_file=config, extra_args=["--sentinel"])
        sentinel.start()
        return sentinel

    def _replica_in_sync(self) -> bool:
        with connect(self.replica.port) as client:
            return client.info("replication").get("master_link_status") == "up"

    def _sentinel_sees_replica(self) -> bool:
        with connect(self.sentinel.port) as client:
            replicas = client.sentinel_slaves(self.service)
        # "master-link-status" comes from the replica's own INFO: the Sentinel has reached it.
        return any(
            int(entry.get("port", 0)) == self.replica.port
            and not entry.get("is_disconnected", True)
            and entry.get("master-link-status") == "ok"
            for entry in replicas
        )

    def master_port(self) -> int:
        """The master's port, as the Sentinel names it now."""
        with connect(self.sentinel.port) as client:
            address = client.sentinel_get_master_addr_by_name(self.service)
        if not isinstance(address, tuple):
            raise RuntimeError(f"the sentinel does not know the service {self.service!r}")
        return int(address[1])

    def kill_master(self) -> int:
        """SIGKILL whichever server is master now; returns its port for ``wait_failover``."""
        port = self.master_port()
        for server in (self.master, self.replica):
            if server.port == port and server.pid is not None:
                server.kill()
                return port
        raise RuntimeError(f"the master on port {port} is not running")

    def wait_failover(self, old_port: int, timeout: float = 30.0) -> int:
        """Wait until the Sentinel names a master other than ``old_port``, that node says it is
        master, and the Sentinel has closed the failover; returns the new master's port.

        GET-MASTER-ADDR-BY-NAME names the promoted replica while the failover is still open,
        and redis-py's Sentinel client refuses a master that SENTINEL MASTER still marks down,
        so all three must hold before a client can follow the switch."""
        promoted: list[int] = []

        def done() -> bool:
            port = self.master_port()
            if port == old_port:
                return False
            with connect(port) as client:
                if client.role()[0] != "master":
                    return False
            with connect(self.sentinel.port) as client:
                state = client.sentinel_master(self.service)
            if not isinstance(state, dict) or int(state["port"]) != port:
                return False
            if state["is_sdown"] or state["is_odown"]:
                return False
            promoted.append(port)
            return True

        if not wait_until(done, timeout):
            raise RuntimeError(
                f"no failover from port {old_port} within {timeout} s\n" + self._diagnosis()
            )
        return promoted[0]

    def _diagnosis(self) -> str:
        servers = {"master": self._master, "replica": self._replica, "sentinel": self._sentinel}
        return "\n".join(
            f"--- {role} {server.port} log ---\n{server.log_tail()}"
            for role, server in servers.items()
            if server is not None
        )

    def stop(self) -> None:
        """Stop all three, the Sentinel first so it does not react to the others going away."""
        servers = (self._sentinel, self._replica, self._master)
        self._sentinel = self._replica = self._master = None
        for server in servers:
            if server is not None:
                server.close()

    def close(self) -> None:
        """Stop, and delete the directory if this object created it."""
        self.stop()
        if self._owns_directory:
            shutil.rmtree(self.directory, ignore_errors=True)

    def __enter__(self) -> LocalSentinel:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def _started(server: RedisServer | None, role: str) -> RedisServer:
    if server is None:
        raise RuntimeError(f"the sentinel set's {role} is not running: call start() first")
    return server
