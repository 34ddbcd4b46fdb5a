#!/usr/bin/env bash
# A real congestion testbed on one Linux host: two senders and a receiver in network namespaces,
# joined by veth pairs through a router namespace whose egress towards the receiver is the
# bottleneck (HTB at --rate, a bfifo of --buffer bytes) with the project's tc-eBPF program on it
# (ecn_int.bpf.c: RED ECN marking on a virtual copy of the queue, HPCC INT stamping, counters).
# The kernel has no netem, so propagation delay is emulated inside the stack (--rx-delay-us).
#
#   dumbbell.sh run --cc NAME [--rate 200mbit] [--duration 4] [--delay-us 1000] [--buffer 300000]
#                   [--kmin 10000] [--kmax 50000] [--pmax 0.2] [--prefix fx$$]
#       builds the dumbbell, runs one nsperf WRITE flow from each sender into the receiver at the
#       same time, prints JSON lines (one per flow, then a summary with the Jain index as `jain`,
#       queue percentiles, drops, CE fraction, control-loop delay) and removes everything.
#   dumbbell.sh up [...] / dumbbell.sh down [--prefix P]
#       only build / only remove the topology (for poking at it by hand).
#
# Needs root. Installs what it lacks (iproute2, ethtool, clang, libbpf-dev, bpftool) with apt.
# NSPERF=path uses that nsperf binary; otherwise it is built with cargo (release).
# Everything it creates (namespaces, veths, qdiscs, BPF programs, child processes, temp files)
# is removed on exit, failure or interrupt.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(cd "$here/../.." && pwd)"

cmd="${1:-}"
[ -n "$cmd" ] && shift
CC=none RATE=200mbit DURATION=4 DELAY_US=1000 BUFFER=300000 KMIN=10000 KMAX=50000 PMAX=0.2
P="fx$$"
while [ $# -gt 0 ]; do
  case "$1" in
    --cc) CC="$2"; shift 2 ;;
    --rate) RATE="$2"; shift 2 ;;
    --duration) DURATION="$2"; shift 2 ;;
    --delay-us) DELAY_US="$2"; shift 2 ;;
    --buffer) BUFFER="$2"; shift 2 ;;
    --kmin) KMIN="$2"; shift 2 ;;
    --kmax) KMAX="$2"; shift 2 ;;
    --pmax) PMAX="$2"; shift 2 ;;
    --prefix) P="$2"; shift 2 ;;
    *) echo "dumbbell.sh: unknown argument $1" >&2; exit 2 ;;
  esac
done
case "$cmd" in run|up|down) ;; *) sed -n '2,20p' "$0" | sed 's/^# \{0,1\}//' >&2; exit 2 ;; esac
case "$CC" in none|dcqcn|timely|hpcc|swift|homa) ;; *) echo "--cc: unknown algorithm $CC" >&2; exit 2 ;; esac
[[ "$P" =~ ^[a-z0-9]{1,10}$ ]] || { echo "--prefix: 1-10 lowercase letters or digits" >&2; exit 2; }
[ "$(id -u)" = 0 ] || { echo "dumbbell.sh needs root (network namespaces, tc, eBPF)" >&2; exit 1; }

rate_bps() { # 200mbit -> 200000000
  local r="${1,,}"
  case "$r" in
    *gbit) echo $(( ${r%gbit} * 1000000000 )) ;;
    *mbit) echo $(( ${r%mbit} * 1000000 )) ;;
    *kbit) echo $(( ${r%kbit} * 1000 )) ;;
    *) echo "$r" ;;
  esac
}
RATE_BPS="$(rate_bps "$RATE")"
[[ "$RATE_BPS" =~ ^[0-9]+$ ]] && [ "$RATE_BPS" -ge 1000000 ] || { echo "--rate: $RATE is not a rate of at least 1mbit" >&2; exit 2; }
PMAX_PERMILLE="$(awk -v p="$PMAX" 'BEGIN { printf "%d", p * 1000 }')"

NS=(s1 s2 sw r)
. "$here/lib.sh"

