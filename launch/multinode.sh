#!/usr/bin/env bash
# Multi-node training without SLURM: run this once on every node, with the same overrides.
#   node0$ NNODES=2 NODE_RANK=0 MASTER_ADDR=node0 NPROC_PER_NODE=4 launch/multinode.sh mesh=2x4 hydra.run.dir=/shared/runs/a
#   node1$ NNODES=2 NODE_RANK=1 MASTER_ADDR=node0 NPROC_PER_NODE=4 launch/multinode.sh mesh=2x4 hydra.run.dir=/shared/runs/a
# Environment:
#   NNODES          number of nodes (required)
#   NODE_RANK       this node's index, 0..NNODES-1 (required): node 0 hosts the c10d rendezvous store
#   MASTER_ADDR     the rendezvous host, reachable from every node: node 0's address (required)
#   MASTER_PORT     the rendezvous port (default 29400)
#   NPROC_PER_NODE  ranks per node (default 1); the mesh's P x D must equal NNODES x NPROC_PER_NODE
#   RDZV_ID         an id the nodes share and other jobs do not (default distzo-$MASTER_PORT)
#   RDZV_CONF       more rendezvous settings, e.g. read_timeout=300,join_timeout=1200
#   TORCHRUN_ARGS   extra torchrun options (e.g. "--max-restarts 3"); PYTHON the interpreter
# The c10d rendezvous numbers the ranks itself, so global rank 0 (which writes the run directory)
# may land on any node: give hydra.run.dir on a shared filesystem.
set -euo pipefail
missing=()
for v in NNODES NODE_RANK MASTER_ADDR; do [[ -n ${!v:-} ]] || missing+=("$v"); done
if [[ ${#missing[@]} -gt 0 ]]; then
  echo "launch/multinode.sh: set ${missing[*]} (e.g. NNODES=2 NODE_RANK=0 MASTER_ADDR=node0 launch/multinode.sh mesh=1x2)" >&2
  exit 2
fi
port=${MASTER_PORT:-29400}
# is_host: node 0 serves the rendezvous store, the others connect to it; explicit, so that it works
# when MASTER_ADDR is an alias torchrun cannot match to a local address, or several agents share a host.
is_host=$([[ $NODE_RANK == 0 ]] && echo 1 || echo 0)
# shellcheck disable=SC2086  # TORCHRUN_ARGS is a list of options
exec "${PYTHON:-python}" -m torch.distributed.run \
  --nnodes="$NNODES" --nproc-per-node="${NPROC_PER_NODE:-1}" \
  --rdzv-backend=c10d --rdzv-endpoint="${MASTER_ADDR}:${port}" --rdzv-id="${RDZV_ID:-distzo-$port}" \
  --rdzv-conf="is_host=${is_host}${RDZV_CONF:+,$RDZV_CONF}" ${TORCHRUN_ARGS:-} -m distzo train "$@"
