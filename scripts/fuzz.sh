#!/usr/bin/env bash
# Coverage-guided fuzzing (cargo fuzz, libFuzzer) of the decoders that take outside input.
#   scripts/fuzz.sh [--dev] [--seconds N] [TARGET...]   (default: 60 s for each target in fuzz/)
# --dev builds the targets without optimization and with debug assertions (overflow checks on):
# fewer executions a second, a build in less than half the time (113 s against about 250 s
# for all targets on 2 cores); the test command's 5 s smoke uses it. Real runs leave it out.
# Prints one JSON line per target: executions, seconds, and the corpus size. A crash stops
# the run with libFuzzer's report; its input is kept under fuzz/artifacts/TARGET/ (turn it
# into a regression test). Needs cargo-fuzz (scripts/install-test-deps.sh installs it).
# cargo fuzz passes flags only a nightly compiler takes (-Zsanitizer=address, sancov); this
# script runs the project's stable toolchain with RUSTC_BOOTSTRAP=1, which takes them, so no
# other toolchain is needed (none can be fetched on the project's machines). FUZZ_TOOLCHAIN=
# nightly uses an installed nightly instead.
set -euo pipefail
cd "$(dirname "$0")/../fuzz"
secs=60
profile=-O
while [ $# -gt 0 ]; do
  case "$1" in
    --dev) profile=--dev; shift ;;
    --seconds)
      if [ $# -lt 2 ] || ! [[ "$2" =~ ^[0-9]+$ ]]; then
        echo "scripts/fuzz.sh: --seconds takes a whole number of seconds" >&2
        exit 2
      fi
      secs="$2"
      shift 2
      ;;
    -*) echo "scripts/fuzz.sh: unknown option $1 (usage: scripts/fuzz.sh [--dev] [--seconds N] [TARGET...])" >&2; exit 2 ;;
    *) break ;;
  esac
done
if [ -n "${FUZZ_TOOLCHAIN:-}" ]; then
  fuzz=(cargo "+$FUZZ_TOOLCHAIN" fuzz)
else
  export RUSTC_BOOTSTRAP=1
  fuzz=(cargo fuzz)
fi
if ! "${fuzz[@]}" --version >/dev/null 2>&1; then
  echo "scripts/fuzz.sh: needs cargo-fuzz (cargo install cargo-fuzz --locked; scripts/install-test-deps.sh does)" >&2
  exit 2
fi
targets=("$@")
[ ${#targets[@]} -gt 0 ] || mapfile -t targets < <("${fuzz[@]}" list)
if ! "${fuzz[@]}" build "$profile" >/dev/null 2>&1; then
  "${fuzz[@]}" build "$profile" # again, to show why
  exit 1
fi
for t in "${targets[@]}"; do
  mkdir -p "corpus/$t"
  log="$(mktemp)"
  if ! "${fuzz[@]}" run "$profile" "$t" "corpus/$t" -- -max_total_time="$secs" -print_final_stats=1 >"$log" 2>&1; then
    tail -40 "$log" >&2
    rm -f "$log"
    echo "{\"target\":\"$t\",\"crash\":true}"
    exit 1
  fi
  runs="$(sed -n 's/^stat::number_of_executed_units: *//p' "$log" | tail -1)"
  took="$(sed -n 's/^Done [0-9]* runs in \([0-9]*\) second.*/\1/p' "$log" | tail -1)"
  corpus="$(find "corpus/$t" -type f | wc -l)"
  rm -f "$log"
  echo "{\"target\":\"$t\",\"executions\":${runs:-0},\"seconds\":${took:-$secs},\"corpus\":$corpus,\"crash\":false}"
done
