#!/usr/bin/env bash
# A multi-host flexns cluster on one Linux machine: every host is a network namespace with its
# own address on 10.77.NET.0/24, all joined by a switch namespace (a Linux bridge); this
# machine reaches them as 10.77.NET.1, like an operator's workstation on the same network.
#
#   host   address       runs
#   ctl    10.77.NET.11  etcd (:2379), block-control (:7420), Prometheus (:9090)
#   sn0-2  .12 .13 .14   block-server: storage nodes (Solar/TCP :7500, admin :7501)
#   agent  10.77.NET.15  block-agent: NBD on :10809, volume vol0 (3 replicas) attached
#   kv0-1  .16 .17       kv-server shards 0 and 1 of 2 (connection manager :7600)
#   kvc0-1 .18 .19       kvcache-engine decode engines decode-0, decode-1 (RPC :7700)
#   client 10.77.NET.20  nothing: run workloads there with `exec client -- CMD`
#
# Every daemon serves Prometheus metrics on its host's :9101, scraped every second by the
# Prometheus on ctl. The storage nodes, agent, kv shards and decode engines register
# themselves in etcd under 3 s leases (/flexns/block/live/..., /flexns/kv/shards/...,
# /flexns/kvcache/segments/...), so a host that dies leaves etcd within 3 s.
#
#   cluster.sh up [--dir DIR] [--net N] [--prefix P] [--bin DIR]
#       builds the hosts and starts everything (waiting for each daemon's banner), creates and
#       attaches vol0, writes DIR/cluster.env, and prints the addresses. On any failure it
#       tears down what it made.
#   cluster.sh status [--dir DIR]     hosts, their processes, and the addresses
#   cluster.sh kill HOST [--dir DIR]  SIGKILL every process on HOST (a host failure)
#   cluster.sh start HOST [--dir DIR] starts HOST's daemons again (same addresses)
#   cluster.sh exec HOST [--dir DIR] -- CMD...   runs CMD on HOST
#   cluster.sh down [--dir DIR]       stops every process (SIGTERM, then SIGKILL after 5 s),
#       removes the namespaces and DIR
#
# --bin DIR holds flexns and blkctl (default: built with cargo, release). DIR defaults to
# /tmp/flexns-cluster; --net (0-255, default 77) and --prefix (default fc) keep clusters apart.
# Needs root; installs what it lacks (iproute2, etcd-server, prometheus) with apt.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(cd "$here/../.." && pwd)"
# shellcheck source=../testbed/lib.sh
source "$here/../testbed/lib.sh"

cmd="${1:-}"
[ -n "$cmd" ] && shift
host_arg=""
case "$cmd" in kill|start|exec) host_arg="${1:-}"; [ -n "$host_arg" ] && shift ;; esac
DIR=/tmp/flexns-cluster NET=77 P=fc BIN=""
extra=()
while [ $# -gt 0 ]; do
  case "$1" in
    --dir) DIR="$2"; shift 2 ;;
    --net) NET="$2"; shift 2 ;;
    --prefix) P="$2"; shift 2 ;;
    --bin) BIN="$2"; shift 2 ;;
    --) shift; extra=("$@"); break ;;
    *) echo "cluster.sh: unknown argument $1" >&2; exit 2 ;;
  esac
done
case "$cmd" in up|status|kill|start|exec|down) ;; *) sed -n '2,33p' "$0" | sed 's/^# \{0,1\}//' >&2; exit 2 ;; esac
[ "$(id -u)" = 0 ] || { echo "cluster.sh needs root (network namespaces)" >&2; exit 1; }

# a running cluster's settings win over the defaults (later commands name only --dir)
if [ "$cmd" != up ] && [ -f "$DIR/cluster.env" ]; then
  # shellcheck disable=SC1091
  source "$DIR/cluster.env"
fi
[[ "$NET" =~ ^[0-9]+$ ]] && [ "$NET" -le 255 ] || { echo "--net: 0 to 255" >&2; exit 2; }
[[ "$P" =~ ^[a-z0-9]{1,6}$ ]] || { echo "--prefix: 1-6 lowercase letters or digits" >&2; exit 2; }

HOSTS=(ctl sn0 sn1 sn2 agent kv0 kv1 kvc0 kvc1 client)
NS=(sw "${HOSTS[@]}")
declare -A OCTET=([ctl]=11 [sn0]=12 [sn1]=13 [sn2]=14 [agent]=15 [kv0]=16 [kv1]=17 [kvc0]=18 [kvc1]=19 [client]=20)
ip_of() { echo "10.77.$NET.${OCTET[$1]}"; }
ETCD="$(ip_of ctl):2379"
CONTROL="$(ip_of ctl):7420"

known_host() {
  [ -n "${OCTET[$1]:-}" ] || { echo "cluster.sh: no host $1 (hosts: ${HOSTS[*]})" >&2; exit 2; }
}

