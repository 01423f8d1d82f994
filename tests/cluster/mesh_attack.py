"""A stranger on the cluster network attacking a job's control mesh (standard library only).

    python mesh_attack.py sniff IFACE SRC DST DIR   (in the hub namespace) capture the first control handshake
                                                    from SRC to DST seen on IFACE: DIR/capture.json, then
                                                    DIR/capture.hello and DIR/capture.proof, the dialer's
                                                    HELLO and PROOF messages byte for byte
    python mesh_attack.py attack DIR CANARY         (on another host) the attacks below; what each got back
                                                    goes to DIR/outcomes.json

The attacks: replay the captured handshake to the listener it was meant for, while the real dialer's seat is
still free; then, against every listener in ``DIR/mesh.json``: hold 50 half-open connections, impersonate the
rank not yet connected (fresh, with a made-up secret), claim it and then speak wire version 99 where its
PROOF belongs, speak hora's old protocol with a pickled payload (the
payload would create CANARY), send garbage, announce an oversized message, and send a forged round frame. The
attacker knows only what the network shows: addresses, the world's name, captured bytes; never the secret.
"""

from __future__ import annotations

import json
import os
import pickle
import socket
import struct
import sys
import time
from pathlib import Path
from typing import Any

MAGIC = b"HoRa"
PREFIX = struct.Struct("<4sHBI")  # magic, wire version, message type, body length
HELLO, PROOF, REFUSE = 1, 2, 4
WIRE_VERSION = 1


# --- sniffing ----------------------------------------------------------------------------------------------
def sniff(iface: str, src: str, dst: str, folder: Path, limit_s: float = 180.0) -> None:
    """Write the first dialer's HELLO and PROOF from ``src`` to ``dst`` (reassembled from TCP segments)."""
    raw = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.ntohs(0x0003))
    raw.bind((iface, 0))
    raw.settimeout(1.0)
    (folder / "sniffing").write_text("")
    streams: dict[tuple[int, int], dict[int, bytes]] = {}  # (sport, dport) -> seq -> payload
    target: tuple[int, int] | None = None
    written = 0
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline and written < 2:
        try:
            frame = raw.recv(65535)
        except TimeoutError:
            continue
        segment = _tcp_payload(frame, src, dst)
        if segment is None:
            continue
        ports, seq, payload = segment
        if target is None and payload.startswith(MAGIC):
            target = ports
            (folder / "capture.json").write_text(json.dumps({"host": dst, "port": ports[1]}))
        if ports != target:
            continue
        streams.setdefault(ports, {})[seq] = payload
        stream = _assemble(streams[ports])
        messages = _messages(stream)
        for index, name in ((0, "capture.hello"), (1, "capture.proof")):
            if len(messages) > index and written == index:
                (folder / f"{name}.tmp").write_bytes(messages[index])
                (folder / f"{name}.tmp").rename(folder / name)
                written += 1


def _tcp_payload(frame: bytes, src: str, dst: str) -> tuple[tuple[int, int], int, bytes] | None:
    if len(frame) < 34 or frame[12:14] != b"\x08\x00":
        return None
    ip = frame[14:]
    ihl, total = (ip[0] & 15) * 4, struct.unpack_from("!H", ip, 2)[0]
    if ip[9] != 6 or socket.inet_ntoa(ip[12:16]) != src or socket.inet_ntoa(ip[16:20]) != dst:
        return None
    tcp = ip[ihl:total]
    sport, dport, seq = struct.unpack_from("!HHI", tcp)
    payload = tcp[(tcp[12] >> 4) * 4 :]
    return ((sport, dport), seq, bytes(payload)) if payload else None


def _assemble(segments: dict[int, bytes]) -> bytes:
    """The stream's bytes from its first segment on, as far as they are contiguous."""
    out = b""
    at = min(segments)
    while at in segments:
        out += segments[at]
        at = (at + len(segments[at])) & 0xFFFFFFFF
    return out


