"""Redis faults under load: a Cluster, a Sentinel failover, stalls, out of memory, eviction.

    python -m tests.reliability.faults SCENARIO [--jobs N] [--max-tokens M] [--workers W]

Scenarios (each prints the markdown table README's "Reliability" section quotes):

* ``cluster``: 2 workers and one Client on a local 3-master Redis Cluster through node 0's
  URL, request ids spread over the three nodes, every job submitted and followed at once;
  then ``mlx-worker submit / stream / ctl stats`` for a request whose keys live elsewhere.
* ``cluster-failover``: the same on 3 masters + 3 replicas (through a replica's URL), with the
  master of the job stream's slot SIGKILLed once a third of the requests ended and the master
  of a running request's log once two thirds did; subscribers, a submit after each promotion
  and an ``mlx-worker stream`` across each kill must follow the promoted replicas by
  themselves.
* ``sentinel``: workers and Client on a ``redis+sentinel://`` URL (lease 2 s); the queued jobs
  replicated (``WAIT 1 2000``), then the master SIGKILLed once a third are done; the workers
  must follow the promoted replica without a restart. ``--replica-lag S`` first cuts the
  replica off (SIGSTOP, and the master drops its link) S seconds before the kill, so the
  failover loses the master's last writes: holes in replay logs, new attempts.
* ``stall``: ``DEBUG SLEEP 3`` a few times while jobs run, past the workers' 2 s socket
  timeout: every publish in flight times out and is sent again.
* ``oom``: valid and invalid entries queued, then Redis (``noeviction``) filled until it
  refuses writes and held there ~5 s while the workers work, then freed.
* ``eviction``: ``mlx-worker run`` against ``allkeys-lru`` and ``volatile-lru`` exits 2 with
  one line; ``--allow-eviction`` serves; ``noeviction`` starts.

Every scenario runs through the same code (``faults_harness``): entries submitted and
followed concurrently through one Client, every replay log checked entry by entry
(``check_log``), every subscriber's stream against its log (``check_followed``), greedy texts
against a direct engine run, the model stream's dead letters, the default and the model job
streams and their groups' pending lists at the end (entries are queued on the default stream
and forwarded), and the workers' logs (burst logging, no prompt or job bytes in them).
"""

from __future__ import annotations

# `mlx_redis_worker` must be imported before anything imports mlx: it loads OpenBLAS first.
import mlx_redis_worker  # noqa: F401  # isort: skip

from collections.abc import Callable
from typing import Any

from tests.reliability.faults_failover import run_cluster_failover
from tests.reliability.faults_memory import run_eviction, run_oom
from tests.reliability.faults_scenarios import FaultConfig, run_cluster, run_sentinel, run_stall
from tests.support.drivers import DriverResult, driver_arguments, exit_with, report

RUNNERS: dict[str, Callable[..., DriverResult]] = {
    "cluster": run_cluster,
    "cluster-failover": run_cluster_failover,
    "sentinel": run_sentinel,
    "stall": run_stall,
    "oom": run_oom,
    "eviction": run_eviction,
}

# The long profiles: a few minutes each at most on a 2-core machine.
LONG: dict[str, dict[str, Any]] = {
    "cluster": {"jobs": 300},
    "cluster-failover": {"jobs": 300},
    "sentinel": {"jobs": 300},
    "stall": {"jobs": 300},
    "oom": {"jobs": 300, "invalid": 12},
    "eviction": {"jobs": 4, "workers": 1},
}

# The short profiles of `make test` (tests/reliability/test_faults.py).
SHORT: dict[str, dict[str, Any]] = {
    "cluster": {"jobs": 60, "max_tokens": 10},
    "cluster-failover": {"jobs": 96, "max_tokens": 10},
    "sentinel": {"jobs": 60, "max_tokens": 10},
    "stall": {"jobs": 60, "max_tokens": 10, "stalls": 2},
    "oom": {"jobs": 60, "max_tokens": 10, "invalid": 8},
    "eviction": {"jobs": 2, "max_tokens": 8, "workers": 1},
}


def config_for(scenario: str, profile: str = "long", **overrides: Any) -> FaultConfig:
    base = (LONG if profile == "long" else SHORT)[scenario]
    chosen = {name: value for name, value in overrides.items() if value is not None}
    return FaultConfig(scenario=scenario, **{**base, **chosen})


def run_scenario(config: FaultConfig, **topology: Any) -> DriverResult:
    """Run one scenario; ``topology`` hands in a running LocalCluster (``cluster=``) or
    LocalSentinel (``sentinel=``) instead of starting one."""
    return RUNNERS[config.scenario](config, **topology)


def main(argv: list[str] | None = None) -> int:
    parser = driver_arguments(__doc__)
    parser.add_argument("scenario", choices=sorted(RUNNERS))
    parser.add_argument("--jobs", type=int, default=None)
    parser.add_argument("--max-tokens", type=int, default=None)
    parser.add_argument("--workers", type=int, default=None)
    parser.add_argument("--lease-seconds", type=float, default=None)
    parser.add_argument(
        "--replica-lag",
        type=float,
        default=None,
        help="sentinel: SIGSTOP the replica this many seconds before the master's SIGKILL, "
        "so the failover loses the master's last writes",
    )
    parser.add_argument("--short", action="store_true", help="the short profile of make test")
    parser.add_argument("--seed", type=int, default=None)
    args = parser.parse_args(argv)
    config = config_for(
        args.scenario,
        "short" if args.short else "long",
        jobs=args.jobs,
        max_tokens=args.max_tokens,
        workers=args.workers,
        lease_seconds=args.lease_seconds,
        seed=args.seed,
        replica_lag=args.replica_lag,
        directory=args.dir,
    )
    return report(run_scenario(config), config)


if __name__ == "__main__":
    exit_with(main)
