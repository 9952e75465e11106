"""OpenAI's ``POST /v1/embeddings`` body → an embedding job, and its answer's body.

``input``: a string, an array of strings, an array of token ids, or an array of arrays of
token ids (each array one input); ``encoding_format``: ``float`` (default) or ``base64``;
``dimensions``: shorter vectors where the model documents them (the worker says no, a 400,
for a model that does not); ``user``: kept in the job's metadata. Whatever else the body
holds is ignored, as OpenAI's API ignores what it does not know.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mlx_redis_gateway.errors import bad_request
from mlx_redis_protocol.codec_job import decode_job, encode_job
from mlx_redis_protocol.embeddings import ENCODINGS, Embeddings, embedding_job
from mlx_redis_protocol.errors import ProtocolError
from mlx_redis_protocol.identifiers import ID_RULE, is_valid_id, new_request_id
from mlx_redis_protocol.limits import Limits
from mlx_redis_protocol.messages import Job


@dataclass(frozen=True, slots=True)
class EmbeddingRequest:
    model: str
    job: Job
    encoding_format: str

    @property
    def inputs(self) -> int:
        assert self.job.input is not None
        return len(self.job.input)


def parse_embedding_request(
    body: object, *, limits: Limits, user_key: str | None = None
) -> EmbeddingRequest:
    """The request in a decoded JSON ``body``; ApiError (400) when it cannot be honoured.
    ``user_key``: the API key's name (the job's tenant, and in its metadata)."""
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    model = body.get("model")
    if not isinstance(model, str) or not is_valid_id(model):
        raise bad_request(f"model must be {ID_RULE}", param="model", code="model_not_found")
    encoding = body.get("encoding_format") or "float"
    if encoding not in ENCODINGS:
        raise bad_request(
            f"encoding_format must be one of {', '.join(ENCODINGS)}", param="encoding_format"
        )
    dimensions = body.get("dimensions")
    if dimensions is not None and (
        isinstance(dimensions, bool) or not isinstance(dimensions, int) or dimensions < 1
    ):
        raise bad_request("dimensions must be an integer >= 1", param="dimensions")
    user = body.get("user")
    metadata = {"user": user, "api_key": user_key} if isinstance(user, str) else None
    if user_key is not None:
        metadata = {**(metadata or {}), "api_key": user_key}
    try:
        job = embedding_job(
            body.get("input"),  # type: ignore[arg-type]  # any JSON: checked right here
            model=model,
            dimensions=dimensions,
            request_id=f"emb-{new_request_id()}",
            tenant=user_key,
            metadata=metadata,
        )
        decode_job(encode_job(job), limits)  # the job's own limits, said before queueing
    except ProtocolError as exc:
        raise bad_request(exc.message, param="input", code=exc.code) from exc
    return EmbeddingRequest(model=model, job=job, encoding_format=str(encoding))


def embeddings_body(model: str, result: Embeddings, encoding_format: str) -> dict[str, Any]:
    """OpenAI's answer: the vectors in input order, and the usage."""
    tokens = result.usage.prompt_tokens
    return {
        "object": "list",
        "data": [
            {"object": "embedding", "index": index, "embedding": vector}
            for index, vector in enumerate(result.encoded(encoding_format))
        ],
        "model": model,
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
    }
