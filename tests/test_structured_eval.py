"""`eval.structured_outputs`: a constrained evaluation scores parsed answers.

The scorer on its own (choice, JSON, regex answers), then `bridge train` + `bridge eval` on the
cheapest recipe with a choice constraint over every target the synthetic graphs can have: every
answer is one of the choices and `valid` is 1.0, whatever the barely trained model prefers.
"""

from __future__ import annotations

import itertools
import json

import pytest
import yaml
from helpers import tiny_graph_recipe_parts

from bridge.cli import main
from bridge.recipe import RecipeError, validate
from bridge.training.evaluate import AnswerScorer, evaluate_bridge
from runner.sampling_params import StructuredOutputsParams

SHAPES = ("clique", "cycle", "path", "star", "wheel")
COUNTS = ("four", "five", "six", "seven", "eight", "nine")
TARGETS = [f"a {s} with {n} nodes" for s, n in itertools.product(SHAPES, COUNTS)]


def test_scorer_choice_json_regex():
    choice = AnswerScorer(StructuredOutputsParams(choice=["cat", "dog"]))
    assert choice.valid("cat") and not choice.valid("ca")
    assert choice.match("dog", " dog ") and not choice.match("cat", "dog")
    schema = AnswerScorer(StructuredOutputsParams(json={"type": "object"}))
    assert schema.match('{"a": 1, "b": [2]}', '{"b": [2], "a": 1}')  # parsed, not textual
    assert not schema.match('{"a": 1', '{"a": 1}') and not schema.valid('{"a": 1')
    assert schema.match('"a red circle"', "a  red circle")  # a JSON string against a text target
    regex = AnswerScorer(StructuredOutputsParams(regex="[0-9]+"))
    assert regex.valid("42") and not regex.valid("42a")
    free = AnswerScorer(None)
    assert free.valid("anything") and free.match("a b", "a  b")


class _FakeBridge:
    tokenizer = None  # single-turn examples: the prompt is used as it is

    def __init__(self, answers):
        self.answers, self.calls = answers, []

    def generate(self, prompts, **kwargs):
        from runner.outputs import CompletionOutput, RequestOutput

        self.calls.append(kwargs)
        return [RequestOutput(request_id=str(i), prompt=None, prompt_token_ids=[], finished=True,
                              outputs=[CompletionOutput(index=0, text=self.answers[i], token_ids=[])])
                for i in range(len(prompts))]


def test_evaluate_bridge_passes_the_constraint_and_reports_valid():
    class Ex:
        def __init__(self, target):
            self.prompt, self.target, self.media, self.turns = "<graph>", target, {}, ()

    so = StructuredOutputsParams(json={"type": "object"})
    fake = _FakeBridge(['{"k": 1}', '{"k": 2}', '{"k"'])
    items = [Ex('{"k": 1}'), Ex('{"k": 3}'), Ex('{"k": 1}')]
    report = evaluate_bridge(fake, items, num_items=3, max_tokens=8, structured_outputs=so)
    assert fake.calls[0]["structured_outputs"] is so and fake.calls[0]["temperature"] == 0.0
    assert report["exact_match"] == pytest.approx(1 / 3) and report["valid"] == pytest.approx(2 / 3)
    assert report["structured_outputs"] == "json" and report["num_misses"] == 2


def test_recipe_refuses_a_bad_constraint_naming_it():
    base = {"name": "x", "stage": "align", **tiny_graph_recipe_parts()}
    with pytest.raises(RecipeError, match=r"eval\.structured_outputs\.regex: Regex parsing error"):
        validate({**base, "eval": {"structured_outputs": {"regex": "a(b"}}}, check_encoder=False)
    with pytest.raises(RecipeError, match=r"unknown key 'eval\.structured_outputs\.choise'"):
        validate({**base, "eval": {"structured_outputs": {"choise": ["a"]}}}, check_encoder=False)


def test_bridge_train_and_eval_with_choices(tmp_path, capsys):
    recipe = {"name": "structured-eval", "seed": 0, "stage": "align", **tiny_graph_recipe_parts(),
              "train": {"max_steps": 1, "batch_size": 4, "progress": False, "device": "cpu"},
              "eval": {"num_items": 6, "max_tokens": 40, "structured_outputs": {"choice": TARGETS}}}
    path, run = tmp_path / "r.yaml", tmp_path / "run"
    path.write_text(yaml.safe_dump(recipe))
    assert main(["train", str(path), "--output-dir", str(run)]) == 0
    report = json.loads((run / "eval.json").read_text())
    assert report["structured_outputs"] == "choice" and report["valid"] == 1.0 and report["n"] == 6
    assert all(s["output"] in TARGETS for s in report["samples"])
    capsys.readouterr()
    # `bridge eval --structured-outputs` overrides the recipe's constraint
    narrow = ["a path with five nodes", "a star with nine nodes"]
    out = tmp_path / "narrow.json"
    argv = ["eval", str(run), "--structured-outputs", json.dumps({"choice": narrow}), "--output", str(out)]
    assert main(argv) == 0
    printed = json.loads(capsys.readouterr().out)
    report = json.loads(out.read_text())
    assert printed["valid"] == 1.0 and all(s["output"] in narrow for s in report["samples"])
    assert main(["eval", str(run), "--structured-outputs", '{"regex": "a(b"}']) == 2
    assert "eval.structured_outputs.regex" in capsys.readouterr().err
