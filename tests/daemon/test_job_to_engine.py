"""The wire's job fields and the engine's request API agree: the join the daemon relies on."""

from __future__ import annotations

import dataclasses

from mlx_redis_protocol.limits import DEFAULT_LIMITS
from mlx_redis_protocol.messages import SAMPLING_FIELDS, Job
from mlx_redis_worker.daemon.worker import scheduler_config
from mlx_redis_worker.engine import SamplingParams
from tests.protocol.messages_samples import JOBS


def test_every_sampling_field_of_a_job_is_a_sampling_params_field() -> None:
    engine_fields = {f.name for f in dataclasses.fields(SamplingParams)}
    missing = [name for name in SAMPLING_FIELDS if name not in engine_fields]
    assert not missing, f"job sampling fields SamplingParams lacks: {missing}"


def test_every_sampling_field_is_a_job_field() -> None:
    job_fields = {f.name for f in dataclasses.fields(Job)}
    assert set(SAMPLING_FIELDS) <= job_fields


def test_a_job_with_every_sampling_field_set_makes_sampling_params() -> None:
    job = next(j for j in JOBS if j.request_id == "req.2:full")
    kwargs = job.sampling_kwargs()
    assert set(kwargs) == set(SAMPLING_FIELDS)
    params = SamplingParams(**kwargs)
    for name, value in kwargs.items():
        assert getattr(params, name) == value


def test_the_engine_enforces_the_wires_caps() -> None:
    """One source for the caps a job meets twice (decoder, then engine): the protocol's."""
    config = scheduler_config(max_concurrency=4, limits=DEFAULT_LIMITS)
    assert config.max_prompt_tokens == DEFAULT_LIMITS.max_prompt_tokens
    assert config.max_logprobs == DEFAULT_LIMITS.max_logprobs