up() {
  for n in "${NS[@]}"; do ip netns add "${P}_$n"; done
  # the bottleneck must see every packet as sent: veth_link turns offloads off
  veth_link s1 s1a 10.77.1.2/24 sw s1b 10.77.1.1/24
  veth_link s2 s2a 10.77.2.2/24 sw s2b 10.77.2.1/24
  veth_link r ra 10.77.3.2/24 sw rb 10.77.3.1/24
  for n in "${NS[@]}"; do ip -n "${P}_$n" link set lo up; done
  ip -n "${P}_s1" route add default via 10.77.1.1
  ip -n "${P}_s2" route add default via 10.77.2.1
  ip -n "${P}_r" route add default via 10.77.3.1
  ip netns exec "${P}_sw" sysctl -qw net.ipv4.ip_forward=1
  local D="${P}rb" NSX=(ip netns exec "${P}_sw")
  "${NSX[@]}" tc qdisc add dev "$D" root handle 1: htb default 10 r2q 100
  "${NSX[@]}" tc class add dev "$D" parent 1: classid 1:10 htb rate "$RATE_BPS" ceil "$RATE_BPS" burst 3k cburst 3k
  "${NSX[@]}" tc qdisc add dev "$D" parent 1:10 handle 10: bfifo limit "$BUFFER"
  clang -O2 -g -target bpf -I"/usr/include/$(uname -m)-linux-gnu" \
    -DRATE_BPS="${RATE_BPS}ULL" -DLIMIT="${BUFFER}ULL" -DKMIN="${KMIN}ULL" -DKMAX="${KMAX}ULL" \
    -DPMAX_PERMILLE="$PMAX_PERMILLE" -c "$here/ecn_int.bpf.c" -o "$work/ecn_int.o"
  "${NSX[@]}" tc qdisc add dev "$D" clsact
  "${NSX[@]}" tc filter add dev "$D" egress bpf da obj "$work/ecn_int.o" sec tc
}

start dumbbell.sh ip:iproute2 tc:iproute2 ethtool:ethtool clang:clang /usr/include/bpf/bpf_helpers.h:libbpf-dev bpftool:bpftool python3:python3
find_nsperf

# one-way delay in each direction; the algorithms' delay targets from the resulting base RTT, and
# DCQCN's increase and alpha timers at one base RTT (its defaults, 55 us, assume a 10 us fabric
# RTT: at a millisecond they recover faster than the CNPs can come back, and the queue runs away);
# HPCC's additive step at 0.5 % of the line rate per RTT, as in the simulator, so two flows
# converge within seconds at a millisecond RTT
half=$(( DELAY_US / 2 ))
base_ns=$(( (DELAY_US + 100) * 1000 ))
bdp=$(( RATE_BPS / 8 * (DELAY_US + 100) / 1000000 ))
net=(--line-rate "${RATE_BPS}bit" --rx-delay-us "$half" --no-gso --no-gro --pacing-burst 4096
  --cc-param "timely.min_rtt_ns=$base_ns" --cc-param "timely.t_low_ns=$(( base_ns + 500000 ))"
  --cc-param "timely.t_high_ns=$(( base_ns + 4000000 ))"
  --cc-param "swift.base_target_ns=$(( base_ns + 500000 ))"
  --cc-param "hpcc.base_rtt_ns=$base_ns" --cc-param "hpcc.rate_ai=$(( RATE_BPS / 8 / 200 ))"
  --cc-param "homa.rtt_bytes=$(( bdp > 4096 ? bdp : 4096 ))"
  --cc-param "dcqcn.rate_timer_ns=$base_ns" --cc-param "dcqcn.alpha_period_ns=$base_ns")
[ "$CC" = hpcc ] && net+=(--no-udp-checksum)

mkfifo "$work/banner"
"${DIE[@]}" ip netns exec "${P}_r" "$NSPERF" server --listen 10.77.3.2:7471 --data 10.77.3.2:4791 --mr-size 16MiB \
  --recovery selective-repeat "${net[@]}" >"$work/banner" 2>"$work/server.err" &
pids+=($!)
exec 3<"$work/banner"
if ! read -r -t 30 banner <&3; then
  echo "nsperf server did not start:" >&2; cat "$work/server.err" >&2; exit 1
fi

start_ns=$(python3 -c 'import time; print(time.monotonic_ns())')
for s in 1 2; do
  "${DIE[@]}" ip netns exec "${P}_s$s" "$NSPERF" client --server 10.77.3.2:7471 --data "10.77.$s.2:4791" --op write \
    --size 64KiB --depth 8 --duration "$DURATION" --mtu 1024 --recovery selective-repeat --cc "$CC" --json \
    "${net[@]}" >"$work/flow$s.json" 2>"$work/flow$s.err" &
  pids+=($!)
done
# sample the real qdisc backlog while the flows run (about every 20 ms; each sample forks tc)
"${DIE[@]}" python3 - "$P" "$DURATION" >"$work/backlog.txt" <<'EOF' &
import re, subprocess, sys, time
p, dur = sys.argv[1], float(sys.argv[2])
end = time.monotonic() + dur
while time.monotonic() < end:
    out = subprocess.run(["ip", "netns", "exec", p + "_sw", "tc", "-s", "qdisc", "show", "dev", p + "rb"],
                         capture_output=True, text=True).stdout
    m = re.search(r"bfifo.*?backlog (\d+)b", out, re.S)
    if m:
        print(m.group(1), flush=True)
    time.sleep(0.02)
EOF
sampler=$!
pids+=($sampler)
fail=0
for s in 1 2; do
  wait "${pids[$s]}" || { fail=1; echo "flow $s failed:" >&2; grep -v "^ \\|^Stack backtrace" "$work/flow$s.err" | tail -5 >&2; }
