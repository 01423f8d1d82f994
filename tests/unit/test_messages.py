"""Agent <-> driver messages and the worker output line splitter."""

from __future__ import annotations

from hora.protocol import messages as protocol
from hora.protocol.messages import BAR, ERASE, LINE, LineSplitter


def test_messages_round_trip_and_noise_is_ignored() -> None:
    msg = {"t": "out", "r": 3, "s": "stdout", "l": "héllo \"quoted\""}
    assert protocol.decode(protocol.encode(msg)) == msg
    assert protocol.decode(b"Welcome to node3!\n") is None
    assert protocol.decode(b"[1, 2]\n") is None


def _texts(pieces: list[tuple[str, str]]) -> list[str]:
    assert all(kind == LINE for kind, _ in pieces), pieces
    return [text for _, text in pieces]


def test_lines_split_across_chunks_and_crlf() -> None:
    s = LineSplitter()
    assert s.feed(b"hel", 0.0) == []
    assert _texts(s.feed(b"lo\nwor", 0.0)) == ["hello"]
    assert s.feed(b"ld\r", 0.0) == []  # could be the start of \r\n
    assert _texts(s.feed(b"\nnext\n", 0.0)) == ["world", "next"]


def test_progress_updates_are_thinned_and_the_final_state_is_a_line() -> None:
    s = LineSplitter(interval=1.0)
    out = s.feed(b"".join(b"\r%d%%" % i for i in range(50)), now=0.0)
    out += s.feed(b"".join(b"\r%d%%" % i for i in range(50, 100)), now=1.5)
    out += s.feed(b"\r100%\n", now=1.6)
    # "49%" is complete only when the next chunk's "\r" arrives (at 1.5 s, past the interval)
    assert out == [(BAR, "0%"), (BAR, "49%"), (LINE, "100%")]


def test_a_held_back_state_goes_out_when_due_or_when_asked() -> None:
    s = LineSplitter(interval=1.0)
    assert s.feed(b"\r1%\r2%\r3%\r", now=0.0) == [(BAR, "1%")]
    assert s.has_pending and s.due(0.5) == []
    assert s.due(1.2) == [(BAR, "3%")] and not s.has_pending  # a bar that stopped redrawing shows its state
    s.feed(b"4%\r", now=1.3)
    assert s.take_pending(1.3) == [(BAR, "4%")]  # another stream's line is next: this state goes first


def test_flush_returns_unterminated_text_or_the_unseen_progress_state() -> None:
    s = LineSplitter(interval=10.0)
    s.feed(b"\r1%\r2%\r3%", now=0.0)
    assert s.flush() == [(LINE, "3%")]  # the process ended with its bar drawn: the state stays
    s2 = LineSplitter()
    s2.feed(b"partial", now=0.0)
    assert s2.flush() == [(LINE, "partial")]


def test_a_bar_erasing_itself_is_one_erase() -> None:
    s = LineSplitter(interval=1.0)
    out = s.feed(b"\repoch 1: 50%\repoch 1: 100%\r" + b" " * 40 + b"\r", now=0.0)
    out += s.feed(b"\r" + b" " * 40 + b"\r", now=5.0)  # tqdm(leave=False) closing, past the interval
    assert out == [(BAR, "epoch 1: 50%"), (ERASE, "")]
    assert s.flush() == []  # neither the spaces that erased the bar nor the erased state
    quick = LineSplitter(interval=10.0)  # a bar erased before any state went out leaves nothing at all
    assert quick.feed(b"\rx\ry\r   \r", now=0.0) == [(BAR, "x"), (ERASE, "")]
    assert quick.feed(b"\ra\rb\r   \r", now=1.0) == []


def test_invalid_utf8_is_replaced_not_fatal() -> None:
    assert LineSplitter().feed(b"caf\xc3\xa9 \xff!\n", 0.0) == [(LINE, "café \ufffd!")]


def test_very_long_line_is_cut_rather_than_buffered_forever() -> None:
    s = LineSplitter(max_line=10)
    assert s.feed(b"x" * 25, 0.0) == [(LINE, "x" * 25)]
