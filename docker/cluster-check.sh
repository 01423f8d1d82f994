#!/bin/bash
# Is the local cluster of docker/compose.yaml really up? `compose up -d` can exit 0 with nothing running
# (podman-compose does when a container cannot start), so check after it:
#
#   docker/cluster-check.sh              podman, or CONTAINER=docker; the compose project `hora` (docker compose)
#                                        or `docker` (podman-compose 1.0 names it after the file's folder)
#   docker/cluster-check.sh -p NAME      another project name (compose -p NAME)
#
# It finds the project's containers by their compose labels, says what state each is in and, for a container
# that is not running, why and what to do; when every node runs, it waits (up to $WAIT seconds, default 60)
# until `hora check` on the first node reaches every node over SSH. Exit code 0 only when that check passes.
set -uo pipefail

projects=(hora docker)
if [ "${1:-}" = "-p" ] && [ -n "${2:-}" ]; then projects=("$2"); fi
engine="${CONTAINER:-$(command -v podman >/dev/null && echo podman || echo docker)}"
wait_s="${WAIT:-60}"

say() { echo "cluster-check: $*" >&2; }

names=""
for project in "${projects[@]}"; do
    names="$("$engine" ps -a --filter "label=com.docker.compose.project=${project}" --format '{{.Names}}' | sort)"
    [ -z "$names" ] || break
done
if [ -z "$names" ]; then
    say "no containers of compose project '${projects[*]}': \`compose up\` created none (read its output above;" \
        "podman-compose prints its errors and still exits 0)"
    exit 1
fi
say "compose project '${project}'"

hosts=()
first=""
bad=0
stuck=0
for name in $names; do
    read -r service status code < <("$engine" inspect --format \
        '{{index .Config.Labels "com.docker.compose.service"}} {{.State.Status}} {{.State.ExitCode}}' "$name")
    if [ "$service" = keys ] && { [ "$status" = running ] || { [ "$status" = exited ] && [ "$code" = 0 ]; }; }; then
        say "keys ($name): $status (a one-off job making the SSH keys)"
        continue
    fi
    case "$status" in
        running)
            say "$service ($name): running"
            hosts+=("${service}:1")
            [ -n "$first" ] || first="$name"
            ;;
        created|configured)
            say "$service ($name) is '$status': it was made but could not start (\`$engine start $name\` shows why)"
            stuck=1
            ;;
        *)
            say "$service ($name) is '$status' (exit code $code); the end of its log:"
            "$engine" logs "$name" 2>&1 | tail -n 20 >&2
            bad=1
            ;;
    esac
done
if [ "$stuck" = 1 ]; then
    nofile="$(ulimit -Hn)"
    nproc="$(ulimit -Hu)"
    pid_max="$(cat /proc/sys/kernel/pid_max 2>/dev/null || echo "$nproc")"
    if [ "$nproc" = unlimited ] || [ "$nproc" -gt "$pid_max" ]; then nproc="$pid_max"; fi
    say "containers that stay 'created' usually hit the limits: podman as root gives a container open-file and" \
        "process limits (1048576) above what it may set inside a container or without CAP_SYS_RESOURCE" \
        "(\"error setting rlimit ... operation not permitted\"). Remove them and start again with limits it can set:"
    say "  podman-compose -f docker/compose.yaml down -v"
    say "  podman-compose --podman-run-args \"--ulimit nofile=${nofile}:${nofile} --ulimit nproc=${nproc}:${nproc}\"" \
        "-f docker/compose.yaml up -d"
    bad=1
fi
[ "$bad" = 0 ] || exit 1
if [ -z "$first" ]; then
    say "no node of project '${project}' is running"
    exit 1
fi

host_list="$(IFS=,; echo "${hosts[*]}")"
say "every node runs; hora check -H ${host_list} -p 2222 on ${first} (sshd may take a few seconds)"
deadline=$((SECONDS + wait_s))
while true; do
    out="$("$engine" exec "$first" hora check -H "$host_list" -p 2222 2>&1)"
    rc=$?
    if [ "$rc" = 0 ] || [ "$SECONDS" -ge "$deadline" ]; then break; fi
    sleep 2
done
echo "$out"
if [ "$rc" = 0 ]; then
    say "the cluster is up: every node answers over SSH with the same hora, torch and Python"
else
    say "hora check still fails after ${wait_s} s (exit code $rc; its output is above): see docs/deploy.md," \
        "SSH troubleshooting"
fi
exit "$rc"
