"""Saved prefix caches an engine must not load: ``load_cache_checked`` says why, loads
nothing, and ``load_cache_from_disk`` keeps answering 0 for them."""

from __future__ import annotations

import json
import shutil
from contextlib import closing
from pathlib import Path
from typing import Any

import pytest

from mlx_redis_worker.engine import EngineCore, SamplingParams
from mlx_redis_worker.engine.fingerprint import model_fingerprint
from mlx_redis_worker.engine.prefix_cache import IncompatibleCacheError
from mlx_redis_worker.models import load_model
from tests.support import engines
from tests.support.engines import PROMPTS, MakeEngine

GREEDY = SamplingParams(max_tokens=4, temperature=0.0)


@pytest.fixture(scope="module")
def saved(tiny_model: Any, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A cache of two entries saved by the tiny llama."""
    target = tmp_path_factory.mktemp("saved") / "cache"
    with closing(engines.make_engine(tiny_model)) as engine:
        engine.generate_batch_sync(PROMPTS[:2], GREEDY)
        assert engine.save_cache_to_disk(str(target))
    return target


def _copy(saved: Path, tmp_path: Path) -> Path:
    copy = tmp_path / "copy"
    shutil.copytree(saved, copy)
    return copy


def _edit_manifest(cache: Path, **changes: Any) -> None:
    manifest = json.loads((cache / "manifest.json").read_text())
    manifest.update(changes)
    (cache / "manifest.json").write_text(json.dumps(manifest))


def _entries(engine: EngineCore) -> int:
    stats = engine.get_cache_stats()
    assert stats is not None
    return int(stats["entries"])


def test_the_saving_model_loads_it(engine: EngineCore, saved: Path) -> None:
    assert engine.load_cache_checked(str(saved)) == 2
    assert engine.load_cache_checked(str(saved)) == 0  # duplicates are not added twice


def test_another_models_cache_names_both_fingerprints(saved: Path, make_engine: MakeEngine) -> None:
    model, tokenizer = other = load_model("tiny-micro")
    other_fingerprint = model_fingerprint(model, tokenizer)
    saved_fingerprint = json.loads((saved / "manifest.json").read_text())["fingerprint"]
    engine = make_engine(other)
    with pytest.raises(IncompatibleCacheError) as refused:
        engine.load_cache_checked(str(saved))
    assert _entries(engine) == 0
    assert engine.load_cache_from_disk(str(saved)) == 0  # the reference API's answer
    error = refused.value
    assert (error.saved_fingerprint, error.model_fingerprint) == (
        saved_fingerprint,
        other_fingerprint,
    )
    assert saved_fingerprint in error.reason and other_fingerprint in error.reason
    assert "another model" in error.reason


@pytest.mark.parametrize(
    ("breakage", "reason"),
    [
        ("missing", "unreadable manifest.json: FileNotFoundError"),
        ("not json", "unreadable manifest.json: JSONDecodeError"),
        ("a list", "manifest.json is not a JSON object"),
        ("format 2", "saved in format 2; this worker reads format 1"),
        ("entry outside", "manifest.json has a malformed entry list"),
        ("entries not a list", "manifest.json has a malformed entry list"),
    ],
)
def test_an_unusable_manifest_says_why(
    engine: EngineCore, saved: Path, tmp_path: Path, breakage: str, reason: str
) -> None:
    cache = _copy(saved, tmp_path)
    manifest = cache / "manifest.json"
    if breakage == "missing":
        manifest.unlink()
    elif breakage == "not json":
        manifest.write_text("{not json")
    elif breakage == "a list":
        manifest.write_text("[]")
    elif breakage == "format 2":
        _edit_manifest(cache, format=2)
    elif breakage == "entry outside":
        # A crafted manifest must not make the worker read outside the cache's directory.
        (tmp_path / "outside.safetensors").write_bytes(b"")
        _edit_manifest(cache, entries=[{"file": "../outside.safetensors", "num_tokens": 1}])
    else:
        _edit_manifest(cache, entries={"file": "entry-00000.safetensors"})
    with pytest.raises(IncompatibleCacheError) as refused:
        engine.load_cache_checked(str(cache))
    assert refused.value.reason.startswith(reason), refused.value.reason
    assert _entries(engine) == 0
    assert engine.load_cache_from_disk(str(cache)) == 0


def test_an_unreadable_entry_loads_nothing(engine: EngineCore, saved: Path, tmp_path: Path) -> None:
    """Every entry is read before any is kept: one bad file leaves no half-loaded cache."""
    cache = _copy(saved, tmp_path)
    files = sorted(cache.glob("entry-*.safetensors"))
    assert len(files) == 2
    files[-1].write_bytes(b"not a safetensors file")
    with pytest.raises(IncompatibleCacheError) as refused:
        engine.load_cache_checked(str(cache))
    assert refused.value.reason.startswith(f"unreadable entry {files[-1].name!r}: ")
    assert _entries(engine) == 0
