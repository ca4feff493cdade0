"""How this process was started, read from its environment, without importing torch.

- **torchrun** (or torch's elastic agent, which `python -m distzo` uses to start its own local
  workers): RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR and MASTER_PORT are set.
- **srun** (one task per rank, also how submitit starts a job's tasks): SLURM describes the step,
  and `adopt_slurm_environment` translates it into torch's variables: the rank from SLURM_PROCID,
  the world from SLURM_STEP_NUM_TASKS, the local rank from SLURM_LOCALID, the ranks of this node
  from SLURM_STEP_TASKS_PER_NODE, the master address from the first host of the step's node list,
  and a port derived from the job and step ids (MASTER_PORT, when set, wins).
- **none**: a plain process.

A SLURM batch script that runs `python -m distzo ...` itself (no srun) is not a step of several
tasks, so it is a plain process too: SLURM_STEP_NUM_TASKS is what srun sets, not SLURM_NTASKS.
"""

from __future__ import annotations

import os
import re

from ..errors import DistzoError

TORCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
PORT_BASE, PORT_SPAN = 20000, 20000  # srun: the rendezvous port is PORT_BASE + (job, step) mod PORT_SPAN


class LaunchError(DistzoError):
    """An environment that does not describe a job distzo can join; the message names the fix."""


def launcher() -> str:
    """"torchrun", "srun" or "none" (see the module docstring)."""
    if "WORLD_SIZE" in os.environ or "TORCHELASTIC_RUN_ID" in os.environ:
        return "srun" if os.environ.get("DISTZO_LAUNCHED_BY") == "srun" else "torchrun"
    if int(os.environ.get("SLURM_STEP_NUM_TASKS", "1")) > 1 and "SLURM_PROCID" in os.environ:
        return "srun"
    return "none"


def first_host(nodelist: str) -> str:
    """The first host of a SLURM node list ("node[03-05,7],gpu1" -> "node03")."""
    head = re.match(r"([^,\[]*)(\[([^\]]*)\])?", nodelist.strip())
    if head is None or not head.group(1) and not head.group(2):
        raise LaunchError(f"cannot read a host from the SLURM node list {nodelist!r}; set MASTER_ADDR to the first "
                          "node's address")
    prefix, ranges = head.group(1), head.group(3)
    if ranges is None:
        return prefix
    return prefix + ranges.split(",")[0].split("-")[0]


def tasks_on_node(spec: str, node_index: int) -> int:
    """This node's tasks from SLURM_STEP_TASKS_PER_NODE ("4", "2(x3)", "3,1", "2(x2),1")."""
    counts: list[int] = []
    for part in spec.split(","):
        m = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        if m is None:
            raise LaunchError(f"cannot read SLURM_STEP_TASKS_PER_NODE={spec!r}; launch with srun --ntasks-per-node")
        counts += [int(m.group(1))] * int(m.group(2) or 1)
    if not 0 <= node_index < len(counts):
        raise LaunchError(f"SLURM_NODEID={node_index} is not a node of SLURM_STEP_TASKS_PER_NODE={spec!r}")
    return counts[node_index]


def adopt_slurm_environment() -> bool:
    """Under srun with several tasks and no torch variables yet: set them from SLURM's (the module
    docstring). Returns whether it did; idempotent."""
    if launcher() != "srun" or "WORLD_SIZE" in os.environ:
        return False
    env = os.environ
    missing = [k for k in ("SLURM_PROCID", "SLURM_LOCALID", "SLURM_NODEID", "SLURM_STEP_TASKS_PER_NODE")
               if k not in env]
    if missing:
        raise LaunchError(f"srun started this task without {', '.join(missing)}; launch with srun (one task per rank) "
                          "inside an allocation, or with torchrun")
    if "MASTER_ADDR" not in env:
        if not env.get("SLURM_STEP_NODELIST"):
            raise LaunchError("srun started this task without SLURM_STEP_NODELIST, so the master's address is "
                              "unknown; set MASTER_ADDR to the first node's address (and MASTER_PORT)")
        env["MASTER_ADDR"] = first_host(env["SLURM_STEP_NODELIST"])
    if "MASTER_PORT" not in env:
        job, step = int(env.get("SLURM_JOB_ID", "0")), int(env.get("SLURM_STEP_ID", "0") or 0)
        env["MASTER_PORT"] = str(PORT_BASE + (job * 131 + step) % PORT_SPAN)
    env["LOCAL_WORLD_SIZE"] = str(tasks_on_node(env["SLURM_STEP_TASKS_PER_NODE"], int(env["SLURM_NODEID"])))
    env["LOCAL_RANK"] = env["SLURM_LOCALID"]
    env["RANK"] = env["SLURM_PROCID"]
    env["WORLD_SIZE"] = env["SLURM_STEP_NUM_TASKS"]
    env["DISTZO_LAUNCHED_BY"] = "srun"
    return True


def launched_rank() -> int:
    """This process's rank in its job (0 when run plainly)."""
    adopt_slurm_environment()
    return int(os.environ.get("RANK", "0"))


def launched_local_rank() -> int:
    """This process's index on its node (torchrun's or srun's LOCAL_RANK; 0 when run plainly)."""
    adopt_slurm_environment()
    return int(os.environ.get("LOCAL_RANK", "0"))


def launched_local_world_size() -> int:
    """Processes of this job on this node (torchrun's or srun's LOCAL_WORLD_SIZE; 1 when run plainly)."""
    adopt_slurm_environment()
    return int(os.environ.get("LOCAL_WORLD_SIZE", "1"))


def launched_world_size() -> int:
    """Processes in this job as torchrun or srun report them; 1 when run plainly."""
    adopt_slurm_environment()
    return int(os.environ.get("WORLD_SIZE", "1"))


def wait_for_failing_peers(timeout_s: float = 20.0) -> None:
    """Under torchrun, the first rank to exit makes torchrun kill the others, possibly before they
    print their own error. Input errors are deterministic, so every rank fails the same way: each
    failing rank counts itself on torchrun's store and waits (bounded) until all ranks have reported,
    so the job ends with every rank's line. Nothing happens outside torchrun's agent (srun, plain)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1 or "TORCHELASTIC_RUN_ID" not in os.environ:  # no agent's store to count on
        return
    import datetime
    import time

    try:
        from torch.distributed import TCPStore

        store = TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, is_master=False,
                         timeout=datetime.timedelta(seconds=timeout_s))
        key = (f"distzo/failed/{os.environ.get('TORCHELASTIC_RUN_ID', '')}/"
               f"{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}")
        deadline = time.time() + timeout_s
        if store.add(key, 1) < world:
            while store.add(key, 0) < world and time.time() < deadline:
                time.sleep(0.05)
    except Exception:  # the store is a courtesy; failing to reach it must not hide the error
        pass
