"""The gateway behind Sentinel: it serves through a ``redis+sentinel://`` URL, says so while
the master is gone (503, never a 500), and serves from the promoted replica after a failover
without a restart."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from pathlib import Path

import openai
import pytest

from mlx_redis_worker.local_redis import LocalSentinel
from tests.support.gateway import GatewayFactory
from tests.support.processes import WorkerFactory


@pytest.mark.timeout(180)
def test_a_gateway_serves_across_a_sentinel_failover(
    redis_sentinel: LocalSentinel, prefix: str, tmp_path: Path
) -> None:
    workers = WorkerFactory(tmp_path, redis_sentinel.url, prefix)
    gateways = GatewayFactory(tmp_path, redis_sentinel.url, prefix)
    try:
        # Not `wait`: the factory reads heartbeats with a plain redis:// client.
        workers.start("sentinel-worker", wait=False).wait_ready()
        gateway = gateways.start()
        client = openai.OpenAI(base_url=gateway.base_url, api_key="unused", max_retries=0)
        before = client.completions.create(
            model="tiny", prompt="hello", max_tokens=8, temperature=0
        )
        assert before.choices[0].finish_reason == "length"

        old = redis_sentinel.kill_master()
        # No master yet: the gateway says so.
        # No master yet: the gateway says so at once.
        with pytest.raises(openai.APIStatusError) as caught:
            client.completions.create(model="tiny", prompt="hello", max_tokens=8, timeout=30)
        assert caught.value.status_code == 503, caught.value.message
        assert caught.value.code == "unavailable", caught.value.message
        redis_sentinel.wait_failover(old)
        # A client retries while the fleet moves to the new master: what it sees meanwhile is
        # a 503 (or the model missing until the worker's next heartbeat there), never a 500.
        seen: list[int] = []
        deadline = time.monotonic() + 60
        while True:
            try:
                after = client.completions.create(
                    model="tiny", prompt="hello", max_tokens=8, temperature=0
                )
                break
            except openai.APIStatusError as exc:
                seen.append(exc.status_code)
                assert exc.status_code in (404, 503), (exc.status_code, exc.message)
            except openai.APIConnectionError:
                seen.append(0)
            assert time.monotonic() < deadline, f"no answer after the failover: {seen}"
            time.sleep(0.5)
        # Greedy: the same text from the promoted replica's fleet as before the failover.
        assert after.choices[0].text == before.choices[0].text, seen
        with urllib.request.urlopen(f"{gateway.url}/health", timeout=5) as answer:
            assert answer.status == 200 and json.loads(answer.read())["status"] == "ok"
    finally:
        gateways.stop_all()
        workers.kill_all()
        print(gateways.report())
        print(workers.report())
