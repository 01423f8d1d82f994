"""The bytes of broadcast_object / allgather_object: nothing a stranger sends is unpickled, with or without a
secret, and tensors arrive on the CPU whatever device they left."""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest
import torch

from hora.api.object_wire import ObjectWire, encode
from hora.errors import ObjectAuthError, UnsafeObjectError
from hora.protocol.jobsecret import JobSecret

SECRET = JobSecret.generate()
WORLD = "hora/ab12cd34ef56/g1"


class Canary:
    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self) -> tuple:
        return (open, (self.path, "w"))


def _sent(wire: ObjectWire, name: str = "state", sender: int = 0) -> tuple[bytes, object]:
    call = wire.call("broadcast", 0, name)
    return wire.seal(call, sender, encode({"w": torch.ones(2)})), call


@pytest.mark.parametrize("forge", ["a byte changed", "another sender", "another world", "another secret",
                                   "a replay of the last call", "another name", "a bare pickle", "cut short"])
def test_bytes_not_sealed_for_this_call_sender_and_world_are_refused_before_unpickling(
        forge: str, tmp_path: Path) -> None:
    sender, receiver = ObjectWire(SECRET, WORLD), ObjectWire(SECRET, WORLD)
    sealed, _ = _sent(sender)
    if forge == "a replay of the last call":
        receiver.open(receiver.call("broadcast", 0, "state"), 0, sealed, mine=False)  # the real first call
        call, claimed = receiver.call("broadcast", 0, "state"), 0  # the second call gets the first one's bytes
    else:
        call, claimed = receiver.call("broadcast", 0, "other" if forge == "another name" else "state"), 0
    if forge == "a byte changed":
        sealed = sealed[:-1] + bytes([sealed[-1] ^ 1])
    elif forge == "another sender":
        claimed = 1
    elif forge == "another world":
        sealed, _ = _sent(ObjectWire(SECRET, "hora/ab12cd34ef56/g2"))
    elif forge == "another secret":
        sealed, _ = _sent(ObjectWire(JobSecret.generate(), WORLD))
    elif forge == "a bare pickle":
        canary = tmp_path / "canary"
        sealed = pickle.dumps(Canary(str(canary))).ljust(64, b"\0")
    elif forge == "cut short":
        sealed = sealed[:20]
    with pytest.raises(ObjectAuthError, match=r"^broadcast_object '(state|other)': the bytes of rank \d's object "
                                              r"failed authentication and were not unpickled"):
        receiver.open(call, claimed, sealed, mine=False)
    assert not (tmp_path / "canary").exists()


def test_a_sealed_object_of_any_class_round_trips_and_each_call_is_numbered() -> None:
    a, b = ObjectWire(SECRET, WORLD), ObjectWire(SECRET, WORLD)
    for step in range(3):
        call_a, call_b = a.call("allgather", 2, "x"), b.call("allgather", 2, "x")
        got = b.open(call_b, 3, a.seal(call_a, 3, encode({"step": step, "err": ValueError("boom")})), mine=False)
        assert got["step"] == step and isinstance(got["err"], ValueError)


def test_without_a_secret_a_stranger_pickle_never_runs_and_safe_values_load(tmp_path: Path) -> None:
    wire = ObjectWire(None, WORLD)
    canary = tmp_path / "canary"
    forged = b"O" + pickle.dumps(Canary(str(canary)), protocol=2)
    with pytest.raises(UnsafeObjectError, match=r"rank 0's object was not unpickled: it holds io\.open, which only an "
                                                  r"unrestricted unpickler can load"):
        wire.open(wire.call("broadcast", 0, "x"), 0, forged, mine=False)
    assert not canary.exists()
    call = wire.call("broadcast", 0, "x")
    assert wire.open(call, 0, wire.seal(call, 0, encode({"lr": 0.5, "t": torch.zeros(1)})), mine=False)["lr"] == 0.5


def _as_if_on_cuda1(obj: object) -> bytes:
    """``obj`` pickled with every storage tagged ``cuda:1``, as a rank on the second GPU sends it."""
    registry = torch.serialization._package_registry
    entry = (-1, lambda storage: "cuda:1", lambda storage, location: None)
    registry.insert(0, entry)  # type: ignore[arg-type]
    try:
        return encode(obj)
    finally:
        registry.remove(entry)  # type: ignore[arg-type]


def test_tensors_arrive_on_the_cpu_whatever_device_the_sender_had() -> None:
    pickled = _as_if_on_cuda1({"exp_avg": torch.arange(3.0)})
    assert b"cuda:1" in pickled
    for secret in (SECRET, None):
        sender, receiver = ObjectWire(secret, WORLD), ObjectWire(secret, WORLD)
        sealed = sender.seal(sender.call("broadcast", 0, "state"), 0, pickled)
        got = receiver.open(receiver.call("broadcast", 0, "state"), 0, sealed, mine=False)
        assert got["exp_avg"].device == torch.device("cpu") and got["exp_avg"].tolist() == [0.0, 1.0, 2.0]
