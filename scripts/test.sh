#!/usr/bin/env bash
# The project's test command: installs the tools the tests use, checks formatting and lints,
# then runs every test of the workspace, and the GPU code of kvcache-engine (feature `gpu`:
# compiled and linted; its tests skip with a message where no CUDA driver or GPU exists).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install-test-deps.sh

# Processes the tests start (the project's programs and daemons, and the servers and tools they
# run) must not outlive them. The ones already running (a cluster a user left up) are noted
# now and not counted.
watched='^(nsperf|ycsb|kv-server|kv|kvcache-bench|kvcache-engine|blkctl|block-server|block-agent|block-control|flexns|flexnsd|flexnsd-bench|ccsim|redis-server|etcd|qemu-nbd|nbdfuse|fio)$'
leftovers() {
  ps -e -o pid=,comm= | awk -v re="$watched" '$2 ~ re {print $1}' | LC_ALL=C sort
}
before="$(leftovers)"

# tests that cannot run here say why in this file (libtest hides a passing test's output);
# the list is printed at the end. Under CI (FLEXNS_CI=1, .ci/run) a skip caused by something
# CI provides (a tool this script installs, root) fails instead.
FLEXNS_SKIP_LOG="$(mktemp)"
export FLEXNS_SKIP_LOG

# on every exit, a passing run or not: the skips, and nothing the tests started may still run
check_leftovers() {
  local rc=$? left p
  if [ -s "$FLEXNS_SKIP_LOG" ]; then
    echo "skipped tests (and why):"
    sort -u "$FLEXNS_SKIP_LOG" | sed 's/^/  /'
  else
    echo "no test skipped"
  fi
  rm -f "$FLEXNS_SKIP_LOG"
  sleep 1
  left="$(LC_ALL=C comm -13 <(echo "$before") <(leftovers) || true)"
  if [ -n "$left" ]; then
    echo "FAIL: processes started by the tests are still running:" >&2
    for p in $left; do
      echo "  $p $(tr '\0' ' ' <"/proc/$p/cmdline" 2>/dev/null)" >&2
    done
    # shellcheck disable=SC2086
    kill -9 $left 2>/dev/null || true
    [ "$rc" = 0 ] && rc=1
  elif [ "$rc" = 0 ]; then
    echo "no process started by the tests outlived them"
  fi
  exit "$rc"
}
trap check_leftovers EXIT

cargo fmt --all -- --check
cargo clippy --workspace --all-targets --quiet -- -D warnings
cargo clippy -p kvcache-engine --features gpu --all-targets --quiet -- -D warnings
cargo clippy -p netstack --features bench-internals --benches --quiet -- -D warnings
scripts/layers.sh
# --no-fail-fast: one run shows every failing test binary, not only the first
cargo test --workspace --no-fail-fast
# every path, crate, test target, binary, subcommand and flag the docs name exists
scripts/check-docs.py
# the public API of each library crate is the checked-in one (docs/api/): it changes only on
# purpose (scripts/public-api.sh --bless rewrites the lists)
scripts/public-api.sh
cargo test -p kvcache-engine --features gpu --lib --test gpu -- --nocapture

# the Python package (a Mooncake-compatible TransferEngine): built, installed, and its tests
scripts/python.sh --dev
python3 -m pytest -q python/tests
# flexns demo's LLM step: two vLLM engines over the package just installed (about 40 s);
# --workspace, so that the test binary and the programs it runs are the ones built above
# (with -p clients alone cargo resolves netstack's features anew and builds it all again)
cargo test --workspace --test demo_steps -- --ignored llm_step

# the notification pipe's protocol under every interleaving (loom; its own target directory)
scripts/loom.sh --quiet
# a short smoke of every fuzz target, built unoptimized with overflow checks (the long runs:
# scripts/fuzz.sh --seconds N, optimized)
if command -v cargo-fuzz >/dev/null 2>&1; then
  scripts/fuzz.sh --dev --seconds 5
elif [ "${FLEXNS_CI:-}" = 1 ]; then
  echo "FAIL: fuzz smoke: cargo-fuzz is missing, yet scripts/install-test-deps.sh installs it" >&2
  exit 1
else
  echo "fuzz smoke: cargo-fuzz is missing (scripts/install-test-deps.sh installs it: cargo install cargo-fuzz --locked)" >>"$FLEXNS_SKIP_LOG"
fi
