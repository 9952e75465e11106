"""An embedding model as the engine runs it: mlx-embeddings' model and tokenizer, and what a
request may ask of them.

The vectors are the library's own (``text_embeds``: the architecture's pooling, then unit
length), computed over a padded batch with its attention mask, so an input's vector does not
depend on what it was batched with (beyond float rounding). A request may ask for fewer
``dimensions`` only where the model documents Matryoshka training: the vector is then cut to
that length and scaled back to unit length.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import numpy as np


@dataclass(frozen=True, slots=True)
class EmbeddingModel:
    """``model``: an mlx-embeddings model (``model(input_ids, attention_mask=...)`` gives
    ``text_embeds``); ``tokenizer``: its tokenizer. ``special_prefix`` / ``special_suffix``:
    the special tokens the tokenizer puts around one text (BERT's ``[CLS]`` and ``[SEP]``),
    put around token-id inputs too, so a text and its token ids give one vector.
    ``matryoshka_dimensions``: the shorter lengths the model was trained to be cut to (none:
    only ``dimensions``)."""

    model: Any
    tokenizer: Any
    name: str
    dimensions: int
    max_input_tokens: int
    vocab_size: int
    pad_token_id: int
    special_prefix: tuple[int, ...] = ()
    special_suffix: tuple[int, ...] = ()
    matryoshka_dimensions: tuple[int, ...] = ()

    # -- inputs (the caller's thread) --------------------------------------------------------

    def tokenize(self, texts: list[str]) -> list[list[int]]:
        """The token ids of each text (no special tokens), in one tokenizer call."""
        if not texts:
            return []
        return [list(ids) for ids in self.tokenizer(texts, add_special_tokens=False)["input_ids"]]

    def inputs_ids(
        self, items: list[str | list[int]], tokenized: list[list[int]] | None = None
    ) -> list[list[int]]:
        """The model's input for each text or list of token ids (``ValueError`` naming the first
        input the model cannot take). ``tokenized``: the ``tokenize`` of the items' texts, in
        order, where the caller tokenized them in a larger batch; else they are tokenized here,
        together."""
        texts = [item for item in items if isinstance(item, str)]
        if any(not text for text in texts):
            empty = next(i for i, item in enumerate(items) if item == "")
            raise ValueError(f"input[{empty}] is an empty string")
        encoded = iter(self.tokenize(texts) if tokenized is None else tokenized)
        result = []
        for index, item in enumerate(items):
            body = next(encoded) if isinstance(item, str) else self._token_ids(item, index)
            ids = [*self.special_prefix, *body, *self.special_suffix]
            if len(ids) > self.max_input_tokens:
                raise ValueError(
                    f"input[{index}] is {len(ids)} tokens, over the model's limit of "
                    f"{self.max_input_tokens} tokens per input"
                )
            result.append(ids)
        return result

    def input_ids(self, item: str | list[int]) -> list[int]:
        """The model's input for one text or list of token ids."""
        return self.inputs_ids([item])[0]

    def _token_ids(self, item: list[int], index: int) -> list[int]:
        if not item:
            raise ValueError(f"input[{index}] is an empty list of token ids")
        bad = next((t for t in item if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise ValueError(
                f"input[{index}] holds token id {bad}, outside the model's vocabulary "
                f"[0, {self.vocab_size})"
            )
        return list(item)

    def check_dimensions(self, dimensions: int | None) -> int:
        """The vector length a request gets (``ValueError`` for one the model cannot give)."""
        if dimensions is None or dimensions == self.dimensions:
            return self.dimensions
        if isinstance(dimensions, bool) or not isinstance(dimensions, int) or dimensions < 1:
            raise ValueError(f"dimensions must be an integer >= 1, got {dimensions!r}")
        if not self.matryoshka_dimensions:
            raise ValueError(
                f"model {self.name!r} gives {self.dimensions}-dimensional vectors and documents "
                "no shorter (Matryoshka) ones: dimensions is not supported for it"
            )
        shortest = min(self.matryoshka_dimensions)
        if not shortest <= dimensions <= self.dimensions:
            raise ValueError(
                f"dimensions must be from {shortest} to {self.dimensions} for model "
                f"{self.name!r} (its Matryoshka lengths: "
                f"{', '.join(map(str, self.matryoshka_dimensions))})"
            )
        return dimensions

    # -- the batch (the engine thread) -------------------------------------------------------

    def embed(self, batch: list[list[int]]) -> np.ndarray[Any, np.dtype[np.float32]]:
        """Unit vectors of a batch of inputs (rows in its order), as float32 on the host."""
        longest = max(len(ids) for ids in batch)
        tokens = np.full((len(batch), longest), self.pad_token_id, dtype=np.int32)
        mask = np.zeros((len(batch), longest), dtype=np.int32)
        for row, ids in enumerate(batch):
            tokens[row, : len(ids)] = ids
            mask[row, : len(ids)] = 1
        output = self.model(mx.array(tokens), attention_mask=mx.array(mask))
        vectors = output.text_embeds.astype(mx.float32)
        mx.eval(vectors)
        return np.asarray(vectors)


def cut_to(vector: np.ndarray[Any, np.dtype[np.float32]], dimensions: int) -> bytes:
    """A unit vector cut to ``dimensions`` and scaled back to unit length, as the wire
    carries it: little-endian float32 bytes."""
    if dimensions < vector.shape[0]:
        vector = vector[:dimensions]
        norm = float(np.linalg.norm(vector))
        if norm > 0:
            vector = vector / norm
    return vector.astype("<f4").tobytes()
