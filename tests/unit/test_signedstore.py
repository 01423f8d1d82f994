"""The job's store as hora uses it: what a process without the secret writes is refused, naming the key."""

from __future__ import annotations

import logging
import socket

import pytest
from torch.distributed import HashStore

from hora.common import rendezvous
from hora.errors import StoreAuthError
from hora.protocol import network, signedstore
from hora.protocol.jobsecret import JobSecret
from hora.protocol.signedstore import SignedStore

SECRET = JobSecret.generate()
ADDR = "10.0.0.1:29500"


def _store(secret: JobSecret | None = SECRET, job: str = "job1") -> SignedStore:
    return SignedStore(HashStore(), secret, job, ADDR)


def test_values_round_trip_under_a_prefix_and_the_raw_store_holds_a_mac() -> None:
    store = _store()
    view = store.under("hora/job1").under("g1")
    view.set("mesh/0", "10.0.0.2:4100")
    assert view.get("mesh/0") == b"10.0.0.2:4100"
    assert store.get("hora/job1/g1/mesh/0") == b"10.0.0.2:4100"  # the same key, seen from the top
    raw = store.raw.get("hora/job1/g1/mesh/0")
    assert raw.startswith(b"M") and raw.endswith(b"10.0.0.2:4100") and len(raw) == 1 + 32 + 13
    assert view.check(["mesh/0"]) and not view.check(["mesh/1"])
    view.set("mesh/1", b"\x00bytes")
    assert view.multi_get(["mesh/0", "mesh/1"]) == [b"10.0.0.2:4100", b"\x00bytes"]


@pytest.mark.parametrize("forge", ["plain", "another key", "another job", "another secret", "truncated", "flipped"])
def test_a_value_not_written_for_this_key_job_and_secret_is_refused_in_one_line(forge: str) -> None:
    store = _store()
    key = "hora/job1/g1/mesh/0"
    sealed = store.seal(key, "10.0.0.2:4100")
    forged = {
        "plain": b"10.66.6.6:4100",
        "another key": store.seal("hora/job1/g1/mesh/1", "10.66.6.6:4100"),
        "another job": _store(job="job2").seal(key, "10.66.6.6:4100"),
        "another secret": _store(JobSecret.generate()).seal(key, "10.66.6.6:4100"),
        "truncated": sealed[:20],
        "flipped": sealed[:-1] + b"5",
    }[forge]
    store.raw.set(key, forged)
    with pytest.raises(StoreAuthError) as info:
        store.get(key)
    text = str(info.value)
    assert "\n" not in text and info.value.key == key
    assert text.startswith(f"the value of store key '{key}' on the rendezvous store at {ADDR} failed authentication")
    assert "docs/security.md" in text and SECRET.hex() not in text


def test_a_rank_with_a_secret_and_one_without_are_told_which_lacks_it() -> None:
    raw = HashStore()
    with_secret, without = SignedStore(raw, SECRET, "j", ADDR), SignedStore(raw, None, "j", ADDR)
    with_secret.set("a", "1")
    without.set("b", "2")
    with pytest.raises(StoreAuthError, match="written with a job secret and this process has none"):
        without.get("a")
    with pytest.raises(StoreAuthError, match="written without a job secret and this process has one"):
        with_secret.get("b")
    assert without.get("b") == b"2" and not without.authenticated and with_secret.authenticated


def test_compare_set_keeps_the_first_value_and_checks_what_it_returns() -> None:
    store = _store()
    assert store.compare_set("lost", "", "1") == b"1"
    assert store.compare_set("lost", "", "2") == b"1"  # the first loss recorded stays
    assert store.compare_set("lost", "1", "3") == b"3"
    store.raw.set("culprit", b'{"rank": 0}')
    with pytest.raises(StoreAuthError, match="'culprit'"):
        store.compare_set("culprit", "", '{"rank": 1}')


def test_counters_and_deletion_pass_through() -> None:
    store = _store().under("board")
    assert store.add("waits", 1) == 1 and store.add("waits", 0) == 1
    store.set("k", "v")
    assert store.delete_key("k") and not store.check(["k"])


def test_an_ignored_value_is_logged_once_per_key(caplog: pytest.LogCaptureFixture) -> None:
    store = _store()
    store.raw.set("board/ended/7", "exit code 0")
    for _ in range(3):
        with pytest.raises(StoreAuthError) as info:
            store.get("board/ended/7")
        with caplog.at_level(logging.WARNING, logger="hora.protocol.signedstore"):
            signedstore.ignored(info.value)
    lines = [r.getMessage() for r in caplog.records if "board/ended/7" in r.getMessage()]
    assert len(lines) == 1 and lines[0].endswith("; ignored")


def _listening(port: int) -> set[str]:
    """The local addresses (hex, as /proc/net/tcp writes them) listening on ``port``."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in f.readlines()[1:]:
                local, state = line.split()[1], line.split()[3]
                addr, _, hexport = local.partition(":")
                if state == "0A" and int(hexport, 16) == port:
                    found.add(addr)
    return found


def _other_ipv4() -> str | None:
    return next((a for a in network.interface_addresses().values() if not a.startswith("127.")), None)


def test_the_store_server_listens_on_the_jobs_address_only() -> None:
    import datetime

    store = rendezvous.serve("127.0.0.1", 0, datetime.timedelta(seconds=10))
    port = int(store.port)
    assert _listening(port) == {"0100007F"}  # 127.0.0.1, not 0.0.0.0 or [::] as torch's own server
    other = _other_ipv4()
    if other is not None:  # another address of this host does not answer
        with pytest.raises(OSError):
            socket.create_connection((other, port), timeout=5).close()
    client = SignedStore(rendezvous.dist.TCPStore("127.0.0.1", port, is_master=False), SECRET, "j", "x")
    client.set("hora/k", "v")
    assert SignedStore(store, SECRET, "j", "x").get("hora/k") == b"v"


def test_an_address_that_is_not_this_hosts_listens_everywhere_as_before() -> None:
    listener = network.listen_on("198.51.100.254")  # TEST-NET-2: assigned to no host here
    try:
        assert listener.getsockname()[0] in ("0.0.0.0", "::")
    finally:
        listener.close()
