"""Redis faults under load, short profiles (the long ones: ``python -m tests.reliability.faults
SCENARIO``): a 3-master Cluster, a Sentinel failover, stalls past the socket timeout, Redis out
of memory, and an evicting Redis refused at start."""

from __future__ import annotations

from pathlib import Path

import pytest

from mlx_redis_worker.local_redis import LocalCluster, LocalSentinel
from tests.reliability.faults import config_for, run_scenario
from tests.reliability.faults_memory import REFUSED_WITHIN_SECONDS
from tests.support.drivers import DriverResult


def _run(scenario: str, tmp_path: Path, **topology: object) -> DriverResult:
    config = config_for(scenario, "short", directory=tmp_path)
    result = run_scenario(config, **topology)
    print(result.table())
    return result


def _assert_every_job_ended_once(result: DriverResult) -> None:
    values = result.values
    assert values["lost"] == 0
    assert values["done"] == values["jobs"]
    assert values["duplicate_endings"] == 0
    assert values["repeated_seqs"] == 0
    assert values["bad_logs"] == 0
    assert values["settled"], "the job streams (default, model) must be empty, nothing pending"
    assert values["leaks"] == 0, "no worker log line may carry a prompt or job bytes"
    assert values["exit_codes"] == [0] * len(values["exit_codes"])


@pytest.mark.timeout(180)
def test_cluster_jobs_spread_over_three_masters(
    tmp_path: Path, redis_cluster: LocalCluster
) -> None:
    """2 workers and one Client on node 0's URL; request ids whose keys land on all three
    masters, submitted and followed concurrently: every greedy text equals a direct engine
    run, every log and stream is whole; the CLI works through node 0 for a request living on
    another node; the publisher still makes one round trip per engine step at most."""
    result = _run("cluster", tmp_path, cluster=redis_cluster)
    assert result.problems == [], result.problems[:20]
    _assert_every_job_ended_once(result)
    values = result.values
    assert all(count > 0 for count in values["per_node"]), values["per_node"]
    assert values["logs_per_node"] == values["per_node"]
    assert values["bad_subscribers"] == 0
    assert values["mismatches"] == 0
    cli = values["cli"]
    assert (cli["submit_rc"], cli["stream_rc"], cli["stats_rc"]) == (0, 0, 0)
    assert 0 < cli["round_trips"] <= cli["steps"]


@pytest.mark.timeout(240)
def test_cluster_failover_is_followed_by_clients(
    tmp_path: Path, redis_cluster_replicas: LocalCluster
) -> None:
    """3 masters + 3 replicas; the master of the job stream's slot SIGKILLed mid-run, then
    the master of a running request's log: every job ends once, every subscriber of the one
    Client gets its done without its stream raising, a submit through that Client after each
    promotion runs at its first try, and `mlx-worker stream` across each kill ends with done."""
    result = _run("cluster-failover", tmp_path, cluster=redis_cluster_replicas)
    assert result.problems == [], result.problems[:20]
    _assert_every_job_ended_once(result)
    values = result.values
    assert values["stream_exceptions_caught"] == values["stream_exceptions_escaped"] == 0
    assert values["bad_subscribers"] == 0
    kills = values["kills"]
    assert [kill["what"] for kill in kills] == ["job stream", "log"]
    assert len({kill["old_port"] for kill in kills}) == 2, "two different masters must die"
    assert all(kill["done_at_kill"] < values["jobs"] for kill in kills), "kills must be mid-run"
    assert all(kill["submit_seconds"] is not None for kill in kills)
    assert all(kill["done_seconds"] is not None for kill in kills)
    assert [kill["cli_rc"] for kill in kills] == [0, 0]


@pytest.mark.timeout(180)
def test_sentinel_failover_mid_run_loses_nothing(
    tmp_path: Path, redis_sentinel: LocalSentinel
) -> None:
    """Queued jobs replicated (WAIT), the master SIGKILLed once a third are done: every job
    ends exactly once, every log passes check_log, and the same worker processes follow the
    promoted replica without a restart."""
    result = _run("sentinel", tmp_path, sentinel=redis_sentinel)
    assert result.problems == [], result.problems[:20]
    _assert_every_job_ended_once(result)
    values = result.values
    assert values["replicas_acked"] == 1
    assert values["new_master"] != values["old_master"]
    assert values["done_at_kill"] < values["jobs"], "the master must die mid-run"
    assert all(values["same_process_running"]), values["same_process_running"]


@pytest.mark.timeout(180)
def test_stalls_past_the_socket_timeout_repeat_no_event(tmp_path: Path) -> None:
    """DEBUG SLEEP 3 twice while jobs run, workers with a 2 s socket timeout: publishes time
    out and are sent again, yet no seq is repeated, every request ends once, and every
    subscriber (timeout longer than the stall) gets its whole stream without an exception."""
    result = _run("stall", tmp_path)
    assert result.problems == [], result.problems[:20]
    _assert_every_job_ended_once(result)
    values = result.values
    assert values["stalls"] == 2
    assert values["publisher_redis_failures"] > 0, "the stalls must have timed out a publish"
    assert values["stream_exceptions_caught"] == values["stream_exceptions_escaped"] == 0
    assert values["bad_subscribers"] == 0


@pytest.mark.timeout(180)
def test_out_of_memory_is_waited_out_and_logged_per_burst(tmp_path: Path) -> None:
    """Redis (noeviction) held full for 5 s while the workers work, with invalid entries in
    the queue: every valid job ends once, every invalid entry is dead-lettered exactly once
    with the decoder's code, the logs show bursts (far fewer redis_failing lines than OOM
    refusals) and never a prompt or job bytes; a worker started while full serves after."""
    result = _run("oom", tmp_path)
    assert result.problems == [], result.problems[:20]
    _assert_every_job_ended_once(result)
    values = result.values
    assert values["filled"] and values["probe_writes_accepted"] == 0
    assert values["invalid_dead_ok"] == values["invalid"] == values["dead_letters"]
    assert values["oom_refusals"] >= 2 * values["redis_failing"] > 0
    assert values["publisher_redis_failures"] > 0


@pytest.mark.timeout(180)
def test_evicting_redis_is_refused_at_start(tmp_path: Path) -> None:
    """allkeys-lru and volatile-lru: `mlx-worker run` exits 2 before loading its model, with
    one stderr line naming the policy and --allow-eviction; with --allow-eviction it serves;
    on noeviction it starts."""
    result = _run("eviction", tmp_path)
    assert result.problems == [], result.problems[:20]
    _assert_every_job_ended_once(result)
    values = result.values
    for policy, found in values["refusals"].items():
        assert found["rc"] == 2, (policy, found)
        assert found["stderr_lines"] == 1, (policy, found)
        # Refused before the model loads (faults_memory.REFUSED_WITHIN_SECONDS says why 60).
        assert found["seconds"] < REFUSED_WITHIN_SECONDS, (policy, found)
    assert values["allowed_warnings"] == 1
    assert values["noeviction_rc"] == 0
