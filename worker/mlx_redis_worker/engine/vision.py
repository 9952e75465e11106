"""Images and videos in requests, for vision-language models (mlx-vlm's).

A vision-language model reaches the engine as its language model, an mlx-lm model, so the
scheduler, the batch caches and every per-request feature treat it as any text model; a
``VisionModel`` rides along on it (``model.vision``): mlx-vlm's model (vision tower, connector,
and the merge of image features into the prompt's embeddings), its processor and the image
placeholder. A request with images goes:

1. ``prepare_vision_prompt``, on a thread of ``EngineCore``'s add path (never the engine thread,
   never the event loop): the processor resizes, normalizes and tiles the images and expands
   each placeholder into its image tokens; the images' content hash keys those tokens for the
   prefix cache (``VisionPrompt.cache_key``), so the same page with the same prompt is a hit.
2. ``tile_features`` then ``prompt_embeddings``, on the engine thread, a few tiles a step
   within the step's budget of image tokens (``vision_queue``): the vision tower, then the
   merge, for the positions the prefix cache does not hold.
3. The prefill takes those embeddings chunk by chunk as it takes a text prompt's tokens
   (``phased_generator``); decoding is text.

A video is its frames, each an image (the daemon samples them).
"""

from __future__ import annotations

import dataclasses
import hashlib
import re
from dataclasses import dataclass
from typing import Any

import mlx.core as mx

from mlx_redis_worker.engine.prompt import VIDEO_PLACEHOLDER

# Prefix-cache ids of image tokens: past the vocabulary, below int32's end (mlx-lm keeps
# token ids in int32 arrays), so they never equal a text token.
_KEY_LIMIT = 2**31 - 1


@dataclass(frozen=True, slots=True)
class VisionModel:
    """What a vision-language model adds to its language model.

    ``vlm``: mlx-vlm's model, whose ``get_input_embeddings`` runs the vision tower and merges
    the image features at the image tokens (its language model's weights are the arrays of
    the engine's mlx-lm model, shared). ``processor``: the model's processor (images to pixel
    arrays, placeholders to image tokens). ``image_placeholder``: the text that marks an
    image in a prompt (``<image>``); ``image_token_id``: the token it expands to.
    """

    vlm: Any
    processor: Any
    model_type: str
    image_placeholder: str
    image_token_id: int


def vision_model_of(model: Any) -> VisionModel | None:
    """The vision parts of an engine's model; None for a text-only model."""
    vision = getattr(model, "vision", None)
    return vision if isinstance(vision, VisionModel) else None


@dataclass(frozen=True, slots=True)
class VisionPrompt:
    """A prompt with its images, processed: ``token_ids`` with each image's tokens in place,
    ``cache_key`` the same with the image tokens replaced by ids derived from the images'
    content (the prefix cache's key), ``arrays`` the processor's pixel arrays (host data)
    for ``get_input_embeddings``, ``image_tokens`` how many tokens the images became (the
    measure of their vision work), and ``vision_end``: the position after the last image
    token (a prefix-cache hit that reaches it needs no vision encoding)."""

    token_ids: list[int]
    cache_key: list[int]
    arrays: dict[str, Any]
    num_images: int
    image_tokens: int
    vision_end: int
    # The vision tower's units of work: the processor's tiles (each picture's sub-images and
    # its whole), encoded a few at a time within a step's budget; one unit when the image
    # tokens do not split evenly over them.
    tiles: int = 1

    def needs_encoding(self, cached_tokens: int) -> bool:
        return cached_tokens < self.vision_end

    @property
    def tile_tokens(self) -> int:
        """Image tokens of one tile."""
        return self.image_tokens // self.tiles

    def encoded(self) -> VisionPrompt:
        """This prompt without its pixel arrays, once encoded (a tiled page's arrays are tens
        of MB; the request keeps its tokens and cache key to its end)."""
        return dataclasses.replace(self, arrays={})


