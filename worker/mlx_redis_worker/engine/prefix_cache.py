"""Prefix cache: reuse the KV cache of earlier requests that share a prompt prefix.

Built on mlx-lm's ``LRUPromptCache`` (a token trie with LRU order and a byte bound), through its
public API only. This module adds honest statistics, our own eviction accounting, an index of
the entries (``LRUPromptCache`` cannot list them, and saving needs to), and atomic save/load to
disk with a model fingerprint. Engine thread only: every method may touch MLX arrays.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import (
    LRUPromptCache,
    can_trim_prompt_cache,
    load_prompt_cache,
    save_prompt_cache,
    trim_prompt_cache,
)

from mlx_redis_worker.engine.errors import IncompatibleCacheError
from mlx_redis_worker.engine.stats import PrefixCacheStats

MANIFEST = "manifest.json"
FORMAT_VERSION = 1
_KEY = "model"  # one model per engine: a constant trie namespace
# mlx-lm's LRU kinds: under pressure it evicts from "assistant" before "system", so the shared
# prefixes callers declared (``prefix_boundary``) outlive whole conversations.
FULL = "assistant"
SHARED_PREFIX = "system"


@dataclass(slots=True)
class PrefixHit:
    cache: list[Any] | None
    cached_tokens: int


@dataclass(slots=True)
class Admission:
    """How a new request is prefilled: ``cache`` holds the reused KV state of its first
    ``cached_tokens`` prompt tokens; ``segments`` are the rest, in the pieces mlx-lm's
    ``BatchGenerator.insert_segments`` takes. ``stores_prefix``: prefill stops at the end of
    the first segment, the request's shared prefix, whose state is then stored."""

    cache: list[Any] | None
    cached_tokens: int
    segments: list[list[int]]
    stores_prefix: bool = False

    @classmethod
    def uncached(cls, prompt: list[int]) -> Admission:
        return cls(None, 0, [prompt])


