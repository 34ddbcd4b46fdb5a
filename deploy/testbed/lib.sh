# Shared by the testbed scripts (sourced). The script sets NS (its namespace names), P (the
# prefix), root (the repository) and its own `up`; this file gives the rest of the life cycle.
# shellcheck shell=bash

work=""
pids=()

# veth_link NS_A DEV_A ADDR_A NS_B DEV_B ADDR_B [MTU]: a veth pair between two of the script's
# namespaces (names without the prefix), addressed (CIDR), up, with offloads off so shapers and
# counters see every packet as sent.
veth_link() {
  local na="$1" da="${P}$2" aa="$3" nb="$4" db="${P}$5" ab="$6" mtu="${7:-1500}"
  ip link add "$da" mtu "$mtu" type veth peer name "$db" mtu "$mtu"
  ip link set "$da" netns "${P}_$na"
  ip link set "$db" netns "${P}_$nb"
  ip -n "${P}_$na" addr add "$aa" dev "$da"
  ip -n "${P}_$nb" addr add "$ab" dev "$db"
  ip -n "${P}_$na" link set "$da" up
  ip -n "${P}_$nb" link set "$db" up
  ip netns exec "${P}_$na" ethtool -K "$da" tso off gso off gro off >/dev/null 2>&1 || true
  ip netns exec "${P}_$nb" ethtool -K "$db" tso off gso off gro off >/dev/null 2>&1 || true
}

# Removes the namespaces (and with them veths, qdiscs and BPF programs).
down() {
  for n in "${NS[@]}"; do ip netns del "${P}_$n" 2>/dev/null || true; done
}

# "${DIE[@]}" CMD...: runs CMD as a child that dies with this script even when the script itself
# is killed (setpriv --pdeathsig). Background children start as `"${DIE[@]}" CMD ... & pids+=($!)`
# (the redirections stay on the background command: a FIFO opened for writing blocks until its
# reader comes, so it must be opened in the child).
DIE=(setpriv --pdeathsig KILL --)

# run CMD...: runs CMD like that in the background and waits for it, returning its status. A
# signal to the script ends the wait at once (bash runs a trap only after a foreground command
# finishes, but interrupts `wait`), so the cleanup trap stops CMD without waiting for it.
run() {
  "${DIE[@]}" "$@" &
  pids+=($!)
  wait "$!"
}

# running PID: whether PID runs (a child that exited but was not waited for is a zombie: no)
running() {
  [ -r "/proc/$1/stat" ] && ! grep -q '^[0-9]* (.*) Z ' "/proc/$1/stat" 2>/dev/null
}

# The EXIT/INT/TERM trap: stops the children, removes everything, keeps the exit status.
cleanup() {
  local rc=$?
  # nothing here may end the trap early (errexit would skip the removal and change the status)
  set +e
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  # a child still running 5 s later (hung in its shutdown) gets SIGKILL: the testbed never
  # waits forever
  local p t
  for t in $(seq 50); do
    for p in "${pids[@]}"; do running "$p" && break; done
    running "$p" || break
    sleep 0.1
  done
  for p in "${pids[@]}"; do running "$p" && { kill -9 "$p" 2>/dev/null || true; }; done
  for p in "${pids[@]}"; do wait "$p" 2>/dev/null || true; done
  down
  [ -n "$work" ] && rm -rf "$work"
  exit "$rc"
}

# install_deps SCRIPT CHECK:PACKAGE...: installs with apt each PACKAGE whose CHECK (a command,
# or a file when it starts with /) is missing.
install_deps() {
  local script="$1" x c p
  shift
  local need=()
  for x in "$@"; do
    c="${x%%:*}" p="${x#*:}"
    if [[ "$c" == /* ]]; then [ -e "$c" ] && continue; else command -v "$c" >/dev/null && continue; fi
    [[ " ${need[*]} " == *" $p "* ]] || need+=("$p")
  done
  if [ "${#need[@]}" -gt 0 ]; then
    echo "$script: installing ${need[*]}" >&2
    apt-get update -qq >&2
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}" >&2
  fi
}

# start SCRIPT DEPS...: `down` exits here; otherwise installs DEPS, traps cleanup, makes the
# work directory and runs `up`; `up` alone leaves the topology standing and exits.
start() {
  local script="$1"
  shift
  if [ "$cmd" = down ]; then down; exit 0; fi
  trap cleanup EXIT INT TERM
  install_deps "$script" "$@"
  work="$(mktemp -d)"
  up
  if [ "$cmd" = up ]; then
    trap - EXIT INT TERM
    rm -rf "$work"
    echo "$script ${P} is up (namespaces: ${NS[*]/#/${P}_}); remove it with: $0 down --prefix $P" >&2
    exit 0
  fi
}

# Sets NSPERF (built with cargo, release, unless given).
find_nsperf() {
  if [ -z "${NSPERF:-}" ]; then
    (cd "$root" && cargo build --release -q -p clients --bin nsperf) >&2
    NSPERF="$root/target/release/nsperf"
  fi
}
