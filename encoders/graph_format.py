"""The graph item: a ``Graph`` record, its JSON file format, validation and content-hash bytes.

JSON graph format (one graph per file)::

    {
      "num_nodes": 5,                          # int >= 1, required
      "edges": [[0, 1], [1, 2], [3, 4]],       # list of [u, v] node indices in [0, num_nodes), required
                                               # (may be empty); an undirected edge is listed once
      "node_features": [[0.1, 2.0], ...],      # optional: num_nodes rows of equal width (numbers)
      "edge_features": [[1.0], [0.5], [2.0]],  # optional: one row per edge, equal width
      "directed": false                        # optional, default false: edges carry messages both ways
    }

Accepted graph items: a ``Graph``, a dict in this format, or a path to such a JSON file.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

GRAPH_KEYS = {"num_nodes", "edges", "node_features", "edge_features", "directed"}


@dataclass
class Graph:
    """One graph: ``edge_index`` is (2, E) long (row 0 = source, row 1 = target), features optional."""

    num_nodes: int
    edge_index: torch.Tensor
    node_features: torch.Tensor | None = None
    edge_features: torch.Tensor | None = None
    directed: bool = False

    @property
    def num_edges(self) -> int:
        return int(self.edge_index.shape[1])


def _number_rows(rows: Any, count: int, what: str, source: str) -> torch.Tensor:
    if not isinstance(rows, list) or len(rows) != count:
        got = f"a list of {len(rows)}" if isinstance(rows, list) else type(rows).__name__
        raise ValueError(
            f"{source}: {what} must be a list of {count} rows (one per "
            f"{'node' if what == 'node_features' else 'edge'}), got {got}"
        )
    width = None
    for i, row in enumerate(rows):
        if not isinstance(row, list) or not row:
            raise ValueError(f"{source}: {what}[{i}] must be a non-empty list of numbers")
        if width is None:
            width = len(row)
        elif len(row) != width:
            raise ValueError(f"{source}: {what}[{i}] has {len(row)} values, {what}[0] has {width}")
        for j, v in enumerate(row):
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                raise ValueError(f"{source}: {what}[{i}][{j}] = {v!r} is not a finite number")
    if count == 0:
        return torch.zeros(0, 0)
    return torch.tensor(rows, dtype=torch.float32)


def _check_num_nodes(n: Any, source: str) -> int:
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"{source}: num_nodes must be an integer >= 1, got {str(n)[:40]}")
    return n


def graph_size(item: Any, source: str = "graph") -> tuple[int, int]:
    """(nodes, edges) a graph item declares, read before anything is built from it: a dict's
    `num_nodes` and its edge list's length (checked again in full by `graph_from_dict`)."""
    if isinstance(item, Graph):
        return item.num_nodes, item.num_edges
    if isinstance(item, dict):
        edges = item.get("edges")
        return _check_num_nodes(item.get("num_nodes"), source), len(edges) if isinstance(edges, list) else 0
    g = to_graph(item)
    return g.num_nodes, g.num_edges


def graph_from_dict(data: Any, source: str = "graph") -> Graph:
    """Validate a dict in the JSON graph format and build a ``Graph``; errors name the bad field."""
    if not isinstance(data, dict):
        raise ValueError(f"{source}: a graph must be a JSON object, got {type(data).__name__}")
    unknown = sorted(set(data) - GRAPH_KEYS)
    if unknown:
        raise ValueError(f"{source}: unknown key(s) {unknown}; valid keys: {sorted(GRAPH_KEYS)}")
    for key in ("num_nodes", "edges"):
        if key not in data:
            raise ValueError(f"{source}: missing required key {key!r}")
    n = _check_num_nodes(data["num_nodes"], source)
    edges = data["edges"]
    if not isinstance(edges, list):
        raise ValueError(f"{source}: edges must be a list of [u, v] pairs, got {type(edges).__name__}")
    for i, edge in enumerate(edges):
        if not isinstance(edge, list) or len(edge) != 2:
            raise ValueError(f"{source}: edges[{i}] must be a [u, v] pair, got {edge!r}")
        for v in edge:
            if isinstance(v, bool) or not isinstance(v, int):
                raise ValueError(f"{source}: edges[{i}] = {edge!r} must hold integer node indices")
            if not 0 <= v < n:
                raise ValueError(f"{source}: edges[{i}] = {edge!r} refers to node {v}, outside [0, {n})")
    directed = data.get("directed", False)
    if not isinstance(directed, bool):
        raise ValueError(f"{source}: directed must be true or false, got {directed!r}")
    node_features = data.get("node_features")
    if node_features is not None:
        node_features = _number_rows(node_features, n, "node_features", source)
    edge_features = data.get("edge_features")
    if edge_features is not None:
        edge_features = _number_rows(edge_features, len(edges), "edge_features", source)
    edge_index = torch.tensor(edges, dtype=torch.long).reshape(-1, 2).T.contiguous()
    return Graph(n, edge_index, node_features, edge_features, directed)


