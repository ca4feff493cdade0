"""Models and data by hub id, against a local server that speaks the hub's protocol (tests/hub/server.py),
never the real hub: training on 1x1 and a 2x2 mesh with one download of each file per node, training
again from the cache with the server stopped, SST-2 from the hub read as the file reader reads its TSV
files, bounded failure when the hub cannot be reached, and the recorded commits that eval.run,
resume=auto and replay read after the branch has moved.

Each run is `python -m distzo` in processes of their own, forked as torchrun starts its ranks
(tests/distributed/launch.py), each re-reading huggingface_hub's settings (HF_ENDPOINT,
HF_HUB_OFFLINE, HF_HOME) from its environment as a fresh process does."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.distributed.launch import run_forked
from tests.hub.repos import glue_files, glue_tsv_folder, sst2_records, tiny_model_files
from tests.hub.server import HubServer, silent_endpoint

SMALL = ("steps=3", "eval_every=0", "log_every=1000", "task.train_size=64", "task.val_size=32", "task.test_size=32")


def distzo(*args: str, hub: str | None, hf_home: Path, cwd: Path, offline: bool = False, nproc: int = 1,
           timeout: float = 300, extra_env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """`python -m distzo ARGS` on `nproc` ranks with the hub at `hub` (its URL), or offline from the
    cache in `hf_home`."""
    env = {"HF_HOME": str(hf_home), "HF_ENDPOINT": hub, "HF_HUB_OFFLINE": "1" if offline else None,
           "HF_DATASETS_OFFLINE": None, **(extra_env or {})}
    return run_forked(nproc, list(args), cwd=cwd, timeout=timeout, env=env)


def ok(r: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert r.returncode == 0, f"{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    return r


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """The test hub with acme/tiny (a model) and nyu-mll/glue (SST-2's subset), running for the module."""
    root = tmp_path_factory.mktemp("hub")
    server = HubServer(tokens=["hf_test_token"])
    server.model_sha = server.add("model", "acme/tiny", tiny_model_files(root / "tiny"))
    server.data_sha = server.add("dataset", "nyu-mll/glue", glue_files(sst2_records()))
    server.add("model", "acme/gated", tiny_model_files(root / "gated"), gated=True)
    server.start()
    yield server
    server.stop()


def test_a_hub_model_trains_on_1x1_and_2x2_fetching_each_file_once_per_node(served, tmp_path):
    """`model.path=org/name` and `task=sst2` (its hub dataset) on one process and on a 2x2 mesh of one
    node (four ranks as torchrun starts them): each fetches every file it needs exactly once (the
    server's log), every rank reads the same commit and trains the same weights (replica checksums),
    and the 2x2 weights equal the 1x1 run's within the data-parallel bound of
    tests/distributed/test_mesh.py (1e-6: data shards pack fewer prompts per row, which moves
    per-example losses by float32 rounding)."""
    finals = {}
    for mesh in ("1x1", "2x2"):
        served.clear_log()
        run = tmp_path / mesh
        ok(distzo("train", "model=hf", "model.path=acme/tiny", "task=sst2", f"mesh={mesh}", *SMALL,
                  f"hydra.run.dir={run}", hub=served.url, hf_home=tmp_path / f"hf-{mesh}", cwd=tmp_path,
                  nproc=4 if mesh == "2x2" else 1))
        downloads = served.downloads()
        assert set(downloads) == {"acme/tiny/config.json", "acme/tiny/generation_config.json",
                                  "acme/tiny/model.safetensors", "acme/tiny/tokenizer.json",
                                  "acme/tiny/tokenizer_config.json", "acme/tiny/chat_template.jinja",
                                  "nyu-mll/glue/README.md", *(f"nyu-mll/glue/sst2/{s}-00000-of-00001.parquet"
                                                              for s in ("train", "validation", "test"))}
        assert set(downloads.values()) == {1}, downloads  # once per node, not once per rank
        assert not any("cola/" in path for _, path, _ in served.requests)  # the other subset is never fetched
        summary = json.loads((run / "summary.json").read_text())
        assert summary["model_revision"] == served.model_sha and summary["dataset_revision"] == served.data_sha
        assert len(set(summary["replica_checksums"])) == 1 and len(summary["replica_checksums"]) == int(mesh[0]) ** 2
        identity = json.loads((run / "run.json").read_text())
        assert identity["sources"]["model"] == {"kind": "model", "repo_id": "acme/tiny", "revision": "main",
                                                "commit": served.model_sha}
        assert identity["sources"]["dataset"]["commit"] == served.data_sha
        finals[mesh] = load_file(run / "final" / "model.safetensors")
    difference = max(float((finals["1x1"][k] - finals["2x2"][k]).abs().max()) for k in finals["1x1"])
    assert difference < 1e-6


def test_prepare_fetches_ahead_and_training_then_runs_offline_from_the_cache(tmp_path):
    """A cluster whose compute nodes have no network: `prepare` on the login node fetches the model and
    the data; with the server stopped and HF_HUB_OFFLINE=1 the same training command runs from the
    cache, at the same commits, to the same weights as the online run."""
    server = HubServer().start()
    model_sha = server.add("model", "acme/tiny", tiny_model_files(tmp_path / "tiny"))
    data_sha = server.add("dataset", "nyu-mll/glue", glue_files(sst2_records()))
    hf_home, url = tmp_path / "hf", server.url
    args = ("model=hf", "model.path=acme/tiny", "task=sst2", *SMALL)
    try:
        r = ok(distzo("prepare", *args, hub=server.url, hf_home=hf_home, cwd=tmp_path))
        assert f"model acme/tiny@{model_sha[:10]}" in r.stdout and f"dataset nyu-mll/glue@{data_sha[:10]}" in r.stdout
        ok(distzo("train", *args, "hydra.run.dir=online", hub=server.url, hf_home=hf_home, cwd=tmp_path))
    finally:
        server.stop()
    r = ok(distzo("train", *args, "hydra.run.dir=offline", hub=url, hf_home=hf_home, cwd=tmp_path, offline=True))
    assert "offline, from the hub cache" in r.stdout
    summary = json.loads((tmp_path / "offline" / "summary.json").read_text())
    assert (summary["model_revision"], summary["dataset_revision"]) == (model_sha, data_sha)
    online, offline = (load_file(tmp_path / d / "final" / "model.safetensors") for d in ("online", "offline"))
    assert all(torch.equal(online[k], offline[k]) for k in online)


def test_sst2_from_the_hub_is_what_the_file_reader_reads(served, tmp_path, monkeypatch, tokenizer):
    """task=sst2 with no task.path reads nyu-mll/glue's sst2 subset (Parquet, the test split unlabelled)
    into the examples the file reader makes of the same records in GLUE's TSV files: same prompts,
    label words and labels in every split."""
    import huggingface_hub.constants as constants

    from distzo.data.tasks import PromptTask
    from tests.conftest import make_config

    monkeypatch.setattr(constants, "ENDPOINT", served.url)  # as HF_ENDPOINT would have set it at import
    monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE",
                        served.url + "/{repo_id}/resolve/{revision}/{filename}")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hf" / "hub"))
    monkeypatch.delenv("HF_DATASETS_OFFLINE", raising=False)
    sizes = ("task.train_size=64", "task.val_size=32", "task.test_size=32")
    from_hub = PromptTask(make_config("model=tiny", "task=sst2", *sizes).task, tokenizer)
    folder = glue_tsv_folder(sst2_records(), tmp_path / "SST-2")
    from_files = PromptTask(make_config("model=tiny", "task=sst2", f"task.path={folder}", *sizes).task, tokenizer)
    assert from_hub.label_words == from_files.label_words == [" terrible", " great"]
    for split in ("train", "validation", "test"):
        hub_examples, file_examples = getattr(from_hub.splits, split), getattr(from_files.splits, split)
        assert len(hub_examples) == len(file_examples) > 0
        assert [(e.prompt, e.label) for e in hub_examples] == [(e.prompt, e.label) for e in file_examples]
    assert {e.label for e in from_hub.splits.train} == {0, 1}
    assert from_hub.origin == f"nyu-mll/glue (sst2) at commit {served.data_sha[:10]}"


