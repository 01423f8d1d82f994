"""The rendezvous store's guard (hora.common.store_guard): torch's clients work through it unchanged, and a
client that writes outside hora's keys or past a bound is disconnected, alone."""

from __future__ import annotations

import datetime
import logging
import socket
import struct
import subprocess
import sys
import threading
from collections.abc import Iterator

import pytest
import torch.distributed as dist

from hora.common import rendezvous
from hora.common.store_guard import SET, VALIDATE, Ledger, Limits, Refused, RequestReader

MB = 1 << 20
TIMEOUT = datetime.timedelta(seconds=20)


def _frame(*parts: bytes | int) -> bytes:
    """A request as torch's client sends it: ints are 64-bit lengths, bytes go as they are."""
    return b"".join(struct.pack("<Q", p) if isinstance(p, int) else p for p in parts)


def _set(key: str, value: bytes) -> bytes:
    k = ("/" + key).encode()
    return bytes([SET]) + _frame(len(k), k, len(value), value)


@pytest.fixture
def served(monkeypatch: pytest.MonkeyPatch) -> Iterator[rendezvous.GuardedStore]:
    monkeypatch.setenv("HORA_STORE_MAX_VALUE_MB", "2")
    monkeypatch.setenv("HORA_STORE_MAX_HOST_MB", "4")
    monkeypatch.setenv("HORA_STORE_MAX_TOTAL_MB", "16")
    store = rendezvous.serve("127.0.0.1", 0, TIMEOUT)
    assert isinstance(store, rendezvous.GuardedStore)
    yield store
    store.guard.close()


def _client(store: rendezvous.GuardedStore) -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", store.port, is_master=False, wait_for_workers=False, timeout=TIMEOUT)


def test_every_store_operation_hora_and_torch_use_works_through_the_guard(served: rendezvous.GuardedStore) -> None:
    c = _client(served)
    c.set("hora/j/a", "x" * 10)
    assert c.get("hora/j/a") == b"x" * 10
    assert c.add("hora/j/n", 3) == 3 and c.add("hora/j/n", 2) == 5
    assert c.check(["hora/j/a"]) and not c.check(["hora/j/none"])
    c.multi_set(["hora/j/m1", "hora/j/m2"], ["1", "2"])
    assert c.multi_get(["hora/j/m1", "hora/j/m2"]) == [b"1", b"2"]
    assert c.compare_set("hora/j/a", "x" * 10, "y") == b"y"
    assert c.compare_set("hora/j/a", "no", "z") == b"y"
    c.append("hora/j/ap", "ab")
    c.append("hora/j/ap", "cd")
    assert c.get("hora/j/ap") == b"abcd"
    assert c.delete_key("hora/j/m1") and not c.check(["hora/j/m1"])
    woken = threading.Timer(0.3, lambda: served.set("hora/j/w", "1"))  # the serving process's own client
    woken.start()
    c.wait(["hora/j/w"])
    c.set("hora/j/big", b"z" * MB)  # streamed through, not held
    assert c.get("hora/j/big") == b"z" * MB
    assert c.clone().get("hora/j/a") == b"y"
    listed = subprocess.run([sys.executable, "-c", "import torch.distributed as d; print(sorted(d.TCPStore("
                             f"'127.0.0.1', {served.port}, is_master=False, wait_for_workers=False).list_keys()))"],
                            capture_output=True, text=True, timeout=60, check=True).stdout
    assert "'hora/j/big'" in listed and "'hora/j/m2'" in listed
    assert served.guard.refused == 0


def test_the_guard_faces_the_network_and_torchs_server_the_loopback_only(served: rendezvous.GuardedStore) -> None:
    assert served.port == served.guard.port != dist.TCPStore.port.__get__(served)  # type: ignore[attr-defined]
    assert served.host == "127.0.0.1"


