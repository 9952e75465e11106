"""The gateway on a 3-master Redis Cluster: a request's shape key sits in its log's slot, a
key's quota script in its own, and the status page reads every node."""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path

import openai

from mlx_redis_worker.local_redis import LocalCluster
from tests.support.gateway import GatewayFactory
from tests.support.processes import WorkerFactory, mlx_worker
from tests.support.sse import RawRequest


def test_streams_resume_limits_and_status_on_a_cluster(
    redis_cluster: LocalCluster, prefix: str, tmp_path: Path
) -> None:
    workers = WorkerFactory(tmp_path, redis_cluster.url, prefix)
    gateways = GatewayFactory(tmp_path, redis_cluster.url, prefix)
    try:
        worker = workers.start("cluster-worker")
        keys = tmp_path / "keys.toml"
        added = mlx_worker(
            "api-key", "add", "ops", "--file", str(keys), "--operator",
            "--requests-per-minute", "3",
        )  # fmt: skip
        assert added.returncode == 0, added.stderr
        secret = added.stdout.strip()
        first, second = (gateways.start("--api-keys", str(keys)) for _ in range(2))
        client = openai.OpenAI(base_url=first.base_url, api_key=secret, max_retries=0)

        whole = client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=12,
            temperature=0,
        )  # fmt: skip
        streamed = client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=12,
            temperature=0, stream=True,
        )  # fmt: skip
        chunks = list(streamed)
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert text == whole.choices[0].message.content

        # Any gateway streams it again from its log (its shape key is in the log's slot).
        with RawRequest(
            second.url, "GET", f"/v1/requests/{chunks[0].id}/stream",
            headers={"Authorization": f"Bearer {secret}"},
        ) as again:  # fmt: skip
            replayed = list(again.messages())
        assert replayed[-1].is_done
        assert "".join(m.content for m in replayed[:-1]) == text

        # The resume (a read counts like a request) was the key's third request of the
        # minute, and the last: the bucket is one, shared.
        second_client = openai.OpenAI(base_url=second.base_url, api_key=secret, max_retries=0)
        try:
            second_client.completions.create(model="tiny", prompt="hi", max_tokens=1)
            raise AssertionError("a fourth request within the minute was admitted")
        except openai.RateLimitError as refusal:
            assert refusal.code == "rate_limit_exceeded"

        request = urllib.request.Request(
            f"{second.url}/status.json", headers={"Authorization": f"Bearer {secret}"}
        )
        with urllib.request.urlopen(request, timeout=10) as answer:
            status = json.load(answer)
        assert [w["worker_id"] for w in status["workers"]] == [worker.worker_id]
        assert [m["model"] for m in status["models"]] == ["tiny"]
    finally:
        gateways.stop_all()
        workers.kill_all()
        print(gateways.report(), workers.report())
