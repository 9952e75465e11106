"""Embeddings through the queue: one worker serving a text model (``tiny``) and an embedding
model (``tiny-embed``) side by side, a gateway in front, and every way in: openai's
``embeddings.create``, langchain-openai's ``OpenAIEmbeddings``, ``Client.embed`` and
``mlx-worker embed``. Each vector is compared with the model's own, computed here alone."""

from __future__ import annotations

import asyncio
import base64
import json
from collections.abc import Iterator
from typing import Any

import numpy as np
import openai
import pytest
from langchain_openai import OpenAIEmbeddings

from mlx_redis_protocol.client import Client
from mlx_redis_protocol.embeddings import EmbeddingFailed
from mlx_redis_protocol.messages import DoneEvent, ErrorEvent
from mlx_redis_worker.engine.embedding_model import EmbeddingModel
from mlx_redis_worker.local_redis import RedisServer
from tests.gateway.conftest import Fleet, running_fleet
from tests.support.gateway import GatewayProcess
from tests.support.processes import mlx_worker

TEXT, EMBED = "tiny", "tiny-embed"
TEXTS = ["The river runs under the old bridge.", "bread", "Seven sailors sailed for days."]


@pytest.fixture(scope="module")
def fleet(redis_server: RedisServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    """One worker process serving the text model and the embedding model side by side."""
    directory = tmp_path_factory.mktemp("fleet")
    with running_fleet(redis_server, directory, model=f"{TEXT},{EMBED}") as fleet:
        yield fleet


def own_vector(model: EmbeddingModel, item: str | list[int]) -> np.ndarray[Any, Any]:
    """The model's vector of one input, computed alone in this process."""
    return model.embed([model.input_ids(item)])[0]


def token_count(model: EmbeddingModel, texts: list[str]) -> int:
    return sum(len(model.input_ids(text)) for text in texts)


def test_openai_sdk_embeds_as_openai_does(
    client: openai.OpenAI, tiny_embed_model: EmbeddingModel
) -> None:
    answer = client.embeddings.create(model=EMBED, input=TEXTS)
    assert [item.index for item in answer.data] == [0, 1, 2]
    for item, text in zip(answer.data, TEXTS, strict=True):
        np.testing.assert_allclose(item.embedding, own_vector(tiny_embed_model, text), atol=2e-6)
    assert answer.usage.prompt_tokens == answer.usage.total_tokens
    assert answer.usage.prompt_tokens == token_count(tiny_embed_model, TEXTS)
    assert answer.model == EMBED

    # base64: the little-endian float32 bytes of the same vector.
    raw = client.embeddings.with_raw_response.create(
        model=EMBED, input="bread", encoding_format="base64"
    )
    encoded = json.loads(raw.text)["data"][0]["embedding"]
    decoded = np.frombuffer(base64.b64decode(encoded), dtype="<f4")
    np.testing.assert_allclose(decoded, own_vector(tiny_embed_model, "bread"), atol=2e-6)

    # Token ids, one list and several; and a documented Matryoshka length, back at unit length.
    ids = tiny_embed_model.tokenizer.encode("bread", add_special_tokens=False)
    for given in (ids, [ids, ids]):
        got = client.embeddings.create(model=EMBED, input=given).data[0].embedding
        np.testing.assert_allclose(got, own_vector(tiny_embed_model, "bread"), atol=2e-6)
    short = client.embeddings.create(model=EMBED, input="bread", dimensions=64).data[0].embedding
    full = own_vector(tiny_embed_model, "bread")
    np.testing.assert_allclose(short, full[:64] / np.linalg.norm(full[:64]), atol=2e-6)


def test_what_a_model_cannot_do_is_a_typed_400(
    client: openai.OpenAI, tiny_embed_model: EmbeddingModel
) -> None:
    with pytest.raises(openai.BadRequestError, match="dimensions must be from 32 to 128"):
        client.embeddings.create(model=EMBED, input="bread", dimensions=16)
    with pytest.raises(openai.BadRequestError, match=r"over the model's limit of 256 tokens"):
        client.embeddings.create(model=EMBED, input=[[7] * 300])
    with pytest.raises(openai.BadRequestError, match="is a text model: it takes prompts only"):
        client.embeddings.create(model=TEXT, input="bread")
    with pytest.raises(openai.BadRequestError, match="is an embedding model"):
        client.chat.completions.create(
            model=EMBED, messages=[{"role": "user", "content": "hi"}], max_tokens=4
        )
    with pytest.raises(openai.BadRequestError) as refused:
        client.embeddings.create(model=EMBED, input=[])
    assert refused.value.body["param"] == "input"  # type: ignore[index]
    with pytest.raises(openai.NotFoundError):
        client.embeddings.create(model="no-such-model", input="bread")


def test_langchain_openai_embeddings(
    gateway: GatewayProcess, tiny_embed_model: EmbeddingModel
) -> None:
    embeddings = OpenAIEmbeddings(
        model=EMBED,
        base_url=gateway.base_url,
        api_key="none",  # type: ignore[arg-type]
        # langchain counts tokens with tiktoken (OpenAI's vocabulary) unless told not to.
        check_embedding_ctx_length=False,
        max_retries=0,
    )
    documents = embeddings.embed_documents(TEXTS)
    for got, text in zip(documents, TEXTS, strict=True):
        np.testing.assert_allclose(got, own_vector(tiny_embed_model, text), atol=2e-6)
    query = embeddings.embed_query("bread")
    np.testing.assert_allclose(query, own_vector(tiny_embed_model, "bread"), atol=2e-6)


def test_client_and_command_line_beside_a_text_model(
    fleet: Fleet, tiny_embed_model: EmbeddingModel
) -> None:
    async def scenario() -> tuple[Any, ...]:
        async with Client(fleet.redis_url, prefix=fleet.prefix) as client:
            return await asyncio.gather(
                client.embed(TEXTS, model=EMBED, timeout=60),
                client.generate("Side by side", model=TEXT, max_tokens=4, timeout=60),
                client.embed(["too long " * 200], model=EMBED, timeout=60),
                client.generate("Side by side", model=EMBED, max_tokens=4, timeout=60),
                client.cache_save("embedder", model=EMBED, timeout=30),
                return_exceptions=True,
            )

    embedded, generated, too_long, wrong_kind, saved = asyncio.run(scenario())
    (reply,) = saved
    assert not reply.ok and reply.error is not None and reply.error.code == "invalid_field"
    assert "is an embedding model: it keeps no prefix cache" in reply.error.message
    for got, text in zip(embedded.as_floats(), TEXTS, strict=True):
        np.testing.assert_allclose(got, own_vector(tiny_embed_model, text), atol=2e-6)
    assert isinstance(generated, DoneEvent) and generated.usage.completion_tokens > 0
    assert isinstance(too_long, EmbeddingFailed) and too_long.code == "invalid_job"
    assert "over the model's limit" in too_long.message
    assert isinstance(wrong_kind, ErrorEvent) and wrong_kind.code == "invalid_job"

    connection = ["--redis-url", fleet.redis_url, "--prefix", fleet.prefix]
    done = mlx_worker("embed", *connection, "--model", EMBED, "bread", "A quiet morning")
    assert done.returncode == 0, done.stderr
    lines = [json.loads(line) for line in done.stdout.splitlines()]
    assert [line["index"] for line in lines] == [0, 1]
    np.testing.assert_allclose(
        lines[0]["embedding"], own_vector(tiny_embed_model, "bread"), atol=2e-6
    )