def graph_to_dict(graph: Graph) -> dict:
    """A ``Graph`` -> a dict in the JSON graph format (inverse of ``graph_from_dict``)."""
    out: dict[str, Any] = {
        "num_nodes": graph.num_nodes,
        "edges": graph.edge_index.T.tolist(),
        "directed": graph.directed,
    }
    if graph.node_features is not None:
        out["node_features"] = graph.node_features.tolist()
    if graph.edge_features is not None:
        out["edge_features"] = graph.edge_features.tolist()
    return out


def load_graph_json(path: str | Path) -> Graph:
    """Read and validate one graph JSON file (format in this module's docstring)."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"graph file {path} does not exist")
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON: {e}") from e
    return graph_from_dict(data, source=str(path))


def save_graph_json(path: str | Path, graph: Graph | dict) -> Path:
    path = Path(path)
    data = graph_to_dict(graph) if isinstance(graph, Graph) else graph_to_dict(graph_from_dict(graph))
    path.write_text(json.dumps(data))
    return path


def to_graph(item: Any) -> Graph:
    """Any accepted graph item -> a checked ``Graph``."""
    if isinstance(item, Graph):
        _check_graph(item)
        return item
    if isinstance(item, dict):
        return graph_from_dict(item)
    if isinstance(item, (str, Path)):
        return load_graph_json(item)
    raise ValueError(
        f"unsupported graph item of type {type(item).__name__}; expected a Graph, a dict in the "
        "JSON graph format, or a path to a graph JSON file"
    )


def _check_graph(g: Graph) -> None:
    if g.num_nodes < 1:
        raise ValueError(f"graph num_nodes must be >= 1, got {g.num_nodes}")
    ei = g.edge_index
    if ei.dim() != 2 or ei.shape[0] != 2 or ei.dtype != torch.long:
        raise ValueError(f"graph edge_index must be a (2, E) long tensor, got {tuple(ei.shape)} {ei.dtype}")
    if ei.numel() and (int(ei.min()) < 0 or int(ei.max()) >= g.num_nodes):
        raise ValueError(f"graph edge_index holds node ids outside [0, {g.num_nodes})")
    if g.node_features is not None and (
        g.node_features.dim() != 2 or g.node_features.shape[0] != g.num_nodes
    ):
        raise ValueError(
            f"graph node_features must be ({g.num_nodes}, F), got {tuple(g.node_features.shape)}"
        )
    if g.edge_features is not None and (
        g.edge_features.dim() != 2 or g.edge_features.shape[0] != g.num_edges
    ):
        raise ValueError(
            f"graph edge_features must be ({g.num_edges}, F), got {tuple(g.edge_features.shape)}"
        )


def graph_hash_parts(item: Any) -> list[bytes]:
    g = to_graph(item)
    parts = [f"{g.num_nodes}:{int(g.directed)}".encode(), g.edge_index.contiguous().numpy().tobytes()]
    for feats in (g.node_features, g.edge_features):
        parts.append(
            b"-"
            if feats is None
            else f"{tuple(feats.shape)}".encode() + feats.float().contiguous().numpy().tobytes()
        )
    return parts