# ns_exec HOST CMD...: CMD in HOST's namespace.
ns_exec() { local h="$1"; shift; ip netns exec "${P}_$h" "$@"; }

# daemon HOST NAME PATTERN CMD...: starts CMD on HOST in its own session (it outlives this
# script), logging to DIR/logs/NAME.log, and waits up to 30 s for PATTERN in the log.
daemon() {
  local h="$1" name="$2" pattern="$3"
  shift 3
  local log="$DIR/logs/$name.log"
  : >"$log"
  ip netns exec "${P}_$h" setsid "$@" >>"$log" 2>&1 </dev/null &
  local t=0
  until grep -q -- "$pattern" "$log"; do
    if ! kill -0 "$!" 2>/dev/null; then
      echo "cluster.sh: $name on $h exited before it was ready:" >&2
      tail -n 20 "$log" >&2
      return 1
    fi
    t=$((t + 1))
    [ "$t" -le 600 ] || { echo "cluster.sh: $name on $h not ready in 30 s:" >&2; tail -n 20 "$log" >&2; return 1; }
    sleep 0.05
  done
}

start_host() {
  local h="$1" ip
  ip="$(ip_of "$h")"
  local m=(--metrics-addr "$ip:9101")
  local live=(--etcd "$ETCD" --etcd-prefix /flexns --etcd-lease-ttl 3)
  case "$h" in
    ctl)
      mkdir -p "$DIR/etcd" "$DIR/prometheus"
      daemon ctl etcd "ready to serve client requests" etcd --name ctl --data-dir "$DIR/etcd" \
        --listen-client-urls "http://$ip:2379" --advertise-client-urls "http://$ip:2379" \
        --listen-peer-urls "http://$ip:2380" --initial-advertise-peer-urls "http://$ip:2380" \
        --initial-cluster "ctl=http://$ip:2380"
      daemon ctl block-control "block-control control=" "$FLEXNS" blk-daemon control \
        --listen "$CONTROL" --etcd "$ETCD" --prefix /flexns "${m[@]}"
      prometheus_config >"$DIR/prometheus.yml"
      daemon ctl prometheus "Server is ready to receive web requests" prometheus \
        --config.file="$DIR/prometheus.yml" --storage.tsdb.path="$DIR/prometheus" \
        --web.listen-address="$ip:9090"
      ;;
    sn*)
      mkdir -p "$DIR/$h"
      daemon "$h" "block-server-$h" "block-server node=" "$FLEXNS" blk-daemon node --dir "$DIR/$h" \
        --listen "$ip:7500" --admin "$ip:7501" --control "$CONTROL" --heartbeat-ms 500 "${live[@]}" "${m[@]}"
      ;;
    agent)
      daemon agent block-agent "block-agent name=" "$FLEXNS" blk-daemon agent --name agent0 \
        --nbd "$ip:10809" --admin "$ip:7511" --control "$CONTROL" --heartbeat-ms 500 "${live[@]}" "${m[@]}"
      ;;
    kvc*)
      local n="${h#kvc}"
      daemon "$h" "kvcache-$h" "segment=decode-$n" "$FLEXNS" kvcache-serve --name "decode-$n" \
        --bind "$ip" --advertise "$ip" --rpc-port 7700 --pool 64MiB --metadata "etcd://$ETCD" \
        --etcd-prefix /flexns/kvcache/ --lease-ttl 3 "${m[@]}"
      ;;
    kv*)
      local shard="${h#kv}"
      daemon "$h" "kv-server-$h" "kv-server cm=" "$FLEXNS" kv-server --cm "$ip:7600" --data "$ip:4791" \
        --resp "$ip:6379" --shard "$shard" --shards 2 --capacity 65536 --data-size 64MiB \
        --etcd "http://$ETCD" --etcd-prefix /flexns/kv/ --etcd-lease-ttl 3 "${m[@]}"
      ;;
    client) ;;
  esac
}

prometheus_config() {
  echo "global: {scrape_interval: 1s, evaluation_interval: 1s}"
  echo "scrape_configs:"
  local h
  for h in ctl sn0 sn1 sn2 agent kv0 kv1 kvc0 kvc1; do
    echo "  - job_name: $h"
    echo "    static_configs: [{targets: ['$(ip_of "$h"):9101']}]"
  done
}

# kill_host HOST SIGNAL: signals every process in HOST's namespace.
kill_host() {
  local pids
  pids="$(ip netns pids "${P}_$1" 2>/dev/null || true)"
  [ -z "$pids" ] || kill "-$2" $pids 2>/dev/null || true
}

teardown() {
  local h t
  for h in "${HOSTS[@]}"; do kill_host "$h" TERM; done
  for t in $(seq 50); do
    local left=0
    for h in "${HOSTS[@]}"; do [ -z "$(ip netns pids "${P}_$h" 2>/dev/null || true)" ] || left=1; done
    [ "$left" = 0 ] && break
    sleep 0.1
  done
  for h in "${HOSTS[@]}"; do kill_host "$h" KILL; done
  ip link del "${P}r" 2>/dev/null || true
  down
}

