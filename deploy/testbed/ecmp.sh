#!/usr/bin/env bash
# An ECMP multipath testbed on one Linux host: host A and host B in network namespaces, joined
# through a router namespace by two equal-cost paths. The router reaches B's service address
# over both links with Linux ECMP hashing the 5-tuple (fib_multipath_hash_policy=3, fields 0x37), so
# a flow with one UDP source port uses one path and a QP that sprays over several source ports
# uses both. Each path is rate-limited at the router (HTB at --rate). B returns traffic over
# both links the same way.
#
#   ecmp.sh run [--rate 500mbit] [--paths 8] [--spray weighted] [--duration 3] [--pairs 3]
#               [--cut-bytes 1GiB] [--cut-at 2] [--cut-for 4] [--failover-bytes 256MiB] [--prefix fe$$]
#       1. spraying versus a fixed source port: one QP writing 64 KiB messages for --duration
#          seconds, sprayed over --paths paths, then with one path (fixed port), interleaved
#          --pairs times. Prints a JSON line per mode ({"experiment":"spray","mode":...,"gbps"}),
#          {"experiment":"spray","ratio":...,"verified":...}, and where the bytes went:
#          {"experiment":"spray","link_bytes":[link 1, link 2],"sprayed_bytes":...,
#          "sprayed_share_of_lesser_link":...} (the router's bytes toward B on each link; about
#          0.5 when spraying splits evenly, 0 when everything took one link).
#       2. a path cut: one sprayed QP writes --cut-bytes in 256 KiB WRITEs; --cut-at seconds in,
#          B's end of path 1 goes down (`ip link set ... down`: the router still hashes flows
#          onto the dead link, a black hole), and comes back --cut-for seconds later. Prints
#          {"experiment":"cut","gbps_before","gbps_during","gbps_after","gbps_after_peak",
#          "stall_ms","verified","path_returned",...}; stall_ms is the longest time without a
#          completed WRITE; path_returned says every path is up again and was brought back by
#          an answered probe.
#       3. failover over explicit address pairs: host A has two addresses, host B two more that
#          the router reaches over one link each (multi-NIC hosts); one QP with two paths and
#          policy `single` writes --failover-bytes while link 1 is cut and restored as in 2.
#          Prints {"experiment":"failover",...} with the same fields.
#   ecmp.sh kvcache [--rate R] [--paths N] [--duration D] [--pairs P] [--size 16MiB] [--prefix P]
#       4. KV-cache transfers: decode engines (kvcache-bench serve, flexns and tcp) in B, the
#          prefill engine in A; kvcache-bench writes --size transfers sprayed over --paths paths,
#          against one path and against the tcp transport with its default lanes (4 connections:
#          ECMP hashes each 5-tuple, so they usually cover both links), interleaved. Prints
#          kvcache-bench's JSON lines (results and ratios), after one sprayed-only run's
#          {"experiment":"kvcache","link_bytes":[link 1, link 2],"sprayed_bytes":...,
#          "sprayed_share_of_lesser_link":...,"verified":...} (the router's bytes toward B).
#          KVCACHE_BENCH=path uses that binary; otherwise it is built (release).
#   ecmp.sh block [--rate R] [--paths N] [--pairs P] [--fault cut|loss|incast|none] [--loss 1]
#                 [--agents N] [--io-bytes 96MiB] [--depth 32] [--cut-at 1.5] [--cut-for 2] [--prefix P]
#       5. the block service on a faulty fabric: a controller and a storage node in B, two agents
#          in A (Solar sprayed over --paths source ports, and the plain block protocol over one
#          kernel TCP connection: the reference), a volume on each (1 replica, the same node).
#          fio (nbd engine) in A writes --io-bytes of fresh random 4 KiB blocks at --depth and
#          reads them back verified (crc32c), Solar and TCP interleaved --pairs times. `cut`:
#          --cut-at seconds in, the link carrying most of the run's traffic (for TCP, its one
#          connection's link; the fault hits the flow) is cut at B's end and restored
#          --cut-for seconds later, as in 2. `loss`: a tc program (loss.bpf.c; the kernel here
#          has no netem) drops --loss percent of the IP packets in both directions of both
#          links for the whole run. `incast`: --agents agents per system (default 4; each its
#          own volume, all on the one storage node, each TCP agent its own connection, which
#          ECMP spreads over the links) write at once. `none`: no fault (with --busy: a busy
#          host alone must not look like a faulty fabric). --agents applies to every fault (default
#          1). Prints per run (all of its agents together)
#          {"experiment":"block","system","fault","iops","p50_us","p99_us","p999_us",
#          "max_ms","stall_ms","errors","verified","node_syncs_over_20ms","solar_timeouts",
#          "solar_blocks_resent",...} (solar_*: the Solar agents' RTO expiries and resent
#          blocks during the run, from their /metrics; stall_ms: the
#          longest time without a completed write; node_syncs_over_20ms/_50ms: the storage node's
#          log syncs that slow during the run, a disk stall, which no transport avoids) and {"experiment":"block","summary":true,...} with the medians and
#          the Solar/TCP ratios. BLKCTL=path uses that blkctl; otherwise it is built (release).
#          BLOCK_KEEP=dir keeps fio's JSON, its per-I/O latency logs and the daemons' logs.
#   ecmp.sh up [...] / ecmp.sh down [--prefix P]
#       only build / only remove the topology.
#   --busy N (any experiment): N busy loops run beside the testbed for the whole run (a CPU-
#       starved host: on 2 cores, its threads wait milliseconds for a core).
#
# Needs root. Installs what it lacks (iproute2, ethtool) with apt. NSPERF=path uses that nsperf
# binary; otherwise it is built with cargo (release). Everything it creates (namespaces, veths,
# qdiscs, child processes, temp files) is removed on exit, failure or interrupt.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(cd "$here/../.." && pwd)"