def _messages(stream: bytes) -> list[bytes]:
    """The complete handshake messages (prefix and body) at the start of ``stream``."""
    found, at = [], 0
    while at + PREFIX.size <= len(stream):
        end = at + PREFIX.size + PREFIX.unpack_from(stream, at)[3]
        if end > len(stream):
            break
        found.append(stream[at:end])
        at = end
    return found


# --- attacking ---------------------------------------------------------------------------------------------
def _wait_file(path: Path, limit_s: float) -> bytes:
    deadline = time.monotonic() + limit_s
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} did not appear within {limit_s:g} s")
        time.sleep(0.02)
    return path.read_bytes()


def _read_messages(sock: socket.socket, count: int) -> list[tuple[int, bytes]]:
    """Up to ``count`` messages from ``sock`` (fewer if it closes): (type, body)."""
    sock.settimeout(15)
    data = b""
    while len(_messages(data)) < count:
        try:
            chunk = sock.recv(65536)
        except (ConnectionResetError, TimeoutError):
            break
        if not chunk:
            break
        data += chunk
    return [(PREFIX.unpack_from(m)[2], m[PREFIX.size :]) for m in _messages(data)]


def _decode_str(body: bytes) -> str:
    """A REFUSE message's reason (a plain-value string: b"s", length, UTF-8)."""
    return body[5:].decode(errors="replace") if body[:1] == b"s" else repr(body)


def _closed(sock: socket.socket) -> bool:
    sock.settimeout(15)
    try:
        while sock.recv(65536):
            pass
    except ConnectionResetError:
        pass
    except TimeoutError:
        return False
    return True


def replay(folder: Path) -> str:
    """Replay the captured HELLO to its listener, let the real dialer go on, then replay its PROOF."""
    where = json.loads(_wait_file(folder / "capture.json", 120))
    hello = _wait_file(folder / "capture.hello", 120)
    with socket.create_connection((where["host"], where["port"]), timeout=15) as sock:
        sock.sendall(hello)
        answer = _read_messages(sock, 2)  # the listener's HELLO and PROOF, for a nonce of its own
        (folder / "replay-ready").write_text("")
        proof = _wait_file(folder / "capture.proof", 60)
        sock.sendall(proof)
        verdict = _read_messages(sock, 1)
    kinds = [k for k, _ in answer]
    if verdict and verdict[0][0] == REFUSE:
        return f"listener answered {kinds}, then refused: {_decode_str(verdict[0][1])}"
    return f"listener answered {kinds}, then {verdict or 'nothing'}"


