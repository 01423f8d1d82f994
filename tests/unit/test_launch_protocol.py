"""Agent <-> driver messages and the worker output line splitter."""

from __future__ import annotations

from hora.launch import protocol
from hora.launch.protocol import LineSplitter


def test_messages_round_trip_and_noise_is_ignored() -> None:
    msg = {"t": "out", "r": 3, "s": "stdout", "l": "héllo \"quoted\""}
    assert protocol.decode(protocol.encode(msg)) == msg
    assert protocol.decode(b"Welcome to node3!\n") is None
    assert protocol.decode(b"[1, 2]\n") is None


def test_lines_split_across_chunks_and_crlf() -> None:
    s = LineSplitter()
    assert s.feed(b"hel", 0.0) == []
    assert s.feed(b"lo\nwor", 0.0) == ["hello"]
    assert s.feed(b"ld\r", 0.0) == []  # could be the start of \r\n
    assert s.feed(b"\nnext\n", 0.0) == ["world", "next"]


def test_progress_updates_are_thinned_and_the_final_state_kept() -> None:
    s = LineSplitter(interval=1.0)
    out = s.feed(b"".join(b"\r%d%%" % i for i in range(50)), now=0.0)
    out += s.feed(b"".join(b"\r%d%%" % i for i in range(50, 100)), now=1.5)
    out += s.feed(b"\r100%\n", now=1.6)
    # "49%" is complete only when the next chunk's "\r" arrives (at 1.5 s, past the interval)
    assert out == ["0%", "49%", "100%"]


def test_flush_returns_unterminated_text_or_the_unseen_progress_state() -> None:
    s = LineSplitter(interval=10.0)
    s.feed(b"\r1%\r2%\r3%", now=0.0)
    assert s.flush() == ["3%"]
    s2 = LineSplitter()
    s2.feed(b"partial", now=0.0)
    assert s2.flush() == ["partial"]


def test_a_bar_erasing_itself_prints_no_blank_line() -> None:
    s = LineSplitter(interval=1.0)
    out = s.feed(b"\repoch 1: 50%\repoch 1: 100%\r" + b" " * 40 + b"\r", now=0.0)
    out += s.feed(b"\r" + b" " * 40 + b"\r", now=5.0)  # tqdm(leave=False) closing, past the interval
    assert out == ["epoch 1: 50%"]
    assert s.flush() == []  # neither the spaces that erased the bar nor the erased state


def test_invalid_utf8_is_replaced_not_fatal() -> None:
    assert LineSplitter().feed(b"caf\xc3\xa9 \xff!\n", 0.0) == ["café \ufffd!"]


def test_very_long_line_is_cut_rather_than_buffered_forever() -> None:
    s = LineSplitter(max_line=10)
    assert s.feed(b"x" * 25, 0.0) == ["x" * 25]
