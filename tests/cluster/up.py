"""Bring the simulated hosts up by hand (``python -m tests.cluster.up`` from the repository root, or
scripts/cluster.sh); Ctrl-C or SIGTERM tears them down."""

from __future__ import annotations

import argparse
import signal
import time
from collections.abc import Sequence

from tests.cluster.netns import Cluster, clean_stale, missing_requirements


def main(argv: Sequence[str] | None = None) -> int:
    """Bring the hosts up by hand, print how to use them, tear them down on Ctrl-C or SIGTERM."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--hosts", default="2,3,4", help="host indices: 10.78.0.<i>, hostname node<i>")
    parser.add_argument("--clean", action="store_true", help="only remove stale namespaces, then exit")
    args = parser.parse_args(argv)
    reason = missing_requirements()
    if reason is not None:
        raise SystemExit(reason)
    if args.clean:
        removed = clean_stale()
        print(f"removed {len(removed)} stale namespaces: {' '.join(removed) or '-'}")
        return 0
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # SIGTERM tears down like Ctrl-C
    with Cluster.build([int(i) for i in args.hosts.split(",")]) as cluster:
        ssh = " ".join(["ssh", *cluster.ssh_args])
        print(f"hosts up (key {cluster.key}); Ctrl-C tears them down.")
        for h in cluster.hosts:
            print(f"  {h.hostname} {h.addr}: nsenter -t {h.sshd_pid} -n -u -m bash")
        first = cluster.hosts[0]
        print(
            f"ssh from {first.hostname}: nsenter -t {first.sshd_pid} -n -u -m {ssh} {cluster.hosts[-1].addr} hostname"
        )
        print(
            f"launch: nsenter -t {first.sshd_pid} -n -u -m hora run -np 2 "
            f"-H {','.join(h.addr + ':1' for h in cluster.hosts[:2])} -i {cluster.key} python train.py"
        )
        try:
            while True:
                time.sleep(3600)
        except KeyboardInterrupt:
            print("tearing down")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
