"""The round frame (hora.engine.scheduling.frames): every form of request, inline data and flags round-trip; a steady
state frame is a few bytes an op; another wire version, a truncation, a wrong field type, unknown flags or a
count beyond the frame are each a FrameError."""

from __future__ import annotations

import struct
from typing import Any

import pytest

from hora.engine.codec import WIRE_VERSION, FrameError, encode
from hora.engine.scheduling import frames
from hora.engine.scheduling.frames import decode_round, encode_round
from hora.engine.scheduling.table import Request

REQ = Request("grad.0", "allreduce", "float32", (4, 2), 1, -1, 1.0, 0.5, (0, 1, 2), "cpu", None, 1234, "t.py:3")
REJECTED = Request("noname.ps0.3", "broadcast", "", (), ps=(0, 1), site=7, where="t.py:9", error="TypeError: bad")
SPLITS = Request("a2a", "alltoall", "int64", (6,), splits=(1, 2, 3))


def test_a_round_frame_round_trips_every_form_of_request_with_inline_data_and_flags() -> None:
    sent: list[Any] = [REQ, 3, (5, "noname.ps0.12"), REJECTED, SPLITS]
    inline = [b"\x01\x02", None, b"", None, b"x" * 100]
    flags = {"stall_query": [("grad.0", "report")], "where": ("t.py:3 in step", {"grad.0": "report"}),
             "notice": [(1, 2, True)], "passed": 3}
    items, data, back = decode_round(encode_round(sent, inline, flags))
    assert items == sent and data == inline and back == flags
    assert [type(i) for i in items] == [Request, int, tuple, Request, Request]


def test_a_steady_state_frame_is_a_few_bytes_per_op() -> None:
    assert len(encode_round([3], [None], {})) == 6 + 5 + 5
    assert len(encode_round([(5, "noname.ps0.12")], [b"\0" * 4], {})) == 6 + 9 + len("noname.ps0.12") + 4 + 4 + 5


def test_a_frame_of_another_wire_version_is_refused_naming_both() -> None:
    frame = bytearray(encode_round([3], [None], {}))
    struct.pack_into("<H", frame, 0, WIRE_VERSION + 1)
    with pytest.raises(FrameError, match=f"wire version {WIRE_VERSION + 1}.*wire version {WIRE_VERSION}"):
        decode_round(bytes(frame))


def test_every_truncated_round_frame_is_a_frame_error() -> None:
    frame = encode_round([REQ, 3, (5, "noname.ps0.12")], [b"ab", None, b"c"], {"passed": 1})
    for cut in range(len(frame)):
        with pytest.raises(FrameError):
            decode_round(frame[:cut])


@pytest.mark.parametrize(("field", "value"), [("shape", (4, "2")), ("kind", "format_disk"), ("ps", [0, 1]),
                                               ("prescale", "1"), ("name", b"grad"), ("splits", 3)])
def test_a_request_with_a_field_of_the_wrong_type_is_refused(field: str, value: Any) -> None:
    fields = list(REQ)
    fields[Request._fields.index(field)] = value
    frame = struct.pack("<HIBI", WIRE_VERSION, 1, 2, 0) + encode(tuple(fields)) + encode({})
    with pytest.raises(FrameError, match=field):
        decode_round(frame)


@pytest.mark.parametrize("flags", [{"format_disk": 1}, {"passed": "3"}, {"where": "here"},
                                   {"stall_query": [("a", 1)]}, ["not", "a", "dict"]])
def test_unknown_or_malformed_flags_are_refused(flags: Any) -> None:
    frame = struct.pack("<HI", WIRE_VERSION, 0) + encode(flags)
    with pytest.raises(FrameError, match="flag"):
        decode_round(frame)


def test_a_count_of_requests_beyond_the_frame_is_refused() -> None:
    with pytest.raises(FrameError, match="claims 4294967295 requests"):
        decode_round(struct.pack("<HI", WIRE_VERSION, 0xFFFFFFFF) + frames._NO_FLAGS)
