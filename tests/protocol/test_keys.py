"""Key names: the documented layout, and one Cluster slot per request."""

from __future__ import annotations

import pytest
from redis.crc import key_slot

from mlx_redis_protocol.identifiers import is_valid_cache_name, is_valid_id
from mlx_redis_protocol.keys import Keys


def test_layout_under_the_default_prefix() -> None:
    keys = Keys()
    assert (keys.jobs, keys.group, keys.dead) == ("mlxw:jobs", "mlxw", "mlxw:dead:{mlxw:jobs}")
    assert keys.out("abc") == "mlxw:out:{abc}"
    assert keys.log("abc") == "mlxw:log:{abc}"
    assert keys.abort("abc") == "mlxw:abort:{abc}"
    assert keys.control == "mlxw:control"
    assert keys.control_for("w1") == "mlxw:control:{w1}"
    assert keys.worker("w1") == "mlxw:worker:{w1}"
    assert keys.reply("t1") == "mlxw:reply:{t1}"
    assert Keys("app.v2").log("x") == "app.v2:log:{x}"


def test_one_request_lands_on_one_cluster_slot() -> None:
    keys = Keys()
    for request_id in ("abc", "a-very:long.request_id-123", "0"):
        slots = {key_slot(name.encode()) for name in (keys.out(request_id), keys.log(request_id))}
        slots.add(key_slot(keys.abort(request_id).encode()))
        slots.add(key_slot(keys.attempt(request_id).encode()))
        assert slots == {key_slot(request_id.encode())}


def test_event_keys_are_the_requests_names_encoded_under_each_prefix() -> None:
    for prefix in ("mlxw", "app.v2"):
        keys = Keys(prefix)
        for request_id in ("abc", "a-very:long.request_id-123"):
            for _ in range(2):  # made, then from the cache: the same names
                assert keys.event_keys(request_id) == (
                    keys.out(request_id).encode(),
                    keys.log(request_id).encode(),
                    keys.attempt(request_id).encode(),
                )


@pytest.mark.parametrize("bad", ["a{b", "a}b", "", "a b", "x" * 300])
def test_event_keys_refuse_a_bad_id_every_time(bad: str) -> None:
    """A refusal is not cached as an answer: the second call is refused as the first."""
    for _ in range(2):
        with pytest.raises(ValueError, match="request id"):
            Keys().event_keys(bad)


@pytest.mark.parametrize("prefix", ["mlxw", "app.v2", "tenant-7"])
def test_the_dead_letter_stream_shares_the_job_streams_slot(prefix: str) -> None:
    """One script moves an entry from the job stream to the dead-letter stream."""
    keys = Keys(prefix)
    assert key_slot(keys.dead.encode()) == key_slot(keys.jobs.encode())


@pytest.mark.parametrize("bad", ["", "a{b", "a}b", "a b", "x*", "é", "a" * 129, "a/b"])
def test_ids_that_could_break_a_hash_tag_are_refused(bad: str) -> None:
    assert not is_valid_id(bad)
    with pytest.raises(ValueError):
        Keys().log(bad)


@pytest.mark.parametrize("bad", ["", "a{b", "a*", "a b", "a\n"])
def test_bad_prefixes_are_refused(bad: str) -> None:
    with pytest.raises(ValueError):
        Keys(bad)


def test_cache_names_are_safe_file_names() -> None:
    assert is_valid_cache_name("warm-v1.2_x")
    for bad in ("", ".hidden", "..", "a/b", "a:b", "a" * 129):
        assert not is_valid_cache_name(bad)
