"""Images through the gateway, sent by the openai SDK as real PNG and JPEG files: chat's
``image_url`` parts and the Responses API's ``input_image``, into jobs whose big files are in
blobs; what a text-only model, a hostile part or an unfetchable URL gets (a 400, before any
job is queued). The fleet is planted heartbeats (no worker reads the queue): what the gateway
queued is read back from Redis."""

from __future__ import annotations

import contextlib
import json
import time
import uuid
from collections.abc import Iterator
from typing import Any

import openai
import pytest
import redis

from mlx_redis_protocol.codec_job import decode_job
from mlx_redis_protocol.constants import JOB_FIELD
from mlx_redis_protocol.heartbeat import Heartbeat, ServedModel
from mlx_redis_protocol.keys import Keys
from mlx_redis_protocol.messages import ContentPart, Job
from mlx_redis_worker.bench.hostile_images import data_url
from mlx_redis_worker.local_redis import RedisServer
from tests.support.fleet import write_heartbeat_sync
from tests.support.gateway import GatewayFactory, GatewayProcess
from tests.support.media import image_file, serving_media

PNG = image_file(1, (48, 32))
JPEG = image_file(2, (900, 700), "JPEG")  # over the inline threshold: a blob


@pytest.fixture(scope="module")
def lone_gateways(
    redis_server: RedisServer, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[GatewayFactory]:
    """The module's gateways (one per test would cost seconds each), with no worker."""
    prefix = f"img{uuid.uuid4().hex[:12]}"
    factory = GatewayFactory(tmp_path_factory.mktemp("gw"), redis_server.url, prefix)
    with contextlib.ExitStack() as stack:
        stack.callback(lambda: print(factory.report()))
        stack.callback(factory.stop_all)
        yield factory


@pytest.fixture(scope="module")
def admin(redis_server: RedisServer) -> Iterator[redis.Redis]:
    with redis.Redis.from_url(redis_server.url) as client:
        yield client


@pytest.fixture(autouse=True)
def no_queued_jobs(admin: redis.Redis, lone_gateways: GatewayFactory) -> None:
    """Each test starts with the models' streams empty."""
    keys = Keys(lone_gateways.prefix)
    admin.delete(keys.model_stream("eyes").stream, keys.model_stream("blind").stream)


@pytest.fixture(scope="module")
def gateway(lone_gateways: GatewayFactory, admin: redis.Redis) -> Iterator[GatewayProcess]:
    keys = Keys(lone_gateways.prefix)
    beat = Heartbeat(
        worker_id="eyes-worker",
        pid=1,
        started_at=time.time(),
        in_flight=0,
        default_model="eyes",
        models={
            "eyes": ServedModel(max_concurrency=4, free_slots=4, in_flight=0, media=("image",)),
            "blind": ServedModel(max_concurrency=4, free_slots=4, in_flight=0),
        },
    )
    write_heartbeat_sync(admin, keys, "eyes-worker", beat.encode(), ttl_ms=600_000)
    yield lone_gateways.start("--media-fetch-timeout", "2")


def _openai(gateway: GatewayProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=gateway.base_url, api_key="none", max_retries=0, timeout=30)


def _queued(admin: redis.Redis, prefix: str, model: str) -> Job:
    """The one job the gateway queued on ``model``'s stream."""
    stream = Keys(prefix).model_stream(model).stream
    deadline = time.monotonic() + 10
    while not (entries := admin.xrange(stream)) and time.monotonic() < deadline:
        time.sleep(0.05)
    ((_, fields),) = entries
    return decode_job(fields[JOB_FIELD.encode()])


def test_chat_image_parts_become_the_jobs_images(
    gateway: GatewayProcess, admin: redis.Redis, lone_gateways: GatewayFactory
) -> None:
    client = _openai(gateway)
    content: Any = [
        {"type": "text", "text": "Compare "},
        {"type": "image_url", "image_url": {"url": data_url(PNG), "detail": "low"}},
        {"type": "text", "text": " and "},
        {"type": "image_url", "image_url": {"url": data_url(JPEG, "jpeg")}},
    ]
    # Nothing answers (no worker): a stream's headers come once the job is queued, and the
    # job is what we look at.
    client.chat.completions.create(
        model="eyes", messages=[{"role": "user", "content": content}], max_tokens=4, stream=True
    ).close()
    job = _queued(admin, lone_gateways.prefix, "eyes")
    assert job.messages is not None
    assert job.messages[0].parts == (
        ContentPart("text", "Compare "),
        ContentPart("image"),
        ContentPart("text", " and "),
        ContentPart("image"),
    )
    assert job.images is not None
    small, big = job.images
    assert small.data == PNG and small.detail == "low"  # small: inline
    assert big.data is None and big.blob is not None  # big: in a blob, with a TTL
    blob_key = Keys(lone_gateways.prefix).blob(big.blob)
    assert admin.get(blob_key) == JPEG and admin.ttl(blob_key) > 0


def test_responses_input_image(
    gateway: GatewayProcess, admin: redis.Redis, lone_gateways: GatewayFactory
) -> None:
    client = _openai(gateway)
    client.responses.create(
        model="eyes",
        input=[
            {
                "role": "user",
                "content": [
                    {"type": "input_text", "text": "What is this?"},
                    {"type": "input_image", "image_url": data_url(PNG), "detail": "high"},
                ],
            }
        ],
        stream=True,
    ).close()
    job = _queued(admin, lone_gateways.prefix, "eyes")
    assert job.images is not None and job.images[0].data == PNG
    assert job.images[0].detail == "high"


@pytest.mark.parametrize(
    ("model", "part", "code", "match"),
    [
        ("blind", {"url": data_url(PNG)}, "invalid_job", "does not take images"),
        ("eyes", {"url": data_url(b"%PDF-1.7 a document", "png")}, None, "allowed format"),
        ("eyes", {"url": "data:image/png;base64,@@@@"}, None, "not valid base64"),
        ("eyes", {"url": "data:image/png,raw"}, None, "must be base64"),
        ("eyes", {"url": data_url(PNG), "detail": "ultra"}, None, "detail"),
        ("eyes", {"url": "https://images.example.com/a.png"}, None, "fetches no image URLs"),
        ("eyes", {"url": "file:///etc/passwd"}, None, "data: or http"),
    ],
)
def test_what_the_gateway_refuses_before_queueing(
    gateway: GatewayProcess,
    admin: redis.Redis,
    lone_gateways: GatewayFactory,
    model: str,
    part: dict[str, Any],
    code: str | None,
    match: str,
) -> None:
    content: Any = [{"type": "text", "text": "hi"}, {"type": "image_url", "image_url": part}]
    with pytest.raises(openai.BadRequestError, match=match) as caught:
        _openai(gateway).chat.completions.create(
            model=model, messages=[{"role": "user", "content": content}]
        )
    if code is not None:
        assert caught.value.code == code
    keys = Keys(lone_gateways.prefix)
    assert not admin.exists(keys.model_stream(model).stream)  # nothing queued


def test_too_many_images_and_images_outside_a_user_turn(gateway: GatewayProcess) -> None:
    client = _openai(gateway)
    part = {"type": "image_url", "image_url": {"url": data_url(PNG)}}
    with pytest.raises(openai.BadRequestError, match="more than 16 images"):
        client.chat.completions.create(
            model="eyes", messages=[{"role": "user", "content": [part] * 17}]
        )
    with pytest.raises(openai.BadRequestError, match="image_url parts in a user turn"):
        client.chat.completions.create(
            model="eyes",
            messages=[
                {"role": "user", "content": "hi"},
                {"role": "assistant", "content": [part]},  # type: ignore[list-item]
            ],
        )


def test_models_say_which_take_images(gateway: GatewayProcess) -> None:
    listed = {model.id: model for model in _openai(gateway).models.list()}
    modalities = {
        name: json.loads(model.model_dump_json())["input_modalities"]
        for name, model in listed.items()
    }
    assert modalities == {"blind": ["text"], "eyes": ["text", "image"]}


def test_image_urls_from_allowed_hosts_are_fetched_by_the_gateway(
    lone_gateways: GatewayFactory, admin: redis.Redis, gateway: GatewayProcess
) -> None:
    """The operator allows localhost (and loopback, which is otherwise refused after
    resolution): the gateway fetches the file into a blob; a redirect is not followed; a
    host not listed is refused."""
    with serving_media({"/a.png": PNG}) as base:
        fetching = lone_gateways.start(
            "--media-fetch-host", "localhost", "--media-fetch-network", "127.0.0.0/8"
        )
        client = _openai(fetching)

        def ask(url: str) -> Any:
            part = {"type": "image_url", "image_url": {"url": url}}
            return client.chat.completions.create(
                model="eyes", messages=[{"role": "user", "content": [part]}], stream=True
            )

        ask(f"{base}/a.png").close()
        job = _queued(admin, lone_gateways.prefix, "eyes")
        assert job.images is not None and job.images[0].blob is not None
        assert admin.get(Keys(lone_gateways.prefix).blob(job.images[0].blob)) == PNG
        with pytest.raises(openai.BadRequestError, match="redirects are not followed"):
            ask(f"{base}/moved")
        with pytest.raises(openai.BadRequestError, match="does not allow"):
            ask(base.replace("localhost", "127.0.0.1") + "/a.png")
