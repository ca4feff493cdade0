#!/usr/bin/env bash
# Train on this machine with NPROC processes (torchrun --standalone: a private rendezvous, no ports to pick):
#   launch/local.sh 4 mesh=2x2 model=tiny steps=100
# NPROC must equal the mesh's P x D. Extra torchrun options go in TORCHRUN_ARGS (e.g. "--max-restarts 3");
# PYTHON picks the interpreter (default: python).
set -euo pipefail
if [[ $# -lt 1 || ! $1 =~ ^[1-9][0-9]*$ ]]; then
  echo "usage: launch/local.sh NPROC [key=value ...]   e.g. launch/local.sh 4 mesh=2x2" >&2
  exit 2
fi
nproc=$1
shift
# shellcheck disable=SC2086  # TORCHRUN_ARGS is a list of options
exec "${PYTHON:-python}" -m torch.distributed.run --standalone --nproc-per-node="$nproc" ${TORCHRUN_ARGS:-} \
  -m distzo train "$@"
