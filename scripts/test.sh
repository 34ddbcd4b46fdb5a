#!/usr/bin/env bash
# The project's test command: installs the tools the tests use, checks formatting and lints,
# then runs every test of the workspace.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install-test-deps.sh
cargo fmt --all -- --check
cargo clippy --workspace --all-targets --quiet -- -D warnings
cargo test --workspace