cmd="${1:-}"
[ -n "$cmd" ] && shift
RATE=500mbit PATHS=8 SPRAY=weighted DURATION=3 PAIRS=3 CUT_BYTES=1GiB CUT_AT=2 CUT_FOR=4 CC=swift
FAILOVER_BYTES=256MiB
SWIFT_TARGET_NS=1000000
SIZE=16MiB
FAULT=cut LOSS=1 IO_BYTES=96MiB DEPTH=32 AGENTS= BUSY=0
P="fe$$"
while [ $# -gt 0 ]; do
  case "$1" in
    --rate) RATE="$2"; shift 2 ;;
    --paths) PATHS="$2"; shift 2 ;;
    --spray) SPRAY="$2"; shift 2 ;;
    --duration) DURATION="$2"; shift 2 ;;
    --pairs) PAIRS="$2"; shift 2 ;;
    --cut-bytes) CUT_BYTES="$2"; shift 2 ;;
    --cut-at) CUT_AT="$2"; shift 2 ;;
    --cut-for) CUT_FOR="$2"; shift 2 ;;
    --failover-bytes) FAILOVER_BYTES="$2"; shift 2 ;;
    --cc) CC="$2"; shift 2 ;;
    --size) SIZE="$2"; shift 2 ;;
    --fault) FAULT="$2"; shift 2 ;;
    --loss) LOSS="$2"; shift 2 ;;
    --io-bytes) IO_BYTES="$2"; shift 2 ;;
    --depth) DEPTH="$2"; shift 2 ;;
    --agents) AGENTS="$2"; shift 2 ;;
    --busy) BUSY="$2"; shift 2 ;;
    --prefix) P="$2"; shift 2 ;;
    *) echo "ecmp.sh: unknown argument $1" >&2; exit 2 ;;
  esac
done
case "$cmd" in run|up|down|kvcache|block) ;; *) sed -n '2,51p' "$0" | sed 's/^# \{0,1\}//' >&2; exit 2 ;; esac
case "$FAULT" in cut|loss|incast|none) ;; *) echo "--fault: cut, loss, incast or none" >&2; exit 2 ;; esac
[[ "$BUSY" =~ ^[0-9]+$ ]] && [ "$BUSY" -le 16 ] || { echo "--busy: 0..16 busy loops" >&2; exit 2; }
[ -n "$AGENTS" ] || { [ "$FAULT" = incast ] && AGENTS=4 || AGENTS=1; }
[[ "$AGENTS" =~ ^[0-9]+$ ]] && [ "$AGENTS" -ge 1 ] && [ "$AGENTS" -le 16 ] || { echo "--agents: 1..16" >&2; exit 2; }
[[ "$LOSS" =~ ^[0-9]+(\.[0-9]+)?$ ]] || { echo "--loss: a percentage like 1 or 0.5" >&2; exit 2; }
[[ "$IO_BYTES" =~ ^[0-9]+(KiB|MiB|GiB)$ ]] || { echo "--io-bytes: like 96MiB" >&2; exit 2; }
[[ "$DEPTH" =~ ^[0-9]+$ ]] && [ "$DEPTH" -ge 1 ] && [ "$DEPTH" -le 256 ] || { echo "--depth: 1..256" >&2; exit 2; }
case "$SPRAY" in single|round-robin|weighted) ;; *) echo "--spray: unknown policy $SPRAY" >&2; exit 2 ;; esac
[[ "$PATHS" =~ ^[0-9]+$ ]] && [ "$PATHS" -ge 2 ] && [ "$PATHS" -le 64 ] || { echo "--paths: 2..64" >&2; exit 2; }
[[ "$PAIRS" =~ ^[0-9]+$ ]] && [ "$PAIRS" -ge 1 ] || { echo "--pairs: a positive number" >&2; exit 2; }
for v in DURATION CUT_AT CUT_FOR; do
  [[ "${!v}" =~ ^[0-9]+(\.[0-9]+)?$ ]] || { echo "--${v,,}: a number of seconds" >&2; exit 2; }
