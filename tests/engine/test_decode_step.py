"""The decode step's per-row work stays in the rows that need it.

mlx-lm's step slices every row through the logits processors once one row has a processor,
and samples every row alone once one row has a sampler of its own. Here a batch of greedy rows
beside a constrained row and a seeded stochastic row is sampled by the shared sampler in one
call a step, and each greedy row's tokens are the ones it makes alone."""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from mlx_redis_worker.engine import speculative_batch
from mlx_redis_worker.engine.config import SchedulerConfig
from mlx_redis_worker.engine.request import Request, ResponseFormat, SamplingParams
from mlx_redis_worker.engine.scheduler import Scheduler
from tests.engine.test_stall_free import tokens_of_length

GREEDY_ROWS = 4
STEPS = 12


def greedy_tokens(scheduler: Scheduler, names: list[str]) -> dict[str, list[int]]:
    tokens: dict[str, list[int]] = {name: [] for name in names}
    for _ in range(STEPS):
        for output in scheduler.step().outputs:
            if output.request_id in tokens:
                tokens[output.request_id] += output.new_token_ids
    return tokens


def add_constrained(scheduler: Scheduler, prompt: list[int], *, temperature: float) -> None:
    """A request constrained to a JSON object: a row with a grammar processor of its own."""
    json_object = ResponseFormat(type="json_object")
    params = SamplingParams(max_tokens=STEPS, temperature=temperature, response_format=json_object)
    request = Request("constrained", prompt, params)
    request.grammar = scheduler.grammars.compile(json_object)
    scheduler.add_request(request)


def test_greedy_rows_are_sampled_in_one_call_beside_rows_with_their_own(
    tiny_model: Any, on_a_stream: Any
) -> None:
    model, tokenizer = tiny_model
    config = SchedulerConfig(enable_prefix_cache=False, max_num_seqs=8, prefill_batch_size=8)
    names = [f"greedy{i}" for i in range(GREEDY_ROWS)]
    greedy = SamplingParams(max_tokens=STEPS, temperature=0.0)

    def run(with_others: bool) -> tuple[dict[str, list[int]], list[int]]:
        scheduler = Scheduler(model, tokenizer, config)
        scheduler.attach_stream(on_a_stream)
        generator = scheduler._ensure_generator()
        shared = generator.sampler
        rows_per_call: list[int] = []

        def counted(logprobs: mx.array) -> mx.array:
            rows_per_call.append(logprobs.shape[0])
            return shared(logprobs)

        generator.sampler = counted
        for i, name in enumerate(names):
            scheduler.add_request(Request(name, tokens_of_length(tokenizer, 20, i), greedy))
        if with_others:
            sampled = SamplingParams(max_tokens=STEPS, temperature=0.8, seed=7)
            scheduler.add_request(Request("sampled", tokens_of_length(tokenizer, 20, 9), sampled))
            add_constrained(scheduler, tokens_of_length(tokenizer, 20, 11), temperature=0.0)
        tokens = greedy_tokens(scheduler, names)
        scheduler.abort_all()
        scheduler.close()
        return tokens, rows_per_call

    alone, _ = run(with_others=False)
    beside, rows_per_call = run(with_others=True)
    assert beside == alone
    assert all(len(tokens) >= STEPS - 2 for tokens in beside.values())
    # After the group's first token (mlx-lm's own step: a call of one row for each greedy
    # row), one call of the shared sampler a decode step over the whole batch (mlx-lm: one
    # call of one row for each greedy row, every step).
    assert rows_per_call.count(1) <= GREEDY_ROWS
    assert sum(rows > GREEDY_ROWS for rows in rows_per_call) >= STEPS - 3


def test_sampled_rows_are_drawn_in_one_call_and_each_draws_what_it_draws_alone(
    tiny_model: Any, on_a_stream: Any, monkeypatch: Any
) -> None:
    """Rows of their own seeded samplers (temperatures, top-k, top-p) beside greedy rows and a
    constrained one: a decode step draws all the plain categorical rows in one call, and each
    row's tokens are the ones it samples alone (the same key, the same draw)."""
    model, tokenizer = tiny_model
    config = SchedulerConfig(enable_prefix_cache=False, max_num_seqs=8, prefill_batch_size=8)
    sampled = {
        "hot": SamplingParams(max_tokens=STEPS, temperature=1.5, seed=1),
        "cool": SamplingParams(max_tokens=STEPS, temperature=0.4, seed=2),
        "top-k": SamplingParams(max_tokens=STEPS, temperature=1.0, top_k=5, seed=3),
        "top-p": SamplingParams(max_tokens=STEPS, temperature=1.0, top_p=0.8, seed=4),
    }
    greedy = SamplingParams(max_tokens=STEPS, temperature=0.0)
    calls: list[int] = []
    drawn = speculative_batch.draw_rows

    def counted(samplers: Any, logprobs: mx.array) -> mx.array:
        calls.append(len(samplers))
        return drawn(samplers, logprobs)

    monkeypatch.setattr(speculative_batch, "draw_rows", counted)

    def run(names: list[str], crowded: bool) -> dict[str, list[int]]:
        scheduler = Scheduler(model, tokenizer, config)
        scheduler.attach_stream(on_a_stream)
        for name in names:
            prompt = tokens_of_length(tokenizer, 20, list(sampled).index(name))
            scheduler.add_request(Request(name, prompt, sampled[name]))
        if crowded:
            for i in range(2):
                prompt = tokens_of_length(tokenizer, 20, 10 + i)
                scheduler.add_request(Request(f"greedy{i}", prompt, greedy))
            add_constrained(scheduler, tokens_of_length(tokenizer, 20, 20), temperature=0.7)
        tokens = greedy_tokens(scheduler, names)
        scheduler.abort_all()
        scheduler.close()
        return tokens

    together = run(list(sampled), crowded=True)
    assert calls and max(calls) == len(sampled)  # every plain categorical row in one call
    assert sum(n == len(sampled) for n in calls) >= STEPS - 3
    for name in sampled:
        assert together[name] == run([name], crowded=False)[name], name
    assert len({tuple(tokens) for tokens in together.values()}) == len(sampled)