class PrefixCache:
    def __init__(self, max_entries: int, max_bytes: int) -> None:
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        # Bounds are enforced by ``_evict`` so evictions can be counted.
        self._lru = LRUPromptCache(max_size=1 << 62, max_bytes=1 << 62)
        # The entries the LRU holds, per kind, least recently stored first: kept in step with
        # every insert and eviction (``_insert``, ``_evict``).
        self._index: dict[str, OrderedDict[tuple[int, ...], list[Any]]] = {
            FULL: OrderedDict(),
            SHARED_PREFIX: OrderedDict(),
        }
        self.hits = 0
        self.misses = 0
        self.tokens_saved = 0
        self.evictions = 0
        self.stores = 0

    def fetch(self, tokens: list[int]) -> PrefixHit:
        """The longest reusable cache for ``tokens``; at least one token is always left to run."""
        cache, rest = self._lru.fetch_nearest_cache(_KEY, tokens)
        if cache is not None and not rest:
            # An identical prompt: keep its last token back so the model produces logits for it.
            if can_trim_prompt_cache(cache):
                trim_prompt_cache(cache, 1)
                rest = tokens[-1:]
            else:
                cache, rest = None, tokens
        cached = len(tokens) - len(rest) if cache is not None else 0
        if cached > 0:
            self.hits += 1
            self.tokens_saved += cached
            return PrefixHit(cache, cached)
        self.misses += 1
        return PrefixHit(None, 0)

    def admit(
        self, prompt: list[int], prefix_boundary: int, key: list[int] | None = None
    ) -> Admission:
        """Reuse what is cached of ``prompt`` (looked up by ``key``, the prompt as the cache
        knows it: image tokens stand for their images). A shared prefix (``prefix_boundary``)
        not cached yet becomes a segment of its own, so it can be stored once prefilled; a
        cached one is marked as used."""
        key = prompt if key is None else key
        hit = self.fetch(key)
        cached = hit.cached_tokens
        if cached < prefix_boundary < len(prompt):
            segments = [prompt[cached:prefix_boundary], prompt[prefix_boundary:]]
            return Admission(hit.cache, cached, segments, stores_prefix=True)
        if 0 < prefix_boundary <= cached:
            self.touch(key[:prefix_boundary])
        return Admission(hit.cache, cached, [prompt[cached:]])

    def store_finished(
        self, prompt: list[int], prefix_boundary: int, tokens: list[int], cache: list[Any]
    ) -> None:
        """A finished sequence (``tokens``: its prompt and output) is stored whole, unless its
        shared prefix is an entry of its own: that one entry serves every request behind it."""
        if prefix_boundary > 0 and self.holds(prompt[:prefix_boundary]):
            return
        self.store(tokens, cache)

    def store(self, tokens: list[int], cache: list[Any], kind: str = FULL) -> None:
        """Keep ``cache`` (the KV state of ``tokens``); ``kind`` is FULL or SHARED_PREFIX."""
        if not tokens or not cache:
            return
        mx.eval([c.state for c in cache])
        self._insert(tuple(tokens), cache, kind)
        self.stores += 1
        self._evict()

    def holds(self, tokens: list[int]) -> bool:
        """True when an entry of exactly ``tokens`` is cached."""
        key = tuple(tokens)
        return any(key in entries for entries in self._index.values())

    def touch(self, tokens: list[int]) -> None:
        """Mark the entry of exactly ``tokens``, if there is one, as just stored: eviction
        takes it after the others of its kind (a shared prefix in use outlives idle ones)."""
        key = tuple(tokens)
        for kind, entries in self._index.items():
            cache = entries.get(key)
            if cache is not None:
                self._insert(key, cache, kind)
                return

    def clear(self) -> dict[str, int]:
        cleared = {"entries": len(self._lru), "bytes": int(self._lru.nbytes)}
        self._lru.trim_to(n_sequences=0)
        for entries in self._index.values():
            entries.clear()
        return cleared

    def stats(self) -> PrefixCacheStats:
        lookups = self.hits + self.misses
        return PrefixCacheStats(
            enabled=True,
            entries=len(self._lru),
            memory_bytes=int(self._lru.nbytes),
            max_entries=self.max_entries,
            max_bytes=self.max_bytes,
            hits=self.hits,
            misses=self.misses,
            hit_rate=self.hits / lookups if lookups else 0.0,
            tokens_saved=self.tokens_saved,
            evictions=self.evictions,
            stores=self.stores,
        )

    def save(self, directory: str | os.PathLike[str], fingerprint: str) -> int:
        """Write every entry to ``directory`` atomically; return how many were written."""
        target = Path(directory).resolve()
        target.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
        try:
            entries = []
            for index, (tokens, cache, kind) in enumerate(self._entries()):
                name = f"entry-{index:05d}.safetensors"
                save_prompt_cache(str(staging / name), cache, {"tokens": json.dumps(tokens)})
                entries.append({"file": name, "num_tokens": len(tokens), "kind": kind})
            manifest = {"format": FORMAT_VERSION, "fingerprint": fingerprint, "entries": entries}
            (staging / MANIFEST).write_text(json.dumps(manifest, indent=1))
            _replace_dir(staging, target)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
        return len(entries)

    def load(self, directory: str | os.PathLike[str], fingerprint: str) -> int:
        """Load entries saved by ``save``; return how many new ones were added.

        Raises ``IncompatibleCacheError`` (and adds nothing) for a cache saved for another model
        (``fingerprint`` differs), in another format, or one that cannot be read whole: every
        entry is read before any is stored, so a bad file never leaves half a cache behind.
        """
        source = Path(directory)
        entries = _manifest_entries(source, fingerprint)
        known = {tuple(tokens) for tokens, _, _ in self._entries()}
        read: list[tuple[list[int], list[Any], str]] = []
        for entry in entries:
            try:
                path = source / entry["file"]
                cache, metadata = load_prompt_cache(str(path), return_metadata=True)
                tokens = [int(token) for token in json.loads(metadata["tokens"])]
            except Exception as exc:  # mlx and json raise many kinds; all mean unreadable
                raise IncompatibleCacheError(
                    source, f"unreadable entry {entry.get('file')!r}: {_reason(exc)}"
                ) from exc
            if tuple(tokens) in known:
                continue
            known.add(tuple(tokens))
            kind = entry.get("kind", FULL)
            read.append((tokens, cache, kind if kind in (FULL, SHARED_PREFIX) else FULL))
        for tokens, cache, kind in read:
            self.store(tokens, cache, kind)
        return len(read)

    def _entries(self) -> list[tuple[list[int], list[Any], str]]:
        return [
            (list(key), cache, kind)
            for kind, entries in self._index.items()
            for key, cache in entries.items()
        ]

    def _insert(self, key: tuple[int, ...], cache: list[Any], kind: str) -> None:
        self._lru.insert_cache(_KEY, list(key), cache, cache_type=kind)
        for entries in self._index.values():
            entries.pop(key, None)
            if can_trim_prompt_cache(cache):
                # The LRU drops the entries that are prefixes of a trimmable one: it serves
                # them too (cut back on fetch).
                for shorter in [k for k in entries if key[: len(k)] == k]:
                    del entries[shorter]
        self._index[kind][key] = cache

    def _evict(self) -> None:
        before = len(self._lru)
        self._lru.trim_to(n_sequences=self.max_entries, n_bytes=self.max_bytes)
        self.evictions += before - len(self._lru)
        # Within a kind the LRU evicts the least recently stored entry first: drop as many.
        for kind, held in self._lru.stats_by_type().items():
            entries = self._index.get(kind)
            while entries and len(entries) > held["n_sequences"]:
                entries.popitem(last=False)


