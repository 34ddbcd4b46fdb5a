#!/usr/bin/env bash
# Builds the flexns Python package (python/: pyo3 + maturin, an abi3 wheel for CPython >= 3.9)
# and installs it into the python3 on PATH: release mode, or with --dev the dev profile (what
# the test command uses: it reuses what `cargo test` built; not for measuring). What a user runs instead is
# `pip install ./python` (pip fetches maturin itself); this script reuses the workspace's
# target directory and an installed maturin, so the test command builds only what changed.
set -euo pipefail
cd "$(dirname "$0")/.."
py="${PYTHON:-python3}"
profile=(--release)
if [ "${1:-}" = "--dev" ]; then
  profile=(--profile dev)
fi
pip_install() {
  "$py" -m pip install -q --disable-pip-version-check "$@" 2>/dev/null \
    || "$py" -m pip install -q --disable-pip-version-check --break-system-packages "$@"
}
command -v maturin >/dev/null 2>&1 || pip_install 'maturin>=1.7,<2'
out="${CARGO_TARGET_DIR:-target}/wheels"
rm -f "$out"/flexns-*.whl
maturin build "${profile[@]}" --quiet -m python/Cargo.toml -o "$out" --interpreter "$py"
pip_install --force-reinstall --no-deps "$out"/flexns-*.whl
"$py" -c 'import flexns; print("flexns Python package installed:", flexns.__file__)'
