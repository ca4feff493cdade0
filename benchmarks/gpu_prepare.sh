#!/usr/bin/env bash
# Gathers, on this machine, what a GPU machine lacks for benchmarks/gpu_check.sh, into .gpu/ (git-ignored):
# the wheels its image does not hold (hydra-core, omegaconf and its antlr4 runtime, torchao, datasets with
# dill and multiprocess), for its Python 3.12 at the versions installed here, and the embedded default's
# tokenizer (the converted SmolLM2 folder without its weights, 3.5 MB), which the random models use.
# About 12 MB in all; the device call carries `.gpu`, and gpu_check.sh installs from it.
#
#   bash benchmarks/gpu_prepare.sh          # once, in the repository root, with the project's venv active
set -euo pipefail
cd "$(dirname "$0")/.."
dest=.gpu
rm -rf "$dest" && mkdir -p "$dest/whl" "$dest/cache/models"
version() { python -c "import importlib.metadata as m; print(m.version('$1'))"; }
for name in hydra-core omegaconf antlr4-python3-runtime torchao datasets dill multiprocess; do
  spec="$name==$(version "$name")"
  python -m pip download -q --no-deps --python-version 3.12 --implementation cp --only-binary=:all: \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform any -d "$dest/whl" "$spec" 2>/dev/null \
  || python -m pip wheel -q --no-deps -w "$dest/whl" "$spec"  # antlr4's runtime ships an sdist only: build it here
done
# The tokenizer the random presets name (model.tokenizer=smollm2): the converted folder, weights left out.
src=$(python -c "from distzo.models.assets import smollm2_folder; print(smollm2_folder())")
mkdir -p "$dest/cache/models/$(basename "$src")"
find "$src" -maxdepth 1 -type f ! -name '*.safetensors' -exec cp {} "$dest/cache/models/$(basename "$src")/" \;
du -sh "$dest"; ls "$dest/whl"
