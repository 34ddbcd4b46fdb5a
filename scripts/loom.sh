#!/usr/bin/env bash
# Model-checks netstack's notification pipe with loom: every interleaving of the producer and
# the consumer in `pipe::loom_model` (hand-over across laps, batched publishing, sleep/notify).
# Its own target directory: `--cfg flexns_loom` changes how netstack builds.
set -euo pipefail
cd "$(dirname "$0")/.."
export RUSTFLAGS="--cfg flexns_loom ${RUSTFLAGS:-}"
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-target}/loom"
export LOOM_MAX_PREEMPTIONS="${LOOM_MAX_PREEMPTIONS:-3}"
exec cargo test --release -p netstack --lib pipe::loom_model -- --test-threads=1 "$@"
