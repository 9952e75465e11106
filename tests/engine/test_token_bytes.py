"""Each token's bytes, as logprobs carry them: exactly what the model's detokenizer appends for
the token, so a sequence's token bytes join to its text even where a character is split."""

from __future__ import annotations

from typing import Any

import pytest
from mlx_lm.tokenizer_utils import SPMStreamingDetokenizer

from mlx_redis_worker.engine import EngineCore, SamplingParams
from mlx_redis_worker.engine.token_bytes import TokenBytes
from tests.support.engines import PROMPTS, MakeEngine

# Characters of two, three and four UTF-8 bytes, which byte-level BPE splits into tokens.
TEXT = "Hello café — naïve 日本 🙂 ok"


@pytest.mark.parametrize("fixture", ["tiny_model", "smollm2_model"])
def test_a_texts_token_bytes_join_to_the_text(fixture: str, request: pytest.FixtureRequest) -> None:
    _, tokenizer = request.getfixturevalue(fixture)
    token_bytes = TokenBytes(tokenizer)
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    pieces = [token_bytes(token) for token in ids]
    assert b"".join(pieces).decode() == TEXT
    assert any(not _is_utf8(piece) for piece in pieces)  # some token splits a character


@pytest.mark.parametrize("fixture", ["tiny_model", "smollm2_model"])
def test_a_whole_tokens_bytes_are_its_decoded_text(
    fixture: str, request: pytest.FixtureRequest
) -> None:
    _, tokenizer = request.getfixturevalue(fixture)
    token_bytes = TokenBytes(tokenizer)
    vocabulary = len(tokenizer._tokenizer)
    whole = [token for token in range(vocabulary) if _is_utf8(token_bytes(token))]
    assert len(whole) > vocabulary // 2
    for token in whole:
        assert token_bytes(token).decode() == tokenizer._tokenizer.decode([token]), token
    assert token_bytes(vocabulary + 10) == b""  # past the vocabulary (a padded embedding)


def test_logprobs_carry_each_tokens_bytes_and_the_alternatives(
    smollm2_model: Any, make_engine: MakeEngine
) -> None:
    engine: EngineCore = make_engine(smollm2_model)
    _, tokenizer = smollm2_model
    token_bytes = TokenBytes(tokenizer)
    params = SamplingParams(max_tokens=16, temperature=0.0, logprobs=3)
    output = engine.generate_batch_sync([PROMPTS[0]], params)[0]
    assert output.logprobs is not None and len(output.logprobs) == 16
    joined = b"".join(entry.token_bytes or b"" for entry in output.logprobs).decode()
    # The detokenizer drops the space a first word token starts with; nothing else differs.
    assert output.output_text in (joined, joined.removeprefix(" "))
    for entry in output.logprobs:
        assert entry.token_bytes == token_bytes(entry.token_id)
        assert entry.top_token_bytes == [token_bytes(token) for token, _ in entry.top_logprobs]


def _is_utf8(data: bytes) -> bool:
    try:
        data.decode()
    except UnicodeDecodeError:
        return False
    return True


class _SentencePieceVocabulary:
    """The two calls mlx-lm's SentencePiece detokenizer makes of a tokenizer, over a small
    SentencePiece-style vocabulary (``▁`` for a space, ``<0xNN>`` byte tokens)."""

    pieces = ("<unk>", "▁caf", "<0xC3>", "<0xA9>", "▁ok", "é")

    def __len__(self) -> int:
        return len(self.pieces)

    def convert_ids_to_tokens(self, ids: list[int]) -> list[str]:
        return [self.pieces[token] for token in ids]


def test_sentencepiece_tokens_are_their_bytes_with_spaces() -> None:
    class Tokenizer:
        detokenizer = SPMStreamingDetokenizer(_SentencePieceVocabulary())

    token_bytes = TokenBytes(Tokenizer())
    assert [token_bytes(token) for token in range(6)] == [
        b"<unk>",
        b" caf",
        b"\xc3",
        b"\xa9",
        b" ok",
        "é".encode(),
    ]
    assert b"".join(token_bytes(token) for token in (1, 2, 3, 4)).decode() == " café ok"
