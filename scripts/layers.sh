#!/usr/bin/env bash
# Checks netstack's layering: a module may use only modules of its own or a lower layer.
# It greps every non-comment `crate::MODULE` path in each top-level module's files and prints
# each use of a higher layer; exits 1 if there is one. Below every layer is the protocol core,
# the crate flexns-proto (netstack/proto: wire, work, memory, cc, path, rtt, transport), which
# cannot import netstack at all (Cargo refuses the cycle); this script also checks that it
# depends on no I/O, runtime or lock crate. netstack's layers, bottom up:
#
#   0  wire work path mem link telemetry  the core's re-exports, memory, sockets, metrics
#   1  pipe cc samehost                   notification pipes, congestion control (+ Homa's ranking),
#                                         the same-host one-copy path
#   2  transport                          the core's RC and Solar over netstack's memory
#   3  offload chain                      offload handlers and jobs, RedN's engine side
#   4  config                             a context's configuration (gathers the above)
#   5  engine                             data cores, run-to-completion, the protocol hook
#   6  verbs                              Context, Pd, Mr, Cq, Qp, SolarAgent, SolarService (and
#                                         Solar's side of each core)
#   7  redn cm sim                        RedN programs, connection manager, simulator
#
# Usage: scripts/layers.sh   (from anywhere in the repository)
set -euo pipefail
src="$(cd "$(dirname "$0")/../netstack/src" && pwd)"
declare -A layer=(
  [wire]=0 [mem]=0 [work]=0 [path]=0 [link]=0 [telemetry]=0
  [pipe]=1 [cc]=1 [samehost]=1
  [transport]=2
  [offload]=3 [chain]=3
  [config]=4
  [engine]=5
  [verbs]=6
  [redn]=7 [cm]=7 [sim]=7
)
bad=0
for m in "${!layer[@]}"; do
  files=()
  [ -f "$src/$m.rs" ] && files+=("$src/$m.rs")
  [ -d "$src/$m" ] && while IFS= read -r f; do files+=("$f"); done < <(find "$src/$m" -name '*.rs')
  # wire, work and path are re-exports of flexns-proto: no files of their own
  case $m in wire | work | path) continue ;; esac
  [ ${#files[@]} -gt 0 ] || { echo "layers.sh: no files for module $m" >&2; exit 2; }
  # code lines only (comments and doc comments may link anywhere)
  while IFS=: read -r file line used; do
    if [ -z "${layer[$used]+x}" ]; then
      echo "layers.sh: $file:$line uses crate::$used, which has no layer here" >&2
      bad=1
    elif [ "${layer[$used]}" -gt "${layer[$m]}" ]; then
      echo "$file:$line: $m (layer ${layer[$m]}) uses crate::$used (layer ${layer[$used]})"
      bad=1
    fi
  done < <(grep -nE 'crate::[a-z_]+' "${files[@]}" /dev/null |
    grep -vE '^[^:]+:[0-9]+:\s*//' |
    sed -E 's/^([^:]+):([0-9]+):.*/\1:\2:&/' |
    while IFS=: read -r f l _ _ rest; do
      grep -oE 'crate::[a-z_]+' <<<"$rest" | sed 's/crate:://' | sort -u | sed "s|^|$f:$l:|"
    done)
done
# The protocol core's dependencies: no runtime, socket, system-call or lock crate.
deps="$(cd "$src/.." && cargo tree -p flexns-proto -e normal --prefix none 2>/dev/null)" || {
  echo "layers.sh: cargo tree -p flexns-proto failed" >&2
  exit 2
}
for banned in tokio mio libc nix rustix socket2 parking_lot crossbeam rand; do
  if grep -qE "^$banned v" <<<"$deps"; then
    echo "flexns-proto depends on $banned: the protocol core does no I/O and takes no lock"
    bad=1
  fi
done
if [ "$bad" = 0 ]; then
  echo "netstack layering: no module uses a higher layer; flexns-proto depends on no I/O, runtime or lock crate"
fi
exit "$bad"