def test_a_hub_that_does_not_answer_costs_one_line_and_a_bounded_wait(tmp_path):
    """A hub behind a dropped route (connections accepted, never answered): one line naming the id and
    the fixes, exit 2, within 30 s (metadata requests time out after HF_HUB_ETAG_TIMEOUT, 10 s, and
    are not retried); no run directory is left behind."""
    sock, url = silent_endpoint()
    try:
        started = time.time()
        r = distzo("train", "model=hf", "model.path=acme/tiny", "hydra.run.dir=run", hub=url, hf_home=tmp_path / "hf",
                   cwd=tmp_path, timeout=60)
        elapsed = time.time() - started
    finally:
        sock.close()
    assert r.returncode == 2 and elapsed < 30, (elapsed, r.stderr[-2000:])
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert lines == [f"distzo: error: model.path='acme/tiny': cannot reach the hub at {url} (ReadTimeout: timed out); "
                     "without a network use a cached copy (HF_HUB_OFFLINE=1, fetched beforehand with python -m distzo "
                     "prepare), a local folder, or a mirror (HF_ENDPOINT=https://...)"], r.stderr
    assert not (tmp_path / "run").exists()


def test_local_models_and_bundled_data_never_touch_the_network(served, tmp_path):
    """The embedded default's path (a converted folder, bundled data) and a local model folder make no
    request at all, with the hub online and reachable: the server's log stays empty."""
    served.clear_log()
    folder = tmp_path / "local-model"
    tiny_model_files(folder)
    for args in (("model=tiny", "task=synthetic-cue"), ("model=hf", f"model.path={folder}", "task=mr-polarity")):
        ok(distzo("train", *args, "steps=1", "eval_every=0", "task.val_size=16", "task.test_size=16",
                  "hydra.run.dir=run-" + args[0].split("=")[1], hub=served.url, hf_home=tmp_path / "hf", cwd=tmp_path))
    assert served.requests == []


