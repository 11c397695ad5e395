"""Graphs: the JSON format and its errors, GCN/GIN/GAT layers, batching, permutation invariance."""

from __future__ import annotations

import json

import pytest
import torch

from encoders.api import Graph, build_encoder, build_tower, graph_from_dict, graph_to_dict, load_graph_json
from encoders.graph_layers import scatter_softmax
from encoders.graph_tower import batch_graphs

HIDDEN = 24


def _graph(n=6, features=True, edge_features=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    edges = [[i, (i + 1) % n] for i in range(n)] + [[0, n // 2]]
    data = {"num_nodes": n, "edges": edges}
    if features:
        data["node_features"] = torch.randn(n, 3, generator=g).tolist()
    if edge_features:
        data["edge_features"] = torch.randn(len(edges), 2, generator=g).tolist()
    return data


def _permuted(data, perm):
    """The same graph with node i renamed perm[i] (edge order shuffled too)."""
    n = data["num_nodes"]
    inverse = [0] * n
    for old, new in enumerate(perm):
        inverse[new] = old
    out = {"num_nodes": n, "edges": [[perm[u], perm[v]] for u, v in data["edges"]][::-1]}
    if "node_features" in data:
        out["node_features"] = [data["node_features"][inverse[i]] for i in range(n)]
    if "edge_features" in data:
        out["edge_features"] = data["edge_features"][::-1]
    return out


def test_json_round_trip(tmp_path):
    data = _graph()
    (tmp_path / "g.json").write_text(json.dumps(data))
    g = load_graph_json(tmp_path / "g.json")
    assert isinstance(g, Graph) and g.num_nodes == 6 and g.edge_index.shape == (2, 7) and not g.directed
    assert g.node_features.shape == (6, 3) and g.edge_features.shape == (7, 2)
    assert graph_from_dict(graph_to_dict(g)).edge_index.tolist() == g.edge_index.tolist()


@pytest.mark.parametrize(
    "data,message",
    [
        ([1, 2], "must be a JSON object"),
        ({"edges": []}, "missing required key 'num_nodes'"),
        ({"num_nodes": 0, "edges": []}, "num_nodes must be an integer >= 1"),
        ({"num_nodes": 2, "edges": [[0, 1]], "weights": []}, r"unknown key\(s\) \['weights'\]"),
        ({"num_nodes": 2, "edges": [[0, 1, 2]]}, r"edges\[0\] must be a \[u, v\] pair"),
        (
            {"num_nodes": 2, "edges": [[0, 1], [1, 2]]},
            r"edges\[1\] = \[1, 2\] refers to node 2, outside \[0, 2\)",
        ),
        ({"num_nodes": 2, "edges": [[0, 1.5]]}, "integer node indices"),
        ({"num_nodes": 2, "edges": [], "node_features": [[1.0]]}, "node_features must be a list of 2 rows"),
        (
            {"num_nodes": 2, "edges": [], "node_features": [[1.0], [1.0, 2.0]]},
            r"node_features\[1\] has 2 values",
        ),
        (
            {"num_nodes": 1, "edges": [], "node_features": [["a"]]},
            r"node_features\[0\]\[0\] = 'a' is not a finite",
        ),
        ({"num_nodes": 2, "edges": [[0, 1]], "edge_features": []}, "edge_features must be a list of 1 rows"),
        ({"num_nodes": 2, "edges": [], "directed": "yes"}, "directed must be true or false"),
    ],
)
def test_json_validation_errors(data, message, tmp_path):
    with pytest.raises(ValueError, match=message):
        graph_from_dict(data)
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match=str(path)):  # file errors name the file
        load_graph_json(path)


def test_json_file_errors(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        load_graph_json(tmp_path / "missing.json")
    (tmp_path / "broken.json").write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        load_graph_json(tmp_path / "broken.json")


def test_tower_checks_feature_widths():
    tower = build_tower({"name": "gin", "node_feature_dim": 3})
    with pytest.raises(ValueError, match="expects node_features of width 3, the graph has none"):
        tower.preprocess(_graph(features=False, edge_features=False))
    with pytest.raises(ValueError, match="node_feature_dim 0"):
        build_tower({"name": "gin"}).preprocess(_graph(edge_features=False))
    with pytest.raises(ValueError, match="no input at all"):
        build_tower({"name": "gcn", "use_degree": False})


def test_scatter_softmax_sums_to_one_per_target():
    logits = torch.randn(5, 2)
    index = torch.tensor([0, 0, 2, 2, 2])
    weights = scatter_softmax(logits, index, 3)
    sums = torch.zeros(3, 2).index_add_(0, index, weights)
    assert torch.allclose(sums[[0, 2]], torch.ones(2, 2)) and torch.equal(sums[1], torch.zeros(2))
    assert torch.allclose(weights[:2], torch.softmax(logits[:2], dim=0))


def test_block_diagonal_batching():
    tower = build_tower({"name": "gcn", "node_feature_dim": 3, "edge_feature_dim": 2})
    a, b = tower.preprocess(_graph(4)), tower.preprocess(_graph(3, seed=1))
    batch = batch_graphs([a, b])
    assert batch["batch"].tolist() == [0] * 4 + [1] * 3
    assert batch["edge_index"].shape == (2, 2 * (5 + 4))  # undirected: both directions
    assert int(batch["edge_index"][:, a["edge_index"].shape[1] :].min()) == 4  # second graph offset by 4
    assert batch["x"].shape == (7, 3) and batch["edge_attr"].shape == (18, 2)


@pytest.mark.parametrize("layer", ["gcn", "gin", "gat"])
def test_readout_is_permutation_invariant_and_batch_independent(layer):
    torch.manual_seed(0)
    tower = build_tower(
        {
            "name": layer,
            "dim": 32,
            "num_layers": 2,
            "node_feature_dim": 3,
            "edge_feature_dim": 2,
            "readout_tokens": 3,
        }
    ).eval()
    data = _graph(7)
    perm = [3, 0, 6, 1, 5, 2, 4]
    other = _graph(5, seed=3)
    with torch.no_grad():
        out, _ = tower(tower.collate([tower.preprocess(data), tower.preprocess(other)]))
        permuted, _ = tower(tower.collate([tower.preprocess(_permuted(data, perm))]))
        changed = dict(data, edges=data["edges"][:-1], edge_features=data["edge_features"][:-1])
        different, _ = tower(tower.collate([tower.preprocess(changed)]))
    assert out.shape == (2, 3, 32)
    assert torch.allclose(out[0], permuted[0], atol=1e-5)
    assert not torch.allclose(out[0], different[0], atol=1e-3)  # it does look at the structure


def test_graph_encoder_directed_and_featureless():
    torch.manual_seed(0)
    enc = build_encoder(
        {
            "tower": {"name": "gat", "dim": 16, "readout_tokens": 2, "heads": 2},
            "projector": {"name": "perceiver", "num_queries": 3, "num_heads": 2, "num_layers": 1},
            "llm_hidden_size": HIDDEN,
        }
    )
    path = {"num_nodes": 4, "edges": [[0, 1], [1, 2], [2, 3]]}
    outs = enc.encode([path, dict(path, directed=True), Graph(1, torch.zeros(2, 0, dtype=torch.long))])
    assert [o.shape for o in outs] == [(3, HIDDEN)] * 3 == [(enc.num_rows(path), HIDDEN)] * 3
    assert not torch.allclose(outs[0], outs[1])  # direction matters for a directed graph


def test_count_embedding_separates_sizes_within_range():
    torch.manual_seed(0)
    tower = build_tower({"name": "gin", "dim": 16, "readout_tokens": 1, "count_embedding": 8}).eval()
    cycles = [{"num_nodes": n, "edges": [[i, (i + 1) % n] for i in range(n)]} for n in (5, 6, 9, 10)]
    with torch.no_grad():
        out, _ = tower(tower.collate([tower.preprocess(c) for c in cycles]))
    assert not torch.allclose(out[0], out[1], atol=1e-4)
    assert tower.readout.count.num_embeddings == 9  # counts 0..8, larger ones clamp to 8
