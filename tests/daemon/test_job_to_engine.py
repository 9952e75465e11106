"""The wire's job fields and the engine's request API agree: the join the daemon relies on."""

from __future__ import annotations

import dataclasses

import pytest

from mlx_redis_protocol.limits import DEFAULT_LIMITS
from mlx_redis_protocol.messages import SAMPLING_FIELDS, Job
from mlx_redis_worker.daemon.jobs import job_speculative, speculative_params
from mlx_redis_worker.daemon.settings import WorkerSettings, parse_speculative
from mlx_redis_worker.daemon.worker import scheduler_config
from mlx_redis_worker.engine import SamplingParams, SpeculativeParams
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


def test_a_jobs_speculative_choice_beats_the_worker_default() -> None:
    default = SpeculativeParams(num_draft_tokens=6)
    plain = Job(request_id="r", prompt="p")
    assert job_speculative(plain, None) is None
    assert job_speculative(plain, default) == default
    off = dataclasses.replace(plain, speculative={"method": "off"})
    assert job_speculative(off, default) is None
    named = dataclasses.replace(plain, speculative={"method": "prompt_lookup"})
    assert job_speculative(named, default) == default  # the default's draft length
    assert job_speculative(named, None) == SpeculativeParams()
    full = dataclasses.replace(
        plain, speculative={"method": "prompt_lookup", "num_draft_tokens": 2}
    )
    assert job_speculative(full, default) == SpeculativeParams(num_draft_tokens=2)


def test_the_speculative_setting_parses_or_says_what_is_wrong() -> None:
    assert parse_speculative("off") is None
    assert parse_speculative("prompt_lookup") == ("prompt_lookup", 4)
    assert speculative_params(parse_speculative("prompt_lookup:8")) == SpeculativeParams(
        num_draft_tokens=8
    )
    for bad in ("on", "prompt_lookup:0", "prompt_lookup:17", "prompt_lookup:x", "off:2"):
        with pytest.raises(ValueError, match="speculative"):
            parse_speculative(bad)
    with pytest.raises(ValueError, match="speculative"):
        WorkerSettings(speculative="medusa")
