"""Library calls print no progress bars unless asked (issue 35): `LLM(...)` and `LLM.generate`,
`Bridge.from_checkpoint` and `Bridge.generate` on a tiny demo run write nothing that looks like a bar
(transformers' "Loading weights", the engine's "Processed prompts"); `use_tqdm=True` brings the bar back,
and transformers' own switch is left as it was found."""

from __future__ import annotations

import re

import pytest
from transformers import AutoModelForCausalLM
from transformers.utils import logging as hf_logging

from bridge.cli import main
from bridge.tiny_models import build_tiny_model
from runner.llm import LLM
from runner.sampling_params import SamplingParams

pytestmark = pytest.mark.usefixtures("one_cpu_thread")

#: what a tqdm bar prints ("100%|", "12.3it/s]", "1.2s/it]")
BAR = re.compile(r"\d+%\||it/s\]|s/it\]")
PARAMS = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)


def test_llm_and_generate_print_no_bar_unless_asked(tmp_path, capfd):
    model = build_tiny_model(tmp_path / "llama", "llama", seed=1)
    capfd.readouterr()
    AutoModelForCausalLM.from_pretrained(model)  # transformers' own bar is on in this process...
    assert "Loading weights" in capfd.readouterr().err
    llm = LLM(model, device="cpu", num_kv_blocks=16)  # ... and LLM(...) loads without it
    assert llm.generate(["a b", "c"], PARAMS)[0].outputs[0].token_ids
    out, err = capfd.readouterr()
    assert not BAR.search(out + err), out + err
    assert hf_logging.is_progress_bar_enabled()  # put back as found
    llm.generate(["a b", "c"], PARAMS, use_tqdm=True)
    assert "Processed prompts" in capfd.readouterr().err


def test_bridge_from_checkpoint_and_generate_print_no_bar_unless_asked(tmp_path, capfd):
    from bridge.api import Bridge
    from bridge.data.sources import build_datasets
    from bridge.recipe import load_recipe

    run = tmp_path / "shapes"
    overrides = ["train.max_steps=1", "train.progress=false", "eval.num_items=1", "data.num_train=8",
                 "data.num_eval=2", "train.batch_size=4"]
    assert main(["demo", "shapes", "--output-dir", str(run), *overrides]) == 0
    recipe = load_recipe(run / "recipe.yaml", [])
    image = build_datasets(recipe.data, recipe.seed)[1][0].media["image"][0]
    capfd.readouterr()
    bridge = Bridge.from_checkpoint(run, device="cpu")
    prompt = {"prompt": "<image>", "image": image}
    assert bridge.generate([prompt], max_tokens=2)[0].outputs[0].token_ids
    out, err = capfd.readouterr()
    assert not BAR.search(out + err), out + err
    bridge.generate([prompt], max_tokens=2, use_tqdm=True)
    assert "Processed prompts" in capfd.readouterr().err
