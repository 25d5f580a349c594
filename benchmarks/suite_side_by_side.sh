#!/usr/bin/env bash
# The whole test suite of two commits at the same time on one machine, so that the machine's drift (on a shared VM
# the same tests cost 20-50% more CPU from one hour to the next) falls on both alike: the CPU ratio of the suites.
#
#   sudo bash benchmarks/suite_side_by_side.sh BASE [HEAD] [WORKDIR]    # HEAD defaults to HEAD, WORKDIR to /tmp/sbs
#
# Each commit is cloned (../shared linked beside it when this checkout has one), gets its virtualenv as .ci/run makes
# it (Debian's python3, requirements-dev.txt; the system packages .ci/run installs must be there), then runs
# `.ci/check` and `pytest -q` under /usr/bin/time, in a network and mount namespace of its own: the two suites share
# no port, no named network namespace (/run/netns) and no munged (/run/munge). A veth pair is up in each namespace
# beside loopback (SLURM does not resolve localhost in a namespace that has only loopback). Needs root (unshare).
# The suite that ends first runs again, unmeasured, until the other ends (beside another suite a test costs more CPU
# than alone: without it the longer suite ran its last minutes alone, a bias in its favour).
# Printed: each suite's tests, wall time and CPU (user + system of every process it reaped), and the CPU ratio.
set -euo pipefail
base=$1 head=${2:-HEAD} work=${3:-/tmp/sbs}
here=$(cd "$(dirname "$0")/.." && pwd)
rm -rf "$work" && mkdir -p "$work"

suite_in_namespace() {  # $1: checkout
    unshare --net --mount --propagation private --fork bash -c '
        set -e
        ip link set lo up
        ip link add hostv0 type veth peer name hostv1
        ip addr add 10.254.0.1/24 dev hostv0
        ip link set hostv0 up && ip link set hostv1 up
        mkdir -p /run/netns /run/munge
        mount -t tmpfs tmpfs /run/netns && mount -t tmpfs tmpfs /run/munge
        chown munge:munge /run/munge 2>/dev/null || true
        cd "$0" && export PATH=/usr/sbin:/usr/bin:$PATH
        bash .ci/check && .venv/bin/python -m pytest -q' "$1"
}

for side in base head; do
    commit=$([ $side = base ] && echo "$base" || echo "$head")
    mkdir -p "$work/$side"
    git clone -q "$here" "$work/$side/main"
    git -C "$work/$side/main" checkout -q "$(git -C "$here" rev-parse "$commit")"
    [ -d "$here/../shared" ] && ln -s "$(cd "$here/../shared" && pwd)" "$work/$side/shared"
    (cd "$work/$side/main" && /usr/bin/python3 -m venv .venv \
        && PIP_DISABLE_PIP_VERSION_CHECK=1 .venv/bin/pip install -q -r requirements-dev.txt -e .) > "$work/$side.install.log" 2>&1
done
run_suite() {  # $1: side, $2: the log's suffix
    /usr/bin/time -f "cpu %U %S wall %e" -o "$work/$1$2.time" \
        bash -c "$(declare -f suite_in_namespace); suite_in_namespace $work/$1/main" > "$work/$1$2.log" 2>&1
}
run_suite base "" & base_pid=$!
run_suite head "" & head_pid=$!
# Beside another suite a test costs more CPU than alone: the suite that ends first runs again (not measured, in a
# session of its own) until the other ends, so that both are measured under the same contention to their end
wait -n "$base_pid" "$head_pid" || true
if kill -0 "$base_pid" 2>/dev/null; then first=head other_pid=$base_pid; else first=base other_pid=$head_pid; fi
if kill -0 "$other_pid" 2>/dev/null; then
    setsid bash -c "$(declare -f suite_in_namespace run_suite); work=$work; run_suite $first .filler" & filler=$!
    wait "$other_pid" || true
    # the filler's pytest is interrupted (its fixtures stop their services), then whatever is left of it is killed:
    # its session, and every process in its network namespace (a launched job runs in a session of its own)
    own_ns=$(readlink /proc/self/ns/net)
    # (a fixed string: as a pattern, `net:[N]`'s brackets matched no line of its own, so this loop killed every
    # process of the machine's own namespace, this script too: why the summary was missing)
    filler_ns=$(for p in $(pgrep -s "$filler"); do readlink "/proc/$p/ns/net"; done 2>/dev/null \
        | { grep -vxF "$own_ns" || true; } | head -1)
    pkill -INT -s "$filler" -f "pytest" 2>/dev/null || true
    for _ in $(seq 60); do pgrep -s "$filler" -f pytest > /dev/null || break; sleep 1; done
    pkill -KILL -s "$filler" 2>/dev/null || true
    if [ -n "$filler_ns" ] && [ "$filler_ns" != "$own_ns" ]; then
        for p in /proc/[0-9]*; do
            [ "$(readlink "$p/ns/net" 2>/dev/null)" = "$filler_ns" ] && kill -KILL "${p#/proc/}" 2>/dev/null
        done
    fi
fi
wait || true  # the filler, killed
for side in base head; do
    echo "$side: $(grep -E '[0-9]+ passed' "$work/$side.log" | tail -1); $(cat "$work/$side.time")"
done
awk '{ cpu[FILENAME] = $2 + $3 } END { b = cpu[ARGV[1]]; h = cpu[ARGV[2]]; printf "CPU: base %.0f s, head %.0f s, head / base %.2fx\n", b, h, h / b }' \
    "$work/base.time" "$work/head.time"
