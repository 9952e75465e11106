"""The hostile run's job stream entries: garbage bytes, msgpack that is not a map, wrong
types, missing fields, huge strings, deep nesting, negative or enormous max_tokens, unknown
versions, entries without a ``job`` field, protocol-valid jobs with absurd sampling values,
and valid greedy jobs; each with the protocol decoder's verdict."""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

import msgpack  # type: ignore[import-untyped]

from mlx_redis_protocol.codec_job import decode_job, encode_job
from mlx_redis_protocol.constants import JOB_FIELD
from mlx_redis_protocol.errors import ProtocolError
from mlx_redis_protocol.messages import Job

KIB = 1024
MIB = 1024 * KIB


@dataclass
class Entry:
    """One generated job stream entry and what the decoder says about it."""

    index: int
    kind: str
    fields: dict[str, bytes]  # the stream entry's fields (normally just ``job``)
    rid: str | None  # the request id it names, when it names one
    code: str | None = None  # the decoder's error code; None when the job decodes
    readable: bool = False  # the worker can name the request in an error event
    valid_job: Job | None = None  # a job the decoder accepts
    greedy_prompt: str | None = None  # one of the reference-checked valid jobs
    entry_id: str = ""

    @property
    def data(self) -> bytes | None:
        return self.fields.get(JOB_FIELD)


def pack(value: Any) -> bytes:
    packed: bytes = msgpack.packb(value, use_bin_type=True)
    return packed


def _nested(depth: int, leaf: Any = 1) -> Any:
    value = leaf
    for level in range(depth):
        value = [value] if level % 2 else {"k": value}
    return value