build_hosts() {
  ip netns add "${P}_sw"
  ip -n "${P}_sw" link add br0 type bridge
  ip -n "${P}_sw" link set br0 up
  ip -n "${P}_sw" link set lo up
  local h i=0
  for h in "${HOSTS[@]}"; do
    ip netns add "${P}_$h"
    ip -n "${P}_$h" link set lo up
    # jumbo frames, as a storage fabric has: Solar sends a 4 KiB block per datagram
    ip link add "${P}h$i" mtu 9000 type veth peer name "${P}s$i" mtu 9000
    ip link set "${P}h$i" netns "${P}_$h"
    ip -n "${P}_$h" link set "${P}h$i" name eth0
    ip -n "${P}_$h" addr add "$(ip_of "$h")/24" dev eth0
    ip -n "${P}_$h" link set eth0 up
    ip link set "${P}s$i" netns "${P}_sw"
    ip -n "${P}_sw" link set "${P}s$i" master br0 up
    i=$((i + 1))
  done
  # this machine's port on the switch
  ip link add "${P}r" mtu 9000 type veth peer name "${P}rs" mtu 9000
  ip link set "${P}rs" netns "${P}_sw"
  ip -n "${P}_sw" link set "${P}rs" master br0 up
  ip addr add "10.77.$NET.1/24" dev "${P}r"
  ip link set "${P}r" up
}

print_addresses() {
  cat <<EOF
flexns cluster $P on 10.77.$NET.0/24 (state in $DIR)
  etcd        http://$ETCD
  prometheus  http://$(ip_of ctl):9090
  control     $CONTROL        (blkctl --control $CONTROL list)
  nbd         nbd://$(ip_of agent):10809/vol0
  kv          kv --etcd http://$ETCD --bind 10.77.$NET.1 get KEY
  kvcache     segments decode-0, decode-1 under etcd prefix /flexns/kvcache/
EOF
}

case "$cmd" in
  up)
    [ -e "$DIR/cluster.env" ] && { echo "cluster.sh: a cluster is up in $DIR (cluster.sh down --dir $DIR)" >&2; exit 1; }
    install_deps cluster.sh ip:iproute2 etcd:etcd-server prometheus:prometheus setsid:util-linux
    if [ -z "$BIN" ]; then
      (cd "$root" && cargo build --release -q -p clients --bin flexns --bin blkctl) >&2
      BIN="$root/target/release"
    fi
    BIN="$(cd "$BIN" && pwd)"
    FLEXNS="$BIN/flexns"
    for b in flexns blkctl; do [ -x "$BIN/$b" ] || { echo "cluster.sh: no $b in $BIN" >&2; exit 1; }; done
    trap 'rc=$?; [ $rc = 0 ] || { echo "cluster.sh: up failed; tearing down" >&2; teardown; rm -rf "$DIR"; }; exit $rc' EXIT
    trap 'exit 130' INT TERM
    mkdir -p "$DIR/logs"
    build_hosts
    for h in "${HOSTS[@]}"; do start_host "$h"; done
    "$BIN/blkctl" --control "$CONTROL" create vol0 --size 64MiB --replicas 3 >"$DIR/logs/blkctl.log"
    "$BIN/blkctl" --control "$CONTROL" attach vol0 --agent agent0 >>"$DIR/logs/blkctl.log"
    printf 'P=%q\nNET=%q\nBIN=%q\nFLEXNS=%q\n' "$P" "$NET" "$BIN" "$FLEXNS" >"$DIR/cluster.env"
    print_addresses
    ;;
  status)
    [ -f "$DIR/cluster.env" ] || { echo "cluster.sh: no cluster in $DIR" >&2; exit 1; }
    print_addresses
    for h in "${HOSTS[@]}"; do
      printf '  %-7s %-13s %s processes\n' "$h" "$(ip_of "$h")" "$(ip netns pids "${P}_$h" 2>/dev/null | wc -l)"
    done
    ;;
  kill)
    known_host "$host_arg"
    kill_host "$host_arg" KILL
    echo "cluster.sh: killed every process on $host_arg" >&2
    ;;
  start)
    known_host "$host_arg"
    [ -f "$DIR/cluster.env" ] || { echo "cluster.sh: no cluster in $DIR" >&2; exit 1; }
    start_host "$host_arg"
    ;;
  exec)
    known_host "$host_arg"
    [ "${#extra[@]}" -gt 0 ] || { echo "cluster.sh exec HOST -- CMD..." >&2; exit 2; }
    exec ip netns exec "${P}_$host_arg" "${extra[@]}"
    ;;
  down)
    teardown
    rm -rf "$DIR"
    ;;
esac
