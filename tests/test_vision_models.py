"""Loading vision-language models: the tiny-vision fixture, the vision extra, refused types."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest
from mlx.utils import tree_flatten

from mlx_redis_worker.engine.vision import vision_model_of
from mlx_redis_worker.models import ModelUnavailable, load_model
from mlx_redis_worker.models.paths import tiny_vision_dir


def test_the_language_model_is_mlx_lms_over_the_vision_models_own_arrays(
    tiny_vision_model: tuple[Any, Any],
) -> None:
    model, tokenizer = tiny_vision_model
    vision = vision_model_of(model)
    assert vision is not None and vision.model_type == "smolvlm"
    assert type(model).__module__ == "mlx_lm.models.llama"
    theirs = {id(array) for _, array in tree_flatten(vision.vlm.language_model.parameters())}
    ours = [array for _, array in tree_flatten(model.parameters())]
    assert ours and all(id(array) in theirs for array in ours)  # shared, not copied
    assert vision.image_placeholder == "<image>"
    assert tokenizer.convert_tokens_to_ids("<image>") == vision.image_token_id


def test_without_the_vision_extra_the_worker_names_it_in_one_line(
    tiny_vision_model: tuple[Any, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "mlx_vlm", None)  # what an install without it imports
    monkeypatch.setitem(sys.modules, "mlx_vlm.utils", None)
    with pytest.raises(ModelUnavailable) as refused:
        load_model(str(tiny_vision_dir("small")))
    message = str(refused.value)
    assert "\n" not in message
    assert "vision extra" in message and "pip install '" in message
    assert message.endswith("[vision]'")


def test_a_vision_model_type_the_batch_cannot_take_is_refused(tmp_path: Path) -> None:
    folder = tmp_path / "qwen2-vl"
    folder.mkdir()
    config = {"model_type": "qwen2_vl", "vision_config": {}, "text_config": {}}
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelUnavailable, match="'qwen2_vl' is not one this engine batches"):
        load_model(str(folder))


def test_the_fingerprint_counts_the_vision_tower(tiny_vision_model: tuple[Any, Any]) -> None:
    """A saved prefix cache holds image positions' KV: another vision tower over the same text
    weights must not load it."""
    from mlx_redis_worker.engine.fingerprint import model_fingerprint

    model, tokenizer = tiny_vision_model
    vision = vision_model_of(model)
    assert vision is not None
    with_tower = model_fingerprint(model, tokenizer)
    weight = vision.vlm.vision_model.post_layernorm.weight
    try:
        vision.vlm.vision_model.post_layernorm.weight = weight * 2
        assert model_fingerprint(model, tokenizer) != with_tower
    finally:
        vision.vlm.vision_model.post_layernorm.weight = weight
    assert model_fingerprint(model, tokenizer) == with_tower
