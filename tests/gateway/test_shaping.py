"""``Shaper``: a request's protocol events → OpenAI chunks, fed with hand-built events (no
Redis). The shaper is pure, so a resumed stream is the same chunks minus those sent, and a
re-run after a worker crash must never show the client a text twice or a rewritten one."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from itertools import pairwise
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from mlx_redis_gateway.shaping import Chunk, Kind, ResponseShape, Shaper
from mlx_redis_protocol.messages import (
    DeltaEvent,
    DoneEvent,
    ErrorEvent,
    Event,
    FinishReason,
    QueuedEvent,
    ResetEvent,
    TokenLogprob,
    UnknownEvent,
    Usage,
)

REQUEST_ID = "chatcmpl-0123456789abcdef"
CREATED = 1_700_000_000


@dataclass
class Log:
    """A request's events as a worker would number them: seq 0 the queued marker, then
    gapless across attempts."""

    events: list[Event] = field(default_factory=list)
    attempt: int = 1

    def __post_init__(self) -> None:
        self.events.append(QueuedEvent(request_id=REQUEST_ID, seq=0, attempt=0))

    @property
    def next_seq(self) -> int:
        return len(self.events)

    def delta(
        self, text: str, tokens: list[int], logprobs: list[TokenLogprob] | None = None
    ) -> Log:
        self.events.append(
            DeltaEvent(
                request_id=REQUEST_ID,
                seq=self.next_seq,
                attempt=self.attempt,
                new_text=text,
                new_token_ids=tuple(tokens),
                logprobs=tuple(logprobs) if logprobs is not None else None,
            )
        )
        return self

    def reset(self) -> Log:
        self.attempt += 1
        self.events.append(
            ResetEvent(request_id=REQUEST_ID, seq=self.next_seq, attempt=self.attempt)
        )
        return self

    def done(
        self, output_text: str, finish_reason: FinishReason = "length", usage: Usage | None = None
    ) -> Log:
        self.events.append(
            DoneEvent(
                request_id=REQUEST_ID,
                seq=self.next_seq,
                attempt=self.attempt,
                finish_reason=finish_reason,
                output_text=output_text,
                usage=usage or Usage(prompt_tokens=5, completion_tokens=3),
            )
        )
        return self

    def error(self, code: str, message: str = "it broke") -> Log:
        self.events.append(
            ErrorEvent(
                request_id=REQUEST_ID,
                seq=self.next_seq,
                attempt=self.attempt,
                code=code,
                message=message,
            )
        )
        return self


def shaper(kind: Kind = "chat", *, include_usage: bool = False, logprobs: bool = False) -> Shaper:
    shape = ResponseShape(
        kind=kind, model="tiny", created=CREATED, include_usage=include_usage, logprobs=logprobs
    )
    return Shaper(REQUEST_ID, shape)


def stream(shaper: Shaper, events: list[Event]) -> list[Chunk]:
    """What a gateway sends for ``events``: the opening chunk, then each event's chunks, up
    to the end."""
    chunks = [shaper.opening()]
    for event in events:
        chunks += shaper.feed(event)
        if shaper.finished:
            break
    return chunks


def content(chunks: list[Chunk]) -> str:
    """The text a client reads from the chunks (chat deltas or completion texts)."""
    texts = []
    for chunk in chunks:
        for choice in chunk.data.get("choices", []):
            if "delta" in choice:
                texts.append(choice["delta"].get("content") or "")
            else:
                texts.append(choice["text"])
    return "".join(texts)


def logprob(token: int, top: int = 0) -> TokenLogprob:
    """A token's logprob: -token/10, with ``top`` alternatives (the token and its neighbours)."""
    return TokenLogprob(
        token_id=token,
        logprob=-token / 10,
        top_logprobs=tuple((token + i, -(token + i) / 10) for i in range(top)),
    )


def errors_of(chunks: list[Chunk]) -> list[dict[str, Any]]:
    return [chunk.data["error"] for chunk in chunks if "error" in chunk.data]


# -- a normal stream ------------------------------------------------------------------------


