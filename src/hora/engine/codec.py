"""The control plane's wire format: plain values in an explicit, versioned encoding; never pickle.

Everything the negotiators send each other (round frames, the mesh's handshake, the Gloo plane's hello) is
made of the values below and nothing else, so reading a frame can build strings, numbers and containers but
can never import a module, call a function or build an object of a class hora did not ask for. A frame that is
truncated, too large, too deep or of an unknown type is refused with :class:`FrameError`, before anything of it
is used and, for sizes, before anything is allocated for it.

==========  =====  ==============================================================
value       tag    then
==========  =====  ==============================================================
None        ``N``
False/True  ``F``  ``T``
int         ``i``  8 bytes, little-endian, signed (ints beyond 64 bits are refused)
float       ``d``  8 bytes, IEEE 754 double, little-endian
str         ``s``  4-byte length, UTF-8 bytes
bytes       ``b``  4-byte length, the bytes
list        ``l``  4-byte count, the items
tuple       ``t``  4-byte count, the items
dict        ``m``  4-byte count, then key and value of each pair (keys: str or int)
==========  =====  ==============================================================

:data:`WIRE_VERSION` numbers this format and every frame layout built on it (:mod:`hora.engine.scheduling.frames`, the
handshake of :mod:`hora.engine.auth.handshake`): a change to any of them takes a new number, and peers of
different numbers refuse each other at connect, naming both.

Example:
    >>> decode(encode({"passed": 3, "where": ("train.py:12", {"step.1": "report"})}))
    {'passed': 3, 'where': ('train.py:12', {'step.1': 'report'})}
"""

from __future__ import annotations

import struct
from typing import Any

WIRE_VERSION = 1
MAX_FRAME_BYTES = 64 << 20  # the largest frame a peer may send; a longer one is refused before it is read
MAX_DEPTH = 16  # containers nested deeper than this are refused (hora's own frames nest 4 deep at most)

_I64 = struct.Struct("<q")
_F64 = struct.Struct("<d")
_U32 = struct.Struct("<I")
_INT_MIN, _INT_MAX = -(1 << 63), (1 << 63) - 1


class FrameError(ValueError):
    """A frame is not what this wire version allows: the message says what, and at which byte."""


def encode(value: Any) -> bytes:
    """``value`` in the wire format.

    Raises:
        FrameError: ``value`` holds something other than the plain values above (a bug in the sender).
    """
    parts: list[bytes] = []
    _encode(value, parts, 0)
    return b"".join(parts)


def _encode(value: Any, parts: list[bytes], depth: int) -> None:
    if depth > MAX_DEPTH:
        raise FrameError(f"cannot encode a value nested more than {MAX_DEPTH} deep")
    if value is None:
        parts.append(b"N")
    elif value is True or value is False:
        parts.append(b"T" if value else b"F")
    elif isinstance(value, int):  # IntEnum members travel as their number
        if not _INT_MIN <= value <= _INT_MAX:
            raise FrameError(f"cannot encode the int {value}: beyond 64 bits")
        parts += (b"i", _I64.pack(value))
    elif isinstance(value, float):
        parts += (b"d", _F64.pack(value))
    elif isinstance(value, str):  # str enums travel as their value
        raw = value.encode()
        parts += (b"s", _U32.pack(len(raw)), raw)
    elif isinstance(value, (bytes, bytearray, memoryview)):
        raw = bytes(value)
        parts += (b"b", _U32.pack(len(raw)), raw)
    elif isinstance(value, (list, tuple)):
        parts += (b"t" if isinstance(value, tuple) else b"l", _U32.pack(len(value)))
        for item in value:
            _encode(item, parts, depth + 1)
    elif isinstance(value, dict):
        parts += (b"m", _U32.pack(len(value)))
        for key, item in value.items():
            if not isinstance(key, (str, int)) or key is True or key is False:
                raise FrameError(f"cannot encode a dict key of type {type(key).__name__}: keys are str or int")
            _encode(key, parts, depth + 1)
            _encode(item, parts, depth + 1)
    else:
        raise FrameError(f"cannot encode a {type(value).__name__}: the wire carries only None, bool, int, float, "
                         "str, bytes, list, tuple and dict")


def decode(data: bytes | bytearray | memoryview) -> Any:
    """The value ``data`` holds; all of ``data`` must be one value.

    Raises:
        FrameError: ``data`` is truncated, has bytes left over, or holds something the format does not allow.
    """
    value, end = decode_from(data, 0)
    if end != len(data):
        raise FrameError(f"{len(data) - end} byte(s) left over after the value (at byte {end})")
    return value


def decode_from(data: bytes | bytearray | memoryview, offset: int) -> tuple[Any, int]:
    """The value that starts at ``offset`` in ``data``, and the offset just past it."""
    try:
        return _decode(data, offset, 0)
    except (struct.error, IndexError):
        raise FrameError(f"truncated frame: {len(data)} bytes end inside a value (starting at byte {offset})") \
            from None
    except UnicodeDecodeError as e:
        raise FrameError(f"a string of the frame is not UTF-8 ({e.reason})") from None


def _decode(data: bytes | bytearray | memoryview, at: int, depth: int) -> tuple[Any, int]:
    tag = data[at]
    at += 1
    if tag == 0x69:  # i
        return _I64.unpack_from(data, at)[0], at + 8
    if tag == 0x73 or tag == 0x62:  # s, b
        (n,) = _U32.unpack_from(data, at)
        start = at + 4
        end = start + n
        if end > len(data):
            raise FrameError(f"a {'string' if tag == 0x73 else 'bytes value'} of {n} bytes at byte {at} runs past "
                             f"the frame's end ({len(data)} bytes)")
        raw = bytes(data[start:end])
        return (raw.decode() if tag == 0x73 else raw), end
    if tag == 0x4E:  # N
        return None, at
    if tag == 0x54 or tag == 0x46:  # T, F
        return tag == 0x54, at
    if tag == 0x64:  # d
        return _F64.unpack_from(data, at)[0], at + 8
    if tag in (0x6C, 0x74, 0x6D):  # l, t, m
        if depth >= MAX_DEPTH:
            raise FrameError(f"containers nested more than {MAX_DEPTH} deep (at byte {at - 1})")
        (n,) = _U32.unpack_from(data, at)
        at += 4
        if n > len(data) - at:  # every item takes a byte at least: a count beyond that is a lie, refused
            raise FrameError(f"a container claims {n} items at byte {at - 4} but only {len(data) - at} bytes follow")
        if tag == 0x6D:
            out: dict[Any, Any] = {}
            for _ in range(n):
                key, at = _decode(data, at, depth + 1)
                if not isinstance(key, (str, int)) or isinstance(key, bool):
                    raise FrameError(f"a dict key before byte {at} is a {type(key).__name__}: keys are str or int")
                out[key], at = _decode(data, at, depth + 1)
            return out, at
        items = []
        for _ in range(n):
            item, at = _decode(data, at, depth + 1)
            items.append(item)
        return (tuple(items) if tag == 0x74 else items), at
    raise FrameError(f"unknown type tag 0x{tag:02x} at byte {at - 1}")
