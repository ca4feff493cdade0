"""Work division over real gloo processes, with the ranks deliberately out of step.

Ranks that share a master build their shares of block i+1 before their forward through block i
(engine/divided.py), so a fast rank runs ahead of a slow one into the rotation of node-shared
stage buffers. One rank sleeps inside every block forward here, the worst case for that rotation:
every evaluation and the final weights must still be bitwise those of a single process.
"""

from __future__ import annotations

import time

import pytest
import torch

from tests.distributed.launch import hosted_store, set_rank_env, start_ranks
from tests.unit.test_engine import EPS, sample_batch

PLAN_SIGNS = (+1, -1)  # a 2x1 mesh: rank r runs evaluation r of MeZO's (+, -) plan
COEFFICIENTS = [[(0, 0.7)], [(0, -1.1)], [(0, 0.4)]]  # fixed: the test needs no loss exchange
LAYERS = 6


def _engine(mesh=None, distribution="gaussian"):
    """A divided engine on a 2x1 mesh's node, or (mesh None) a single process's resident one."""
    from distzo import native
    from distzo.engine import divided_engine, resident_engine
    from distzo.models.loading import random_model
    from distzo.models.selection import adapter_for
    from distzo.zo.directions import Directions
    from distzo.zo.params import TrainableParams

    model = random_model("llama", 400, {"num_hidden_layers": LAYERS}, 0, torch.float32)
    params = TrainableParams.from_model(model)
    directions = Directions(3, distribution, kernels=native.load("auto"))
    if mesh is None:
        return model, resident_engine(model, adapter_for(model), params, directions, eps=EPS)
    return model, divided_engine(model, adapter_for(model), params, directions, eps=EPS, mesh=mesh, node=mesh.node)


def _run(engine, plan):
    """Per step, this process's evaluations' logits by plan index."""
    logits = []
    for step, coefficients in enumerate(COEFFICIENTS):
        scores = engine.run_probes(sample_batch(seed=step), plan, step)
        logits.append({i: s.logits for i, s in scores.items()})
        engine.apply(step, coefficients, 1e-2, 0.05)
    with engine.materialized():
        pass
    return logits


def _worker(rank, world, port, slow_rank, distribution, out_dir):
    set_rank_env(rank, world, port)
    from distzo.parallel.mesh import Mesh
    from distzo.zo.estimators import Probe

    mesh = Mesh.create("2x1", "cpu", timeout_s=120)
    model, engine = _engine(mesh, distribution)
    block = engine.adapter.block

    def slow_block(i, *args, **kwargs):  # the slow rank lags a whole forward behind at every block
        if rank == slow_rank:
            time.sleep(0.03)
        return block(i, *args, **kwargs)

    engine.adapter.block = slow_block
    plan = [Probe(0, s) for s in PLAN_SIGNS]
    logits = _run(engine, plan)  # the engine deals the plan: this rank runs evaluation `rank`
    assert all(set(x) == {rank} for x in logits)
    torch.save({"logits": [x[rank] for x in logits],
                "weights": {k: v.clone() for k, v in model.state_dict().items()}}, out_dir / f"rank{rank}.pt")
    mesh.close()


@pytest.mark.parametrize("slow_rank,distribution", [(1, "gaussian"), (0, "rademacher")])
def test_ranks_out_of_step_still_compute_the_single_process_step(tmp_path, slow_rank, distribution):
    from distzo.zo.estimators import Probe

    store = hosted_store(2, 300)
    start_ranks(_worker, 2, (2, store.port, slow_rank, distribution, tmp_path))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the ranks (OMP_NUM_THREADS=1): a matmul's result may depend on threads
    try:
        model, engine = _engine(distribution=distribution)
        expected = _run(engine, [Probe(0, s) for s in PLAN_SIGNS])
    finally:
        torch.set_num_threads(threads)
    for rank in range(2):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        for step, logits in enumerate(got["logits"]):
            assert torch.equal(logits, expected[step][rank]), f"rank {rank}, step {step}"
        state = model.state_dict()
        assert all(torch.equal(got["weights"][k], state[k]) for k in state), f"rank {rank} weights"
