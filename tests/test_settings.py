"""Worker settings: precedence flags > MLXW_* env > TOML file > defaults, and validation."""

from __future__ import annotations

from pathlib import Path

import pytest

from mlx_redis_protocol.cli import build_parser
from mlx_redis_worker.daemon.settings import WorkerSettings, default_worker_id, load_settings
from tests.support.processes import mlx_worker


def test_precedence_flags_env_file_defaults(tmp_path: Path) -> None:
    config = tmp_path / "worker.toml"
    config.write_text(
        'model = "from-file"\nprefix = "file"\nmax-concurrency = 4\nlease_seconds = 9\n'
    )
    env = {"MLXW_PREFIX": "env", "MLXW_MAX_CONCURRENCY": "6", "MLXW_LOG_LEVEL": ""}
    settings = load_settings({"prefix": "flag", "model": None}, env, str(config))
    assert settings.prefix == "flag"  # flag beats env and file
    assert settings.max_concurrency == 6  # env beats file
    assert settings.model == "from-file"  # file beats default; a None flag is "not given"
    assert settings.lease_seconds == 9.0
    assert settings.drain_timeout == WorkerSettings().drain_timeout  # default


def test_bad_values_are_clear_errors(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="MLXW_MAX_CONCURRENCY"):
        load_settings({}, {"MLXW_MAX_CONCURRENCY": "many"})
    with pytest.raises(ValueError, match="max_concurrency must be > 0"):
        load_settings({"max_concurrency": 0}, {})
    with pytest.raises(ValueError, match="worker_id"):
        load_settings({"worker_id": "a{b}"}, {})
    config = tmp_path / "bad.toml"
    config.write_text("no_such_setting = 1\n")
    with pytest.raises(ValueError, match="unknown setting"):
        load_settings({}, {}, str(config))


def test_default_worker_id_is_stable_and_valid() -> None:
    assert default_worker_id() == default_worker_id()
    WorkerSettings(worker_id=default_worker_id())  # passes validation


def test_cli_reports_bad_settings_in_one_line() -> None:
    result = mlx_worker("health", "--worker-id", "a{b}", timeout=60)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "mlx-worker health: bad settings: worker_id must be 1-128 characters of "
        "A-Z a-z 0-9 . _ : -, got 'a{b}'"
    ]


def test_dead_letter_maxlen_from_every_source(tmp_path: Path) -> None:
    assert WorkerSettings().dead_letter_maxlen == 10_000
    config = tmp_path / "worker.toml"
    config.write_text("dead-letter-maxlen = 500\n")
    assert load_settings({}, {}, str(config)).dead_letter_maxlen == 500
    assert (
        load_settings({}, {"MLXW_DEAD_LETTER_MAXLEN": "700"}, str(config)).dead_letter_maxlen == 700
    )
    flags = {"dead_letter_maxlen": 900}
    assert load_settings(flags, {"MLXW_DEAD_LETTER_MAXLEN": "700"}).dead_letter_maxlen == 900
    with pytest.raises(ValueError, match="dead_letter_maxlen must be > 0"):
        load_settings({"dead_letter_maxlen": 0}, {})


@pytest.mark.parametrize(
    ("toml", "message"),
    [
        ('max_concurrency = "four"', "max_concurrency must be an integer, got the string 'four'"),
        ("max_concurrency = 4.5", "max_concurrency must be an integer, got float"),
        ("max_concurrency = true", "max_concurrency must be an integer, got bool"),
        ('allow_eviction = "yes"', "allow_eviction must be true or false, got the string 'yes'"),
        ("allow_eviction = 1", "allow_eviction must be true or false, got int"),
        ('lease_seconds = "9"', "lease_seconds must be a number, got the string '9'"),
        ("prefix = 7", "prefix must be a string, got int"),
        ("metrics_port = [9464]", "metrics_port must be an integer, got list"),
        ("max_concurrency = ", "not valid TOML: Invalid value (at line 1, column 19)"),
    ],
)
def test_config_values_of_the_wrong_type_name_key_type_and_file(
    tmp_path: Path, toml: str, message: str
) -> None:
    config = tmp_path / "worker.toml"
    config.write_text(toml + "\n")
    with pytest.raises(ValueError) as raised:
        load_settings({}, {}, str(config))
    assert str(raised.value) == f"config file {config}: {message}"


