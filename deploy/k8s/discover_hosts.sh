#!/bin/sh
# Host discovery for elastic hora jobs (`hora run --host-discovery-script`): prints "host:slots" for every
# worker listed in the hostfile the operator maintains (MPIJob: /etc/mpi/discover_hosts.sh's sibling
# /etc/mpi/hostfile; Volcano's svc plugin: /etc/volcano/worker.host). Only hosts that resolve are printed,
# so pods that are gone or not yet scheduled drop out.
HOSTFILE="${HORA_HOSTFILE:-/etc/mpi/hostfile}"
SLOTS="${HORA_SLOTS_PER_WORKER:-1}"
[ -r "$HOSTFILE" ] || { echo "discover_hosts.sh: cannot read $HOSTFILE" >&2; exit 1; }
grep -v '^[[:space:]]*#' "$HOSTFILE" | while read -r host rest; do
    [ -n "$host" ] || continue
    slots="$(printf '%s\n' "$rest" | sed -n 's/.*slots=\([0-9]*\).*/\1/p')"
    getent hosts "$host" >/dev/null 2>&1 && echo "${host}:${slots:-$SLOTS}"
done