done
[[ "$P" =~ ^[a-z0-9]{1,10}$ ]] || { echo "--prefix: 1-10 lowercase letters or digits" >&2; exit 2; }
[[ "${RATE,,}" =~ ^[0-9]+(kbit|mbit|gbit)$ ]] || { echo "--rate: like 500mbit" >&2; exit 2; }
RATE_BPS=$(python3 -c "import re,sys; n,u=re.match(r'(\d+)(kbit|mbit|gbit)',sys.argv[1].lower()).groups(); print(int(n)*{'kbit':10**3,'mbit':10**6,'gbit':10**9}[u])" "$RATE")
case "$CC" in none|dcqcn|timely|swift|homa) ;; *) echo "--cc: none, dcqcn, timely, swift or homa (the testbed has no INT for hpcc)" >&2; exit 2 ;; esac
[ "$(id -u)" = 0 ] || { echo "ecmp.sh needs root (network namespaces, tc)" >&2; exit 1; }

NS=(a r b)
. "$here/lib.sh"

# A 10.88.1.2 --- (ra) R (r1) === (b1) B 10.88.11.2     B's service address 10.88.2.2 on lo
#                      (r2) === (b2)   10.88.12.2
up() {
  for n in "${NS[@]}"; do ip netns add "${P}_$n"; done
  veth_link a a0 10.88.1.2/24 r ra 10.88.1.1/24 9000
  veth_link r r1 10.88.11.1/24 b b1 10.88.11.2/24 9000
  veth_link r r2 10.88.12.1/24 b b2 10.88.12.2/24 9000
  ip -n "${P}_a" addr add 10.88.1.3/24 dev "${P}a0"
  ip -n "${P}_b" addr add 10.88.2.2/32 dev lo
  ip -n "${P}_b" addr add 10.88.2.4/32 dev lo   # reached over link 1 only
  ip -n "${P}_b" addr add 10.88.2.3/32 dev lo   # reached over link 2 only
  for n in "${NS[@]}"; do
    ip -n "${P}_$n" link set lo up
    ip netns exec "${P}_$n" sysctl -qw net.ipv4.conf.all.rp_filter=0 net.ipv4.conf.default.rp_filter=0
    # hash the 5-tuple as an IPv4 switch does (policy 3, fields: addresses, protocol, ports).
    # Policy 1 would reuse the sending socket's hash (it survives the veth), which Linux TCP
    # draws anew after every RTO: a fabric hashing IPv6 flow labels behaves so, an IPv4 one not
    ip netns exec "${P}_$n" sysctl -qw net.ipv4.fib_multipath_hash_policy=3 \
      net.ipv4.fib_multipath_hash_fields=0x0037
  done
  for d in ra r1 r2; do ip netns exec "${P}_r" sysctl -qw "net.ipv4.conf.${P}$d.rp_filter=0"; done
  for d in b1 b2; do ip netns exec "${P}_b" sysctl -qw "net.ipv4.conf.${P}$d.rp_filter=0"; done
  ip netns exec "${P}_r" sysctl -qw net.ipv4.ip_forward=1
  ip -n "${P}_a" route add default via 10.88.1.1
  ip -n "${P}_r" route add 10.88.2.4/32 via 10.88.11.2 dev "${P}r1"
  ip -n "${P}_r" route add 10.88.2.3/32 via 10.88.12.2 dev "${P}r2"
  ip -n "${P}_r" route add 10.88.2.2/32 \
    nexthop via 10.88.11.2 dev "${P}r1" weight 1 nexthop via 10.88.12.2 dev "${P}r2" weight 1
  ip -n "${P}_b" route add 10.88.1.0/24 \
    nexthop via 10.88.11.1 dev "${P}b1" weight 1 nexthop via 10.88.12.1 dev "${P}b2" weight 1
  # each path is a rate-limited link at the router (real rates: veth_link turned offloads off)
  for d in r1 r2; do
    ip netns exec "${P}_r" tc qdisc add dev "${P}$d" root handle 1: htb default 10
    ip netns exec "${P}_r" tc class add dev "${P}$d" parent 1: classid 1:10 htb rate "$RATE" ceil "$RATE" \
      burst 64k cburst 64k quantum 9000
    ip netns exec "${P}_r" tc qdisc add dev "${P}$d" parent 1:10 handle 10: bfifo limit 4000000
  done
}

deps=(ip:iproute2 tc:iproute2 ethtool:ethtool python3:python3 ping:iputils-ping)
[ "$cmd" = block ] && deps+=(fio:fio)
[ "$cmd" = block ] && [ "$FAULT" = loss ] && deps+=(clang:clang /usr/include/bpf/bpf_helpers.h:libbpf-dev)
start ecmp.sh "${deps[@]}"
# --busy N: busy loops beside the testbed for the whole run, stopped with everything else
for _ in $(seq 1 "$BUSY"); do
  "${DIE[@]}" bash -c 'while :; do :; done' &
  pids+=($!)
done