def prepare_vision_prompt(
    vision: VisionModel,
    prompt: str | list[int],
    images: list[Any],
    videos: list[list[Any]],
    *,
    vocab_size: int,
    max_tokens: int,
) -> VisionPrompt:
    """Process ``prompt`` with its ``images`` and ``videos`` (a thread of the add path: this
    resizes and normalizes pixels). A prompt of token ids (a chat rendered by ``chat_prompt``)
    is read back as its text, placeholders included. ``ValueError`` for token ids out of
    range, placeholders that do not match the media, an image that cannot be read, or a
    prompt over ``max_tokens``."""
    tokenizer = vision.processor.tokenizer
    if not isinstance(prompt, str):
        prompt = _text_of(tokenizer, prompt, vocab_size)
    if not all(isinstance(video, list) and video for video in videos):
        raise ValueError("each video must be a non-empty list of frames")
    from mlx_redis_worker.engine.images import as_rgb_image  # Pillow: the vision extra

    text, media = _place_media(prompt, vision.image_placeholder, images, videos)
    pictures = [as_rgb_image(item) for item in media]
    bos = getattr(tokenizer, "bos_token", None)
    processed = vision.processor(
        text=[text],
        images=[pictures],
        add_special_tokens=bos is None or not text.startswith(bos),
    )
    # The processor wraps host data in arrays (no computation, no stream): the engine thread
    # runs every operation on them.
    token_ids = [int(t) for t in processed["input_ids"][0].tolist()]
    if len(token_ids) > max_tokens:
        raise ValueError(
            f"prompt has {len(token_ids)} tokens with its images, over the limit of {max_tokens}"
        )
    image_positions = [i for i, t in enumerate(token_ids) if t == vision.image_token_id]
    if not image_positions:
        raise ValueError("the processor placed no image tokens in the prompt")
    if image_positions[-1] == len(token_ids) - 1:
        # The prompt's last token is fed as a token id when its first token is sampled.
        raise ValueError("a prompt must not end with an image")
    arrays = {k: v for k, v in processed.items() if k != "input_ids" and v is not None}
    tiles = int(arrays["pixel_values"].shape[1]) if "pixel_values" in arrays else 1
    return VisionPrompt(
        token_ids=token_ids,
        cache_key=_cache_key(token_ids, image_positions, _content_digest(pictures), vocab_size),
        arrays=arrays,
        num_images=len(pictures),
        image_tokens=len(image_positions),
        vision_end=image_positions[-1] + 1,
        tiles=tiles if tiles > 0 and len(image_positions) % tiles == 0 else 1,
    )


def tile_features(vision: VisionModel, prompt: VisionPrompt, first: int, count: int) -> mx.array:
    """The image features of ``prompt``'s tiles ``first`` to ``first + count`` (engine thread:
    runs the vision tower on them). mlx-vlm's own ``get_input_embeddings`` makes them, given
    those tiles and a prompt of their image tokens alone: every position is then a feature."""
    arrays = dict(prompt.arrays)
    arrays.pop("attention_mask", None)
    window = slice(first, first + count)
    pixel_values = arrays.pop("pixel_values")[:, window]
    if "pixel_attention_mask" in arrays:
        arrays["pixel_attention_mask"] = arrays["pixel_attention_mask"][:, window]
    ids = mx.array([[vision.image_token_id] * (count * prompt.tile_tokens)])
    features: mx.array = vision.vlm.get_input_embeddings(ids, pixel_values, **arrays).inputs_embeds[
        0
    ]
    mx.eval(features)
    return features


def prompt_embeddings(
    vision: VisionModel, prompt: VisionPrompt, start: int, features: mx.array | None = None
) -> mx.array:
    """The input embeddings of ``prompt``'s positions from ``start`` on, the image features
    merged in by mlx-vlm's ``get_input_embeddings`` (engine thread): ``features`` of all its
    tiles (``tile_features``), or computed here (the vision tower over every tile)."""
    arrays = dict(prompt.arrays)
    pixel_values = arrays.pop("pixel_values")
    mask = arrays.pop("attention_mask", None)
    if features is not None:
        arrays["cached_image_features"] = features
    merged = vision.vlm.get_input_embeddings(
        mx.array([prompt.token_ids]), pixel_values, mask=mask, **arrays
    )
    embeddings: mx.array = merged.inputs_embeds[0, start:]
    mx.eval(embeddings)
    return embeddings


