#!/usr/bin/env bash
# Gathers, on this machine, what a GPU machine lacks for benchmarks/gpu_check.sh, into .gpu/ (git-ignored):
# the wheels its image does not hold (hydra-core, omegaconf and its antlr4 runtime, torchao, datasets with
# dill and multiprocess, gguf), for its Python 3.12 at the versions installed here, the embedded default's
# tokenizer (the converted SmolLM2 folder without its weights, 3.5 MB), which the random models use, and
# the loss study's vader CSV (built here: it needs a package index). About 12 MB in all; the device call
# carries `.gpu`, and gpu_check.sh installs from it.
#
# The loss study's stage (STAGES=study) also needs the embedded model itself: its GGUF (98.4 MB) is more
# than one device call may carry (64 MiB with the working tree), so it is split into two halves,
# .gpu-model-a/ and .gpu-model-b/ (git-ignored), carried by two calls back to back on one warm machine
# (gpu_check.sh's header has the two calls); gpu_check.sh joins them and checks the sha256.
#
#   bash benchmarks/gpu_prepare.sh          # once, in the repository root, with the project's venv active
set -euo pipefail
cd "$(dirname "$0")/.."
dest=.gpu
rm -rf "$dest" && mkdir -p "$dest/whl" "$dest/cache/models"
# The commit the working tree is at (the device copies the tree without .git; gpu_check.sh prints this),
# marked when files differ from it.
{ git rev-parse --short HEAD; git diff --quiet HEAD || echo "(with uncommitted changes)"; } | paste -sd" " > "$dest/commit"
version() { python -c "import importlib.metadata as m; print(m.version('$1'))"; }
for name in hydra-core omegaconf antlr4-python3-runtime torchao datasets dill multiprocess gguf; do
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
# The vader task of the loss study (benchmarks/convergence.py reads $DISTZO_VADER_CSV there).
python examples/vader_three_class.py --set amazon --out "$dest/data/amazon3.csv"
# The embedded model's GGUF in two halves, with the whole file's sha256.
gguf=$(python -c "from distzo.models.assets import WHEEL_MODELS as W; m = W['smollm2-wheel']; print(m.gguf(m, None))")
rm -rf .gpu-model-a .gpu-model-b && mkdir -p .gpu-model-a .gpu-model-b
half=$(( ($(stat -c %s "$gguf") + 1) / 2 ))
head -c "$half" "$gguf" > .gpu-model-a/gguf.part
tail -c +"$((half + 1))" "$gguf" > .gpu-model-b/gguf.part
sha256sum < "$gguf" | cut -d' ' -f1 > .gpu-model-b/sha256
du -sh "$dest" .gpu-model-a .gpu-model-b; ls "$dest/whl"