# cut_link K / restore_link K: B's end of link K (1 or 2) goes down: the router still hashes
# flows onto it, a black hole. Restored as a router brings a link back: the route uses it only
# once its neighbour answers (the kernel would otherwise hash B's replies onto it at once, into
# an unresolved ARP entry whose first request may go out before the carrier is up and is
# retried a second later).
# link_bytes K: bytes the router has sent toward B on link K
link_bytes() {
  ip -n "${P}_r" -s link show "${P}r$1" | awk '/TX:/ {getline; print $1; exit}'
}
cut_link() {
  ip -n "${P}_b" link set "${P}b$1" down
}
restore_link() {
  local k="$1" o=$(( 3 - $1 ))
  ip -n "${P}_b" route replace 10.88.1.0/24 via "10.88.1$o.1" dev "${P}b$o"
  ip -n "${P}_b" link set "${P}b$k" up
  for _ in 1 2 3 4 5 6 7 8 9 10; do
    ip netns exec "${P}_b" ping -q -c 1 -W 0.2 -I "${P}b$k" "10.88.1$k.1" >/dev/null 2>&1 && break
  done
  ip -n "${P}_b" route replace 10.88.1.0/24 \
    nexthop via 10.88.11.1 dev "${P}b1" weight 1 nexthop via 10.88.12.1 dev "${P}b2" weight 1
}

if [ "$cmd" = kvcache ]; then
  if [ -z "${KVCACHE_BENCH:-}" ]; then
    (cd "$root" && cargo build --release -q -p clients --bin kvcache-bench) >&2
    KVCACHE_BENCH="$root/target/release/kvcache-bench"
  fi
  # the stack under both engines: selective repeat (spraying reorders), Swift as on the other runs
  printf '[qp]\nrecovery = "selective-repeat"\ncc = "%s"\n[cc.swift]\nbase_target_ns = %s\n' \
    "$CC" "$SWIFT_TARGET_NS" >"$work/kvc.toml"
  # kvc_server NAME TRANSPORT PORT: a decode engine in B on the ECMP service address
  kvc_server() {
    mkfifo "$work/$1.banner"
    "${DIE[@]}" ip netns exec "${P}_b" "$KVCACHE_BENCH" serve --transport "$2" --metadata P2PHANDSHAKE \
      --bind 10.88.2.2 --advertise 10.88.2.2 --rpc-port "$3" --pool "$SIZE" --paths "$PATHS" \
      --stack-config "$work/kvc.toml" >"$work/$1.banner" 2>"$work/$1.err" &
    pids+=($!)
    local line
    if ! read -r -t 30 line <"$work/$1.banner"; then
      echo "decode engine $1 did not start:" >&2; cat "$work/$1.err" >&2; exit 1
    fi
    "${DIE[@]}" cat "$work/$1.banner" >/dev/null &
    pids+=($!)
  }
  kvc_server kvf flexns 7481
  kvc_server kvt tcp 7482
  # where a sprayed transfer's bytes go: one sprayed-only run between two reads of the router's
  # counters (the comparison below mixes in one-path and tcp runs)
  b=("$(link_bytes 1)" "$(link_bytes 2)")
  if ! run ip netns exec "${P}_a" "$KVCACHE_BENCH" --server 10.88.2.2:7481 --bind 10.88.1.2 \
    --paths "$PATHS" --stack-config "$work/kvc.toml" --size "$SIZE" --duration "$DURATION" --pairs 1 \
    --json >"$work/kvs.json" 2>"$work/kvc.err"; then
    echo "the sprayed kvcache run failed:" >&2; grep -v "^ \\|^Stack backtrace" "$work/kvc.err" | tail -5 >&2; exit 1
  fi
  python3 - "$work/kvs.json" "$(( $(link_bytes 1) - b[0] ))" "$(( $(link_bytes 2) - b[1] ))" <<'PY'
import json, sys
runs = [json.loads(l) for l in open(sys.argv[1]) if l.startswith("{")]
links = [int(sys.argv[2]), int(sys.argv[3])]
sprayed = sum(r["bytes"] for r in runs if r.get("bench") == "kvcache_write")
print(json.dumps({"experiment": "kvcache", "link_bytes": links, "sprayed_bytes": sprayed,
                  "verified": bool(runs) and all(r.get("verified") for r in runs if r.get("bench") == "kvcache_write"),
                  "sprayed_share_of_lesser_link": round(min(links) / sprayed, 3) if sprayed else None}))
PY
  if ! run ip netns exec "${P}_a" "$KVCACHE_BENCH" --server 10.88.2.2:7481 --bind 10.88.1.2 \
    --paths "$PATHS" --compare-paths 1 --compare tcp --compare-server 10.88.2.2:7482 \
    --stack-config "$work/kvc.toml" --size "$SIZE" --duration "$DURATION" --pairs "$PAIRS" --json \
    2>"$work/kvc.err"; then
    echo "the kvcache experiment failed:" >&2; grep -v "^ \\|^Stack backtrace" "$work/kvc.err" | tail -5 >&2; exit 1
  fi
  exit 0
fi