def test_a_run_reads_its_recorded_commits_again_after_the_branch_moves(served, tmp_path):
    """LoRA on the hub model: run.json records both commits; after new commits land on main (other
    weights, other data), eval.run, replay and resume=auto read the recorded ones: the evaluation
    equals the run's own test result, replay rebuilds the saved adapter, the resumed run reports the
    old commits, and no request names the new ones."""
    run = tmp_path / "run"
    args = ("model=hf", "model.path=acme/tiny", "task=sst2", "peft=lora", "optim.lr=1e-2", "checkpoint.every=1",
            "task.train_size=64", "task.val_size=32", "task.test_size=32", "eval_every=0")
    common = dict(hub=served.url, hf_home=tmp_path / "hf", cwd=tmp_path)
    ok(distzo("train", *args, "steps=2", f"hydra.run.dir={run}", **common))
    summary = json.loads((run / "summary.json").read_text())
    old_model, old_data = served.model_sha, served.data_sha
    moved = {served.add("model", "acme/tiny", tiny_model_files(tmp_path / "tiny-v2", init_seed=1)),
             served.add("dataset", "nyu-mll/glue", glue_files(sst2_records(n_train=80)))}
    try:
        served.clear_log()
        ok(distzo("eval", f"eval.run={run}", "hydra.run.dir=eval", **common))
        result = json.loads((tmp_path / "eval" / "eval.json").read_text())
        assert result["accuracy"] == summary["test_accuracy"] and result["loss"] == pytest.approx(
            [m for m in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())
             if m.get("type") == "eval" and m.get("split") == "test"][-1]["loss"], rel=1e-9)
        ok(distzo("replay", str(run), "--out", str(tmp_path / "replayed.safetensors"), **common))
        replayed = load_file(tmp_path / "replayed.safetensors")
        adapter = load_file(run / "final" / "adapter.safetensors")
        assert replayed.keys() == adapter.keys() and all(torch.equal(replayed[k], adapter[k]) for k in adapter)
        ok(distzo("train", *args, "steps=3", "resume=auto", f"hydra.run.dir={run}", **common))
        resumed = json.loads((run / "summary.json").read_text())
        assert resumed["steps"] == 3 and resumed["resumed_from_step"] == 2
        assert (resumed["model_revision"], resumed["dataset_revision"]) == (old_model, old_data)
        assert not any(sha in path for sha in moved for _, path, _ in served.requests)
        assert not any(path.endswith("/revision/main") for _, path, _ in served.requests)
    finally:  # the module's later tests see the original commits again
        served.repo("model", "acme/tiny").branches["main"] = old_model
        served.repo("dataset", "nyu-mll/glue").branches["main"] = old_data


def test_a_gated_model_loads_with_a_token(served, tmp_path):
    """A gated repository: refused in one line without a token (docs/errors.md), fetched with HF_TOKEN."""
    r = ok(distzo("prepare", "model=hf", "model.path=acme/gated", "task=synthetic-cue", hub=served.url,
                  hf_home=tmp_path / "hf", cwd=tmp_path, extra_env={"HF_TOKEN": "hf_test_token"}))
    assert "model acme/gated@" in r.stdout
