"""Per-decoder-layer options of a run: activation checkpointing and torch.compile.

Both replace a layer's `forward` on the instance, not the module: parameter names (so
checkpoints), FSDP2's per-layer hooks (which stay around the call, outside the checkpointed and
compiled region) and the model's own code are untouched.

- Activation checkpointing (`train.activation_checkpointing`): a layer keeps only its inputs
  and recomputes its activations during the backward (PyTorch's non-reentrant checkpoint), so a
  full finetune at long sequences fits; it costs one more forward of each layer. It applies
  whether the LLM trains or is frozen (a frozen LLM still back-propagates to the projector).
- torch.compile (`train.compile`): each layer's forward is compiled (Inductor fuses the norms,
  rotary embedding, activation and residual adds that run as separate kernels in eager mode).
  All layers share one code object, so they share the compiled graph; a new shape (another
  packed length) compiles once more, then dynamic shapes take over.
"""

from __future__ import annotations

import functools

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from bridge.training.fsdp import decoder_layers


def apply_layer_options(llm: nn.Module, *, activation_checkpointing: bool, compile: bool) -> int:
    """Wrap every decoder layer's forward; returns how many layers were wrapped. Raises when an
    option is asked for and the LLM has no decoder layers it can find."""
    if not (activation_checkpointing or compile):
        return 0
    layers = decoder_layers(llm)
    if not layers:
        asked = [n for n, on in (("activation_checkpointing", activation_checkpointing),
                                 ("compile", compile)) if on]
        raise ValueError(
            f"train.{' and train.'.join(asked)}: no decoder layers found in {type(llm).__name__} "
            "(expected model.layers, transformer.h or blocks)"
        )
    for layer in layers:
        forward = layer.forward
        if compile:
            forward = torch.compile(forward)
        if activation_checkpointing:
            forward = functools.partial(checkpoint, forward, use_reentrant=False)
        layer.forward = forward
    return len(layers)
