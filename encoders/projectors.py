"""Projectors: tower features -> rows in the LLM's embedding space.

The four shapes of adapter the literature converged on: a linear map (LLaVA-1), a GELU MLP
(LLaVA-1.5), frame stacking + SwiGLU (Ultravox, cuts audio rows by k), and a perceiver resampler
(Flamingo / Qwen-VL: a fixed number of rows whatever the input length).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from encoders.parts import Projector, check_keys, lengths_mask
from encoders.registry import register_projector


def stack_frames(
    x: torch.Tensor, lengths: torch.Tensor | None, k: int
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Concatenate each run of ``k`` consecutive rows: ``(B, T, d) -> (B, ceil(T/k), k*d)``.

    The tail is zero padded; an item of ``l`` real rows keeps ``ceil(l/k)`` rows (its last row
    carries the leftover frames and zeros), so no real frame is dropped.
    """
    if k < 1:
        raise ValueError(f"stack factor must be >= 1, got {k}")
    if k == 1:
        return x, lengths
    b, t, d = x.shape
    if lengths is not None:
        x = x * lengths_mask(lengths, b, t, x.device).unsqueeze(-1).to(x.dtype)
    pad = (-t) % k
    if pad:
        x = F.pad(x, (0, 0, 0, pad))
    x = x.reshape(b, (t + pad) // k, k * d)
    new_lengths = None if lengths is None else (lengths + k - 1) // k
    return x, new_lengths


@register_projector("identity")
class IdentityProjector(Projector):
    """No parameters; only valid when the tower already emits the LLM's hidden size."""

    def __init__(self, in_dim: int, out_dim: int):
        super().__init__()
        if in_dim != out_dim:
            raise ValueError(f"identity projector needs in_dim == out_dim, got {in_dim} != {out_dim}")
        self.in_dim, self.out_dim = in_dim, out_dim

    @classmethod
    def from_config(cls, cfg: dict, in_dim: int, out_dim: int) -> IdentityProjector:
        check_keys(cfg, set(), "projector 'identity'")
        return cls(in_dim, out_dim)

    def forward(self, x, lengths=None):
        return x, lengths


@register_projector("linear")
class LinearProjector(Projector):
    """One linear map (LLaVA-1 style)."""

    def __init__(self, in_dim: int, out_dim: int, bias: bool = True):
        super().__init__()
        self.in_dim, self.out_dim = in_dim, out_dim
        self.proj = nn.Linear(in_dim, out_dim, bias=bias)

    @classmethod
    def from_config(cls, cfg: dict, in_dim: int, out_dim: int) -> LinearProjector:
        check_keys(cfg, {"bias"}, "projector 'linear'")
        return cls(in_dim, out_dim, bias=bool(cfg.get("bias", True)))

    def forward(self, x, lengths=None):
        return self.proj(x), lengths


@register_projector("mlp")
class MLPProjector(Projector):
    """``num_layers`` linear layers with GELU between them (LLaVA-1.5 uses 2)."""

    def __init__(
        self,
        in_dim: int,
        out_dim: int,
        num_layers: int = 2,
        hidden_dim: int | None = None,
        layer_norm: bool = False,
    ):
        super().__init__()
        if num_layers < 1:
            raise ValueError(f"mlp projector needs num_layers >= 1, got {num_layers}")
        self.in_dim, self.out_dim = in_dim, out_dim
        hidden_dim = hidden_dim or out_dim
        dims = [in_dim] + [hidden_dim] * (num_layers - 1) + [out_dim]
        layers: list[nn.Module] = [nn.LayerNorm(in_dim)] if layer_norm else []
        for i in range(num_layers):
            layers.append(nn.Linear(dims[i], dims[i + 1]))
            if i < num_layers - 1:
                layers.append(nn.GELU())
        self.net = nn.Sequential(*layers)

    @classmethod
    def from_config(cls, cfg: dict, in_dim: int, out_dim: int) -> MLPProjector:
        check_keys(cfg, {"num_layers", "hidden_dim", "layer_norm"}, "projector 'mlp'")
        return cls(
            in_dim,
            out_dim,
            num_layers=int(cfg.get("num_layers", 2)),
            hidden_dim=cfg.get("hidden_dim"),
            layer_norm=bool(cfg.get("layer_norm", False)),
        )

    def forward(self, x, lengths=None):
        return self.net(x), lengths


class SwiGLU(nn.Module):
    """``down(silu(gate(x)) * up(x))``: the gated MLP of Llama-family blocks."""

    def __init__(self, in_dim: int, hidden_dim: int, out_dim: int):
        super().__init__()
        self.gate = nn.Linear(in_dim, hidden_dim)
        self.up = nn.Linear(in_dim, hidden_dim)
        self.down = nn.Linear(hidden_dim, out_dim)

    def forward(self, x):
        return self.down(F.silu(self.gate(x)) * self.up(x))


@register_projector("stack_swiglu")
class StackSwiGLUProjector(Projector):
    """Stack ``stack`` consecutive frames, normalise, then a SwiGLU MLP (Ultravox's audio adapter).

    Rows per item: ``ceil(rows / stack)``.
    """

    def __init__(self, in_dim: int, out_dim: int, stack: int = 4, hidden_dim: int | None = None):
        super().__init__()
        if stack < 1:
            raise ValueError(f"stack_swiglu projector needs stack >= 1, got {stack}")
        self.in_dim, self.out_dim, self.stack = in_dim, out_dim, stack
        self.norm = nn.LayerNorm(in_dim * stack)
        self.mlp = SwiGLU(in_dim * stack, hidden_dim or out_dim, out_dim)

    @classmethod
    def from_config(cls, cfg: dict, in_dim: int, out_dim: int) -> StackSwiGLUProjector:
        check_keys(cfg, {"stack", "hidden_dim"}, "projector 'stack_swiglu'")
        return cls(in_dim, out_dim, stack=int(cfg.get("stack", 4)), hidden_dim=cfg.get("hidden_dim"))

    def output_rows(self, rows: int) -> int:
        return math.ceil(rows / self.stack)

    def forward(self, x, lengths=None):
        x, lengths = stack_frames(x, lengths, self.stack)
        return self.mlp(self.norm(x)), lengths


class CrossAttentionBlock(nn.Module):
    """Queries attend to (features + queries), then an MLP; pre-norm residual (Flamingo's resampler)."""

    def __init__(self, dim: int, num_heads: int, mlp_ratio: float = 4.0):
        super().__init__()
        self.norm_q = nn.LayerNorm(dim)
        self.norm_kv = nn.LayerNorm(dim)
        self.attn = nn.MultiheadAttention(dim, num_heads, batch_first=True)
        self.norm_mlp = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(
            nn.Linear(dim, int(dim * mlp_ratio)), nn.GELU(), nn.Linear(int(dim * mlp_ratio), dim)
        )

    def forward(self, q: torch.Tensor, kv: torch.Tensor, kv_pad: torch.Tensor) -> torch.Tensor:
        qn = self.norm_q(q)
        kvn = torch.cat([self.norm_kv(kv), qn], dim=1)
        pad = torch.cat([kv_pad, torch.zeros(q.shape[:2], dtype=torch.bool, device=q.device)], dim=1)
        q = q + self.attn(qn, kvn, kvn, key_padding_mask=pad, need_weights=False)[0]
        return q + self.mlp(self.norm_mlp(q))


@register_projector("perceiver")
class PerceiverResampler(Projector):
    """``num_queries`` learned queries cross-attend to the features: always ``num_queries`` rows.

    Useful when a tower's row count is large or variable and the LLM context is precious.
    """

    def __init__(
        self,
        in_dim: int,
        out_dim: int,
        num_queries: int = 16,
        num_layers: int = 2,
        num_heads: int = 4,
        dim: int | None = None,
    ):
        super().__init__()
        dim = dim or out_dim
        if dim % num_heads:
            raise ValueError(f"perceiver dim {dim} is not divisible by num_heads {num_heads}")
        self.in_dim, self.out_dim, self.num_queries = in_dim, out_dim, num_queries
        self.inp = nn.Linear(in_dim, dim)
        self.queries = nn.Parameter(torch.randn(num_queries, dim) * 0.02)
        self.blocks = nn.ModuleList([CrossAttentionBlock(dim, num_heads) for _ in range(num_layers)])
        self.norm = nn.LayerNorm(dim)
        self.out = nn.Linear(dim, out_dim)

    @classmethod
    def from_config(cls, cfg: dict, in_dim: int, out_dim: int) -> PerceiverResampler:
        check_keys(cfg, {"num_queries", "num_layers", "num_heads", "dim"}, "projector 'perceiver'")
        return cls(
            in_dim,
            out_dim,
            num_queries=int(cfg.get("num_queries", 16)),
            num_layers=int(cfg.get("num_layers", 2)),
            num_heads=int(cfg.get("num_heads", 4)),
            dim=cfg.get("dim"),
        )

    def output_rows(self, rows: int) -> int:
        return self.num_queries

    def forward(self, x, lengths=None):
        b, t, _ = x.shape
        kv = self.inp(x)
        pad = ~lengths_mask(lengths, b, t, x.device)
        q = self.queries.unsqueeze(0).expand(b, -1, -1)
        for block in self.blocks:
            q = block(q, kv, pad)
        return self.out(self.norm(q)), None