if [ "$cmd" = block ]; then
  if [ -z "${BLKCTL:-}" ]; then
    (cd "$root" && cargo build --release -q -p clients --bin blkctl) >&2
    BLKCTL="$root/target/release/blkctl"
  fi
  # daemon NAME NS ROLE ARGS...: `blkctl daemon ROLE ARGS` in namespace NS; waits for its banner
  daemon() {
    local name="$1" ns="$2" role="$3"
    shift 3
    "${DIE[@]}" ip netns exec "${P}_$ns" "$BLKCTL" daemon "$role" "$@" >"$work/$name.log" 2>&1 &
    local pid=$!
    pids+=("$pid")
    for _ in $(seq 1 300); do
      grep -q "^block-" "$work/$name.log" && return 0
      kill -0 "$pid" 2>/dev/null || break
      sleep 0.1
    done
    echo "$name did not start:" >&2; tail -20 "$work/$name.log" >&2; exit 1
  }
  daemon control b control --listen 10.88.2.2:7420 --state "$work/control.json" --node-timeout-ms 60000
  daemon node0 b node --dir "$work/node0" --listen 10.88.2.2:7500 --admin 10.88.2.2:0 \
    --control 10.88.2.2:7420 --metrics-addr 10.88.2.2:9400
  # the node's log syncs so far, all volumes (flexns_store_log_sync_duration_seconds):
  # "COUNT OVER_20MS OVER_50MS". A write waits for its sync, so a slow one is a stall that
  # the disk made, in either system's run
  node_syncs() {
    ip netns exec "${P}_b" python3 - <<'PY'
import re, urllib.request
text = urllib.request.urlopen("http://10.88.2.2:9400/metrics", timeout=5).read().decode()
n = {"count": 0.0, "0.02": 0.0, "0.05": 0.0}
for line in text.splitlines():
    if not line.startswith("flexns_store_log_sync_duration_seconds"):
        continue
    v = float(line.rsplit(" ", 1)[1])
    if line.startswith("flexns_store_log_sync_duration_seconds_count"):
        n["count"] += v
    m = re.search(r'le="([^"]+)"', line)
    if m and m.group(1) in n:
        n[m.group(1)] += v
print(int(n["count"]), int(n["count"] - n["0.02"]), int(n["count"] - n["0.05"]))
PY
  }
  # the Solar agents' RTO expiries and resent blocks so far: "TIMEOUTS RESENT"
  solar_counts() {
    ip netns exec "${P}_a" python3 - "$AGENTS" <<'PY'
import sys, urllib.request
t = r = 0
for k in range(1, int(sys.argv[1]) + 1):
    text = urllib.request.urlopen(f"http://10.88.1.2:{9500 + k}/metrics", timeout=5).read().decode()
    for line in text.splitlines():
        if line.startswith("flexns_solar_timeouts_total"):
            t += int(float(line.rsplit(" ", 1)[1]))
        elif line.startswith("flexns_solar_blocks_resent_total"):
            r += int(float(line.rsplit(" ", 1)[1]))
print(t, r)
PY
  }
  blk=(ip netns exec "${P}_a" "$BLKCTL" --control 10.88.2.2:7420 --dir "$work")
  declare -A uri
  for k in $(seq 1 "$AGENTS"); do
    daemon "solar$k" a agent --name "solar$k" --nbd "127.0.0.1:$(( 10808 + k ))" --admin 10.88.1.2:0 \
      --control 10.88.2.2:7420 --transport solar --paths "$PATHS" --cc "$CC" \
      --metrics-addr "10.88.1.2:$(( 9500 + k ))"
    daemon "tcp$k" a agent --name "tcp$k" --nbd "127.0.0.1:$(( 10908 + k ))" --admin 10.88.1.2:0 \
      --control 10.88.2.2:7420 --transport tcp
    for sys in solar tcp; do
      "${blk[@]}" create "v$sys$k" --size "$IO_BYTES" --replicas 1 >/dev/null
      uri[$sys$k]="$("${blk[@]}" attach "v$sys$k" --agent "$sys$k" | tail -1)"
    done
  done
  if [ "$FAULT" = loss ]; then
    # the kernel here has no netem: a tc egress program drops at random (loss.bpf.c), on the
    # router's ports toward B and B's ports toward the router: loss in both directions
    ppm=$(python3 -c "import sys; print(round(float(sys.argv[1]) * 10000))" "$LOSS")
    clang -O2 -g -target bpf -I"/usr/include/$(uname -m)-linux-gnu" -DLOSS_PPM="$ppm" \
      -c "$here/loss.bpf.c" -o "$work/loss.o"
    for nd in r:r1 r:r2 b:b1 b:b2; do
      ip netns exec "${P}_${nd%%:*}" tc qdisc add dev "${P}${nd#*:}" clsact
      ip netns exec "${P}_${nd%%:*}" tc filter add dev "${P}${nd#*:}" egress bpf da obj "$work/loss.o" sec tc
    done
  fi
  # fio reads 64MiB as 64,000,000 bytes: give it the byte count the volume has
  io_bytes=$(python3 -c "import sys; n,u=sys.argv[1][:-3],sys.argv[1][-3:]; print(int(n)*{'KiB':1<<10,'MiB':1<<20,'GiB':1<<30}[u])" "$IO_BYTES")
  for pair in $(seq 1 "$PAIRS"); do
    for sys in solar tcp; do
      name="$sys.$pair"
      fpids=()
      for k in $(seq 1 "$AGENTS"); do
        "${DIE[@]}" ip netns exec "${P}_a" fio --name="$name.$k" --ioengine=nbd --uri="${uri[$sys$k]}" \
          --rw=randwrite --bs=4k --iodepth="$DEPTH" --size="$io_bytes" --randrepeat=0 \
          --randseed="$(od -An -N4 -tu4 /dev/urandom | tr -d ' ')" --refill_buffers \
          --verify=crc32c --do_verify=1 --verify_fatal=1 --verify_state_save=0 \
          --write_lat_log="$work/$name.$k" --log_avg_msec=0 \
          --output-format=json --output="$work/$name.$k.json" >"$work/$name.$k.err" 2>&1 &
        pids+=($!)
        fpids+=($!)
      done
      python3 -c 'import time; print(time.monotonic_ns())' >"$work/$name.times"
      node_syncs >"$work/$name.syncs" || true
      [ "$sys" = solar ] && { solar_counts >"$work/$name.solar" || true; }
      if [ "$FAULT" = cut ]; then
        b1=$(link_bytes 1) b2=$(link_bytes 2)
        run sleep "$CUT_AT"
        # the link that carried more of this run so far
        k=1
        [ $(( $(link_bytes 2) - b2 )) -gt $(( $(link_bytes 1) - b1 )) ] && k=2
        python3 -c 'import time; print(time.monotonic_ns())' >>"$work/$name.times"
        cut_link "$k"
        run sleep "$CUT_FOR"
        restore_link "$k"
        echo "$k" >"$work/$name.link"
      fi
      for f in "${fpids[@]}"; do wait "$f" || true; done
      node_syncs >>"$work/$name.syncs" || true
      [ "$sys" = solar ] && { solar_counts >>"$work/$name.solar" || true; }
    done
  done
  # BLOCK_KEEP=DIR keeps fio's results and per-I/O latency logs there, with each volume's
  # describe (its agent's view: paths, counters)
  if [ -n "${BLOCK_KEEP:-}" ]; then
    for k in $(seq 1 "$AGENTS"); do
      for sys in solar tcp; do "${blk[@]}" describe "v$sys$k" >"$work/describe.$sys$k.json" 2>&1 || true; done
    done
    mkdir -p "$BLOCK_KEEP" && cp "$work"/*.{json,log,times} "$BLOCK_KEEP"/ 2>/dev/null || true
  fi
  python3 - "$work" "$FAULT" "$LOSS" "$PAIRS" "$PATHS" "$RATE" "$AGENTS" "$BUSY" <<'PYEOF'
import json, sys
work, fault, loss, pairs, paths, rate, agents, busy = sys.argv[1:]
agents, busy = int(agents), int(busy)
def med(v):
    v = sorted(x for x in v if x is not None)
    return v[len(v) // 2] if v else None
def pct(v, q):
    return v[min(len(v) - 1, int(q * len(v)))] if v else None
runs = {"solar": [], "tcp": []}
for pair in range(1, int(pairs) + 1):
    for sysname in ("solar", "tcp"):
        name = f"{sysname}.{pair}"
        r = {"experiment": "block", "system": sysname, "fault": fault, "pair": pair, "agents": agents,
             "paths": int(paths) if sysname == "solar" else 1, "rate_per_path": rate}
        if fault == "loss":
            r["loss_pct"] = float(loss)
        iops, errors, writes, verified_reads, lats, stall, problems = 0.0, 0, 0, 0, [], 0, []
        for k in range(1, agents + 1):
            try:
                s = open(f"{work}/{name}.{k}.json").read()
                job = json.loads(s[s.index("{"):])["jobs"][0]
            except (OSError, ValueError) as e:
                err = open(f"{work}/{name}.{k}.err").read()[-400:]
                problems.append(f"agent {k}: no fio result: {e}: {err}")
                errors += 1
                continue
            w, rd = job["write"], job["read"]
            iops += w["iops"]
            errors += 1 if job["error"] else 0
            writes += w["total_ios"]
            verified_reads += rd["total_ios"]
            if job["error"] or rd["total_ios"] != w["total_ios"] or w["total_ios"] == 0:
                problems.append(f"agent {k}: error {job['error']}, {w['total_ios']} written, {rd['total_ios']} verified")
            # per-I/O completions of writes (direction 1): latencies, and the longest gap
            times = []
            try:
                for line in open(f"{work}/{name}.{k}_clat.1.log"):
                    f = [x.strip() for x in line.split(",")]
                    if len(f) >= 3 and f[2] == "1":
                        times.append(int(f[0]))
                        lats.append(int(f[1]))
            except OSError:
                pass
            times.sort()
            stall = max([stall] + [b - a for a, b in zip(times, times[1:])])
        lats.sort()
        us = lambda q: round(pct(lats, q) / 1000, 1) if lats else None
        r.update({
            "iops": round(iops), "p50_us": us(0.5), "p99_us": us(0.99), "p999_us": us(0.999),
            "max_ms": round(lats[-1] / 1e6, 1) if lats else None, "stall_ms": stall,
            "errors": errors, "writes": writes, "verified_reads": verified_reads,
            # every block written was read back and matched its crc32c (verify_fatal stops at a mismatch)
            "verified": not problems,
        })
        if problems:
            r["problems"] = problems
        try:
            r["cut_link"] = int(open(f"{work}/{name}.link").read())
        except OSError:
            pass
        # the storage node's log syncs during the run (writes and their read-back): how many,
        # and how many took over 20 and 50 ms (the disk's stalls, which hit both systems)
        try:
            a, b = [[int(x) for x in l.split()] for l in open(f"{work}/{name}.syncs").read().split("\n")[:2]]
            r.update({"node_log_syncs": b[0] - a[0], "node_syncs_over_20ms": b[1] - a[1],
                      "node_syncs_over_50ms": b[2] - a[2]})
        except (OSError, ValueError):
            pass
        # the Solar agents' RTO expiries and resent blocks during the run
        try:
            a, b = [[int(x) for x in l.split()] for l in open(f"{work}/{name}.solar").read().split("\n")[:2]]
            r.update({"solar_timeouts": b[0] - a[0], "solar_blocks_resent": b[1] - a[1]})
        except (OSError, ValueError):
            pass
        r["busy_loops"] = busy
        print(json.dumps(r))
        runs[sysname].append(r)
s, t = runs["solar"], runs["tcp"]
ratio = lambda k, inv=False: med([(b[k] / a[k] if inv else a[k] / b[k]) for a, b in zip(s, t)
                                  if a.get(k) and b.get(k)])
print(json.dumps({
    "experiment": "block", "summary": True, "fault": fault, "pairs": int(pairs), "agents": agents,
    "iops_solar": med([r.get("iops") for r in s]), "iops_tcp": med([r.get("iops") for r in t]),
    "iops_ratio": ratio("iops"), "p99_ratio": ratio("p99_us"), "p999_ratio": ratio("p999_us"),
    "stall_ms_solar_max": max((r.get("stall_ms") or 0 for r in s), default=None),
    "stall_ms_tcp_max": max((r.get("stall_ms") or 0 for r in t), default=None),
    "errors_solar": sum(1 for r in s if r.get("errors")), "errors_tcp": sum(1 for r in t if r.get("errors")),
    "solar_timeouts": sum(r.get("solar_timeouts") or 0 for r in s),
    "solar_blocks_resent": sum(r.get("solar_blocks_resent") or 0 for r in s),
    "busy_loops": busy,
    "verified": all(r.get("verified") for r in s + t),
}))
PYEOF
  exit 0
fi

find_nsperf

# start_server NAME CM DATA [flags]: an nsperf server in B; waits for its banner
start_server() {
  local name="$1" cm="$2" data="$3"
  shift 3
  mkfifo "$work/$name.banner"
  "${DIE[@]}" ip netns exec "${P}_b" "$NSPERF" server --listen "$cm" --data "$data" --mr-size 64MiB \
    --recovery selective-repeat "$@" >"$work/$name.banner" 2>"$work/$name.err" &
  pids+=($!)
  local line
  if ! read -r -t 30 line <"$work/$name.banner"; then
    echo "nsperf server $name did not start:" >&2; cat "$work/$name.err" >&2; exit 1
  fi
  # keep the pipe drained
  "${DIE[@]}" cat "$work/$name.banner" >/dev/null &
  pids+=($!)
}
start_server spray 10.88.2.2:7471 10.88.2.2:4791
start_server pairs 10.88.2.4:7472 10.88.2.4:4791 --extra-addr 10.88.2.3
net=(--op write --mtu 4096 --recovery selective-repeat --json --cc "$CC"
  --line-rate "$(( RATE_BPS * 2 ))bit" --cc-param "swift.base_target_ns=$SWIFT_TARGET_NS")
client=(ip netns exec "${P}_a" "$NSPERF" client --server 10.88.2.2:7471 --data 10.88.1.2:4791
  --paths "$PATHS" --spray "$SPRAY" "${net[@]}")

# 1. spraying versus one fixed source port, interleaved; the router's bytes toward B on each
# link, before and after, say how the runs split over the two links
echo "$(link_bytes 1) $(link_bytes 2)" >"$work/spray.links"
if ! run "${client[@]}" --size 64KiB --depth 32 --duration "$DURATION" --compare-paths 1 --pairs "$PAIRS" \
  >"$work/spray.json" 2>"$work/spray.err"; then
  echo "the spray experiment failed:" >&2; grep -v "^ \\|^Stack backtrace" "$work/spray.err" | tail -5 >&2; exit 1
fi
echo "$(link_bytes 1) $(link_bytes 2)" >>"$work/spray.links"

# cut_run NAME CMD...: runs CMD in the background, cuts link 1 (B's end) --cut-at seconds in,
# restores it --cut-for seconds later, waits; NAME.json, NAME.times (cut and restore times)
cut_run() {
  local name="$1"
  shift
  "${DIE[@]}" "$@" >"$work/$name.json" 2>"$work/$name.err" &
  pids+=($!)
  local cpid=$!
  run sleep "$CUT_AT"
  python3 -c 'import time; print(time.monotonic_ns())' >"$work/$name.times"
  cut_link 1
  run sleep "$CUT_FOR"
  python3 -c 'import time; print(time.monotonic_ns())' >>"$work/$name.times"
  restore_link 1
  if ! wait "$cpid"; then
    echo "the $name experiment failed:" >&2; grep -v "^ \\|^Stack backtrace" "$work/$name.err" | tail -5 >&2
  fi
}
# 2. a path cut in the middle of a sprayed transfer, and its return
cut_run cut "${client[@]}" --size 256KiB --depth 16 --bytes "$CUT_BYTES"
# 3. failover of a single-path QP over two address pairs
cut_run failover ip netns exec "${P}_a" "$NSPERF" client --server 10.88.2.4:7472 --data 10.88.1.2:4791 \
  --extra-addr 10.88.1.3 --paths 2 --spray single "${net[@]}" --size 256KiB --depth 16 --bytes "$FAILOVER_BYTES"

python3 - "$work" "$RATE" "$PATHS" "$SPRAY" <<'EOF'
import json, sys
work, rate, paths, spray = sys.argv[1:]
def lines(name):
    out = []
    for l in open(f"{work}/{name}"):
        try:
            out.append(json.loads(l))
        except ValueError:
            pass
    return out
spray_lines = lines("spray.json")
runs = [l for l in spray_lines if l.get("bench") == "write_bw"]
ratio = next((l for l in spray_lines if l.get("bench") == "ratio"), {})
def med(v):
    v = sorted(v)
    return v[len(v) // 2] if v else None
sprayed = [r for r in runs if r.get("multipath")]
fixed = [r for r in runs if not r.get("multipath")]
for mode, rs in (("spray", sprayed), ("fixed", fixed)):
    print(json.dumps({"experiment": "spray", "mode": mode, "paths": int(paths) if mode == "spray" else 1,
                      "spray": spray if mode == "spray" else "single", "rate_per_path": rate,
                      "gbps": med([r["gbps"] for r in rs]), "runs_gbps": [r["gbps"] for r in rs],
                      "retransmitted_packets": sum(r.get("retransmitted_packets", 0) for r in rs)}))
print(json.dumps({"experiment": "spray", "ratio": ratio.get("ratio"), "ratios": ratio.get("ratios"),
                  "verified": bool(runs) and all(r["verified"] for r in runs)}))
# where the bytes went: every fixed run's bytes on one link (whichever its port hashes to), the
# sprayed runs' bytes over both; the link that carried less carried only sprayed bytes
before, after = (list(map(int, l.split())) for l in open(f"{work}/spray.links"))
links = [a - b for a, b in zip(after, before)]
sprayed_bytes = sum(r["bytes"] for r in sprayed)
print(json.dumps({"experiment": "spray", "link_bytes": links, "sprayed_bytes": sprayed_bytes,
                  "fixed_bytes": sum(r["bytes"] for r in fixed),
                  "sprayed_share_of_lesser_link": round(min(links) / sprayed_bytes, 3) if sprayed_bytes else None}))
ok = True
for name, npaths, policy in (("cut", int(paths), spray), ("failover", 2, "single")):
    res = next((l for l in lines(f"{name}.json") if l.get("bench") == "write_bw"), None)
    try:
        cut_ns, up_ns = (int(x) for x in open(f"{work}/{name}.times").read().split())
    except (OSError, ValueError):
        res = None
    if res is None:
        print(json.dumps({"experiment": name, "error": "no result (see stderr)", "verified": False}))
        ok = False
        continue
    bin_ns = res["timeline_bin_ms"] * 1_000_000
    t0 = res["timeline_start_monotonic_ns"]
    tl = res["timeline_mbps"]
    def gbps(a_ns, b_ns):
        a, b = max(0, (a_ns - t0) // bin_ns), min(len(tl), (b_ns - t0) // bin_ns)
        return round(sum(tl[a:b]) / max(1, b - a) / 1000, 3) if b > a else None
    end_ns = t0 + len(tl) * bin_ns
    mp = res.get("multipath", {})
    per = mp.get("per_path", [])
    print(json.dumps({
        "experiment": name, "bytes": res["bytes"], "rate_per_path": rate, "paths": npaths, "spray": policy,
        "gbps_before": gbps(t0 + 300_000_000, cut_ns), "gbps_during": gbps(cut_ns + 300_000_000, up_ns),
        "gbps_after": gbps(up_ns + 500_000_000, end_ns - bin_ns),
        # the best quarter second after the path came back (it returns at its first answered probe)
        "gbps_after_peak": max((gbps(t, t + 250_000_000) or 0 for t in range(up_ns, end_ns - 250_000_000, bin_ns)),
                               default=None),
        "stall_ms": res.get("max_gap_ms"), "verified": res["verified"],
        "path_downs": mp.get("path_downs"), "paths_up_at_end": sum(1 for p in per if p.get("up")),
        "path_returned": bool(per) and all(p.get("up") for p in per) and any(p.get("ups", 0) > 0 for p in per),
        "retransmitted_packets": res.get("retransmitted_packets"), "per_path": per, "timeline_mbps": tl,
    }))
sys.exit(0 if ok else 1)
EOF