def test_a_chat_stream_opens_with_the_role_and_sends_each_delta_under_its_seq() -> None:
    log = Log().delta("Hel", [1]).delta("lo", [2]).delta(" you", [3]).done("Hello you")
    chunks = stream(shaper("chat"), log.events)

    assert [chunk.seq for chunk in chunks] == [0, 1, 2, 3, 4]
    assert chunks[0].data["choices"] == [
        {
            "index": 0,
            "delta": {"role": "assistant", "content": ""},
            "logprobs": None,
            "finish_reason": None,
        }
    ]
    assert [c.data["choices"][0]["delta"] for c in chunks[1:4]] == [
        {"content": "Hel"},
        {"content": "lo"},
        {"content": " you"},
    ]
    assert chunks[-1].data["choices"] == [
        {"index": 0, "delta": {}, "logprobs": None, "finish_reason": "length"}
    ]
    for chunk in chunks:
        assert chunk.data["id"] == REQUEST_ID
        assert chunk.data["object"] == "chat.completion.chunk"
        assert chunk.data["model"] == "tiny" and chunk.data["created"] == CREATED
        assert "usage" not in chunk.data
        json.dumps(chunk.data)  # what goes on the wire
    assert content(chunks) == "Hello you"


def test_a_text_stream_sends_text_completion_chunks() -> None:
    log = Log().delta("Once", [1]).delta(" upon", [2]).done("Once upon", "stop")
    chunks = stream(shaper("text"), log.events)

    assert [chunk.data["object"] for chunk in chunks] == ["text_completion"] * 4
    assert [chunk.data["choices"][0]["text"] for chunk in chunks] == ["", "Once", " upon", ""]
    assert [chunk.data["choices"][0]["finish_reason"] for chunk in chunks] == [
        None,
        None,
        None,
        "stop",
    ]


def test_the_completion_is_the_final_attempts_text_with_usage() -> None:
    usage = Usage(prompt_tokens=14, completion_tokens=2, cached_tokens=13)
    for kind in ("chat", "text"):
        s = shaper(kind)
        stream(s, Log().delta("Hi", [1]).delta("!", [2]).done("Hi!", "stop", usage).events)
        assert s.finished and s.error is None
        body = s.completion()
        assert body["id"] == REQUEST_ID and body["model"] == "tiny"
        choice = body["choices"][0]
        if kind == "chat":
            assert body["object"] == "chat.completion"
            assert choice["message"] == {"role": "assistant", "content": "Hi!", "refusal": None}
        else:
            assert body["object"] == "text_completion"
            assert choice["text"] == "Hi!"
        assert choice["finish_reason"] == "stop" and choice["logprobs"] is None
        assert body["usage"] == {
            "prompt_tokens": 14,
            "completion_tokens": 2,
            "total_tokens": 16,
            "prompt_tokens_details": {"cached_tokens": 13},
        }


def test_events_that_carry_no_text_send_nothing() -> None:
    s = shaper()
    assert s.feed(QueuedEvent(request_id=REQUEST_ID, seq=0, attempt=0)) == []
    unknown = UnknownEvent(request_id=REQUEST_ID, seq=1, attempt=1, event_type="x", fields={})
    assert s.feed(unknown) == []
    # A delta whose bytes do not yet make a whole character: a token, but no text.
    assert s.feed(Log().delta("", [7]).events[-1]) == []
    assert not s.finished


def test_a_stream_is_not_finished_before_its_terminal_event() -> None:
    s = shaper()
    stream(s, Log().delta("a", [1]).events)
    assert not s.finished and s.done is None and s.error is None


# -- a job re-run after a worker crash ------------------------------------------------------


def test_a_rerun_that_repeats_the_sent_text_shows_it_once_and_continues() -> None:
    log = (
        Log()
        .delta("Hel", [1])
        .delta("lo", [2])
        .reset()
        .delta("Hel", [1])  # the re-run repeats what the client has
        .delta("lo wor", [2, 3])  # and goes past it
        .delta("ld", [4])
        .done("Hello world")
    )
    s = shaper()
    chunks = stream(s, log.events)

    assert content(chunks) == "Hello world"
    assert [c.data["choices"][0]["delta"].get("content") for c in chunks[1:-1]] == [
        "Hel",
        "lo",
        " wor",
        "ld",
    ]
    assert errors_of(chunks) == []
    assert s.done is not None and s.completion()["choices"][0]["message"]["content"] == (
        "Hello world"
    )


