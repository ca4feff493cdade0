"""What a run directory says about the run that wrote it: its saved configuration and trained weights."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from ..config.compose import saved_config
from ..errors import DistzoError

CONFIG_FILE = Path(".hydra") / "config.yaml"  # written by Hydra on the command line, by the library otherwise
RUN_FILE = "run.json"  # the run's identity (distzo.state.resume.run_identity), written when it starts
FINAL_MODEL, FINAL_ADAPTER = "model.safetensors", "adapter.safetensors"  # in <run>/final/


class RunFilesError(DistzoError):
    """A directory that is not the run it was given as."""


def load_run_config(run_dir: str | Path, key: str = "") -> DictConfig:
    """A run's saved configuration over the current schema's defaults (keys added since it was
    written take their defaults; the layouts of earlier versions are read by distzo.config.legacy).
    key: the setting that named the directory, for messages."""
    path = Path(run_dir) / CONFIG_FILE
    if not path.is_file():
        raise RunFilesError(f"{f'{key}=' if key else ''}{run_dir} is not a distzo run directory "
                            f"(no {CONFIG_FILE}); give the directory a training run wrote (its hydra.run.dir)")
    try:
        data = OmegaConf.to_container(OmegaConf.load(path))
    except Exception as exc:  # YAML's scanner and parser errors: the file itself is damaged
        raise RunFilesError(f"{path} is not readable YAML ({' '.join(str(exc).split())[:200]}); copy the run "
                            "directory again from where it was written") from None
    if not isinstance(data, dict):
        raise RunFilesError(f"{path} holds no configuration (a YAML {type(data).__name__}); copy the run directory "
                            "again from where it was written")
    try:
        cfg = saved_config(data)
    except DistzoError:
        raise
    except Exception as exc:  # OmegaConf's merge errors: a key this distzo no longer has, a wrong type
        raise RunFilesError(f"{path} does not fit this distzo's configuration ({' '.join(str(exc).split())[:200]}); "
                            "use the distzo version that trained it") from None
    missing = sorted(OmegaConf.missing_keys(cfg))
    if missing:  # sections the presets choose: Hydra saves every one it composed
        raise RunFilesError(f"{path} lacks {', '.join(missing)}, which every run's saved configuration holds: the file "
                            "was cut short or overwritten (copy the run directory again from where it was written), "
                            "or a distzo from before those settings wrote it (use that version)")
    return cfg


def recorded_sources(run_dir: str | Path) -> dict[str, Any] | None:
    """The hub commits a run read (run.json's `sources`), for reading the same files again; None
    when it read nothing from the hub or predates the record."""
    import json

    try:
        identity = json.loads((Path(run_dir) / RUN_FILE).read_text())
    except (OSError, ValueError):
        return None
    return identity.get("sources") if isinstance(identity, dict) else None


def final_weights(run_dir: str | Path, key: str = "eval.run") -> Path:
    """<run>/final/model.safetensors or <run>/final/adapter.safetensors, whichever the run saved,
    checked whole from its header (a copy cut short costs one line, not safetensors' traceback)."""
    from ..models.loading import safetensors_problem

    final = Path(run_dir) / "final"
    for name in (FINAL_MODEL, FINAL_ADAPTER):
        if (final / name).is_file():
            problem = safetensors_problem(final / name)
            if problem:
                raise RunFilesError(f"{key}={run_dir}: final/{name} is {problem}; copy the run directory again "
                                    "from where it was written, or train the run again")
            return final / name
    raise RunFilesError(f"{key}={run_dir} has no trained weights ({final}/{FINAL_MODEL} or {FINAL_ADAPTER}); the run "
                        "must have finished with save_final=true")
