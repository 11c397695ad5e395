"""Graph towers: node inputs -> GCN / GIN / GAT message passing -> k tokens by attention pooling.

A graph becomes a fixed number of LLM rows (``readout_tokens``): k learned queries attend over the
graph's nodes (a set operation, so the rows do not depend on node order). Graphs are batched
block-diagonally: nodes concatenated, edge indices offset, a ``batch`` vector naming each node's graph.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from encoders.graph_format import to_graph
from encoders.graph_layers import LAYERS
from encoders.parts import Tower, check_keys
from encoders.registry import register_tower


def batch_graphs(graphs: list[dict]) -> dict[str, torch.Tensor]:
    """Block-diagonal batch of preprocessed graphs (see ``GraphTower.preprocess``)."""
    sizes = torch.tensor([g["num_nodes"] for g in graphs], dtype=torch.long)
    offsets = torch.cumsum(sizes, 0) - sizes
    batch = {
        "edge_index": torch.cat([g["edge_index"] + off for g, off in zip(graphs, offsets.tolist())], dim=1),
        "batch": torch.repeat_interleave(torch.arange(len(graphs)), sizes),
        "num_nodes": sizes,
        "num_edges": torch.tensor([g["num_input_edges"] for g in graphs], dtype=torch.long),
    }
    for key in ("x", "edge_attr"):
        if graphs[0][key] is not None:
            batch[key] = torch.cat([g[key] for g in graphs], dim=0)
    return batch


def to_dense(x: torch.Tensor, batch: torch.Tensor, sizes: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(N_total, d) node rows -> (B, N_max, d) padded, and a (B, N_max) padding mask (True = pad)."""
    b, n_max = sizes.shape[0], int(sizes.max())
    offsets = torch.cumsum(sizes, 0) - sizes
    pos = torch.arange(x.shape[0], device=x.device) - offsets[batch]
    dense = x.new_zeros(b, n_max, x.shape[1])
    dense[batch, pos] = x
    pad = torch.arange(n_max, device=x.device)[None, :] >= sizes[:, None]
    return dense, pad


class AttentionReadout(nn.Module):
    """k learned queries cross-attend over a graph's nodes -> (B, k, dim); permutation invariant.

    With ``size_features`` the tokens also receive log(1 + nodes) and log(1 + edges) through a linear
    map: attention pooling is a weighted mean, which alone cannot count. With ``count_embedding`` = C
    they also receive a learned embedding of the node count (clamped at C): exact sizes, for tasks
    that ask "how many nodes" within a known range.
    """

    def __init__(
        self, dim: int, tokens: int, heads: int, size_features: bool = True, count_embedding: int = 0
    ):
        super().__init__()
        self.queries = nn.Parameter(torch.randn(tokens, dim) * 0.02)
        self.attn = nn.MultiheadAttention(dim, heads, batch_first=True)
        self.size = nn.Linear(2, dim) if size_features else None
        self.max_count = int(count_embedding)
        self.count = nn.Embedding(self.max_count + 1, dim) if count_embedding else None
        self.norm = nn.LayerNorm(dim)

    def forward(self, x, batch, sizes, num_edges):
        dense, pad = to_dense(x, batch, sizes)
        q = self.queries.unsqueeze(0).expand(dense.shape[0], -1, -1)
        out = self.attn(q, dense, dense, key_padding_mask=pad, need_weights=False)[0] + q
        if self.size is not None:
            counts = torch.stack([sizes, num_edges], dim=-1).to(out.dtype)
            out = out + self.size(torch.log1p(counts)).unsqueeze(1)
        if self.count is not None:
            out = out + self.count(sizes.clamp_max(self.max_count)).unsqueeze(1)
        return self.norm(out)


