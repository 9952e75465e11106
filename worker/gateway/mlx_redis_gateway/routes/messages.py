"""``POST /v1/messages`` and ``POST /v1/messages/count_tokens``: Anthropic's Messages API over
a chat job (``anthropic_api``), answered as a message or its event stream
(``anthropic_shaping``); every refusal in Anthropic's error shape (``errors``).

The gateway has no tokenizer, so ``count_tokens`` asks a worker of the model: its job, queued
like any other (the same key, quota and fair share), is rendered and tokenized exactly as the
request would be run (chat template, tools and all) and ends with the count, the model not run.
"""

from __future__ import annotations

import re
from typing import Final

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from mlx_redis_gateway.anthropic_api import parse_messages_request
from mlx_redis_gateway.api_keys import ApiKey
from mlx_redis_gateway.errors import bad_request
from mlx_redis_gateway.gateway import Gateway, client_left, id_headers
from mlx_redis_gateway.openai_api import CompletionRequest

# The first version of the API with the Messages events this gateway sends (``anthropic-version``
# names a date; 2023-01-01 streamed otherwise). Later versions are answered the same way, the
# shapes the SDKs of those versions parse (anthropic 2.17's, 2026-10-21, is tested); a request
# without the header is read as this one.
FIRST_VERSION: Final = "2023-06-01"
_VERSION: Final = re.compile(r"\d{4}-\d{2}-\d{2}")


def check_version(request: Request) -> None:
    """400 for an ``anthropic-version`` that is no date, or one before the Messages events."""
    version = request.headers.get("anthropic-version", FIRST_VERSION).strip()
    if not _VERSION.fullmatch(version) or version < FIRST_VERSION:
        raise bad_request(
            f"anthropic-version {version[:64]!r} is not supported: this gateway speaks "
            f"{FIRST_VERSION} and later versions",
            param="anthropic-version",
        )


class MessageRoutes:
    def __init__(self, gateway: Gateway) -> None:
        self.gateway = gateway

    async def create(self, request: Request) -> Response:
        accepted, key = await self._accepted(request, count_only=False)
        return await self.gateway.serve(request, accepted, key)

    async def count_tokens(self, request: Request) -> Response:
        """``{"input_tokens": N}``: the prompt's tokens as the model's worker counts them."""
        gateway = self.gateway
        accepted, key = await self._accepted(request, count_only=True)
        request_id = accepted.request_id
        shape = await gateway.admit_and_submit(accepted, key)
        shaper = await gateway.finished(request, request_id, shape, resumable=False)
        if shaper is None:
            return client_left()
        if shaper.error is not None:
            raise shaper.error
        assert shaper.done is not None
        return JSONResponse(
            {"input_tokens": shaper.done.usage.prompt_tokens},
            headers=id_headers(request_id, anthropic=True),
        )

    async def _accepted(
        self, request: Request, *, count_only: bool
    ) -> tuple[CompletionRequest, ApiKey | None]:
        """The request's job (its version, key and body checked; its model served, and taking
        images if it has some), and its key."""
        gateway = self.gateway
        check_version(request)
        key = gateway.auth.api_key(request)
        async with gateway.screening(key):
            accepted = parse_messages_request(
                await gateway.json_body(request),
                limits=gateway.settings.limits,
                user_key=key.name if key is not None else None,
                count_only=count_only,
                counts=gateway.settings.counts,
            )
            await gateway.check_served(accepted.model)
            await gateway.check_media(accepted)
        return accepted, key
