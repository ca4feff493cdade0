"""Tasks and data: bundled movie-review polarity sentences, a synthetic task, prompts and batches."""

from .tasks import Batch, ClassificationTask, TrainSampler

__all__ = ["Batch", "ClassificationTask", "TrainSampler"]
