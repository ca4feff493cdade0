"""Where a run's model, tokenizer and data come from when the hub holds them: resolved once, fetched
once per node, read at the same commit by every rank.

On a mesh rank 0 resolves each hub id (`model.path`, `model.tokenizer`, `task.path`) to a commit,
with the settings' revisions, or the commits an earlier run recorded (resume, `eval.run`); every rank
receives those pins, so every rank reads the same files however a branch moves meanwhile. Each
node's local rank 0 then fetches the files into the node's hub cache while its peers wait, so no two
processes download the same file onto one node, and every rank finally reads the cached snapshot
without a request. A process on its own does the same with a mesh of one. The pins go into run.json
and the run's summary (`HubPins.record`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Mapping

from .. import hub
from ..config.schema import Config
from ..data.records import dataset_fetch
from ..errors import DistzoError
from ..models.loading import model_fetches
from ..parallel.mesh import Mesh

log = logging.getLogger("distzo")


@dataclass(frozen=True)
class HubPins:
    """The hub commits a run reads, by role (model, tokenizer, dataset); empty when all is local."""

    pins: dict[str, hub.Pin] = field(default_factory=dict)

    def record(self) -> dict[str, dict[str, str]]:
        """For run.json: role -> the pin (repository, revision asked for, commit)."""
        return {role: pin.record() for role, pin in self.pins.items()}

    @classmethod
    def from_record(cls, record: Mapping[str, Any] | None) -> HubPins:
        return cls({role: hub.Pin.from_record(r) for role, r in (record or {}).items()})

    def revisions(self) -> dict[str, str]:
        """For the summary: `<role>_revision` -> the commit."""
        return {f"{role}_revision": pin.commit for role, pin in self.pins.items()}

    def get(self, role: str) -> hub.Pin | None:
        return self.pins.get(role)


def uses_hub(cfg: Config, model: bool = True, data: bool = True) -> bool:
    """Whether a configuration names anything on the hub (decided alike on every rank, no request):
    its model and tokenizer (`model`), its data (`data`)."""
    m, t = cfg.model, cfg.task
    return ((model and ((str(m.source) == "local" and hub.is_hub_id(m.path))
                        or (m.tokenizer not in (None, "smollm2") and hub.is_hub_id(m.tokenizer))))
            or (data and t.dataset not in ("trivia",) and hub.is_hub_id(t.path)))


def fetch_hub_pins(cfg: Config, mesh: Mesh, recorded: HubPins | None = None, *, model: bool = True,
                  data: bool = True) -> HubPins:
    """Resolve, fetch (once per node) and pin what `cfg` names on the hub; collective. recorded: the
    pins of an earlier run of this configuration (resume, eval.run), read instead of a branch's
    current commit. model / data: whether the run reads the configuration's model and tokenizer, its
    data (not where you hand over your own). Raises HubError (the same line on every rank)."""
    if not uses_hub(cfg, model, data):
        return HubPins()
    recorded = recorded or HubPins()

    def fetches() -> list:
        plan = [*(model_fetches(cfg.model, recorded.pins) if model else []),
                dataset_fetch(cfg.task, recorded.get("dataset")) if data else None]
        return [f for f in plan if f is not None]

    plan = mesh.decided_on_main(fetches)
    error = None
    if mesh.node.local_rank == 0:
        try:
            for f in plan:
                where = "offline, from the hub cache" if hub.offline(f.pin.kind) else f"from {hub.endpoint()}"
                log.info("Fetching the %s %s at commit %s %s into %s", f.role, f.pin.repo_id, f.pin.commit[:10],
                         where, hub.hub_cache())
                f.download()
        except DistzoError as exc:
            error = exc
    # The node's other ranks wait here while it downloads, however long that takes.
    errors = [e for e in mesh.all_gather_object(error, patient=True) if e is not None]
    if errors:
        raise errors[0]
    return HubPins({f.role: f.pin for f in plan})