def test_a_rerun_may_split_the_repeated_text_differently() -> None:
    log = (
        Log()
        .delta("ab", [1, 2])
        .delta("cd", [3, 4])
        .reset()
        .delta("a", [1])
        .delta("bcde", [2, 3, 4, 5])
        .done("abcde")
    )
    assert content(stream(shaper("text"), log.events)) == "abcde"


def test_a_rerun_shorter_than_the_sent_text_sends_nothing_until_it_passes_it() -> None:
    log = Log().delta("abcdef", [1, 2, 3]).reset().delta("ab", [1]).delta("cd", [2])
    s = shaper()
    assert content(stream(s, log.events)) == "abcdef"
    assert len(stream(shaper(), log.events)) == 2  # the opening and "abcdef"
    assert not s.finished


def test_a_reset_before_any_text_changes_nothing() -> None:
    log = Log().reset().delta("x", [1]).done("x")
    assert content(stream(shaper(), log.events)) == "x"


def test_a_rerun_with_other_text_ends_the_stream_as_rewritten() -> None:
    log = Log().delta("Hello", [1, 2]).reset().delta("Help", [1, 3]).delta(" me", [4]).done("x")
    s = shaper()
    chunks = stream(s, log.events)

    assert content(chunks) == "Hello"  # nothing of the new attempt reached the client
    assert chunks[-1].seq == 3  # the diverging delta's
    assert errors_of(chunks) == [
        {
            "message": errors_of(chunks)[0]["message"],
            "type": "server_error",
            "param": None,
            "code": "stream_rewritten",
        }
    ]
    assert REQUEST_ID in errors_of(chunks)[0]["message"]
    assert s.finished and s.done is None
    assert s.error is not None and s.error.status == 500 and s.error.code == "stream_rewritten"


def test_a_rerun_with_the_same_text_from_other_tokens_is_rewritten() -> None:
    log = Log().delta("ab", [1, 2]).reset().delta("ab", [1, 9])
    chunks = stream(shaper(), log.events)
    assert [error["code"] for error in errors_of(chunks)] == ["stream_rewritten"]


def test_a_rerun_that_differs_only_past_the_sent_text_is_no_rewrite() -> None:
    log = Log().delta("ab", [1]).reset().delta("abXY", [1, 5]).done("abXY")
    chunks = stream(shaper(), log.events)
    assert errors_of(chunks) == []
    assert content(chunks) == "abXY"


def test_an_answer_not_streamed_is_the_final_attempt_even_when_a_rerun_differs() -> None:
    log = Log().delta("Hello", [1, 2]).reset().delta("Help", [1, 3]).done("Help")
    s = Shaper(REQUEST_ID, shaper().shape, streaming=False)
    for event in log.events:
        assert s.feed(event) == [] or isinstance(event, DoneEvent)
    assert s.error is None
    assert s.completion()["choices"][0]["message"]["content"] == "Help"


# -- resuming -------------------------------------------------------------------------------


def a_long_log() -> Log:
    return (
        Log()
        .delta("The", [1])
        .delta(" cat", [2])
        .reset()
        .delta("The cat", [1, 2])
        .delta(" sat", [3])
        .delta("", [4])
        .delta(" down", [5])
        .done("The cat sat down", "stop")
    )


def test_a_resumed_stream_is_exactly_the_chunks_after_the_last_seen_seq() -> None:
    events = a_long_log().events
    full = stream(shaper(include_usage=True), events)
    seqs = [chunk.seq for chunk in full]
    assert seqs == sorted(seqs)  # so "after seq N" is a tail of the stream
    for last_seen in range(-1, len(events) + 1):
        head = [chunk for chunk in full if chunk.seq <= last_seen]
        # Another gateway replays the log from the start and drops what the client has.
        tail = [c for c in stream(shaper(include_usage=True), events) if c.seq > last_seen]
        assert head + tail == full, last_seen
        assert content(head) + content(tail) == "The cat sat down"


