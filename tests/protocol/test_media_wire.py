"""Images and videos on the wire: what a job carries round-trips, and what the decoder refuses
before any worker reads a byte of media (counts, sizes, formats, sources, placements)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import msgpack  # type: ignore[import-untyped]
import pytest

from mlx_redis_protocol.codec_job import decode_job, encode_job
from mlx_redis_protocol.errors import ProtocolError
from mlx_redis_protocol.limits import DEFAULT_LIMITS
from mlx_redis_protocol.messages import ChatMessage, ContentPart, ImageInput, Job, VideoInput
from tests.support.media import image_file, png_bomb

PNG = image_file(1)
JPEG = image_file(2, fmt="JPEG")


def _job(**fields: Any) -> bytes:
    message = {"v": 1, "request_id": "r1", "messages": [{"role": "user", "content": "What?"}]}
    return bytes(msgpack.packb({**message, **fields}, use_bin_type=True))


def _refused(code: str, match: str, **fields: Any) -> None:
    with pytest.raises(ProtocolError, match=match) as caught:
        decode_job(_job(**fields))
    assert caught.value.code == code
    assert caught.value.request_id == "r1"  # the worker can tell the request why


def test_images_and_videos_round_trip_with_their_places() -> None:
    job = Job(
        request_id="r1",
        messages=(
            ChatMessage(
                role="user",
                content="Compare  with ",
                parts=(
                    ContentPart("text", "Compare "),
                    ContentPart("image"),
                    ContentPart("text", " with "),
                    ContentPart("image"),
                ),
            ),
        ),
        images=(ImageInput(data=PNG, detail="low"), ImageInput(blob="b-1")),
        videos=(
            VideoInput(url="https://media.example.com/a.mp4", fps=2.0, max_frames=8),
            VideoInput(frames=(ImageInput(data=JPEG), ImageInput(blob="b-2"))),
        ),
    )
    decoded = decode_job(encode_job(job))
    assert decoded == job
    # The chat templates' shape: parts in place; the unplaced video goes first in the turn.
    turn = decoded.chat_messages()[0]  # type: ignore[index]
    assert turn["content"] == [
        {"type": "video"},
        {"type": "video"},
        {"type": "text", "text": "Compare "},
        {"type": "image"},
        {"type": "text", "text": " with "},
        {"type": "image"},
    ]


def test_media_without_places_go_to_the_last_user_turn() -> None:
    job = decode_job(
        _job(
            messages=[
                {"role": "user", "content": "first"},
                {"role": "assistant", "content": "ok"},
                {"role": "user", "content": "Describe it"},
            ],
            images=[{"data": PNG}],
        )
    )
    turns = job.chat_messages()
    assert turns is not None
    assert turns[0]["content"] == "first"
    assert turns[2]["content"] == [{"type": "image"}, {"type": "text", "text": "Describe it"}]


def test_a_text_only_content_array_is_plain_text() -> None:
    job = decode_job(_job(messages=[{"role": "user", "content": [{"type": "text", "text": "a"}]}]))
    assert job.messages is not None and job.messages[0].parts is None
    assert job.messages[0].content == "a"


@pytest.mark.parametrize(
    ("fields", "code", "match"),
    [
        ({"images": [{"data": PNG}] * 17}, "limit_exceeded", "images has more than 16"),
        ({"images": []}, "invalid_field", "at least 1"),
        ({"images": [{"data": b"GIF89a" + b"\0" * 10, "blob": "x"}]}, "conflicting", "blob"),
        ({"images": [{}]}, "missing_field", r"images\[0\]\.data"),
        ({"images": [{"data": b"%PDF-1.7 not an image"}]}, "invalid_field", "allowed format"),
        ({"images": [{"data": "a string"}]}, "invalid_field", "must be bin"),
        ({"images": [{"blob": "../etc"}]}, "invalid_field", "blob must be"),
        ({"images": [{"url": "file:///etc/passwd"}]}, "invalid_field", "http"),
        ({"images": [{"url": "https://x/" + "a" * 3000}]}, "limit_exceeded", "longer"),
        ({"images": [{"data": PNG, "detail": "ultra"}]}, "invalid_field", "detail"),
        ({"videos": [{"data": PNG}]}, "invalid_field", "allowed format"),
        ({"videos": [{"url": "https://x/v.mp4", "fps": 0}]}, "invalid_field", "fps"),
        ({"videos": [{"url": "https://x/v.mp4", "fps": 31}]}, "invalid_field", "fps"),
        ({"videos": [{"url": "https://x/v.mp4", "max_frames": 65}]}, "limit_exceeded", "65|64"),
        ({"videos": [{"frames": [{"data": PNG}] * 65}]}, "limit_exceeded", "frames"),
        ({"videos": [{"frames": [{"data": PNG}], "fps": 1}]}, "conflicting", "fps"),
        ({"videos": [{"frames": [{"data": PNG}], "url": "https://x"}]}, "conflicting", "frames"),
        (
            {"messages": [{"role": "user", "content": [{"type": "image"}]}]},
            "invalid_field",
            "place 1 image",
        ),
        (
            {"messages": [{"role": "user", "content": [{"type": "audio"}]}]},
            "invalid_field",
            "type must be",
        ),
    ],
)
def test_the_decoder_refuses_bad_media(fields: dict[str, Any], code: str, match: str) -> None:
    code = "conflicting_fields" if code == "conflicting" else code
    _refused(code, match, **fields)


def test_a_job_over_its_media_bytes_is_refused_before_anything_is_read() -> None:
    limits = replace(DEFAULT_LIMITS, max_media_bytes=len(PNG) * 2)
    with pytest.raises(ProtocolError, match="max_media_bytes") as caught:
        decode_job(_job(images=[{"data": PNG}] * 3), limits)
    assert caught.value.code == "limit_exceeded"
    # A bomb's header is a valid PNG signature: the wire passes it, the worker refuses it.
    assert decode_job(_job(images=[{"data": png_bomb()}])).images is not None
