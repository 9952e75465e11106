"""``redis_url_file`` (MLXW_REDIS_URL_FILE): the Redis URL, password included, from a file."""

from __future__ import annotations

from pathlib import Path

import pytest

from mlx_redis_worker.daemon.settings import load_settings

URL = "redis://:s3cret@redis.internal:6380/2"


@pytest.fixture
def url_file(tmp_path: Path) -> str:
    path = tmp_path / "redis-url"
    path.write_text(URL + "\n")  # as `echo` writes it
    path.chmod(0o600)
    return str(path)


def test_read_from_the_environment(url_file: str) -> None:
    settings = load_settings({}, {"MLXW_REDIS_URL_FILE": url_file})
    assert settings.redis_url == URL
    assert settings.redis_url_file == url_file


def test_read_from_the_config_file(url_file: str, tmp_path: Path) -> None:
    config = tmp_path / "worker.toml"
    config.write_text(f'redis-url-file = "{url_file}"\n')
    assert load_settings({}, {}, str(config)).redis_url == URL


def test_a_higher_source_wins_either_way(url_file: str, tmp_path: Path) -> None:
    # A URL flag beats a file named in the environment...
    settings = load_settings({"redis_url": "redis://flag:1/0"}, {"MLXW_REDIS_URL_FILE": url_file})
    assert settings.redis_url == "redis://flag:1/0"
    assert settings.redis_url_file is None
    # ...and a file flag beats a URL in the environment.
    settings = load_settings({"redis_url_file": url_file}, {"MLXW_REDIS_URL": "redis://env:1/0"})
    assert settings.redis_url == URL


def test_both_in_one_source_is_an_error(url_file: str) -> None:
    with pytest.raises(ValueError, match="not both"):
        load_settings({}, {"MLXW_REDIS_URL": "redis://x:1/0", "MLXW_REDIS_URL_FILE": url_file})


@pytest.mark.parametrize("content", ["", "\n", "redis://a:1/0\nredis://b:1/0\n"])
def test_the_file_must_hold_one_url(tmp_path: Path, content: str) -> None:
    path = tmp_path / "redis-url"
    path.write_text(content)
    with pytest.raises(ValueError, match="one line") as raised:
        load_settings({}, {"MLXW_REDIS_URL_FILE": str(path)})
    assert "redis://" not in str(raised.value)  # never echo the secret


def test_a_missing_file_names_the_path(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="cannot read"):
        load_settings({}, {"MLXW_REDIS_URL_FILE": str(tmp_path / "missing")})
