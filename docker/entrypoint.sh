#!/bin/bash
# The image's entrypoint (tini runs it as PID 1's child: tini reaps zombies and forwards signals).
#
#   sshd            set up SSH (below) and run sshd in the foreground on $HORA_SSH_PORT (default 2222)
#   jupyter [ARGS]  set up SSH, run JupyterLab on $JUPYTER_PORT (8888) with a token: $JUPYTER_TOKEN, or a
#                   generated one printed on start; an empty token is refused (never a server without auth)
#   run ARGS        set up SSH, then `hora run ARGS` (the launcher; e.g. an MPIJob's launcher pod)
#   anything else   set up SSH, then exec'd as is (`bash`, `python train.py`, `hora check`)
#
# SSH set-up, at every start, as the non-root user:
#   * keys and files from $HORA_SSH_DIR (default /etc/hora/ssh, a mounted file, directory or secret):
#     authorized_keys, id_* (client keys), config, known_hosts are copied into ~/.ssh with the permissions ssh
#     insists on (700 for the directory, 600 for the files), whatever the mount gave them;
#     $HORA_AUTHORIZED_KEYS may name another authorized_keys file; $HORA_SSH_WAIT=N waits up to N seconds
#     for $HORA_SSH_DIR/authorized_keys to appear (keys made by another container at start-up);
#   * host keys are generated at the first start in ~/.sshd (never baked into the image);
#   * sshd: key-only (no password, no keyboard-interactive), no root login, the venv on PATH for sessions.
set -euo pipefail

SSH_PORT="${HORA_SSH_PORT:-2222}"
SSH_SRC="${HORA_SSH_DIR:-/etc/hora/ssh}"
STATE="${HOME}/.sshd"

say() { echo "hora-entrypoint: $*" >&2; }

setup_ssh() {
    install -d -m 700 "${HOME}/.ssh" "${STATE}"
    local f name waited=0
    # HORA_SSH_WAIT=N: wait up to N seconds for the keys to appear (made by another container at start-up).
    while [ ! -s "${SSH_SRC}/authorized_keys" ] && [ "$waited" -lt "${HORA_SSH_WAIT:-0}" ]; do
        sleep 1
        waited=$((waited + 1))
    done
    if [ -d "${SSH_SRC}" ]; then
        for f in "${SSH_SRC}"/*; do
            [ -f "$f" ] || continue
            name="$(basename "$f")"
            case "$name" in
                authorized_keys|config|known_hosts|id_*) install -m 600 "$f" "${HOME}/.ssh/${name}" ;;
            esac
        done
    fi
    if [ -n "${HORA_AUTHORIZED_KEYS:-}" ]; then
        if [ ! -r "${HORA_AUTHORIZED_KEYS}" ]; then
            say "HORA_AUTHORIZED_KEYS=${HORA_AUTHORIZED_KEYS} is not a readable file; mount it into the container"
            exit 2
        fi
        install -m 600 "${HORA_AUTHORIZED_KEYS}" "${HOME}/.ssh/authorized_keys"
    fi
    if [ ! -f "${HOME}/.ssh/config" ]; then
        # Inside one job's private network: take each node's key on first contact (they are generated per
        # container start, so nothing could be pinned in advance); the port defaults to the nodes' sshd port.
        printf 'Host *\n    Port %s\n    StrictHostKeyChecking accept-new\n    LogLevel ERROR\n' "${SSH_PORT}" \
            > "${HOME}/.ssh/config"
        chmod 600 "${HOME}/.ssh/config"
    fi
    for f in "${HOME}"/.ssh/id_*.pub; do [ -f "$f" ] && chmod 644 "$f"; done
    local kind
    for kind in ed25519 ecdsa rsa; do
        [ -f "${STATE}/ssh_host_${kind}_key" ] || ssh-keygen -q -t "$kind" -N '' -f "${STATE}/ssh_host_${kind}_key"
    done
    cat > "${STATE}/sshd_config" <<CONF
Port ${SSH_PORT}
HostKey ${STATE}/ssh_host_ed25519_key
HostKey ${STATE}/ssh_host_ecdsa_key
HostKey ${STATE}/ssh_host_rsa_key
PidFile ${STATE}/sshd.pid
AuthorizedKeysFile .ssh/authorized_keys
PubkeyAuthentication yes
PasswordAuthentication no
KbdInteractiveAuthentication no
PermitEmptyPasswords no
PermitRootLogin no
UsePAM no
StrictModes yes
X11Forwarding no
PrintMotd no
SetEnv PATH=${PATH}
Subsystem sftp internal-sftp
CONF
}

check_shm() {
    local kib
    kib="$(df -k --output=size /dev/shm 2>/dev/null | tail -n 1 | tr -d ' ')" || return 0
    if [ -n "$kib" ] && [ "$kib" -lt 1048576 ]; then
        say "/dev/shm is only $((kib / 1024)) MiB: DataLoader workers and NCCL need more; start the container" \
            "with --shm-size=2g (docker/podman) or a memory emptyDir on /dev/shm (Kubernetes)"
    fi
}

run_sshd() {
    if [ ! -s "${HOME}/.ssh/authorized_keys" ]; then
        say "no authorized keys: mount a file at ${SSH_SRC}/authorized_keys (or set HORA_AUTHORIZED_KEYS);" \
            "until then nobody can log in (password login is disabled)"
    fi
    say "sshd listening on port ${SSH_PORT} (key-only)"
    exec /usr/sbin/sshd -D -e -f "${STATE}/sshd_config"
}

run_jupyter() {
    if [ -n "${JUPYTER_TOKEN+set}" ] && [ -z "${JUPYTER_TOKEN}" ]; then
        say "JUPYTER_TOKEN is set but empty: refusing to start JupyterLab without authentication"
        exit 2
    fi
    if [ -z "${JUPYTER_TOKEN:-}" ]; then
        JUPYTER_TOKEN="$(python -c 'import secrets; print(secrets.token_hex(24))')"
        say "JupyterLab token (generated): ${JUPYTER_TOKEN}"
        say "open http://<host>:${JUPYTER_PORT:-8888}/lab?token=${JUPYTER_TOKEN}"
    fi
    export JUPYTER_TOKEN
    exec jupyter lab --no-browser --ip=0.0.0.0 --port="${JUPYTER_PORT:-8888}" \
        --ServerApp.root_dir="${HOME}" --ServerApp.allow_remote_access=True "$@"
}

mode="${1:-sshd}"
[ $# -gt 0 ] && shift
setup_ssh
check_shm
case "$mode" in
    sshd) run_sshd ;;
    jupyter) run_jupyter "$@" ;;
    run) exec hora run "$@" ;;
    *) exec "$mode" "$@" ;;
esac
