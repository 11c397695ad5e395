"""Synthetic graph set: small graphs of a known kind -> "a <kind> with <n> nodes" (n spelled out).

Kinds: cycle, path, star, clique (complete graph), wheel; 4 to 9 nodes. Node labels are shuffled
per item, so the encoder must read structure (degrees, connectivity), not ids. Items are dicts in
the encoders' JSON graph format (`{"num_nodes": n, "edges": [[u, v], ...]}`), featureless: the
tower sees degree embeddings, and the demo recipe adds an exact node-count embedding.
"""

from __future__ import annotations

from bridge.data.example import Example
from bridge.data.synthetic_base import SyntheticDataset

KINDS: tuple[str, ...] = ("cycle", "path", "star", "clique", "wheel")
SIZES: tuple[int, ...] = (4, 5, 6, 7, 8, 9)
NUMBER_WORDS: dict[int, str] = {4: "four", 5: "five", 6: "six", 7: "seven", 8: "eight", 9: "nine"}


def kind_edges(kind: str, n: int) -> list[tuple[int, int]]:
    if kind == "path":
        return [(i, i + 1) for i in range(n - 1)]
    if kind == "cycle":
        return [(i, (i + 1) % n) for i in range(n)]
    if kind == "star":
        return [(0, i) for i in range(1, n)]
    if kind == "clique":  # the complete graph
        return [(i, j) for i in range(n) for j in range(i + 1, n)]
    if kind == "wheel":  # hub 0 plus a cycle over 1..n-1
        rim = list(range(1, n))
        return [(0, i) for i in rim] + [(rim[k], rim[(k + 1) % len(rim)]) for k in range(len(rim))]
    raise ValueError(f"unknown graph kind {kind!r}; choose from {KINDS}")


class GraphsDataset(SyntheticDataset):
    modality = "graph"

    def __init__(self, num_items: int, *, seed: int, split: str, prompt: str = "<graph>"):
        super().__init__(num_items, seed=seed, split=split, prompt=prompt)

    @staticmethod
    def vocab_words() -> list[str]:
        return ["a", *KINDS, "with", "nodes", *NUMBER_WORDS.values()]

    def __getitem__(self, index: int) -> Example:
        rng = self._item_rng(index)
        kind = KINDS[rng.integers(len(KINDS))]
        n = int(SIZES[rng.integers(len(SIZES))])
        relabel = rng.permutation(n)
        edges = [[int(relabel[u]), int(relabel[v])] for u, v in kind_edges(kind, n)]
        order = rng.permutation(len(edges))
        graph = {"num_nodes": n, "edges": [edges[i] for i in order]}
        return Example(self.prompt, f"a {kind} with {NUMBER_WORDS[n]} nodes", {"graph": [graph]})
