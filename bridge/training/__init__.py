"""Training: the recipe-driven trainer (stages, LoRA, schedule, checkpoints, DDP) and its evaluation.

The entry points live in `bridge.training.trainer` (`Trainer`, `train`); this package's own
import stays empty so that reading a checkpoint (`bridge.training.checkpoint`) never loads the
trainer, its evaluation, or the inference API that evaluation uses.
"""
