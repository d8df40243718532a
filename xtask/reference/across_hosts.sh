#!/usr/bin/env bash
# By hand, as root: distlab across two hosts played by network namespaces on this machine
# (each with a veth into a bridge in a third namespace; addresses that exist only inside
# them, all removed on exit), next to the same on one host:
#   1. all_reduce bus bandwidth, 1 MiB .. 256 MiB, W=2 (1 + 1 ranks) and W=4 (2 + 2), over TCP
#      between the hosts (distlab-worker bench-comm --hosts), against shared memory on one
#      host, and torch's gloo over TCP both ways when a Python with torch is given;
#   2. the reference step (4 layers, d_model 256, 4 heads, seq 128, vocab 256, global batch
#      16, fp32 AdamW) with dp=4: 2 + 2 ranks across the hosts (a server in host 0, a worker
#      with --ranks 2 in each) against 4 ranks on one worker; the median step of steps 5..30.
#
#   bash xtask/reference/across_hosts.sh [PYTHON_WITH_TORCH]
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
python=${1:-}
cargo build --release -q -p distlab-server -p distlab-worker --manifest-path "$root/Cargo.toml"
worker=$root/target/release/distlab-worker
server=$root/target/release/distlab-server
tag=dlb$$
switch=${tag}sw
hosts=(${tag}h0 ${tag}h1)
ips=(10.123.$(($$ % 250)).1 10.123.$(($$ % 250)).2)
work=$(mktemp -d)

cleanup() {
    for ns in "${hosts[@]}" "$switch"; do
        ip netns pids "$ns" 2>/dev/null | xargs -r kill -9 2>/dev/null || true
        ip netns del "$ns" 2>/dev/null || true
    done
    rm -rf "$work"
}
trap cleanup EXIT

ip netns add "$switch"
ip -n "$switch" link add br0 type bridge
ip -n "$switch" link set br0 up
for h in 0 1; do
    ip netns add "${hosts[$h]}"
    ip -n "${hosts[$h]}" link add eth0 type veth peer name "p$h" netns "$switch"
    ip -n "${hosts[$h]}" addr add "${ips[$h]}/24" dev eth0
    ip -n "${hosts[$h]}" link set eth0 up
    ip -n "${hosts[$h]}" link set lo up
    ip -n "$switch" link set "p$h" master br0
    ip -n "$switch" link set "p$h" up
done
export DISTLAB_RENDEZVOUS_SECRET=$(od -An -N16 -tx1 /dev/urandom | tr -d ' \n')
in_host() { local h=$1; shift; ip netns exec "${hosts[$h]}" "$@"; }

echo "== all_reduce busbw (GB/s; distlab: buffers in shared memory, as DDP's buckets)"
range=(--min-bytes 1048576 --max-bytes 268435456)
busbw() { # JSON lines of bench-comm -> "bytes busbw" of the shared-memory all_reduce
    python3 -c '
import json, sys
for line in sys.stdin:
    try: p = json.loads(line)
    except ValueError: continue
    if p.get("bench") == "collective" and p["op"] == "all_reduce" and p["memory"] == "shared":
        print(p["bytes"], round(p["busbw_gbps"], 3))
    if p.get("bench") == "memcpy":
        print("memcpy", round(p["busbw_gbps"], 3))'
}
for world in 2 4; do
    half=$((world / 2))
    placement=$(python3 -c "print(','.join(['0'] * $half + ['1'] * $half))")
    dir=$work/bench-$world
    mkdir -p "$dir"
    in_host 1 "$worker" bench-comm --world "$world" "${range[@]}" --hosts "$placement" --host 1 \
        --host-ip "${ips[1]}" --run-dir "$dir" > /dev/null &
    echo "-- W=$world across the hosts ($half + $half), TCP between them:"
    in_host 0 "$worker" bench-comm --world "$world" "${range[@]}" --hosts "$placement" --host 0 \
        --host-ip "${ips[0]}" --run-dir "$dir" | busbw
    wait
    echo "-- W=$world on one host, shared memory:"
    "$worker" bench-comm --world "$world" "${range[@]}" | busbw
    if [ -n "$python" ]; then
        echo "-- gloo W=$world across the hosts (TCP), all_reduce: bytes time busbw"
        for r in $(seq 1 $((world - 1))); do
            h=$((r / half))
            in_host "$h" "$python" "$root/xtask/reference/allreduce.py" --world "$world" --rank "$r" \
                --master "${ips[0]}:29555" --ifname eth0 --ops all_reduce "${range[@]}" > /dev/null &
        done
        in_host 0 "$python" "$root/xtask/reference/allreduce.py" --world "$world" --rank 0 \
            --master "${ips[0]}:29555" --ifname eth0 --ops all_reduce "${range[@]}" | grep all_reduce
        wait
        echo "-- gloo W=$world on one host (loopback)"
        "$python" "$root/xtask/reference/allreduce.py" --world "$world" --ops all_reduce "${range[@]}" | grep all_reduce
    fi
done

echo "== the reference DDP step (dp=4): 4 ranks on one host, then 2 + 2 across the hosts"
data=$work/data
echo "a password for the bench" | "$server" user add admin --admin --data-dir "$data" > /dev/null
base=http://${ips[0]}:18555
DISTLAB_WORKER_TOKEN=bench-token in_host 0 "$server" --addr "${ips[0]}:18555" --auth accounts \
    --data-dir "$data" --local-workers 0 --static-dir "$work" > "$work/server.log" 2>&1 &
sleep 2
api() { in_host 0 curl -s -b "$work/cookies" -c "$work/cookies" -H 'content-type: application/json' "$@"; }
api -d '{"name": "admin", "password": "a password for the bench"}' "$base/api/session" > /dev/null
spec='{"name": "reference dp=4", "model": {"layers": 4, "d_model": 256, "heads": 4, "seq_len": 128, "vocab": 256},
       "parallel": {"dp": 4}, "train": {"steps": 30, "micro_batch": 4, "eval_every": 0}}'
start_worker() { # host, extra flags...
    local h=$1; shift
    DISTLAB_WORKER_TOKEN=bench-token in_host "$h" "$worker" --server "$base" --name "bench-$h" \
        --checkpoint-dir "$work/checkpoints" --offload-dir "$work/offload" "$@" > "$work/worker-$h.log" 2>&1 &
}
median_step() { # runs the spec, prints the median step_ms of steps 5..29
    local id
    id=$(api -d "$spec" "$base/api/experiments" | python3 -c 'import json,sys; print(json.load(sys.stdin)["id"])')
    for _ in $(seq 1 600); do
        status=$(api "$base/api/experiments/$id" | python3 -c 'import json,sys; print(json.load(sys.stdin)["status"])')
        case $status in succeeded) break ;; failed | cancelled) echo "the run $status"; return 1 ;; esac
        sleep 1
    done
    api "$base/api/experiments/$id/metrics" | python3 -c '
import json, statistics, sys
steps = [p["step_ms"] for p in json.load(sys.stdin)["steps"] if p["step"] >= 5]
print(f"median step {statistics.median(steps):.1f} ms (min {min(steps):.1f}, max {max(steps):.1f}, {len(steps)} steps)")'
}
start_worker 0
sleep 2
echo -n "4 ranks on one host:        "
median_step
in_host 0 pkill -f "name bench-0" || true
sleep 1
start_worker 0 --ranks 2
start_worker 1 --ranks 2
sleep 2
echo -n "2 + 2 ranks across the hosts: "
median_step
