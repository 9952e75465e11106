"""How many prompt tokens a step may prefill beside the running batch's decode.

Chunked prefill with decode first (vLLM's scheduler, Sarathi-Serve's stall-free batching):
while sequences are decoding, each step decodes them and spends a bounded share of its time on
prompts. Sarathi sizes the share from an offline profile; here it comes from what this machine
does as the engine runs, since the same worker serves a 2-core CPU and an H100: an
exponential moving average of the decode step's seconds and of prefill tokens per second, both
measured on the engine thread. The budget is the tokens that fit in ``max_stall`` decode steps
at the measured prefill speed, kept between a floor (a long prompt always progresses:
``min_tokens``, fewer where such a pass would take longer than a decode step) and
``max_tokens`` (the prefill chunk).

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

# The least share of a steady decode step that prompts in prefill earn each step, whatever
# the stall bound (0 included): a long prompt always progresses.
MIN_SHARE = 0.125

# A pass of short prompts beside decoding may take up to this many steady decode steps when
# that ends its prompts (``short_pass_tokens``): a chat prompt's prefill ends in a pass or two
# instead of in shares of the credit, each waiting for it (the pass beyond its credit is paid
# back by the steps after it).
SHORT_PASS_STEPS = 4.0

# While the prompt the next pass would end is chat-size (it ends within a short pass), steps
# earn at least this share of a decode step: prefill and decode take turns in equal time, as
# they did before the stall bound, and the bound's share is kept for long prompts. At 0.2
# for every prompt, 8 chat prompts (33 tokens each) beside 4 other streams on tiny took
# 4 passes, each repaid over 15-20 steps: their first tokens came 4-5x later than with nothing
# else decoding.
CHAT_SHARE = 1.0

# Where a pass of ``min_tokens`` takes longer than a steady decode step (deep in a long prompt,
# where every token attends over the whole context), the floor shrinks to what fits in one
# step, down to this fraction of ``min_tokens``: a stream's longest gap stays near two steps.
FLOOR_FRACTION = 0.25

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
        # Prefill tokens a second of each prompt lane (short, long: see PromptLane): a narrow
        # pass of short prompts goes several times faster a token than one deep in long ones.
        self._rates = [0.0, 0.0]
        # The lane the next pass prefills (the scheduler sets it from the generator).
        self.lane = 0
        # Seconds of prefill beside decoding earned and not yet spent (``earn``, ``spend``).
        self.credit = 0.0
        # Steps that prefilled a burst's prompts with no decode beside them (burst_budget).
        self.burst_steps = 0

    @property
    def prefill_rate(self) -> float:
        """The measured prefill speed (tokens a second) of the lane the next pass prefills;
        the other lane's until this one's first pass is measured (a first pass deep in a
        26k-token prompt, sized as a whole chunk, took 5.2 s on tiny while others waited)."""
        return self._rates[self.lane] or self._rates[1 - self.lane]

    @property
    def floor(self) -> int:
        """The fewest tokens a pass beside decoding takes: ``min_tokens``, or what the lane's
        measured speed does in one steady decode step where that is less (at least
        ``FLOOR_FRACTION`` of ``min_tokens``): beside a 26k-token prompt on tiny a pass of 32
        tokens took two to eight decode steps, each a gap in every stream."""
        fits = self.prefill_rate * self.decode_seconds
        if not 0.0 < fits < math.inf:  # a speed not yet measured
            return self.min_tokens
        least = max(1, math.ceil(self.min_tokens * FLOOR_FRACTION))
        return max(least, min(self.min_tokens, int(fits)))

    def budget(self, decoding: bool) -> int:
        """The prompt tokens this step may prefill. Beside decoding streams: the tokens the
        stall credit pays for at the measured speed (``earn``), 0 while that is less than
        the ``floor`` (this step decodes only), ``min_tokens`` until both speeds are measured.
        With nothing decoding: the tokens that take about ``max_pass_seconds`` at the measured
        speed, at most a whole chunk: on a slow machine, or deep into a long prompt (attention
        over its whole context), a whole chunk can take many seconds, and a request arriving
        meanwhile (another tenant's) waits for the pass to end. ``inf`` stall: whole chunks."""
        if math.isinf(self.max_stall):
            return self.max_tokens
        if not decoding:
            if not self.max_pass_seconds > 0.0 or self.prefill_rate <= 0.0:
                return self.max_tokens
            return max(self.min_tokens, self.burst_budget(self.max_pass_seconds))
        if self.decode_seconds <= 0.0 or self.prefill_rate <= 0.0:
            return self.min_tokens
        # Rounded: a credit capped at the floor's seconds pays for the floor exactly.
        tokens = round(self.prefill_rate * self.credit, 6)
        if tokens < self.floor:
            return 0
        return int(min(self.max_tokens, tokens))

    def short_pass_tokens(self) -> int:
        """The tokens a pass of short prompts beside decoding may take to end them: what the
        short lane's measured speed does in ``SHORT_PASS_STEPS`` steady decode steps (0 before
        both are measured), at most a chunk."""
        return int(min(self.max_tokens, self._rates[0] * SHORT_PASS_STEPS * self.decode_seconds))

    def earn(self, chat: bool = False) -> None:
        """A decode step runs while prompts wait for prefill: the credit grows by
        ``max_stall`` of a steady decode step (at least ``MIN_SHARE``: prompts always
        progress; at least ``CHAT_SHARE`` while the next pass would end a ``chat`` prompt,
        one of at most ``short_pass_tokens``), up to one pass of the ``floor`` or one stall,
        whichever takes longer: a pass waits for its credit instead of stretching every step
        (beside four long prompts deep in prefill on tiny, a pass of 32 tokens took 2x a
        decode step: each step was 3x)."""
        if math.isinf(self.max_stall) or self.decode_seconds <= 0.0:
            return
        share = max(self.max_stall, MIN_SHARE, CHAT_SHARE if chat else 0.0)
        floor_seconds = self.floor / self.prefill_rate if self.prefill_rate > 0.0 else 0.0
        cap = max(floor_seconds, share * self.decode_seconds)
        credit = min(cap, self.credit + share * self.decode_seconds)
        if math.isfinite(credit):  # absurd measurements leave it as it was
            self.credit = credit

    def spend(self, seconds: float) -> None:
        """A pass beside decoding took ``seconds`` of the credit (a pass slower than its
        credit is paid back by the steps after it)."""
        credit = self.credit - seconds
        if seconds > 0.0 and math.isfinite(credit) and not math.isinf(self.max_stall):
            self.credit = credit

    def burst_budget(self, slack: float) -> int:
        """The prompt tokens whose pass takes at most ``slack`` seconds at the measured speed
        (0 before it is measured), at most a whole chunk."""
        if not slack > 0.0 or self.prefill_rate <= 0.0:
            return 0
        return int(min(self.max_tokens, self.prefill_rate * slack))

    def seconds_for(self, tokens: int) -> float:
        """The seconds a pass of ``tokens`` takes at the measured speed (inf before it is
        measured)."""
        rate = self.prefill_rate
        return tokens / rate if rate > 0.0 else math.inf

    def observe_decode(self, seconds: float) -> None:
        if seconds > 0.0 and math.isfinite(seconds):
            self.decode_seconds = _average(self.decode_seconds, seconds)

    def observe_prefill(self, tokens: int, seconds: float) -> None:
        if tokens > 0 and seconds > 0.0 and math.isfinite(tokens / seconds):
            self._rates[self.lane] = _average(self._rates[self.lane], tokens / seconds)

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