def _manifest_entries(source: Path, fingerprint: str) -> list[dict[str, Any]]:
    """The entries listed by the manifest in ``source``, once it says the cache was made by
    the model with ``fingerprint`` in this format; else ``IncompatibleCacheError``."""
    try:
        manifest = json.loads((source / MANIFEST).read_text())
    except (OSError, ValueError) as exc:  # missing, unreadable, not UTF-8, not JSON
        raise IncompatibleCacheError(source, f"unreadable {MANIFEST}: {_reason(exc)}") from exc
    if not isinstance(manifest, dict):
        raise IncompatibleCacheError(source, f"{MANIFEST} is not a JSON object")
    if manifest.get("format") != FORMAT_VERSION:
        raise IncompatibleCacheError(
            source,
            f"saved in format {manifest.get('format')!r}; this worker reads format "
            f"{FORMAT_VERSION}",
        )
    saved = manifest.get("fingerprint")
    if saved != fingerprint:
        raise IncompatibleCacheError(
            source,
            f"saved by another model (fingerprint {saved}); this model's fingerprint is "
            f"{fingerprint}",
            saved_fingerprint=str(saved),
            model_fingerprint=fingerprint,
        )
    entries = manifest.get("entries", [])
    if not isinstance(entries, list) or not all(map(_is_entry, entries)):
        raise IncompatibleCacheError(source, f"{MANIFEST} has a malformed entry list")
    return entries


def _is_entry(entry: object) -> bool:
    """An entry names a plain file beside the manifest: a path would let a crafted manifest
    read outside the cache directory."""
    if not isinstance(entry, dict):
        return False
    name = entry.get("file")
    return isinstance(name, str) and not name.startswith(".") and Path(name).name == name


def _reason(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def _replace_dir(staging: Path, target: Path) -> None:
    """Swap ``staging`` into ``target``: readers see the old or the new cache, never a mix."""
    if not target.exists():
        staging.rename(target)
        return
    retired = target.with_name(f".{target.name}.old-{os.getpid()}")
    target.rename(retired)
    try:
        staging.rename(target)
    except BaseException:
        retired.rename(target)
        raise
    with contextlib.suppress(OSError):
        shutil.rmtree(retired)
