"""How many prompt tokens a step may prefill beside the running batch's decode.

Chunked prefill with decode first (vLLM's scheduler, Sarathi-Serve's stall-free batching):
while sequences are decoding, each step decodes them and spends a bounded share of its time on
prompts. Sarathi sizes the share from an offline profile; here it comes from what this machine
does as the engine runs, since the same worker serves a 2-core CPU and an H100: an
exponential moving average of the decode step's seconds and of prefill tokens per second, both
measured on the engine thread. The budget is the tokens that fit in ``max_stall`` decode steps
at the measured prefill speed, kept between ``min_tokens`` (a long prompt always progresses)
and ``max_tokens`` (the prefill chunk).

The speed of a small chunk is lower than a large one's (a pass has fixed costs), so the budget
found from it is conservative; the next step's budget grows toward the size whose pass takes
the stall: the fixed point of ``tokens = speed(tokens) * stall``.

The bound protects a stream from work that came after it started streaming. In a burst
(requests arriving together, none of them streaming yet), the first of them to get their first
tokens have no such claim on the rest of the burst: the scheduler then asks ``burst_budget``
for the tokens that fit in the seconds those streams may still wait (``max_prefill_wait``
from their last token), and runs that prefill with no decode beside it, so the burst's first
tokens come as fast as without the bound. See ``Scheduler._burst_slack``.
"""

from __future__ import annotations

import math

from mlx_redis_worker.engine.stats import PrefillPaceStats

# Weight of a new measurement: the budget follows a change of load within a few steps, and one
# step slowed by something else (a grammar compile, the OS) moves it a third of the way.
SMOOTHING = 0.3


class PrefillPace:
    """Engine thread only: fed with the timings of decode and prefill passes, asked for the
    next step's prefill budget."""

    def __init__(
        self, max_stall: float, min_tokens: int, max_tokens: int, max_pass_seconds: float = 0.0
    ) -> None:
        self.max_stall = max_stall
        self.max_tokens = max_tokens
        self.min_tokens = min(min_tokens, max_tokens)
        # With nothing decoding, a pass may take about this long (0: a whole chunk): new
        # requests are admitted and aborts applied only between passes.
        self.max_pass_seconds = max_pass_seconds
        self.decode_seconds = 0.0
        self.prefill_rate = 0.0
        # Steps that prefilled a burst's prompts with no decode beside them (burst_budget).
        self.burst_steps = 0

    def budget(self, decoding: bool, spent: float = 0.0) -> int:
        """The prompt tokens this step may prefill. Beside decoding streams: the tokens that
        take about ``max_stall`` decode steps (the minimum until both speeds are measured).
        With nothing decoding: the tokens that take about ``max_pass_seconds`` at the measured
        speed, at most a whole chunk: on a slow machine, or deep into a long prompt (attention
        over its whole context), a whole chunk can take many seconds, and a request arriving
        meanwhile (another tenant's) waits for the pass to end. ``inf`` stall: whole chunks.
        ``spent``: decode steps of the stall this step already took (a long-context decode
        batch's pass beside the steady one)."""
        if math.isinf(self.max_stall):
            return self.max_tokens
        if not decoding:
            if not self.max_pass_seconds > 0.0 or self.prefill_rate <= 0.0:
                return self.max_tokens
            return max(self.min_tokens, self.burst_budget(self.max_pass_seconds))
        if self.decode_seconds <= 0.0 or self.prefill_rate <= 0.0:
            return self.min_tokens
        stall = max(0.0, self.max_stall - spent)
        tokens = min(self.max_tokens, self.prefill_rate * self.decode_seconds * stall)
        return max(self.min_tokens, int(tokens))

    def burst_budget(self, slack: float) -> int:
        """The prompt tokens whose pass takes at most ``slack`` seconds at the measured speed
        (0 before it is measured), at most a whole chunk."""
        if not slack > 0.0 or self.prefill_rate <= 0.0:
            return 0
        return int(min(self.max_tokens, self.prefill_rate * slack))

    def observe_decode(self, seconds: float) -> None:
        if seconds > 0.0 and math.isfinite(seconds):
            self.decode_seconds = _average(self.decode_seconds, seconds)

    def observe_prefill(self, tokens: int, seconds: float) -> None:
        if tokens > 0 and seconds > 0.0 and math.isfinite(tokens / seconds):
            self.prefill_rate = _average(self.prefill_rate, tokens / seconds)

    def stats(self) -> PrefillPaceStats:
        return PrefillPaceStats(
            budget_tokens=self.budget(decoding=True),
            decode_step_seconds=self.decode_seconds,
            prefill_tokens_per_second=self.prefill_rate,
            max_prefill_stall=self.max_stall,
            min_prefill_tokens=self.min_tokens,
            burst_steps=self.burst_steps,
        )


def _average(current: float, sample: float) -> float:
    return sample if current <= 0.0 else current + SMOOTHING * (sample - current)