def test_config_values_of_the_right_type_are_taken(tmp_path: Path) -> None:
    config = tmp_path / "worker.toml"
    config.write_text("lease_seconds = 9\nallow_eviction = true\nmetrics_port = 9464\n")
    settings = load_settings({}, {}, str(config))
    assert settings.lease_seconds == 9.0 and isinstance(settings.lease_seconds, float)
    assert settings.allow_eviction is True
    assert settings.metrics_port == 9464


@pytest.mark.parametrize(
    "url",
    [
        "redis://localhost:6379/0",
        "redis://localhost",
        "rediss://user:pw@host.example:6380/3?ssl_ca_certs=/etc/ca.crt",
        "redis+sentinel://:pw@s1:26379,s2/mymaster/1",
        "unix:///run/redis/redis.sock",
    ],
)
def test_redis_urls_of_every_supported_form_pass(url: str) -> None:
    assert WorkerSettings(redis_url=url).redis_url == url


@pytest.mark.parametrize(
    ("url", "shown", "problem"),
    [
        ("garbage", "'garbage'", "no scheme; use redis://"),
        ("localhost:6379", "'localhost:6379'", "unknown scheme; use redis://"),
        ("redis://", "'redis://'", "no host; use redis://"),
        ("redis://:pw-S3CRET@host:63x9/0", "'redis://***@host:63x9/0'", "the port must be"),
        ("redis://host/db0", "'redis://host/db0'", "what follows the host must be a database"),
        ("redis://u:pw-S3CRET/x@host/0", "'redis://***@host/0'", "the port must be"),
        ("unix://", "'unix://'", "no socket path"),
        ("redis+sentinel://u:pw-S3CRET@s1/", "'redis+sentinel://***@s1/'", "URLs look like"),
    ],
)
def test_bad_redis_urls_are_refused_without_their_password(
    url: str, shown: str, problem: str
) -> None:
    with pytest.raises(ValueError) as raised:
        load_settings({"redis_url": url}, {})
    message = str(raised.value)
    assert message.startswith(f"redis_url {shown} is not a Redis URL: "), message
    assert problem in message, message
    assert "S3CRET" not in message


def test_several_models_from_every_source(tmp_path: Path) -> None:
    """A TOML list, a comma-separated MLXW_MODEL and repeated --model flags all name several
    models; names come from NAME= or the source's last path component."""
    config = tmp_path / "models.toml"
    config.write_text('model = ["chat=tiny-qwen3", "tiny"]\ndefault_model = "tiny"\n')
    from_file = load_settings({}, environ={}, config_file=str(config))
    assert [(m.name, m.source) for m in from_file.models] == [
        ("chat", "tiny-qwen3"),
        ("tiny", "tiny"),
    ]
    assert from_file.default_model_name == "tiny"
    from_env = load_settings({}, environ={"MLXW_MODEL": "tiny, /srv/models/qwen3-8b/"})
    assert [m.name for m in from_env.models] == ["tiny", "qwen3-8b"]
    assert from_env.default_model_name == "tiny"
    with pytest.raises(ValueError, match="model names must differ"):
        load_settings({}, environ={"MLXW_MODEL": "a=tiny,a=smollm2"})
    result = mlx_worker("run", "--model", "a=tiny", "--model", "a=smollm2")
    assert result.returncode == 2 and "model names must differ" in result.stderr


