#!/usr/bin/env bash
# Builds flexns's libibverbs.so.1 and the small libmlx5.so.1, libefa.so.1 and librdmacm.so.1
# perftest needs beside it (see docs/IBVERBS.md), and prints the directory they are in:
#   LD_LIBRARY_PATH=$(scripts/build-ibverbs.sh --release) ibv_devinfo
# The crate is built as a staticlib (rustc gives a cdylib its own anonymous version script,
# which GNU ld will not combine with named version nodes) and each library is linked from it
# with its version script; --gc-sections keeps only what the exported functions reach.
# Usage: scripts/build-ibverbs.sh [--release]   (default: the dev profile)
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
profile=debug
cargo_args=()
case "${1:-}" in
  --release) profile=release; cargo_args=(--release) ;;
  "") ;;
  *) echo "usage: $0 [--release]" >&2; exit 2 ;;
esac
target=${CARGO_TARGET_DIR:-$root/target}
cargo build -q -p flexns-ibverbs --lib "${cargo_args[@]}" --manifest-path "$root/Cargo.toml" >&2
archive=$target/$profile/libflexns_ibverbs.a
out=$target/ibverbs/$profile
mkdir -p "$out"
link() { # soname map
  local so=$1 map=$2
  # every global of the version script is a root of the link (-u), so the archive's objects
  # that define them are pulled in
  local undef=()
  for s in $(sed -e 's:/\*.*\*/::' "$map" | tr ';{}' '\n\n\n' | sed -n 's/^[[:space:]]*\([A-Za-z_][A-Za-z0-9_]*\)[[:space:]]*$/\1/p' \
      | grep -v -E '^(global|local|IBVERBS_.*|MLX5_.*|EFA_.*|RDMACM_.*)$'); do
    undef+=("-Wl,-u,$s")
  done
  cc -shared -o "$out/$so.tmp" -Wl,-soname,"$so" -Wl,--version-script="$map" -Wl,--gc-sections \
    -Wl,-z,now "${undef[@]}" "$archive" -lgcc_s -lutil -lrt -lpthread -lm -ldl -lc
  mv -f "$out/$so.tmp" "$out/$so"
}
link libibverbs.so.1 "$root/ibverbs/ibverbs.map"
link libmlx5.so.1 "$root/ibverbs/mlx5.map"
link libefa.so.1 "$root/ibverbs/efa.map"
link librdmacm.so.1 "$root/ibverbs/rdmacm.map"
echo "$out"
