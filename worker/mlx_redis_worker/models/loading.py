"""Loading a model by fixture name, local folder or hub id: ``mlx_lm.load``, or for a
vision-language model (its config names a vision tower) mlx-vlm through ``models/vision.py``.

Nothing is downloaded: a hub id must already be in the local Hugging Face cache. Every way a
model can be unusable (no such folder, a name that is nothing known, a folder mlx-lm cannot
load, a fixture that cannot be built) is a :class:`ModelUnavailable` with one line for the
operator, not a traceback from deep inside the hub client or mlx-lm.

mlx-lm, mlx-vlm and the hub client load when a model does: the daemon imports this module
(``ModelUnavailable``) where no model loads and MLX may be absent (``mlx-worker bench fleet``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mlx_redis_protocol.logs import one_line
from mlx_redis_worker.models.fixture_packages import MissingFixturePackage
from mlx_redis_worker.models.paths import FIXTURES, resolve_model


class ModelUnavailable(Exception):
    """The model the settings name cannot be loaded on this machine (one line, no traceback)."""


def load_model(name_or_path: str) -> tuple[Any, Any]:
    """``mlx_lm.load`` on the folder :func:`locate_model` finds: ``(model, tokenizer)``; a
    vision-language model's language model comes with its vision parts (``model.vision``)."""
    import mlx_lm

    from mlx_redis_worker.models.vision import (
        VisionModelError,
        is_vision_config,
        load_vision_model,
        read_config,
    )

    folder = locate_model(name_or_path)
    config = read_config(folder)
    if is_vision_config(config):
        try:
            return load_vision_model(folder, config)
        except VisionModelError as exc:
            raise ModelUnavailable(f"model {name_or_path!r}: {exc}") from exc
    try:
        return mlx_lm.load(str(folder))  # type: ignore[no-any-return]
    except Exception as exc:  # whatever mlx-lm refuses: a missing config, an unknown model type
        raise ModelUnavailable(
            f"model {name_or_path!r}: mlx-lm cannot load {folder}: {one_line(exc, typed=True)}"
        ) from exc


def locate_model(name_or_path: str) -> Path:
    """The local folder of a fixture name (built on first use), a path, or a hub id found in
    the local Hugging Face cache; ModelUnavailable otherwise."""
    if name_or_path in FIXTURES:
        try:
            return Path(resolve_model(name_or_path))
        except MissingFixturePackage as exc:  # the one command that installs it
            raise ModelUnavailable(
                f"model fixture {name_or_path!r} cannot be prepared: {exc}"
            ) from exc
        except Exception as exc:  # building the fixture failed (a missing package, disk full)
            raise ModelUnavailable(
                f"model fixture {name_or_path!r} could not be prepared: {one_line(exc, typed=True)}"
            ) from exc
    path = Path(name_or_path).expanduser()
    if path.exists():
        if not path.is_dir():
            raise ModelUnavailable(f"model {name_or_path!r} is a file, not a model folder")
        return path
    if _looks_like_a_path(name_or_path):
        raise ModelUnavailable(f"model folder {name_or_path!r} does not exist")
    cached = _in_hub_cache(name_or_path)
    if cached is None:
        from huggingface_hub.constants import HF_HUB_CACHE

        raise ModelUnavailable(
            f"model {name_or_path!r} is not a fixture name ({', '.join(FIXTURES)}), not a local "
            f"folder, and not in the local Hugging Face cache ({HF_HUB_CACHE}); nothing is "
            "downloaded here"
        )
    return cached


def _looks_like_a_path(name: str) -> bool:
    """A name only a path can be (a hub id is ``name`` or ``owner/name``)."""
    return name.startswith(("/", "./", "../", "~")) or name.count("/") > 1 or name in (".", "..")


def _in_hub_cache(repo_id: str) -> Path | None:
    """The snapshot of ``repo_id`` in the local Hugging Face cache, asking no server."""
    from mlx_lm.utils import hf_repo_to_path  # the same files mlx_lm.load would fetch

    try:
        return Path(hf_repo_to_path(repo_id))
    except Exception:  # not cached, or not a valid repo id (HFValidationError): not there
        return None
