"""Training: the recipe-driven trainer (stages, LoRA, schedule, checkpoints, DDP) and its evaluation."""

from bridge.training.trainer import Trainer, train

__all__ = ["Trainer", "train"]
