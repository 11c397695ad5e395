"""Which wrapper trains a multi-rank run (none, DDP or FSDP2), and the state-dict plumbing that
makes a checkpoint the same files whichever one it was.

Why FSDP2 when the LLM is unfrozen: DDP keeps a full copy of the weights, their gradients and
two AdamW moments on every rank (16 bytes per parameter in fp32), which is what stops a full
finetune of a multi-billion-parameter LLM from fitting; FSDP2 (`fully_shard`) keeps 1/N of each
on every rank and all-gathers a decoder layer's weights only while it runs. Frozen-LLM stages
(align, LoRA) train a few million parameters, where DDP's one all-reduce is simpler and faster.

Sharding: every decoder layer is its own FSDP unit (its weights are gathered just before it
runs and freed after), then the root (the BridgeModel: encoders, embeddings, final norm and LM
head) is one more unit. Parameters become DTensors; `clip_grad_norm_` and AdamW work on them
unchanged. Gradients are averaged over ranks (reduce-scatter), as DDP averages them, so a
2-rank run matches a 1-rank run with the same global batch.

Checkpoints: all ranks take part in gathering full (unsharded) state dicts onto rank 0's CPU
(`get_model_state_dict` / `get_optimizer_state_dict` with full_state_dict, cpu_offload); rank 0
writes them in the one checkpoint format. Resuming hands the full tensors back to every rank,
which keeps its own shard (`set_model_state_dict` / `set_optimizer_state_dict`). The optimizer
state is keyed by parameter name (not position) in every mode, so a checkpoint written by a
DDP run resumes under FSDP and back.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn

from bridge.training.distributed import DistInfo

WRAPPERS = ("auto", "ddp", "fsdp")


def resolve_wrapper(requested: str, llm_unfrozen: bool, dist_info: DistInfo) -> str:
    """'none', 'ddp' or 'fsdp'. auto: fsdp when the LLM's full weights train. One rank: 'none',
    unless fsdp is asked for by name (FSDP2 on one device, the multi-device code path)."""
    if requested not in WRAPPERS:
        raise ValueError(f"train.distributed: {requested!r} is not one of {list(WRAPPERS)}")
    if not dist_info.enabled:
        return "fsdp" if requested == "fsdp" else "none"
    if requested == "auto":
        return "fsdp" if llm_unfrozen else "ddp"
    return requested


def decoder_layers(llm: nn.Module) -> list[nn.Module]:
    """The transformer blocks of a Hugging Face causal LM (`model.layers` in Llama/Qwen-style
    models, `transformer.h` in GPT-style ones); empty when none is found (only the root shards)."""
    decoder = llm.get_decoder() if hasattr(llm, "get_decoder") else llm
    for name in ("layers", "h", "blocks"):
        found = getattr(decoder, name, None)
        if isinstance(found, nn.ModuleList):
            return list(found)
    return []


MIXED_PRECISION = ("none", "bf16")


def mixed_precision_policy(kind: str):
    """FSDP2's MixedPrecisionPolicy for `train.mixed_precision`, or None for "none".

    bf16: each decoder layer's weights are all-gathered and computed in bf16 (half the all-gather
    bytes and bf16 matmuls), while the sharded parameters the optimizer steps stay fp32 and
    gradients are reduce-scattered in fp32 (summing many bf16 gradients loses bits). The layer
    casts its floating inputs to bf16 and hands fp32 back, so the root (encoders, embeddings,
    final norm, LM head: small, and fed fp32 media) keeps full precision.
    """
    if kind not in MIXED_PRECISION:
        raise ValueError(f"train.mixed_precision: {kind!r} is not one of {list(MIXED_PRECISION)}")
    if kind == "none":
        return None
    from torch.distributed.fsdp import MixedPrecisionPolicy

    return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                                output_dtype=torch.float32)


def shard_model(
    model: nn.Module, llm: nn.Module, device: torch.device, world_size: int, mixed_precision: str = "none"
) -> nn.Module:
    """FSDP2 in place: each decoder layer of `llm` (under `mixed_precision`'s policy), then `model`
    (the root). Must run before the optimizer is built: it replaces the parameters with sharded
    DTensors."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    policy = mixed_precision_policy(mixed_precision)
    mesh = init_device_mesh(device.type, (world_size,))
    for layer in decoder_layers(llm):
        fully_shard(layer, mesh=mesh, **({"mp_policy": policy} if policy is not None else {}))
    fully_shard(model, mesh=mesh)
    return model


def wrap_for_training(model: nn.Module, wrapper: str, device: torch.device) -> nn.Module:
    """The module the training step calls: DDP around `model`, or `model` itself (unwrapped, or
    already sharded in place by `shard_model`)."""
    if wrapper == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        ids = [device.index] if device.type == "cuda" else None
        return DistributedDataParallel(model, device_ids=ids)
    return model


def is_sharded(model: nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


@contextlib.contextmanager
def gradient_sync(train_module: nn.Module, sync: bool) -> Iterator[None]:
    """Inside: backward reduces gradients across ranks only when `sync` (the last micro-batch of
    an accumulated step). DDP: `no_sync()`; FSDP2: `set_requires_gradient_sync(False)` keeps the
    unsharded gradients local until the final micro-step's reduce-scatter."""
    if sync:
        yield
        return
    if is_sharded(train_module):
        train_module.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            train_module.set_requires_gradient_sync(True)
    elif hasattr(train_module, "no_sync"):
        with train_module.no_sync():
            yield
    else:
        yield


@dataclass
class FullState:
    """Full (unsharded) CPU tensors of the model and optimizer; filled on rank 0 only."""

    model: dict[str, torch.Tensor]
    optimizer: dict


def _options(**kw):
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=True, cpu_offload=True, **kw)


def gather_full_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> FullState:
    """Collective under FSDP: every rank must call it. Rank 0 gets full CPU tensors (keys are
    `model`'s parameter names, wrappers' prefixes removed); other ranks get empty dicts."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    if not is_sharded(model):  # one rank or DDP: the tensors are already whole
        state = {k: v.detach().to("cpu") for k, v in model.state_dict().items()}
        return FullState(state, get_optimizer_state_dict(model, optimizer, options=_options()))
    return FullState(
        get_model_state_dict(model, options=_options()),
        get_optimizer_state_dict(model, optimizer, options=_options()),
    )


def load_full_model_state(model: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Copy full tensors (a subset of `model`'s names) into it; a sharded model keeps its shard.
    Every rank passes the same full tensors (each read them from the checkpoint)."""
    if is_sharded(model):
        from torch.distributed.checkpoint.state_dict import set_model_state_dict

        set_model_state_dict(model, state, options=_options(strict=False))
        return
    own = model.state_dict()
    with torch.no_grad():
        for name, value in state.items():
            own[name].copy_(value)


def load_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer, state: dict) -> None:
    """Restore an optimizer state written by `gather_full_state` (parameter-name keys), or by an
    older checkpoint (`optimizer.state_dict()`, position keys: same parameter order needed)."""
    groups = state.get("param_groups") or [{}]
    if any(isinstance(k, int) for k in groups[0].get("params", [])):
        optimizer.load_state_dict(state)
        return
    from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

    set_optimizer_state_dict(model, optimizer, state, options=_options())