class Generator:
    """Deterministic hostile entries; ``make(i)`` gives entry ``i``."""

    # Relative weights; 1 in ~200 entries is over 1 MiB.
    WEIGHTS: tuple[tuple[str, int], ...] = (
        ("garbage", 28),
        ("not_a_map", 12),
        ("wrong_type", 40),
        ("missing", 16),
        ("huge", 8),
        ("too_large", 1),
        ("deep", 12),
        ("max_tokens", 20),
        ("version", 16),
        ("no_job_field", 6),
        ("bad_request_id", 10),
        ("absurd", 20),
        ("valid", 10),
    )

    def __init__(self, seed: int, pool: list[str], max_tokens: int) -> None:
        self.rng = random.Random(seed)
        self.pool = pool
        self.max_tokens = max_tokens
        kinds, weights = zip(*self.WEIGHTS, strict=True)
        self.kinds: list[str] = list(kinds)
        self.weights: list[int] = list(weights)

    def make(self, index: int) -> Entry:
        kind = self.rng.choices(self.kinds, self.weights)[0]
        rid = f"h-{index:06d}"
        fields = getattr(self, f"_{kind}")(rid)
        entry = Entry(index, kind, fields, rid)
        if kind == "valid":
            entry.greedy_prompt = self.pool[index % len(self.pool)]
        try:
            job = decode_job(entry.data)
        except ProtocolError as exc:
            entry.code = exc.code
            entry.readable = exc.request_id == rid
        else:
            entry.valid_job = job
        if entry.code is None and job.request_id != rid:
            entry.rid = None  # a generated id: nobody can follow it
        return entry

    def _job(self, **fields: Any) -> dict[str, bytes]:
        return {JOB_FIELD: pack(fields)}

    def _garbage(self, rid: str) -> dict[str, bytes]:
        rng = self.rng
        body = bytes(rng.getrandbits(8) for _ in range(rng.randint(0, 512)))
        head = rng.choice([b"", b"\x81", b"\x8f", b"\xdf\xff\xff\xff\xff", b"\xc1", b"\xd9"])
        return {JOB_FIELD: head + body}

    def _not_a_map(self, rid: str) -> dict[str, bytes]:
        value = self.rng.choice([[1, "v", rid], 1, "job", None, True, 1.5, b"\x00" * 9, []])
        return {JOB_FIELD: pack(value)}

    def _wrong_type(self, rid: str) -> dict[str, bytes]:
        bad = self.rng.choice(
            [
                {"prompt": 123},
                {"prompt": b"bytes"},
                {"prompt": ["a"]},
                {"prompt": ""},
                {"prompt": "x", "max_tokens": "5"},
                {"prompt": "x", "max_tokens": 5.0},
                {"prompt": "x", "max_tokens": True},
                {"prompt": "x", "temperature": "hot"},
                {"prompt": "x", "temperature": True},
                {"prompt": "x", "temperature": float("nan")},
                {"prompt": "x", "top_p": float("inf")},
                {"prompt": "x", "top_p": 1.5},
                {"prompt": "x", "min_p": -0.1},
                {"prompt": "x", "repetition_penalty": 0},
                {"prompt": "x", "top_k": -1},
                {"prompt": "x", "seed": -1},
                {"prompt": "x", "seed": -(2**63)},
                {"prompt": "x", "stop": "x"},
                {"prompt": "x", "stop": [1]},
                {"prompt": "x", "stop": [""]},
                {"prompt": "x", "stop_token_ids": [-1]},
                {"prompt": "x", "logprobs": True},
                {"prompt": "x", "logprobs": 21},
                {"prompt": "x", "stream_interval": 0},
                {"prompt": "x", "deadline": "soon"},
                {"prompt": "x", "metadata": [1]},
                {"prompt": "x", "metadata": {"x": float("nan")}},
                {"prompt": "x", "metadata": {"x": b"bin"}},
                {"prompt_token_ids": "abc"},
                {"prompt_token_ids": [1.5]},
                {"prompt_token_ids": []},
                {"prompt_token_ids": [-3]},
                {"messages": "hi"},
                {"messages": []},
                {"messages": [{"role": 1, "content": "x"}]},
                {"messages": [{"role": "", "content": "x"}]},
                {"messages": [{"role": "u" * 65, "content": "x"}]},
                {"messages": ["hi"]},
                {"prompt": "x", "prompt_token_ids": [1]},
                {"prompt": "x", "messages": [{"role": "user", "content": "x"}]},
            ]
        )
        return self._job(v=1, request_id=rid, **bad)

    def _missing(self, rid: str) -> dict[str, bytes]:
        return self.rng.choice(
            [
                self._job(v=1, request_id=rid),
                self._job(request_id=rid, prompt="x"),
                {JOB_FIELD: pack({})},
                self._job(v=1),
                self._job(v=1, request_id=rid, messages=[{"role": "user"}]),
                self._job(v=1, request_id=rid, prompt=None, max_tokens=4),
            ]
        )

    def _huge(self, rid: str) -> dict[str, bytes]:
        rng = self.rng
        choice = rng.randrange(6)
        if choice == 0:  # a string over max_str_len
            return self._job(v=1, request_id=rid, prompt="x" * (256 * KIB + 1))
        if choice == 1:  # an array over max_array_len
            return self._job(v=1, request_id=rid, prompt_token_ids=[1] * 32769)
        if choice == 2:  # metadata over 16 KiB
            return self._job(v=1, request_id=rid, prompt="x", metadata={"x": "y" * (17 * KIB)})
        if choice == 3:  # too many stop strings, or one too long
            stop = ["s"] * 17 if rng.random() < 0.5 else ["s" * 257]
            return self._job(v=1, request_id=rid, prompt="x", stop=stop)
        if choice == 4:  # a map with too many keys
            fields = {f"k{i}": i for i in range(300)}
            return self._job(v=1, request_id=rid, prompt="x", **fields)
        # A text prompt the decoder takes (200 KiB) but that is far over the engine's
        # 32768-token prompt cap once tokenized.
        text = " ".join(rng.choice(["ab", "cd", "ef", "gh", "1", "2"]) for _ in range(70_000))
        return self._job(v=1, request_id=rid, prompt=text, max_tokens=4)

    def _too_large(self, rid: str) -> dict[str, bytes]:
        return self._job(v=1, request_id=rid, prompt="x", pad="p" * (MIB + 1))

    def _deep(self, rid: str) -> dict[str, bytes]:
        choice = self.rng.randrange(4)
        if choice == 0:  # metadata deeper than 8
            return self._job(v=1, request_id=rid, prompt="x", metadata=_nested(40))
        if choice == 1:  # deeper than msgpack's own stack
            return {JOB_FIELD: b"\x91" * 200_000 + b"\x00"}
        if choice == 2:  # deep nesting inside a prompt field
            return self._job(v=1, request_id=rid, prompt=_nested(500))
        # Deep nesting in an unknown field: ignored by the protocol, so a valid job.
        return self._job(v=1, request_id=rid, prompt="deep", max_tokens=2, extra=_nested(500))

    def _max_tokens(self, rid: str) -> dict[str, bytes]:
        value = self.rng.choice([-1, 0, -(2**63), 32769, 10**6, 2**63 - 1, 2**64 - 1])
        return self._job(v=1, request_id=rid, prompt="x", max_tokens=value)

    def _version(self, rid: str) -> dict[str, bytes]:
        value = self.rng.choice([0, 2, 99, -1, "1", 1.0, True, None, 2**64 - 1, [1], {"v": 1}])
        return self._job(v=value, request_id=rid, prompt="x", max_tokens=2)

    def _no_job_field(self, rid: str) -> dict[str, bytes]:
        job = pack({"v": 1, "request_id": rid, "prompt": "x"})
        return self.rng.choice([{"jobs": job}, {"JOB": job}, {"x": b""}])

    def _bad_request_id(self, rid: str) -> dict[str, bytes]:
        value = self.rng.choice(
            ["", "a b", "{x}", "../../etc/passwd", "x" * 129, "id\n", "é", 42, ["x"], "a*"]
        )
        return self._job(v=1, request_id=value, prompt="x", max_tokens=2)

    def _absurd(self, rid: str) -> dict[str, bytes]:
        """Jobs the protocol accepts, with sampling values nobody would send."""
        absurd = self.rng.choice(
            [
                {"temperature": 1e300},
                {"temperature": 1e-300},
                {"temperature": 1.0, "top_k": 2**62},
                {"temperature": 1.0, "top_p": 0.0},
                {"temperature": 1.0, "min_p": 1.0},
                {"repetition_penalty": 1e-300},
                {"repetition_penalty": 1e300},
                {"presence_penalty": 9e15, "frequency_penalty": -9e15},
                {"frequency_penalty": 1.7e308},
                {"temperature": 1.0, "seed": 2**64 - 1},
                {"temperature": 1.0, "logprobs": 20},
                {"stop_token_ids": [2**62, 0]},
                {"stop": ["x" * 256] * 16},
                {"stream_interval": 2**40},
                {"deadline": 0},
                {"deadline": 1e300},
                {"prompt_token_ids": [10**9]},
                {"prompt_token_ids": [2**63 - 1] * 3},
                {"messages": [{"role": "}}{%", "content": "{{ 7*7 }}"}] * 3},
                {"messages": [{"role": "system", "content": ""}]},
                {"metadata": _nested(7, leaf="x"), "temperature": 0.5},
            ]
        )
        if not any(k in absurd for k in ("prompt_token_ids", "messages")):
            absurd["prompt"] = "absurd " + rid
        return self._job(v=1, request_id=rid, max_tokens=self.rng.randint(1, 4), **absurd)

    def _valid(self, rid: str) -> dict[str, bytes]:
        prompt = self.pool[int(rid.split("-")[1]) % len(self.pool)]
        job = Job(request_id=rid, prompt=prompt, max_tokens=self.max_tokens, temperature=0.0)
        return {JOB_FIELD: encode_job(job)}
