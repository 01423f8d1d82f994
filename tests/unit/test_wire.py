"""The control plane's wire format: the plain-value codec (hora.engine.codec) and the round frame
(hora.engine.frames). Nothing that reaches a decoder can run code; every malformed input is a FrameError."""

from __future__ import annotations

import os
import pickle
import struct
from pathlib import Path
from typing import Any

import pytest

from hora.datapath.reduce_ops import ReduceOp
from hora.engine import codec, frames
from hora.engine.codec import MAX_DEPTH, WIRE_VERSION, FrameError, decode, encode
from hora.engine.frames import decode_round, encode_round
from hora.engine.table import Request

VALUES: list[Any] = [
    None, True, False, 0, -1, (1 << 63) - 1, -(1 << 63), 1.5, float("inf"), "", "ünïcode", b"", b"\x00\xff",
    [], (), {}, [1, "a", b"b", None], (1, (2, (3,))), {"a": [1, 2], 3: {"b": (True, 2.5)}},
    {"where": ("train.py:12", {"step.1": "report"}), "notice": [(1, 2, True)], "passed": 4},
]


@pytest.mark.parametrize("value", VALUES, ids=repr)
def test_plain_values_round_trip_with_their_types(value: Any) -> None:
    back = decode(encode(value))
    assert back == value and type(back) is type(value)


def test_int_enums_and_str_enums_travel_as_their_plain_values() -> None:
    from hora.datapath.kinds import Kind

    assert decode(encode([ReduceOp.SUM, Kind.ALLREDUCE])) == [int(ReduceOp.SUM), "allreduce"]


@pytest.mark.parametrize("bad", [object(), {1.5: "float key"}, 1 << 64, {frozenset(): 1}, ReduceOp])
def test_anything_else_is_refused_when_encoding(bad: Any) -> None:
    with pytest.raises(FrameError):
        encode(bad)


def test_every_truncation_is_a_frame_error_never_another_exception() -> None:
    data = encode(VALUES)
    for cut in range(len(data)):
        with pytest.raises(FrameError):
            decode(data[:cut])


def test_bytes_left_over_are_refused() -> None:
    with pytest.raises(FrameError, match="1 byte"):
        decode(encode(1) + b"N")


def test_a_length_or_count_beyond_the_frame_is_refused_before_anything_is_allocated() -> None:
    with pytest.raises(FrameError, match="runs past the frame's end"):
        decode(b"b" + struct.pack("<I", 0xFFFFFFFF) + b"xy")
    with pytest.raises(FrameError, match="claims 4294967295 items"):
        decode(b"l" + struct.pack("<I", 0xFFFFFFFF))


def test_nesting_beyond_the_bound_is_refused() -> None:
    deep = b"l\x01\x00\x00\x00" * (MAX_DEPTH + 1) + b"N"
    with pytest.raises(FrameError, match="nested more than"):
        decode(deep)
    nested: Any = None
    for _ in range(MAX_DEPTH + 2):
        nested = [nested]
    with pytest.raises(FrameError, match="nested more than"):
        encode(nested)


def test_unknown_tags_bad_keys_and_bad_utf8_are_refused() -> None:
    with pytest.raises(FrameError, match="unknown type tag 0x80"):
        decode(b"\x80")
    with pytest.raises(FrameError, match="dict key"):
        decode(b"m\x01\x00\x00\x00" + encode(None) + encode(1))
    with pytest.raises(FrameError, match="not UTF-8"):
        decode(b"s\x01\x00\x00\x00\xff")


class _Canary:
    """What an attacker's pickle would run: it creates a file."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, (f"touch {self.path}",))


def test_a_pickle_payload_is_refused_and_never_runs(tmp_path: Path) -> None:
    canary = tmp_path / "canary"
    payload = pickle.dumps(_Canary(str(canary)))
    with pytest.raises(FrameError):
        decode(payload)
    with pytest.raises(FrameError):
        decode_round(payload)
    with pytest.raises(FrameError):
        decode_round(struct.pack("<HI", WIRE_VERSION, 1) + bytes([2]) + b"\0\0\0\0" + payload)
    assert not canary.exists()


# --- round frames ---------------------------------------------------------------------------------------
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


def test_the_bound_on_frames_is_named() -> None:
    assert codec.MAX_FRAME_BYTES == 64 << 20
