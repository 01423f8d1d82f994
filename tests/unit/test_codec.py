"""The control plane's plain-value codec (hora.engine.codec): nothing that reaches the decoder can run code;
every malformed input is a FrameError (the round frame built on it: test_frames.py)."""

from __future__ import annotations

import os
import pickle
import struct
from pathlib import Path
from typing import Any

import pytest

from hora.datapath.reduce_ops import ReduceOp
from hora.engine import codec
from hora.engine.codec import MAX_DEPTH, WIRE_VERSION, FrameError, decode, encode
from hora.engine.scheduling.frames import decode_round

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
    from hora.datapath.kinds.op import Kind

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


def test_the_bound_on_frames_is_named() -> None:
    assert codec.MAX_FRAME_BYTES == 64 << 20
