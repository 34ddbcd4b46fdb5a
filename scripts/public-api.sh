#!/usr/bin/env bash
# The public-API snapshot: lists every public item (and the inherent methods, fields, variants
# and associated items of its types), each with its signature as rustdoc renders it, and each
# type's trait and auto-trait implementations, of each library crate from rustdoc's HTML, and
# compares the lists with the checked-in ones in docs/api/<crate>.txt, so the surface changes
# only on purpose. rustdoc's output differs across toolchains: see docs/TESTING.md.
#   scripts/public-api.sh           check; exits 1 with a unified diff when a list differs
#   scripts/public-api.sh --bless   rewrite docs/api/*.txt from the code as it is
# Not listed: flexns-ibverbs (its surface is the C ABI of libibverbs.so.1, checked by
# ibverbs/tests/abi_layout.rs and the perftest tests) and flexns-python (a cdylib whose surface
# is the Python module, checked by python/tests).
# Cost: `cargo doc --no-deps --lib` of these crates only (dependencies are not documented), with
# the caller's RUSTDOCFLAGS untouched so a later run reuses the output.
set -euo pipefail
cd "$(dirname "$0")/.."

bless=()
case "${1:-}" in
  --bless) bless=(--bless) ;;
  "") ;;
  *) echo "usage: scripts/public-api.sh [--bless]" >&2; exit 2 ;;
esac

crates=(netstack flexns-proto block-agent kvcache-engine kv-store etcd-lite flexnsd clients test-support)
pkgs=()
for c in "${crates[@]}"; do pkgs+=(-p "$c"); done
# rustdoc's own warnings (links, HTML in comments) are not this check's business: shown only if
# the build fails
if ! out="$(cargo doc --no-deps --lib --quiet "${pkgs[@]}" 2>&1)"; then
  printf '%s\n' "$out" >&2
  echo "public-api: cargo doc failed" >&2
  exit 1
fi
target="$(cargo metadata --format-version 1 --no-deps | python3 -c 'import json,sys; print(json.load(sys.stdin)["target_directory"])')"
mkdir -p docs/api
exec python3 scripts/public-api.py "${bless[@]}" "$target/doc" docs/api "${crates[@]}"
