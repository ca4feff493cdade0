#!/usr/bin/env bash
# Run README.md's quick start exactly as written, as a new user would: in a fresh clone of this
# repository's HEAD and a fresh virtualenv, each command of the quick-start block, then the commands
# that use the result (with the run directory the main job wrote). The suite runs the same commands
# shortened (tests/e2e/test_readme.py); this runs them in full: the set-up (1.5-3 min), the main job
# (about 10 min on 2 CPU cores), the tests (about 20 min), evaluation and a second training run.
#
# Usage: bash launch/check_readme.sh [WORK_DIR]      (PYTHON=python3.12 picks the interpreter)
set -euo pipefail
src=$(cd "$(dirname "$0")/.." && pwd)
work=${1:-$(mktemp -d -t distzo-readme-XXXXXX)}
PY=${PYTHON:-python}
echo "[check] fresh clone of $(git -C "$src" rev-parse --short HEAD) and virtualenv in $work"
git clone -q "$src" "$work/distzo"
"$PY" -m venv "$work/venv"
# shellcheck disable=SC1091
source "$work/venv/bin/activate"
cd "$work/distzo"

# The ```bash blocks of a README section, continuations joined, comments kept out by bash itself.
section() { awk -v want="## $1" '/^## /{on=($0==want)} on' README.md | awk '/^```bash$/{on=1;next} /^```$/{on=0} on'; }

run() { echo "[check] \$ $1"; local t=$SECONDS; bash -c "$1"; echo "[check] ok in $((SECONDS - t)) s"; }

while IFS= read -r line; do run "$line"; done <<< "$(section "Quick start" | head -n 2)"

run_dir=$(ls -d outputs/*/* | tail -n 1)
uses=$(section "Quick start" | tail -n +3)
example=$(grep -o 'eval\.run=[^ ]*' <<< "$uses" | head -n 1 | cut -d= -f2)
echo "[check] the main job wrote $run_dir (the README's example says $example)"
while IFS= read -r line; do
  [ -n "$line" ] || continue
  run "${line//$example/$run_dir}"
done <<< "$uses"
echo "[check] README quick start: every command ran"
