"""Hostile input to `LLM.generate` and faults while it runs: each is a ValueError naming the prompt,
a failing encoder fails only its own prompts, and threads sharing one LLM each get correct results."""

from __future__ import annotations

import threading

import pytest
import torch
from helpers import IdentityEncoder

from bridge.tiny_models import build_tiny_model
from runner import LLM, GenerationError, SamplingParams

HIDDEN = 64
GREEDY = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)

pytestmark = pytest.mark.usefixtures("one_cpu_thread")


class FlakyEncoder(IdentityEncoder):
    """Identity, except for items whose first value is 99 (raises) or 77 (returns NaN rows)."""

    def encode(self, items):
        self.calls.append(len(items))
        out = []
        for item in items:
            if float(item[0, 0]) == 99.0:
                raise RuntimeError("cannot decode this item")
            out.append(torch.full_like(item, float("nan")) if float(item[0, 0]) == 77.0 else item.clone())
        return out


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("hostile_gen") / "qwen3", "qwen3", seed=5)


@pytest.fixture(scope="module")
def llm(model_dir):
    return LLM(model_dir, enable_prompt_embeds=True, encoders={"image": FlakyEncoder("image")}, device="cpu",
               num_kv_blocks=64, dtype="bfloat16")


def _free(llm):
    return llm.stats().all_free


def _nested():
    return torch.nested.nested_tensor([torch.zeros(2, HIDDEN), torch.zeros(3, HIDDEN)])


BAD_TENSORS = {
    "float64 beyond bfloat16": lambda: torch.full((3, HIDDEN), 1e39, dtype=torch.float64),
    "sparse": lambda: torch.zeros(3, HIDDEN).to_sparse(),
    "meta": lambda: torch.empty(3, HIDDEN, device="meta"),
    "nested": _nested,
}


@pytest.mark.parametrize("kind", sorted(BAD_TENSORS))
def test_bad_tensors_are_value_errors(llm, kind):
    good = {"prompt_token_ids": [5, 6, 7]}
    steps = llm.stats().num_steps
    with pytest.raises(ValueError, match="prompt 1") as err:
        llm.generate([good, {"prompt_embeds": BAD_TENSORS[kind]()}], GREEDY, use_tqdm=False)
    assert len(str(err.value)) < 300
    with pytest.raises(ValueError, match="prompt 0"):
        llm.generate({"prompt": "a <embeds>", "multi_modal_data": {"prompt_embeds": [BAD_TENSORS[kind]()]}},
                     GREEDY, use_tqdm=False)
    assert llm.stats().num_steps == steps and _free(llm)


def test_sparse_token_ids_and_mask_are_value_errors(llm):
    with pytest.raises(ValueError, match="prompt_token_ids"):
        llm.generate({"prompt_token_ids": torch.tensor([5, 6]).to_sparse()}, GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match="prompt_is_token_ids"):
        llm.generate({"prompt_embeds": torch.zeros(2, HIDDEN), "prompt_is_token_ids": ["x", object()]},
                     GREEDY, use_tqdm=False)


@pytest.mark.parametrize("marker, says", [(99.0, "cannot decode"), (77.0, "NaN")])
def test_a_failing_encoder_fails_only_its_prompt(llm, marker, says):
    def image(first):
        rows = torch.randn(2, HIDDEN, generator=torch.Generator().manual_seed(int(first)))
        rows[0, 0] = first
        return rows

    prompts = [{"prompt": f"a <image> {w}", "multi_modal_data": {"image": [image(v)]}}
               for w, v in (("red", 1.0), ("blue", marker), ("green", 2.0))]
    clean = llm.generate([prompts[0], prompts[2]], GREEDY, use_tqdm=False)
    with pytest.raises(GenerationError, match="prompt 1") as err:
        llm.generate(prompts, GREEDY, use_tqdm=False)
    assert set(err.value.errors) == {1}
    assert "image" in err.value.errors[1] and says in err.value.errors[1]
    outs = err.value.outputs
    assert outs[1] is None
    assert [outs[0].outputs[0].token_ids, outs[2].outputs[0].token_ids] == [
        c.outputs[0].token_ids for c in clean]
    assert _free(llm)


def test_threads_sharing_one_llm_get_correct_results(model_dir):
    llm = LLM(model_dir, device="cpu", num_kv_blocks=64, async_scheduling=True)
    prompts = [[{"prompt_token_ids": [10 + t, 20 + i, 30]} for i in range(3)] for t in range(2)]
    expected = [[o.outputs[0].token_ids for o in llm.generate(p, GREEDY, use_tqdm=False)] for p in prompts]
    got: dict[int, list] = {0: [], 1: []}
    errors: list[BaseException] = []

    def worker(t: int) -> None:
        try:
            for _ in range(5):
                outs = llm.generate(prompts[t], GREEDY, use_tqdm=False)
                got[t].append([o.outputs[0].token_ids for o in outs])
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(2)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=120)
    assert not errors
    assert all(run == expected[t] for t in range(2) for run in got[t]) and all(len(got[t]) == 5 for t in got)
    assert _free(llm)
