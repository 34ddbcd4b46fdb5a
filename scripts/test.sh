#!/usr/bin/env bash
# The project's test command: installs the tools the tests use, checks formatting and lints,
# then runs every test of the workspace, and the GPU code of kvcache-engine (feature `gpu`:
# compiled and linted; its tests skip with a message where no CUDA driver or GPU exists).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install-test-deps.sh
cargo fmt --all -- --check
cargo clippy --workspace --all-targets --quiet -- -D warnings
cargo clippy -p kvcache-engine --features gpu --all-targets --quiet -- -D warnings
cargo test --workspace
cargo test -p kvcache-engine --features gpu --lib --test gpu -- --nocapture