class GraphTower(Tower):
    """Message passing + attention-pooling readout. Registered as "gcn", "gin" and "gat".

    Config keys (defaults): dim 64, num_layers 3, node_feature_dim 0 (width of the graphs'
    node_features; 0 = graphs carry none), edge_feature_dim 0, use_degree True (a learned embedding of
    each node's degree, clamped at max_degree 32, added to the node input: featureless graphs need
    it), heads 4 (GAT), readout_tokens 4, readout_heads 4, size_features True, count_embedding 0
    (C > 0: a learned embedding of the node count, clamped at C, added to the tokens), dropout 0.0.
    Rows per graph: readout_tokens.
    """

    modality = "graph"
    layer_type = ""
    KEYS = {
        "dim",
        "num_layers",
        "node_feature_dim",
        "edge_feature_dim",
        "use_degree",
        "max_degree",
        "heads",
        "readout_tokens",
        "readout_heads",
        "size_features",
        "count_embedding",
        "dropout",
    }

    def __init__(
        self,
        dim: int = 64,
        num_layers: int = 3,
        node_feature_dim: int = 0,
        edge_feature_dim: int = 0,
        use_degree: bool = True,
        max_degree: int = 32,
        heads: int = 4,
        readout_tokens: int = 4,
        readout_heads: int = 4,
        size_features: bool = True,
        count_embedding: int = 0,
        dropout: float = 0.0,
    ):
        super().__init__()
        self._cfg = {k: v for k, v in locals().items() if k in self.KEYS}
        if not node_feature_dim and not use_degree:
            raise ValueError(
                f"{self.layer_type} tower: with node_feature_dim 0 and use_degree false the nodes "
                "have no input at all; set one of them"
            )
        if readout_tokens < 1 or num_layers < 0:
            raise ValueError(f"{self.layer_type} tower: readout_tokens must be >= 1 and num_layers >= 0")
        self.node_feature_dim, self.edge_feature_dim = int(node_feature_dim), int(edge_feature_dim)
        self.max_degree, self.readout_tokens = int(max_degree), int(readout_tokens)
        self.node_in = nn.Linear(node_feature_dim, dim) if node_feature_dim else None
        self.degree = nn.Embedding(max_degree + 1, dim) if use_degree else None
        kwargs = {"heads": heads} if self.layer_type == "gat" else {}
        self.layers = nn.ModuleList(
            [LAYERS[self.layer_type](dim, edge_feature_dim, **kwargs) for _ in range(num_layers)]
        )
        self.norms = nn.ModuleList([nn.LayerNorm(dim) for _ in range(num_layers)])
        self.dropout = float(dropout)
        self.readout = AttentionReadout(dim, readout_tokens, readout_heads, size_features, count_embedding)
        self.out_dim = int(dim)

    @classmethod
    def from_config(cls, cfg: dict) -> GraphTower:
        check_keys(cfg, cls.KEYS, f"tower {cls.layer_type!r}")
        return cls(**cfg)

    def export_config(self) -> dict:
        return {"name": self.layer_type, **copy.deepcopy(self._cfg)}

    def output_rows(self, item: Any) -> int:
        return self.readout_tokens

    def preprocess(self, item: Any) -> dict:
        """Check the graph against the tower's feature widths; list undirected edges both ways."""
        g = to_graph(item)
        nf, ef = g.node_features, g.edge_features
        if self.node_feature_dim:
            if nf is None or nf.shape[1] != self.node_feature_dim:
                got = "none" if nf is None else f"width {nf.shape[1]}"
                raise ValueError(
                    f"{self.layer_type} tower expects node_features of width "
                    f"{self.node_feature_dim}, the graph has {got}"
                )
        elif nf is not None:
            raise ValueError(
                f"the graph has node_features of width {nf.shape[1]} but the {self.layer_type} "
                "tower was built with node_feature_dim 0; set node_feature_dim to use them"
            )
        if self.edge_feature_dim:
            if ef is None or (g.num_edges and ef.shape[1] != self.edge_feature_dim):
                got = "none" if ef is None else f"width {ef.shape[1]}"
                raise ValueError(
                    f"{self.layer_type} tower expects edge_features of width "
                    f"{self.edge_feature_dim}, the graph has {got}"
                )
            ef = ef.reshape(g.num_edges, self.edge_feature_dim).float()
        elif ef is not None and g.num_edges:
            raise ValueError(
                f"the graph has edge_features of width {ef.shape[1]} but the {self.layer_type} "
                "tower was built with edge_feature_dim 0; set edge_feature_dim to use them"
            )
        edge_index = g.edge_index
        if not g.directed:
            edge_index = torch.cat([edge_index, edge_index.flip(0)], dim=1)
            if self.edge_feature_dim:
                ef = torch.cat([ef, ef], dim=0)
        return {
            "num_nodes": g.num_nodes,
            "num_input_edges": g.num_edges,
            "edge_index": edge_index,
            "x": nf.float() if self.node_feature_dim else None,
            "edge_attr": ef if self.edge_feature_dim else None,
        }

    def collate(self, processed: list[dict]) -> dict[str, torch.Tensor]:
        return batch_graphs(processed)

    def forward(self, batch: dict) -> tuple[torch.Tensor, None]:
        edge_index, sizes = batch["edge_index"], batch["num_nodes"]
        n = int(sizes.sum())
        h = 0
        if self.node_in is not None:
            h = self.node_in(batch["x"])
        if self.degree is not None:
            deg = torch.zeros(n, dtype=torch.long, device=edge_index.device)
            deg.index_add_(0, edge_index[1], torch.ones_like(edge_index[1]))
            h = h + self.degree(deg.clamp_max(self.max_degree))
        edge_attr = batch.get("edge_attr")
        for layer, norm in zip(self.layers, self.norms):
            update = F.gelu(layer(h, edge_index, edge_attr))
            h = norm(h + F.dropout(update, self.dropout, self.training))
        return self.readout(h, batch["batch"], sizes, batch["num_edges"]), None


@register_tower("gcn")
class GCNTower(GraphTower):
    layer_type = "gcn"


@register_tower("gin")
class GINTower(GraphTower):
    layer_type = "gin"


@register_tower("gat")
class GATTower(GraphTower):
    layer_type = "gat"