def token_embeddings(vision: VisionModel, token_ids: list[int]) -> mx.array:
    """Text tokens embedded as ``prompt_embeddings`` embeds a prompt's text positions (for a
    text row beside an image row in one prefill pass)."""
    features = vision.vlm.get_input_embeddings(mx.array([token_ids]), None)
    embeddings: mx.array = features.inputs_embeds[0]
    return embeddings


def _text_of(tokenizer: Any, token_ids: Any, vocab_size: int) -> str:
    """The text of a token-id prompt, special tokens and all (the processor tokenizes it
    again, each image placeholder expanded)."""
    if not isinstance(token_ids, list) or not all(
        isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab_size for t in token_ids
    ):
        raise ValueError(f"prompt must be a string or a list of token ids in [0, {vocab_size})")
    text: str = tokenizer.decode(
        token_ids, skip_special_tokens=False, clean_up_tokenization_spaces=False
    )
    return text


def _place_media(
    prompt: str, placeholder: str, images: list[Any], videos: list[list[Any]]
) -> tuple[str, list[Any]]:
    """The prompt with one image placeholder per image and per video frame, and the images
    and frames in the order of their placeholders. Each image placeholder in ``prompt`` takes
    the next image, each ``VIDEO_PLACEHOLDER`` the next video; a prompt with neither gets its
    images, then its videos, before its text."""
    marks = re.compile(f"({re.escape(placeholder)}|{re.escape(VIDEO_PLACEHOLDER)})")
    pieces = marks.split(prompt)
    found_images = pieces[1::2].count(placeholder)
    found_videos = pieces[1::2].count(VIDEO_PLACEHOLDER)
    if found_images == found_videos == 0:
        pieces = ["", *[placeholder, ""] * len(images), *[VIDEO_PLACEHOLDER, ""] * len(videos)]
        pieces[-1] += prompt
    elif (found_images, found_videos) != (len(images), len(videos)):
        raise ValueError(
            f"the prompt marks {found_images} image(s) ({placeholder}) and {found_videos} "
            f"video(s) ({VIDEO_PLACEHOLDER}) for {len(images)} image(s) and {len(videos)} "
            "video(s)"
        )
    next_image, next_video = iter(images), iter(videos)
    text: list[str] = []
    media: list[Any] = []
    for i, piece in enumerate(pieces):
        if i % 2 == 0:
            text.append(piece)
        elif piece == placeholder:
            text.append(placeholder)
            media.append(next(next_image))
        else:
            frames = next(next_video)
            text.append(placeholder * len(frames))
            media.extend(frames)
    return "".join(text), media


def _content_digest(pictures: list[Any]) -> bytes:
    """The identity of a request's images, in order: their sizes and pixels."""
    digest = hashlib.blake2b(digest_size=16)
    for picture in pictures:
        digest.update(f"{picture.mode}:{picture.width}x{picture.height};".encode())
        digest.update(picture.tobytes())
    return digest.digest()


def _cache_key(
    token_ids: list[int], image_positions: list[int], digest: bytes, vocab_size: int
) -> list[int]:
    """``token_ids`` with the j-th image token replaced by an id hashed from the images' digest
    and j: the same images give the same key, others differ at their first image token (and,
    one position's ids aside, at every later one)."""
    key = list(token_ids)
    span = _KEY_LIMIT - vocab_size
    for j, position in enumerate(image_positions):
        mixed = hashlib.blake2b(digest + j.to_bytes(4, "little"), digest_size=8).digest()
        key[position] = vocab_size + int.from_bytes(mixed, "little") % span
    return key
