"""Tasks and data: records from bundled sets or local files, templates, splits, and the batches of
the scoring contract."""

from .tasks import PromptTask, TrainSampler

__all__ = ["PromptTask", "TrainSampler"]