# -- errors ---------------------------------------------------------------------------------


def test_an_error_event_ends_the_stream_with_an_error_chunk_of_the_mapped_code() -> None:
    cases = {
        "engine_error": (500, "server_error", None, "engine_error"),
        "internal": (500, "server_error", None, "internal"),
        "dead_lettered": (500, "server_error", None, "dead_lettered"),
        "invalid_job": (400, "invalid_request_error", None, "invalid_job"),
        "unknown_model": (404, "invalid_request_error", "model", "model_not_found"),
        "a_code_from_a_newer_worker": (500, "server_error", None, "a_code_from_a_newer_worker"),
    }
    for code, (status, kind, param, openai_code) in cases.items():
        s = shaper()
        chunks = stream(s, Log().delta("a", [1]).error(code, "it broke").events)
        assert chunks[-1].seq == 2
        assert chunks[-1].data == {
            "error": {"message": "it broke", "type": kind, "param": param, "code": openai_code}
        }
        assert s.finished and s.done is None
        assert s.error is not None and s.error.status == status


# -- usage ----------------------------------------------------------------------------------


def test_include_usage_adds_a_last_chunk_with_usage_and_no_choices() -> None:
    usage = Usage(prompt_tokens=9, completion_tokens=2, cached_tokens=4)
    kinds: list[tuple[Kind, str]] = [("chat", "chat.completion.chunk"), ("text", "text_completion")]
    for kind, object_name in kinds:
        chunks = stream(
            shaper(kind, include_usage=True),
            Log().delta("ab", [1, 2]).done("ab", "stop", usage).events,
        )
        *rest, closing, last = chunks
        assert closing.data["choices"][0]["finish_reason"] == "stop"
        assert last.seq == closing.seq == 2
        assert last.data["object"] == object_name and last.data["id"] == REQUEST_ID
        assert last.data["choices"] == []
        assert last.data["usage"] == {
            "prompt_tokens": 9,
            "completion_tokens": 2,
            "total_tokens": 11,
            "prompt_tokens_details": {"cached_tokens": 4},
        }
        assert all("usage" not in chunk.data for chunk in [*rest, closing])


def test_a_client_that_lost_the_usage_chunk_gets_closing_and_usage_again() -> None:
    events = Log().delta("ab", [1, 2]).done("ab", "stop").events
    full = stream(shaper(include_usage=True), events)
    *_, delta, closing, usage = full
    assert delta.has_id and not closing.has_id and usage.has_id
    # The client's Last-Event-ID is the last chunk with an id it read: the delta's seq.
    resumed = [c for c in stream(shaper(include_usage=True), events) if c.seq > delta.seq]
    assert resumed == [closing, usage]


# -- logprobs -------------------------------------------------------------------------------


def test_chat_logprobs_name_each_token_by_id_with_its_top_alternatives() -> None:
    log = Log().delta("ab", [1, 2], [logprob(1, 2), logprob(2, 2)]).delta("c", [3], [logprob(3, 2)])
    s = shaper("chat", logprobs=True)
    chunks = stream(s, log.done("abc").events)

    assert chunks[0].data["choices"][0]["logprobs"] is None
    assert chunks[1].data["choices"][0]["logprobs"] == {
        "content": [
            {
                "token": "token_id:1",
                "logprob": -0.1,
                "bytes": None,
                "top_logprobs": [
                    {"token": "token_id:1", "logprob": -0.1, "bytes": None},
                    {"token": "token_id:2", "logprob": -0.2, "bytes": None},
                ],
            },
            {
                "token": "token_id:2",
                "logprob": -0.2,
                "bytes": None,
                "top_logprobs": [
                    {"token": "token_id:2", "logprob": -0.2, "bytes": None},
                    {"token": "token_id:3", "logprob": -0.3, "bytes": None},
                ],
            },
        ]
    }
    assert [e["token"] for e in chunks[2].data["choices"][0]["logprobs"]["content"]] == [
        "token_id:3"
    ]
    whole = s.completion()["choices"][0]["logprobs"]["content"]
    assert [entry["token"] for entry in whole] == ["token_id:1", "token_id:2", "token_id:3"]
    assert all(len(entry["top_logprobs"]) == 2 for entry in whole)


