"""Hand-off of streamed outputs to the caller waiting on a request.

``RequestOutputCollector`` lives on the caller's event loop: the engine thread hands it each
step's outputs in one ``call_soon_threadsafe`` per step. When the caller falls behind, outputs
are merged (deltas concatenated) instead of queued, so a slow reader costs O(1) memory and never
loses a token. ``RequestStreamState`` decides, on the engine thread, when enough tokens have
accumulated to emit (``stream_interval``).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from mlx_redis_worker.engine.request import RequestOutput


class RequestOutputCollector:
    def __init__(self, aggregate: bool = True) -> None:
        self.aggregate = aggregate
        self._pending: list[RequestOutput] = []
        self._ready = asyncio.Event()

    def put(self, output: RequestOutput) -> None:
        if self.aggregate and self._pending:
            self._pending[-1] = output.merged_after(self._pending[-1])
        else:
            self._pending.append(output)
        self._ready.set()

    def get_nowait(self) -> RequestOutput | None:
        if not self._pending:
            return None
        output = self._pending.pop(0)
        if not self._pending:
            self._ready.clear()
        return output

    async def get(self) -> RequestOutput:
        while True:
            output = self.get_nowait()
            if output is not None:
                return output
            await self._ready.wait()

    def clear(self) -> None:
        self._pending.clear()
        self._ready.clear()


@dataclass(slots=True)
class RequestStreamState:
    """Emit every ``stream_interval`` tokens, and always the final output; remembers how much of
    the request's transcript (tokens, text pieces) the outputs so far have carried."""

    stream_interval: int = 1
    sent_tokens: int = 0
    sent_text_parts: int = 0

    def should_send(self, completion_tokens: int, finished: bool) -> bool:
        return finished or completion_tokens - self.sent_tokens >= self.stream_interval

    def mark_sent(self, completion_tokens: int, text_parts: int) -> None:
        self.sent_tokens = completion_tokens
        self.sent_text_parts = text_parts
