"""Message-passing layers in plain torch over a COO ``edge_index`` (2, E): GCN, GIN, GAT.

Convention: row 0 of ``edge_index`` is the source, row 1 the target; a layer updates each node from
its incoming edges. Undirected graphs arrive with both directions listed (the tower adds them).
Optional edge features ``edge_attr`` (E, edge_dim) enter every message through a linear map.
Nothing here needs torch_geometric; scatter operations are ``index_add_`` / ``scatter_reduce``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def add_self_loops(
    edge_index: torch.Tensor, edge_attr: torch.Tensor | None, num_nodes: int
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Append one (i, i) edge per node; self-loop edge features are zeros."""
    loops = torch.arange(num_nodes, device=edge_index.device).repeat(2, 1)
    edge_index = torch.cat([edge_index, loops], dim=1)
    if edge_attr is not None:
        edge_attr = torch.cat([edge_attr, edge_attr.new_zeros(num_nodes, edge_attr.shape[1])], dim=0)
    return edge_index, edge_attr


def scatter_softmax(logits: torch.Tensor, index: torch.Tensor, num_nodes: int) -> torch.Tensor:
    """Softmax of ``logits`` (E, H) over the edges that share a target ``index`` (E,)."""
    expand = index.unsqueeze(-1).expand_as(logits)
    peak = logits.new_full((num_nodes, logits.shape[1]), float("-inf"))
    peak = peak.scatter_reduce(0, expand, logits, reduce="amax", include_self=True)
    weights = (logits - peak.gather(0, expand)).exp()
    total = logits.new_zeros(num_nodes, logits.shape[1]).index_add_(0, index, weights)
    return weights / total.gather(0, expand).clamp_min(1e-16)


class GCNLayer(nn.Module):
    """Kipf & Welling: ``x_i' = sum_{j in N(i) + i} (W x_j + W_e e_ji) / sqrt(d_i d_j) + b``."""

    def __init__(self, dim: int, edge_dim: int = 0):
        super().__init__()
        self.lin = nn.Linear(dim, dim, bias=False)
        self.edge = nn.Linear(edge_dim, dim, bias=False) if edge_dim else None
        self.bias = nn.Parameter(torch.zeros(dim))

    def forward(self, x, edge_index, edge_attr=None):
        n = x.shape[0]
        edge_index, edge_attr = add_self_loops(edge_index, edge_attr, n)
        src, dst = edge_index
        deg = x.new_zeros(n).index_add_(0, dst, x.new_ones(dst.shape[0]))
        norm = (deg[src] * deg[dst]).rsqrt().unsqueeze(-1)
        msg = self.lin(x)[src]
        if self.edge is not None:
            msg = msg + self.edge(edge_attr)
        return torch.zeros_like(x).index_add_(0, dst, msg * norm) + self.bias


class GINLayer(nn.Module):
    """Xu et al. (GINE with edge features): ``x_i' = MLP((1 + eps) x_i + sum_j relu(x_j + W_e e_ji))``.

    Sum aggregation makes GIN as discriminative as the 1-WL test: it sees degrees and counts.
    """

    def __init__(self, dim: int, edge_dim: int = 0):
        super().__init__()
        self.eps = nn.Parameter(torch.zeros(1))
        self.edge = nn.Linear(edge_dim, dim) if edge_dim else None
        self.mlp = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))

    def forward(self, x, edge_index, edge_attr=None):
        src, dst = edge_index
        msg = x[src]
        if self.edge is not None:
            msg = F.relu(msg + self.edge(edge_attr))
        agg = torch.zeros_like(x).index_add_(0, dst, msg)
        return self.mlp((1 + self.eps) * x + agg)


class GATLayer(nn.Module):
    """Velickovic et al.: multi-head attention over incoming edges (self loops included), heads concat."""

    def __init__(self, dim: int, edge_dim: int = 0, heads: int = 4, negative_slope: float = 0.2):
        super().__init__()
        if dim % heads:
            raise ValueError(f"GAT layer: dim {dim} is not divisible by heads {heads}")
        self.heads, self.head_dim, self.negative_slope = heads, dim // heads, negative_slope
        self.lin = nn.Linear(dim, dim, bias=False)
        self.att_src = nn.Parameter(torch.randn(heads, self.head_dim) * self.head_dim**-0.5)
        self.att_dst = nn.Parameter(torch.randn(heads, self.head_dim) * self.head_dim**-0.5)
        self.edge = nn.Linear(edge_dim, dim, bias=False) if edge_dim else None
        self.att_edge = (
            nn.Parameter(torch.randn(heads, self.head_dim) * self.head_dim**-0.5) if edge_dim else None
        )
        self.bias = nn.Parameter(torch.zeros(dim))

    def forward(self, x, edge_index, edge_attr=None):
        n = x.shape[0]
        edge_index, edge_attr = add_self_loops(edge_index, edge_attr, n)
        src, dst = edge_index
        h = self.lin(x).view(n, self.heads, self.head_dim)
        logits = (h * self.att_src).sum(-1)[src] + (h * self.att_dst).sum(-1)[dst]
        if self.edge is not None:
            e = self.edge(edge_attr).view(-1, self.heads, self.head_dim)
            logits = logits + (e * self.att_edge).sum(-1)
        alpha = scatter_softmax(F.leaky_relu(logits, self.negative_slope), dst, n)
        out = h.new_zeros(n, self.heads, self.head_dim).index_add_(0, dst, h[src] * alpha.unsqueeze(-1))
        return out.reshape(n, -1) + self.bias


LAYERS = {"gcn": GCNLayer, "gin": GINLayer, "gat": GATLayer}