def test_text_logprobs_are_parallel_lists() -> None:
    log = Log().delta("ab", [1, 2], [logprob(1, 2), logprob(2, 2)]).done("ab")
    s = shaper("text", logprobs=True)
    chunks = stream(s, log.events)

    expected = {
        "tokens": ["token_id:1", "token_id:2"],
        "token_logprobs": [-0.1, -0.2],
        "top_logprobs": [
            {"token_id:1": -0.1, "token_id:2": -0.2},
            {"token_id:2": -0.2, "token_id:3": -0.3},
        ],
        "text_offset": None,
    }
    assert chunks[1].data["choices"][0]["logprobs"] == expected
    assert s.completion()["choices"][0]["logprobs"] == expected


def test_a_token_without_text_yet_still_sends_its_logprob() -> None:
    log = Log().delta("", [7], [logprob(7)]).delta("é", [8], [logprob(8)])
    chunks = stream(shaper("chat", logprobs=True), log.events)
    assert [c.data["choices"][0]["delta"] for c in chunks[1:]] == [
        {"content": ""},
        {"content": "é"},
    ]
    tokens = [e["token"] for c in chunks[1:] for e in c.data["choices"][0]["logprobs"]["content"]]
    assert tokens == ["token_id:7", "token_id:8"]


def test_a_repeating_rerun_sends_each_tokens_logprob_once() -> None:
    log = (
        Log()
        .delta("ab", [1, 2], [logprob(1), logprob(2)])
        .reset()
        .delta("a", [1], [logprob(1)])
        .delta("bc", [2, 3], [logprob(2), logprob(3)])
        .done("abc")
    )
    s = shaper("text", logprobs=True)
    chunks = stream(s, log.events)
    sent = [t for c in chunks[1:] if (lp := c.data["choices"][0]["logprobs"]) for t in lp["tokens"]]
    assert sent == ["token_id:1", "token_id:2", "token_id:3"]
    assert s.completion()["choices"][0]["logprobs"]["tokens"] == sent


def with_bytes(token: int, data: bytes, top: dict[int, bytes] | None = None) -> TokenLogprob:
    """A token's logprob with its bytes (and its alternatives', -id/10 each)."""
    alternatives = top or {}
    return TokenLogprob(
        token_id=token,
        logprob=-token / 10,
        top_logprobs=tuple((other, -other / 10) for other in alternatives),
        token_bytes=data,
        top_token_bytes=tuple(alternatives.values()),
    )


def test_tokens_with_bytes_are_named_by_their_text_with_their_bytes() -> None:
    # "é" is two bytes, split across tokens 2 and 3.
    items = [
        with_bytes(1, b" caf", {1: b" caf", 4: b" cow"}),
        with_bytes(2, b"\xc3", {2: b"\xc3", 5: b"!"}),
        with_bytes(3, b"\xa9", {3: b"\xa9", 6: b"e"}),
    ]
    log = Log().delta(" caf", [1, 2], items[:2]).delta("\u00e9", [3], items[2:]).done(" caf\u00e9")
    s = shaper("chat", logprobs=True)
    stream(s, log.events)
    entries = s.completion()["choices"][0]["logprobs"]["content"]
    assert [(e["token"], e["bytes"]) for e in entries] == [
        (" caf", list(b" caf")),
        ("\ufffd", [0xC3]),
        ("\ufffd", [0xA9]),
    ]
    assert bytes(b for e in entries for b in e["bytes"]).decode() == " caf\u00e9"
    assert entries[0]["top_logprobs"] == [
        {"token": " caf", "bytes": list(b" caf"), "logprob": -0.1},
        {"token": " cow", "bytes": list(b" cow"), "logprob": -0.4},
    ]

    t = shaper("text", logprobs=True)
    chunks = stream(t, log.events)
    whole = t.completion()["choices"][0]["logprobs"]
    assert whole["tokens"] == [" caf", "\ufffd", "\ufffd"]
    assert whole["top_logprobs"][2] == {"\ufffd": -0.3, "e": -0.6}
    # The split character starts where its first byte's token does.
    assert whole["text_offset"] == [0, 4, 4]
    streamed = [c.data["choices"][0]["logprobs"] for c in chunks[1:3]]
    assert [lp["text_offset"] for lp in streamed] == [[0, 4], [4]]


