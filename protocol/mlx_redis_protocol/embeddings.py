"""An embedding job's answer: its vectors, gathered from its events in order.

On the wire each vector is little-endian float32 bytes (an ``embedding`` event carries a run
of them); ``Embeddings`` gives them as lists of floats, or as OpenAI's ``base64`` encoding
(the base64 of exactly those bytes). ``EmbeddingCollector`` follows one request's events (a
``reset`` drops what an earlier attempt sent) to its terminal event; the client's
``Client.embed`` and the gateway's ``/v1/embeddings`` both read answers through it.
"""

from __future__ import annotations

import base64
import sys
from array import array
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from mlx_redis_protocol.errors import ClientError, ProtocolError
from mlx_redis_protocol.identifiers import new_request_id
from mlx_redis_protocol.messages import (
    DoneEvent,
    EmbeddingEvent,
    ErrorEvent,
    Event,
    Job,
    ResetEvent,
    Usage,
)

ENCODINGS = ("float", "base64")


def floats(vector: bytes) -> list[float]:
    """A wire vector (little-endian float32 bytes) as Python floats."""
    values = array("f", vector)
    if sys.byteorder == "big":
        values.byteswap()
    return values.tolist()


@dataclass(frozen=True, slots=True)
class Embeddings:
    """A finished embedding job: one vector per input, in input order, and its usage
    (``prompt_tokens``: the tokens its inputs took, with the model's special tokens)."""

    request_id: str
    vectors: tuple[bytes, ...]
    usage: Usage

    def as_floats(self) -> list[list[float]]:
        return [floats(vector) for vector in self.vectors]

    def as_base64(self) -> list[str]:
        return [base64.b64encode(vector).decode("ascii") for vector in self.vectors]

    def encoded(self, encoding_format: str) -> list[list[float]] | list[str]:
        """The vectors as OpenAI's ``encoding_format`` gives them: ``float`` or ``base64``."""
        return self.as_base64() if encoding_format == "base64" else self.as_floats()


class EmbeddingFailed(ClientError):
    """The embedding job ended with an ``error`` event (``code``, ``message``) or without
    all its vectors (an abort)."""

    def __init__(self, request_id: str, code: str, message: str) -> None:
        super().__init__(f"embedding request {request_id} failed ({code}): {message}")
        self.request_id = request_id
        self.code = code
        self.message = message


class EmbeddingCollector:
    """Feed one request's events in seq order; ``result`` once it has ended."""

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        self._vectors: list[bytes] = []
        self.done: DoneEvent | None = None
        self.error: ErrorEvent | None = None

    @property
    def finished(self) -> bool:
        return self.done is not None or self.error is not None

    def feed(self, event: Event) -> None:
        if isinstance(event, ResetEvent):
            self._vectors = []
        elif isinstance(event, EmbeddingEvent):
            if event.index != len(self._vectors):  # a worker's bug, not a client's problem
                raise EmbeddingFailed(
                    self.request_id,
                    "internal",
                    f"vectors from input {event.index} came after {len(self._vectors)} vectors",
                )
            self._vectors.extend(event.vectors)
        elif isinstance(event, DoneEvent):
            self.done = event
        elif isinstance(event, ErrorEvent):
            self.error = event

    def result(self, inputs: int | None = None) -> Embeddings:
        """The answer; ``EmbeddingFailed`` when the job failed or ended short of
        ``inputs`` vectors (an abort, an expired deadline)."""
        if self.error is not None:
            raise EmbeddingFailed(self.request_id, self.error.code, self.error.message)
        done = self.done
        if done is None:
            raise EmbeddingFailed(self.request_id, "internal", "the request has not ended")
        if done.finish_reason != "stop" or (inputs is not None and len(self._vectors) != inputs):
            raise EmbeddingFailed(
                self.request_id,
                done.finish_reason,
                f"ended ({done.finish_reason}) with {len(self._vectors)} vectors",
            )
        return Embeddings(self.request_id, tuple(self._vectors), done.usage)


EmbeddingInputs = str | Sequence[int] | Sequence[str | Sequence[int]]


def embedding_job(
    inputs: EmbeddingInputs,
    *,
    model: str | None = None,
    dimensions: int | None = None,
    request_id: str | None = None,
    tenant: str | None = None,
    priority: int | None = None,
    metadata: Mapping[str, Any] | None = None,
    deadline: float | None = None,
) -> Job:
    """The job that embeds ``inputs``, as OpenAI's ``input`` takes them: a text, texts, one
    list of token ids, or lists of token ids. (Checked by the job decoder when queued.)"""
    return Job(
        request_id=request_id or new_request_id(),
        input=embedding_inputs(inputs),
        dimensions=dimensions,
        model=model,
        tenant=tenant,
        priority=priority,
        metadata=metadata,
        deadline=deadline,
    )


def embedding_inputs(inputs: EmbeddingInputs) -> tuple[str | tuple[int, ...], ...]:
    """OpenAI's ``input`` shapes as the job's ``input``: a list of texts or of token-id
    lists (one list of ints is one input). ``ProtocolError`` for anything else."""
    if isinstance(inputs, str):
        return (inputs,)
    items = list(inputs) if isinstance(inputs, Sequence) else None
    if not items:
        raise ProtocolError("invalid_field", "input must be a string or a non-empty array")
    if all(isinstance(item, int) and not isinstance(item, bool) for item in items):
        return (tuple(items),)  # type: ignore[arg-type]  # ints, checked just above
    converted: list[str | tuple[int, ...]] = []
    for item in items:
        if isinstance(item, str):
            converted.append(item)
        elif isinstance(item, Sequence) and all(
            isinstance(token, int) and not isinstance(token, bool) for token in item
        ):
            converted.append(tuple(int(token) for token in item))
        else:
            raise ProtocolError(
                "invalid_field",
                "input must hold strings or arrays of token ids (integers), not a mix of "
                "single integers and arrays",
            )
    return tuple(converted)