@pytest.mark.parametrize("attack,bound", [
    ("a key outside hora's", "outside hora's keys (hora/, hora.run/, hora.spark/)"),
    ("one value too large", "a 3145728-byte value to 'hora/j/v' (at most 2097152 bytes per value: "
                            "HORA_STORE_MAX_VALUE_MB)"),
    ("many values from one host", "its host would hold"),
])
def test_a_client_past_a_bound_is_disconnected_and_the_others_go_on(
        served: rendezvous.GuardedStore, attack: str, bound: str, caplog: pytest.LogCaptureFixture) -> None:
    honest = _client(served)
    honest.set("hora/j/mine", "kept")
    with caplog.at_level(logging.WARNING, logger="hora.common.store_guard"), \
            socket.create_connection(("127.0.0.1", served.port)) as stranger:
        stranger.sendall(bytes([VALIDATE]) + struct.pack("<I", 0x3C85F7CE))
        try:
            if attack == "a key outside hora's":
                stranger.sendall(_set("other/key", b"v"))
            elif attack == "one value too large":
                stranger.sendall(_set("hora/j/v", b"\0" * (3 * MB)))
            else:
                for i in range(6):  # 6 MiB from one host, 4 allowed
                    stranger.sendall(_set(f"hora/j/flood/{i}", b"\0" * MB))
            stranger.settimeout(20)
            assert stranger.recv(1) == b""  # closed
        except (BrokenPipeError, ConnectionResetError):
            pass  # closed while it was still sending
    assert served.guard.refused == 1
    assert any(bound in r.getMessage() and "the rendezvous store closed the connection of 127.0.0.1:" in
               r.getMessage() for r in caplog.records), caplog.text
    assert honest.get("hora/j/mine") == b"kept"  # the honest client's connection is untouched
    assert not honest.check(["hora/j/v"])  # the refused value never reached torch's server whole
    assert served.guard.ledger.total <= 4 * MB + 16 * 1024


def test_a_host_is_charged_for_what_it_holds_not_what_it_sent() -> None:
    ledger = Ledger(Limits(value_bytes=MB, host_bytes=2 * MB, total_bytes=8 * MB))
    for _ in range(10):  # one key rewritten in place: counted once
        ledger.charge("10.0.0.9", "hora/j/board/waiting/0", MB)
    assert ledger.held("10.0.0.9") < 2 * MB
    ledger.charge("10.0.0.8", "hora/j/board/waiting/0", 10)  # another host overwrites it: it is theirs now
    assert ledger.held("10.0.0.9") == 0
    ledger.charge("10.0.0.9", "hora/j/a", MB)
    with pytest.raises(Refused, match="its host would hold"):
        ledger.charge("10.0.0.9", "hora/j/b", MB)
    ledger.release("/hora/j/a")
    ledger.charge("10.0.0.9", "hora/j/b", MB)  # deleted keys free their host's room


def test_a_value_streams_through_in_pieces_and_is_charged_before_its_bytes_pass() -> None:
    reader = RequestReader(Ledger(Limits(value_bytes=MB, host_bytes=MB + 4096, total_bytes=8 * MB)), "10.0.0.9")
    request = _set("hora/j/x", b"a" * 1000)
    passed = b"".join(reader.feed(request[i:i + 7]) for i in range(0, len(request), 7))
    assert passed == request  # byte for byte, whatever the pieces
    refused = RequestReader(Ledger(Limits(value_bytes=MB, host_bytes=8 * MB, total_bytes=8 * MB)), "10.0.0.9")
    big = _set("hora/j/y", b"b" * (MB + 1))
    head = big[:1 + 8 + len("/hora/j/y")]
    assert refused.feed(head) == head  # the command and key pass: torch's server cannot act on them alone
    with pytest.raises(Refused, match="per value"):
        refused.feed(big[len(head):len(head) + 8])  # the length: refused, never passed on


def test_many_clients_at_once_all_get_their_answers(served: rendezvous.GuardedStore) -> None:
    """What init() of many ranks does: every client writes and waits for the others' keys at once."""
    clients = [_client(served) for _ in range(16)]
    errors: list[BaseException] = []

    def rank(i: int) -> None:
        try:
            clients[i].set(f"hora/j/arrived/{i}", str(i))
            clients[i].wait([f"hora/j/arrived/{r}" for r in range(16)])
            assert clients[i].multi_get([f"hora/j/arrived/{r}" for r in range(16)]) == [
                str(r).encode() for r in range(16)]
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=rank, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors and not any(t.is_alive() for t in threads), errors