def test_text_offsets_count_from_the_attempt_that_is_sent() -> None:
    log = (
        Log()
        .delta("ab", [1, 2], [with_bytes(1, b"a"), with_bytes(2, b"b")])
        .reset()
        .delta("a", [1], [with_bytes(1, b"a")])
        .delta("bcd", [2, 3], [with_bytes(2, b"b"), with_bytes(3, b"cd")])
        .delta("e", [4], [with_bytes(4, b"e")])
        .done("abcde")
    )
    s = shaper("text", logprobs=True)
    chunks = stream(s, log.events)
    sent = [lp for c in chunks[1:] if (lp := c.data["choices"][0]["logprobs"])]
    assert [(lp["tokens"], lp["text_offset"]) for lp in sent] == [
        (["a", "b"], [0, 1]),
        (["cd"], [2]),
        (["e"], [4]),
    ]
    assert s.completion()["choices"][0]["logprobs"]["text_offset"] == [0, 1, 2, 4]


def test_logprobs_not_asked_for_are_null_even_when_the_events_carry_them() -> None:
    log = Log().delta("ab", [1, 2], [logprob(1), logprob(2)]).done("ab")
    s = shaper("chat")
    chunks = stream(s, log.events)
    assert all(choice["logprobs"] is None for c in chunks for choice in c.data["choices"])
    assert s.completion()["choices"][0]["logprobs"] is None


# -- the shape kept in Redis ----------------------------------------------------------------


def test_a_response_shape_survives_its_encoding() -> None:
    shape = ResponseShape("text", "tiny", CREATED, include_usage=True, logprobs=True, owner="a")
    assert ResponseShape.decode(shape.encode()) == shape
    assert ResponseShape.decode(shape.encode().encode()) == shape
    for raw in (b"not json", b"{}", b'{"kind": "image", "model": "m", "created": 1}', b"[]"):
        assert ResponseShape.decode(raw) is None


# -- property: a re-run that repeats the text never duplicates it ---------------------------


@st.composite
def rerun_logs(draw: st.DrawFn) -> tuple[list[str], list[Event]]:
    """Tokens (their texts may be empty: a partial character), streamed up to a random point,
    reset, and streamed again whole; each attempt cut into deltas at its own random points."""
    pieces = draw(st.lists(st.text(max_size=3), min_size=1, max_size=20))

    def deltas(log: Log, count: int) -> None:
        inner = draw(st.sets(st.integers(1, count - 1))) if count > 1 else set()
        bounds = [0, *sorted(inner), count]
        for start, end in pairwise(bounds):
            tokens = list(range(start, end))
            log.delta("".join(pieces[start:end]), tokens, [logprob(t) for t in tokens])

    log = Log()
    deltas(log, draw(st.integers(0, len(pieces))))
    log.reset()
    deltas(log, len(pieces))
    return pieces, log.done("".join(pieces)).events


@settings(max_examples=200, deadline=None)
@given(rerun_logs(), st.sampled_from(["chat", "text"]))
def test_a_repeating_rerun_shows_the_text_and_each_token_exactly_once(
    case: tuple[list[str], list[Event]], kind: Kind
) -> None:
    pieces, events = case
    s = shaper(kind, logprobs=True)
    chunks = stream(s, events)
    assert errors_of(chunks) == []
    assert content(chunks) == "".join(pieces)
    assert s.done is not None
    sent_tokens: list[str] = []
    for chunk in chunks:
        for choice in chunk.data["choices"]:
            if choice["logprobs"] is not None:
                lp = choice["logprobs"]
                sent_tokens += (
                    lp["tokens"] if kind == "text" else [e["token"] for e in lp["content"]]
                )
    assert sent_tokens == [f"token_id:{t}" for t in range(len(pieces))]
