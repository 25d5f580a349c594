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
for side in base head; do
    /usr/bin/time -f "cpu %U %S wall %e" -o "$work/$side.time" \
        bash -c "$(declare -f suite_in_namespace); suite_in_namespace $work/$side/main" > "$work/$side.log" 2>&1 &
done
wait
for side in base head; do
    echo "$side: $(grep -E '[0-9]+ passed' "$work/$side.log" | tail -1); $(cat "$work/$side.time")"
done
awk '{ cpu[FILENAME] = $2 + $3 } END { b = cpu[ARGV[1]]; h = cpu[ARGV[2]]; printf "CPU: base %.0f s, head %.0f s, head / base %.2fx\n", b, h, h / b }' \
    "$work/base.time" "$work/head.time"
