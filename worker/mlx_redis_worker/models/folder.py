"""Atomic publication of a model folder: build next to the destination, then rename into place.

A half-written folder is never visible under the final name, so a crash mid-build leaves the
old folder (or nothing) behind, and two processes racing to prepare the same fixture both end
up with one complete copy.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any


def is_prepared(folder: Path) -> bool:
    """Whether ``folder`` holds a finished model (its config is written last, by rename)."""
    return (folder / "config.json").is_file() and any(folder.glob("model*.safetensors"))


def write_json(path: Path, data: Any) -> None:
    """Write ``data`` as indented UTF-8 JSON with a trailing newline."""
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def _publish(staging: Path, dest: Path) -> None:
    """Rename ``staging`` to ``dest``, replacing an existing ``dest`` (the caller chose to)."""
    old: Path | None = None
    if dest.exists():
        old = Path(tempfile.mkdtemp(prefix=f".{dest.name}.old-", dir=dest.parent))
        os.rmdir(old)
        try:
            os.rename(dest, old)
        except FileNotFoundError:  # someone else removed it meanwhile
            old = None
    try:
        os.rename(staging, dest)
    except OSError:
        if not is_prepared(dest):
            raise
        # Another process published a complete copy first; keep theirs.
        shutil.rmtree(staging, ignore_errors=True)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


@contextmanager
def atomic_folder(dest: Path) -> Iterator[Path]:
    """Yield an empty staging folder beside ``dest``; on success it becomes ``dest``.

    On any exception the staging folder is removed and ``dest`` is left untouched.
    """
    dest.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", suffix=".tmp", dir=dest.parent))
    os.chmod(staging, 0o755)
    try:
        yield staging
        _publish(staging, dest)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
