"""Fuzzing the other caller-facing validators: SamplingParams fields, graph JSON (the encoders'
format, and graph files in a JSONL data set), and recipe overrides. Each input is accepted (and
then satisfies the documented invariants) or refused with a ValueError; no other exception."""

from __future__ import annotations

import json
import math
import tempfile
from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st
from test_training import BASE

from bridge.data.jsonl import JsonlDataset
from bridge.recipe import SCHEMA, apply_overrides, validate
from encoders.graph_format import graph_from_dict
from runner.sampling_params import SamplingParams

# ----------------------------------------------------------------------------- SamplingParams

ANY_VALUE = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=8), st.lists(st.one_of(st.integers(-5, 5), st.text(max_size=3)), max_size=3),
    st.binary(max_size=4), st.tuples(st.integers(), st.integers()),
)
FIELDS = ["max_tokens", "temperature", "top_p", "top_k", "seed", "ignore_eos", "stop", "stop_token_ids",
          "logprobs", "prompt_logprobs", "repetition_penalty", "presence_penalty", "frequency_penalty",
          "min_tokens", "skip_special_tokens"]


@settings(max_examples=400)
@given(st.dictionaries(st.sampled_from(FIELDS), ANY_VALUE, max_size=6))
def test_sampling_params_accept_or_value_error(kwargs):
    try:
        p = SamplingParams(**kwargs)
    except ValueError as err:
        assert len(str(err)) < 400
        return
    assert isinstance(p.max_tokens, int) and p.max_tokens >= 1
    for name in ("temperature", "top_p", "repetition_penalty", "presence_penalty", "frequency_penalty"):
        assert isinstance(getattr(p, name), float) and math.isfinite(getattr(p, name)), name
    assert p.temperature >= 0 and 0 < p.top_p <= 1 and p.repetition_penalty > 0
    assert isinstance(p.top_k, int) and (p.top_k == -1 or p.top_k >= 1)
    assert 0 <= p.min_tokens <= p.max_tokens
    assert all(isinstance(s, str) and s for s in p.stop_strings)
    assert all(isinstance(t, int) and -(2**63) <= t < 2**63 for t in p.stop_token_ids)


# ----------------------------------------------------------------------------- graph JSON

JSON_LEAF = st.one_of(
    st.none(), st.booleans(), st.integers(-3, 12), st.floats(allow_nan=False), st.text(max_size=4)
)
JSON = st.recursive(JSON_LEAF, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(
    st.text(max_size=6), inner, max_size=4), max_leaves=12)


@st.composite
def graph_dicts(draw) -> object:
    """Near-valid graphs (each key drawn from valid or hostile values) and arbitrary JSON."""
    if draw(st.booleans()):
        return draw(JSON)
    n = draw(st.integers(-1, 6) | JSON)
    node = st.integers(-1, 7)
    graph = {
        "num_nodes": n,
        "edges": draw(st.lists(st.lists(node, min_size=0, max_size=3), max_size=6) | JSON),
    }
    if draw(st.booleans()):
        width = draw(st.integers(0, 3))
        graph["node_features"] = draw(st.lists(st.lists(st.floats(), min_size=width, max_size=width),
                                               max_size=7) | JSON)
    if draw(st.booleans()):
        graph["edge_features"] = draw(st.lists(st.lists(st.floats(allow_nan=False), max_size=2), max_size=6))
    if draw(st.booleans()):
        graph["directed"] = draw(st.booleans() | JSON)
    if draw(st.integers(0, 4)) == 0:
        graph[draw(st.text(max_size=5))] = draw(JSON)
    return graph


@settings(max_examples=300)
@given(graph_dicts())
def test_graph_json_builds_or_value_error(data):
    try:
        graph = graph_from_dict(data, source="g.json")
    except ValueError as err:
        assert len(str(err)) < 2000
        return
    assert graph.num_nodes >= 1 and graph.edge_index.shape[0] == 2
    assert graph.edge_index.numel() == 0 or int(graph.edge_index.max()) < graph.num_nodes


@settings(max_examples=60)
@given(st.one_of(graph_dicts().map(json.dumps), st.text(max_size=40), st.binary(max_size=40)))
def test_graph_files_in_a_data_set_load_or_name_file_and_line(content):
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        graph = root / "g.json"
        graph.write_bytes(content if isinstance(content, bytes) else content.encode())
        (root / "d.jsonl").write_text(json.dumps({"graph": "g.json", "text": "t"}) + "\n")
        try:
            data = JsonlDataset(root / "d.jsonl", prompt="<graph>")
        except ValueError as err:
            assert "d.jsonl:1: graph file" in str(err) and len(str(err)) < 600
            return
        assert isinstance(data[0].media["graph"][0], dict)
        data.check_all_items()


# ----------------------------------------------------------------------------- recipe overrides


def _schema_keys(schema=SCHEMA, prefix="") -> list[str]:
    keys = []
    for key, spec in schema.items():
        if isinstance(spec, dict):
            keys += _schema_keys(spec, f"{prefix}{key}.")
        else:
            keys.append(f"{prefix}{key}")
    return keys


KEYS = _schema_keys() + ["model.tiny.bogus", "train.nope", "encoder.tower.channels", "x", "train"]
VALUES = st.one_of(
    st.sampled_from([".nan", ".inf", "-.inf", "-1", "0", "1000000000", "1e400", "-3.5", "true", "null", "",
                     "[1, 2]", "{a: 1}", "abc", "'", "[", "1e-3", "0x10", "~"]),
    st.integers(-(2**40), 2**40).map(str),
    st.floats().map(repr),
    st.text(max_size=10),
)


@settings(max_examples=200)
@given(st.lists(st.tuples(st.sampled_from(KEYS), VALUES), min_size=1, max_size=3))
def test_recipe_overrides_validate_or_value_error(overrides):
    try:
        validate(apply_overrides(BASE, [f"{key}={value}" for key, value in overrides]))
    except ValueError as err:
        assert len(str(err)) < 2000
