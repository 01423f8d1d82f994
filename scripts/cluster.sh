#!/usr/bin/env bash
# Bring up the simulated hosts of tests/cluster by hand (root): node2..node4 at 10.78.0.2-4, each a network
# namespace with its own sshd and hostname. Stays in the foreground; Ctrl-C (or SIGTERM) tears it all down.
#   scripts/cluster.sh                 # hosts 2,3,4
#   scripts/cluster.sh --hosts 2,3     # other indices
#   scripts/cluster.sh --clean         # remove namespaces left by a crashed run, then exit
# Needs root and: apt-get update && apt-get install -y openssh-server iproute2
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
python="${PYTHON:-$root/.venv/bin/python}"
[ -x "$python" ] || python="$(command -v python3)"
cd "$root"
exec "$python" -m tests.cluster.up "$@"