def test_idempotency_window_defaults_to_a_day_and_outlives_the_log() -> None:
    settings = WorkerSettings()
    assert settings.idempotency_seconds >= 86400 > settings.log_ttl
    flags = {"idempotency_seconds": 7 * 86400}
    assert load_settings(flags, {}).idempotency_seconds == 7 * 86400
    assert load_settings({}, {"MLXW_IDEMPOTENCY_SECONDS": "3600"}).idempotency_seconds == 3600
    with pytest.raises(ValueError, match="idempotency_seconds must be > 0"):
        load_settings({"idempotency_seconds": 0}, {})


def test_grammar_limits_from_settings_default_to_the_engines() -> None:
    from mlx_redis_worker.daemon.settings import GRAMMAR_SETTINGS
    from mlx_redis_worker.engine.config import GRAMMAR_LIMITS, GrammarLimits

    assert GRAMMAR_SETTINGS == GRAMMAR_LIMITS
    assert WorkerSettings().grammar_limits == GrammarLimits()
    settings = load_settings(
        {"max_schema_bytes": 1000}, {"MLXW_MAX_MASK_US": "500", "MLXW_MAX_GRAMMAR_COMPILE_MS": "9"}
    )
    assert settings.grammar_limits == GrammarLimits(
        max_schema_bytes=1000, max_grammar_compile_ms=9, max_mask_us=500
    )
    with pytest.raises(ValueError, match="max_mask_us must be > 0"):
        load_settings({}, {"MLXW_MAX_MASK_US": "0"})


def test_a_no_flag_turns_off_what_env_or_file_turn_on() -> None:
    """Each boolean setting has --NAME and --no-NAME; without either, the other sources
    decide."""
    parse = build_parser().parse_args
    assert parse(["run", "--fair-share"]).fair_share is True
    assert parse(["run"]).fair_share is None
    off = parse(["run", "--no-fair-share"]).fair_share
    assert off is False
    assert load_settings({"fair_share": off}, {"MLXW_FAIR_SHARE": "1"}).fair_share is False
    assert load_settings({"fair_share": None}, {"MLXW_FAIR_SHARE": "1"}).fair_share is True
    assert parse(["run", "--no-allow-eviction"]).allow_eviction is False


def test_a_draft_model_default_needs_a_draft_model() -> None:
    with pytest.raises(ValueError, match="speculative draft_model needs a draft model"):
        load_settings({}, {"MLXW_SPECULATIVE": "draft_model:3"})
    settings = load_settings(
        {"draft_model": "smollm2-draft"}, {"MLXW_SPECULATIVE": "draft_model:3"}
    )
    assert (settings.speculative, settings.draft_model) == ("draft_model:3", "smollm2-draft")
    parsed = build_parser().parse_args(["run", "--draft-model", "smollm2-draft"])
    assert parsed.draft_model == "smollm2-draft"


def test_the_prefill_stall_bound_reaches_the_engine_from_every_source(tmp_path: Path) -> None:
    from mlx_redis_protocol.limits import DEFAULT_LIMITS
    from mlx_redis_worker.daemon.worker import scheduler_config
    from mlx_redis_worker.engine.config import SchedulerConfig

    assert WorkerSettings().max_prefill_stall == SchedulerConfig().max_prefill_stall
    config = tmp_path / "worker.toml"
    config.write_text("max-prefill-stall = 3.5\n")
    assert load_settings({}, {}, str(config)).max_prefill_stall == 3.5
    from_env = load_settings({}, {"MLXW_MAX_PREFILL_STALL": "inf"})
    assert from_env.max_prefill_stall == float("inf")
    args = build_parser().parse_args(["run", "--max-prefill-stall", "0.5"])
    from_flag = load_settings({"max_prefill_stall": args.max_prefill_stall}, {})
    engine_config = scheduler_config(
        max_concurrency=4, limits=DEFAULT_LIMITS, max_prefill_stall=from_flag.max_prefill_stall
    )
    assert engine_config.max_prefill_stall == 0.5
    with pytest.raises(ValueError, match="max_prefill_stall must be >= 0"):
        load_settings({}, {"MLXW_MAX_PREFILL_STALL": "nan"})