class Canary:
    """The payload: unpickling it runs ``touch CANARY``."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, (f"touch {self.path}",))


def _body(value: dict[str, Any]) -> bytes:
    """A plain-value dict of str/int/bool/bytes (hora.engine.codec's format, written out by hand)."""
    out = [b"m", struct.pack("<I", len(value))]
    for key, item in value.items():
        out += [b"s", struct.pack("<I", len(key)), key.encode()]
        if isinstance(item, bool):
            out.append(b"T" if item else b"F")
        elif isinstance(item, int):
            out += [b"i", struct.pack("<q", item)]
        elif isinstance(item, bytes):
            out += [b"b", struct.pack("<I", len(item)), item]
        else:
            out += [b"s", struct.pack("<I", len(item.encode())), item.encode()]
    return b"".join(out)


def impersonate(host: str, port: int, rank: int, to: int, world: str) -> str:
    """Claim ``rank`` with a HELLO of our own and a made-up PROOF."""
    hello = _body({"rank": rank, "to": to, "world": world, "purpose": "mesh", "nonce": os.urandom(32),
                   "secret": True, "code": "0" * 64, "hora": "0.1.0", "host": "stranger"})
    with socket.create_connection((host, port), timeout=15) as sock:
        sock.sendall(PREFIX.pack(MAGIC, WIRE_VERSION, HELLO, len(hello)) + hello)
        answer = _read_messages(sock, 2)
        proof = b"b" + struct.pack("<I", 32) + os.urandom(32)
        sock.sendall(PREFIX.pack(MAGIC, WIRE_VERSION, PROOF, len(proof)) + proof)
        verdict = _read_messages(sock, 1)
    if verdict and verdict[0][0] == REFUSE:
        return f"answered {[k for k, _ in answer]}, then refused: {_decode_str(verdict[0][1])}"
    return f"answered {[k for k, _ in answer]}, then {verdict or 'nothing'}"


def other_version_after_hello(host: str, port: int, rank: int, to: int, world: str) -> str:
    """Claim ``rank`` with a HELLO, then send a message of wire version 99 where the PROOF belongs (issue 33:
    this failed the listener's init, as if a rank of the job ran another hora)."""
    hello = _body({"rank": rank, "to": to, "world": world, "purpose": "mesh", "nonce": os.urandom(32),
                   "secret": True, "code": "0" * 64, "hora": "0.1.0", "host": "stranger"})
    with socket.create_connection((host, port), timeout=15) as sock:
        sock.sendall(PREFIX.pack(MAGIC, WIRE_VERSION, HELLO, len(hello)) + hello)
        answer = _read_messages(sock, 2)
        sock.sendall(PREFIX.pack(MAGIC, 99, PROOF, 0))
        verdict = _read_messages(sock, 1)
    if verdict and verdict[0][0] == REFUSE:
        return f"answered {[k for k, _ in answer]}, then refused: {_decode_str(verdict[0][1])}"
    return f"answered {[k for k, _ in answer]}, then {verdict or 'nothing'}"


def send_and_see(host: str, port: int, data: bytes) -> str:
    """Send ``data`` on a fresh connection; what the listener did."""
    with socket.create_connection((host, port), timeout=15) as sock:
        try:
            sock.sendall(data)
        except (BrokenPipeError, ConnectionResetError):
            return "closed"
        return "closed" if _closed(sock) else "left open"


def attack(folder: Path, canary: str) -> None:
    outcomes: dict[str, Any] = {"replay": replay(folder)}
    mesh = json.loads(_wait_file(folder / "mesh.json", 120))
    world, listeners = mesh["world"], {int(r): a for r, a in mesh["listeners"].items()}
    late = len(listeners)  # the rank that has not connected yet
    half_open: list[socket.socket] = []
    pickled = pickle.dumps(Canary(canary))
    for rank, address in sorted(listeners.items()):
        host, _, port_text = address.rpartition(":")
        port = int(port_text)
        half_open += [socket.create_connection((host, port), timeout=15) for _ in range(50)]
        outcomes[f"rank{rank}"] = {
            "impersonate": impersonate(host, port, late, rank, world),
            "other version after hello": other_version_after_hello(host, port, late, rank, world),
            "old protocol with a pickle": send_and_see(
                host, port, struct.pack("<4sI", b"hora", late) + struct.pack("<I", len(pickled)) + pickled),
            "garbage": send_and_see(host, port, os.urandom(4096)),
            "oversized": send_and_see(host, port, PREFIX.pack(MAGIC, WIRE_VERSION, HELLO, 1 << 31)),
            "forged frame": send_and_see(host, port, struct.pack("<QI", 0, len(pickled)) + pickled + os.urandom(16)),
        }
    (folder / "outcomes.json").write_text(json.dumps(outcomes, indent=1))
    (folder / "attack-done").write_text("")
    for sock in half_open:  # held until the listener hangs up on them (it does once every rank is in)
        _closed(sock)
        sock.close()


if __name__ == "__main__":
    if sys.argv[1] == "sniff":
        sniff(sys.argv[2], sys.argv[3], sys.argv[4], Path(sys.argv[5]))
    else:
        attack(Path(sys.argv[2]), sys.argv[3])