done
wait "$sampler" || true

prog_id=$(ip netns exec "${P}_sw" tc filter show dev "${P}rb" egress | grep -o ' id [0-9]*' | head -1 | awk '{print $2}')
map_ids=$(bpftool -j prog show id "$prog_id" | python3 -c 'import json,sys; print(" ".join(map(str, json.load(sys.stdin).get("map_ids", []))))')
for m in $map_ids; do
  if bpftool -j map show id "$m" | grep -q '"name":"tb_stats"'; then
    bpftool -j map dump id "$m" >"$work/stats.json"
  fi
done
ip netns exec "${P}_sw" tc -s qdisc show dev "${P}rb" >"$work/qdisc.txt"

python3 - "$work" "$CC" "$RATE_BPS" "$BUFFER" "$KMIN" "$KMAX" "$DELAY_US" "$fail" <<'EOF'
import json, re, sys
work, cc, rate, buf, kmin, kmax, delay, fail = sys.argv[1:]
rate, buf = int(rate), int(buf)
flows = []
for s in (1, 2):
    rec = None
    try:
        for line in open(f"{work}/flow{s}.json"):
            j = json.loads(line)
            if j.get("bench") == "write_bw":
                rec = j
    except (OSError, ValueError):
        pass
    flows.append(rec)
for i, f in enumerate(flows, 1):
    if f is None:
        print(json.dumps({"flow": i, "cc": cc, "error": "no result (see stderr)"}))
        continue
    c = f.get("cc") or {}
    print(json.dumps({"flow": i, "cc": cc, "mbps": round(f["gbps"] * 1000, 2), "verified": f["verified"],
                      "retransmitted_packets": f.get("retransmitted_packets"),
                      "cnps_received": c.get("cnps_received"), "control_loop_p50_us": c.get("control_loop_p50_us"),
                      "control_loop_p99_us": c.get("control_loop_p99_us"), "cc_fault": c.get("fault")}))
rates = [f["gbps"] * 1000 for f in flows if f]
jain = (sum(rates) ** 2 / (len(rates) * sum(r * r for r in rates))) if rates and sum(rates) > 0 else 0.0
st = {}
try:
    dump = json.load(open(f"{work}/stats.json"))
    v = dump[0].get("formatted", {}).get("value") or dump[0]["value"]
    st = v if isinstance(v, dict) else {}
except (OSError, ValueError, IndexError, KeyError):
    pass
hist = st.get("hist", [])
total = sum(hist)
def pct(p):
    if not total:
        return None
    acc = 0
    for i, n in enumerate(hist):
        acc += n
        if acc >= p * total:
            return int((i + 1) * buf / len(hist))
    return buf
q = open(f"{work}/qdisc.txt").read()
m = re.search(r"bfifo.*?dropped (\d+)", q, re.S)
drops = int(m.group(1)) if m else None
samples = [int(x) for x in open(f"{work}/backlog.txt").read().split()]
samples.sort()
def spct(p):
    return samples[min(len(samples) - 1, int(p * (len(samples) - 1)))] if samples else None
loops = [f["cc"] for f in flows if f and f.get("cc")]
p50s = [c["control_loop_p50_us"] for c in loops if c.get("control_loop_p50_us") is not None]
p99s = [c["control_loop_p99_us"] for c in loops if c.get("control_loop_p99_us") is not None]
pk = st.get("pkts", 0)
print(json.dumps({
    "summary": True, "cc": cc, "bottleneck_mbps": rate / 1e6, "buffer_bytes": buf, "kmin": int(kmin), "kmax": int(kmax),
    "added_rtt_us": int(delay), "flows_mbps": [round(r, 2) for r in rates], "total_mbps": round(sum(rates), 2),
    "jain": round(jain, 4),
    "queue_p50_bytes": pct(0.5), "queue_p90_bytes": pct(0.9), "queue_p99_bytes": pct(0.99),
    "queue_max_bytes": st.get("max_backlog"),
    "qdisc_backlog_p50_bytes": spct(0.5), "qdisc_backlog_p99_bytes": spct(0.99), "qdisc_samples": len(samples),
    "drops": drops, "ce_fraction": round(st.get("marked", 0) / pk, 4) if pk else None,
    "ect_packets": st.get("ect"), "int_stamped": st.get("stamped"), "packets": pk,
    "control_loop_p50_us": max(p50s) if p50s else None, "control_loop_p99_us": max(p99s) if p99s else None,
    # the CNP crosses the sender's emulated one-way delay on its way back; without it:
    "control_loop_excl_delay_p50_us": round(max(p50s) - int(delay) / 2, 1) if p50s else None,
    "control_loop_excl_delay_p99_us": round(max(p99s) - int(delay) / 2, 1) if p99s else None,
    "all_flows_ok": fail == "0" and all(f and f["verified"] for f in flows),
}))
EOF
[ "$fail" = 0 ]
