#!/usr/bin/env bash
# End-to-end smoke test of the two daemons, driven through the `pdkv` CLI only.
#
# Starts decode then prefill in the background on the CPU backend in a fresh runtime dir, generates
# one completion, checks `pdkv status`, stops both and checks that they left no pidfile or socket.
# Every step runs under `timeout`; on any failure the trap stops what is still running and prints
# both daemons' logs. Exit status 0 and a last line "smoke test passed" on success.
#
# Environment: PDKV (the CLI, default .venv/bin/pdkv), SMOKE_STEP_TIMEOUT (seconds per step, 60),
# SMOKE_KEEP=1 keeps the runtime dir for inspection. Other PDKV_* variables are cleared so that an
# operator's settings cannot point the test at live daemons.
set -euo pipefail

repo_root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PDKV=${PDKV:-$repo_root/.venv/bin/pdkv}
STEP_TIMEOUT=${SMOKE_STEP_TIMEOUT:-60}

if [[ ! -x $PDKV ]] && ! command -v "$PDKV" >/dev/null 2>&1; then
    echo "smoke test: no pdkv CLI at '$PDKV'; run 'make install' or set PDKV=/path/to/pdkv" >&2
    exit 2
fi

while IFS= read -r var; do
    unset "$var"
done < <(compgen -e | grep '^PDKV_' || true)

RUNTIME_DIR=$(mktemp -d "${TMPDIR:-/tmp}/pdkv-smoke.XXXXXX")
chmod 0700 "$RUNTIME_DIR"
export PDKV_RUNTIME_DIR=$RUNTIME_DIR
export PDKV_LOG_FORMAT=json

step="setup"
started_pids=()

log() { printf '[smoke] %s\n' "$*"; }

# Run one CLI step under the per-step timeout; SIGKILL 10 s after SIGTERM if it hangs.
pdkv() { timeout --kill-after=10 "$STEP_TIMEOUT" "$PDKV" "$@"; }

fail() {
    echo "smoke test: FAILED at step '$step': $*" >&2
    exit 1
}

# True while a process runs; an exited one not yet reaped by init (a zombie) has stopped.
running() {
    local state
    state=$(sed 's/.*) //' "/proc/$1/stat" 2>/dev/null | cut -d' ' -f1) || return 1
    [[ -n $state && $state != Z ]]
}

# The pid a daemon's pidfile names, or nothing.
pidfile_pid() {
    if [[ -s $1 ]]; then tr -dc '0-9' <"$1"; fi
}

cleanup() {
    local rc=$?
    trap - EXIT INT TERM
    if ((rc != 0)); then
        echo "smoke test: failed (exit $rc) at step '$step'; stopping daemons" >&2
        timeout 30 "$PDKV" stop all >&2 || echo "smoke test: 'pdkv stop all' failed too" >&2
        local pid
        for pid in "${started_pids[@]}"; do
            if kill -0 "$pid" 2>/dev/null; then
                echo "smoke test: pid $pid still alive after stop; SIGKILL" >&2
                kill -KILL "$pid" 2>/dev/null || true
            fi
        done
        local role
        for role in decode prefill; do
            echo "----- $RUNTIME_DIR/$role.log -----" >&2
            cat "$RUNTIME_DIR/$role.log" >&2 2>/dev/null || echo "(no log)" >&2
        done
    fi
    if [[ ${SMOKE_KEEP:-0} == 1 ]]; then
        echo "smoke test: runtime dir kept at $RUNTIME_DIR" >&2
    else
        rm -rf -- "$RUNTIME_DIR"
    fi
    exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

# Start one role in the background and check that it left a live pidfile and a socket.
start_role() {
    local role=$1 sock=$2
    step="$role start"
    log "starting $role"
    pdkv "$role" start --device cpu --num-blocks 128 --background ||
        fail "'pdkv $role start --background' exited $?"
    local pid
    pid=$(pidfile_pid "$RUNTIME_DIR/$role.pid")
    [[ -n $pid ]] || fail "no pidfile $RUNTIME_DIR/$role.pid after a successful start"
    started_pids+=("$pid")
    kill -0 "$pid" 2>/dev/null || fail "$role pid $pid from the pidfile is not running"
    [[ -S $RUNTIME_DIR/$sock ]] || fail "$role is up but $RUNTIME_DIR/$sock is not a socket"
    log "$role up (pid $pid)"
}

start_role decode decode.sock
start_role prefill prefill.sock

step="generate"
log "generating"
out=$(pdkv generate "hello" --max-tokens 16 --temperature 0 --seed 0 --no-stream) ||
    fail "'pdkv generate' exited $?"
[[ -n $out ]] || fail "'pdkv generate \"hello\"' printed nothing"
log "generated: $(printf '%q' "$out")"

step="status"
status_out=$(pdkv status) || fail "'pdkv status' exited $? with both daemons up: $status_out"
for role in decode prefill; do
    grep -Eq "^$role +up\b" <<<"$status_out" ||
        fail "'pdkv status' does not report $role up: $status_out"
done
log "status ok"

step="stop"
log "stopping"
pdkv stop all || fail "'pdkv stop all' exited $?"
for pid in "${started_pids[@]}"; do
    ! running "$pid" || fail "pid $pid still running after 'pdkv stop all'"
done
for f in decode.pid prefill.pid decode.sock prefill.sock; do
    [[ ! -e $RUNTIME_DIR/$f ]] || fail "$RUNTIME_DIR/$f left behind after a clean stop"
done

step="status after stop"
rc=0
status_out=$(pdkv status) || rc=$?
((rc != 0)) || fail "'pdkv status' exited 0 with both daemons stopped: $status_out"
((rc != 124 && rc != 137)) || fail "'pdkv status' timed out with both daemons stopped"

step="done"
echo "smoke test passed"
