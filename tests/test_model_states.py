"""Model states: the right class from a config alone, fail-fast errors that name the model type, the
feature and the reason (from config-only directories, no weights), and M-RoPE positions equal to
transformers' own Qwen2-VL `get_rope_index`, including a passthrough "prompt_embeds" item."""

from __future__ import annotations

import json
import warnings

import pytest
import torch
from transformers import AutoConfig

from runner.multimodal.mrope import MRopeItem, compute_mrope_positions, mrope_positions_window
from runner.worker.model_states import (
    DefaultModelState,
    EncoderDecoderModelState,
    EncoderOnlyModelState,
    HybridModelState,
    ModelState,
    MRopeModelState,
    check_model_dir,
    load_hf_config,
    resolve_model_state_cls,
)

tiny_models = pytest.importorskip("bridge.tiny_models")


# -- resolution ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("model_type", ["llama", "qwen2", "qwen3", "mistral", "gemma3_text", "phi3"])
def test_decoder_only_families_resolve_to_default(model_type):
    # Tested families get a DefaultModelState subclass of their own (their row of the capability table).
    assert issubclass(resolve_model_state_cls(AutoConfig.for_model(model_type)), DefaultModelState)


@pytest.mark.parametrize("model_type", ["qwen2_vl", "qwen2_vl_text", "qwen2_5_vl", "qwen2_5_vl_text"])
def test_qwen2_vl_family_resolves_to_mrope(model_type):
    cls = resolve_model_state_cls(AutoConfig.for_model(model_type))
    assert cls is MRopeModelState
    assert cls.uses_mrope and cls.supports_prompt_embeds


def test_mrope_recognised_from_rope_parameters_alone():
    config = {"model_type": "my_llm", "rope_parameters": {"rope_type": "default", "mrope_section": [2, 3, 3]}}
    assert resolve_model_state_cls(config) is MRopeModelState


@pytest.mark.parametrize(
    ("model_type", "expected"),
    [
        ("t5", EncoderDecoderModelState),
        ("bart", EncoderDecoderModelState),
        ("whisper", EncoderDecoderModelState),
        ("mllama", EncoderDecoderModelState),  # cross-attention layers in its text config
        ("bamba", HybridModelState),
        ("jamba", HybridModelState),
        ("qwen3_next", HybridModelState),
        ("falcon_h1", HybridModelState),
        ("granitemoehybrid", HybridModelState),
        ("lfm2", HybridModelState),
        ("nemotron_h", HybridModelState),
        ("mamba", HybridModelState),
        ("bert", EncoderOnlyModelState),
        ("roberta", EncoderOnlyModelState),
    ],
)
def test_special_families_resolve(model_type, expected):
    assert resolve_model_state_cls(AutoConfig.for_model(model_type)) is expected


def test_resolution_from_config_json_dicts():
    assert resolve_model_state_cls({"model_type": "custom", "layer_types": ["full_attention", "conv"]}) is (
        HybridModelState
    )
    assert resolve_model_state_cls({"model_type": "custom", "hybrid_override_pattern": "M*M-"}) is (
        HybridModelState
    )
    assert resolve_model_state_cls({"model_type": "custom", "architectures": ["CustomForMaskedLM"]}) is (
        EncoderOnlyModelState
    )
    assert resolve_model_state_cls({"model_type": "custom", "is_encoder_decoder": True}) is (
        EncoderDecoderModelState
    )
    composite = {"model_type": "vlm", "text_config": {"model_type": "t", "cross_attention_layers": [1]}}
    assert resolve_model_state_cls(composite) is EncoderDecoderModelState
    sliding = {"model_type": "custom", "layer_types": ["sliding_attention", "full_attention"]}
    assert issubclass(resolve_model_state_cls(sliding), DefaultModelState)
    assert resolve_model_state_cls({"model_type": "custom", "architectures": ["CustomForCausalLM"]}) is (
        DefaultModelState
    )


def test_capability_flags_are_class_level():
    for cls in (EncoderDecoderModelState, HybridModelState, EncoderOnlyModelState):
        assert not cls.supports_prompt_embeds and not cls.supports_generation
    assert EncoderDecoderModelState.is_encoder_decoder
    assert HybridModelState.is_hybrid
    assert EncoderOnlyModelState.is_encoder_only
    assert DefaultModelState.supports_prompt_embeds and DefaultModelState.supports_mm_inputs
    assert not DefaultModelState.uses_mrope
    state = MRopeModelState(AutoConfig.for_model("qwen2_vl"))
    assert state.model_type == "qwen2_vl" and state.text_config.model_type == "qwen2_vl_text"


# -- fail fast from config-only directories -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("kind", "cls", "reason_word"),
    [
        ("t5", EncoderDecoderModelState, "cross-attention"),
        ("bamba", HybridModelState, "mamba"),
        ("qwen3_next", HybridModelState, "linear-attention"),
        ("bert", EncoderOnlyModelState, "head"),
    ],
)
def test_prompt_embeds_fail_fast_on_config_only_dirs(tmp_path, kind, cls, reason_word):
    model_dir = tiny_models.write_config_only_model(tmp_path / kind, kind)
    assert not any(p.suffix in (".safetensors", ".bin") for p in model_dir.iterdir())
    config = load_hf_config(model_dir)
    assert resolve_model_state_cls(config) is cls
    with pytest.raises(ValueError) as info:
        check_model_dir(model_dir, enable_prompt_embeds=True)
    message = str(info.value)
    assert repr(config.model_type) in message
    assert "prompt embeddings" in message
    assert reason_word in message
    # Without prompt embeds the runner still refuses (it cannot run the family), with the same clarity.
    with pytest.raises(ValueError, match=f"{config.model_type}.*generation"):
        check_model_dir(model_dir, enable_prompt_embeds=False)


@pytest.mark.parametrize(
    ("family", "expected"),
    [
        ("llama", DefaultModelState),
        ("qwen2", DefaultModelState),
        ("qwen3", DefaultModelState),
        ("qwen2_vl", MRopeModelState),
    ],
)
def test_tiny_kit_directories_resolve(tiny_model_root, family, expected):
    model_dir = tiny_models.build_tiny_model(tiny_model_root / f"states_{family}", family)
    checked = check_model_dir(model_dir, enable_prompt_embeds=True)
    assert issubclass(checked.model_state_cls, expected)  # tested families: a subclass of their own
    assert checked.config.model_type == family


def test_decoder_only_dir_passes(tmp_path):
    model_dir = tmp_path / "llama"
    model_dir.mkdir()
    AutoConfig.for_model("llama", hidden_size=64, num_hidden_layers=1).save_pretrained(model_dir)
    checked = check_model_dir(model_dir, enable_prompt_embeds=True)
    assert issubclass(checked.model_state_cls, DefaultModelState)
    assert checked.async_scheduling is True


def test_prompt_logprobs_with_embeds_is_an_error_for_token_prompts_fine():
    config = AutoConfig.for_model("qwen3")
    with pytest.raises(ValueError, match=r"'qwen3'.*prompt_logprobs.*no token id"):
        DefaultModelState.check_supported(config, enable_prompt_embeds=True, prompt_logprobs=True)
    assert DefaultModelState.check_supported(config, enable_prompt_embeds=False, prompt_logprobs=True)


def test_async_scheduling_with_multimodal_embeds():
    config = AutoConfig.for_model("qwen3")
    with pytest.raises(ValueError, match=r"'qwen3'.*async scheduling"):
        DefaultModelState.check_supported(
            config, enable_prompt_embeds=True, async_scheduling=True, has_mm=True
        )
    with pytest.warns(UserWarning, match="async scheduling turned off"):
        assert (
            DefaultModelState.check_supported(
                config, enable_prompt_embeds=True, async_scheduling=None, has_mm=True
            )
            is False
        )
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert DefaultModelState.check_supported(config, enable_prompt_embeds=True, has_mm=False) is True
        assert (
            DefaultModelState.check_supported(
                config, enable_prompt_embeds=True, async_scheduling=False, has_mm=True
            )
            is False
        )


def test_realtime_refused_for_mrope_allowed_for_default():
    with pytest.raises(ValueError, match=r"'qwen2_vl'.*realtime.*M-RoPE"):
        MRopeModelState.check_supported(
            AutoConfig.for_model("qwen2_vl"), enable_prompt_embeds=True, realtime=True
        )
    assert DefaultModelState.check_supported(
        AutoConfig.for_model("llama"), enable_prompt_embeds=True, realtime=True
    )


def test_load_hf_config_errors(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        load_hf_config(tmp_path / "missing")
    with pytest.raises(ValueError, match="no config.json"):
        load_hf_config(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "surely_not_a_model_type"}))
    with pytest.raises(ValueError, match="surely_not_a_model_type"):
        load_hf_config(tmp_path)


def test_base_class_is_usable_directly():
    assert ModelState.check_supported({"model_type": "x"}, enable_prompt_embeds=True) is True


# -- M-RoPE positions vs transformers -----------------------------------------------------------------------

MERGE = 2


@pytest.fixture(scope="module")
def qwen2_vl_model(tmp_path_factory):
    """transformers' own Qwen2VLModel on the tiny kit's qwen2_vl config, read back from its directory."""
    from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VLModel

    model_dir = tiny_models.build_tiny_model(tmp_path_factory.mktemp("mrope") / "qwen2_vl", "qwen2_vl")
    config = load_hf_config(model_dir)
    assert config.vision_config.spatial_merge_size == MERGE
    return Qwen2VLModel(config).eval()


# (kind, length or raw grid): "text" n tokens, "embeds" a passthrough item of n rows, "image"/"video" a raw
# patch grid (t, h, w) as transformers' image_grid_thw / video_grid_thw hold it.
PROMPTS = [
    [("text", 3), ("image", (1, 4, 6)), ("text", 2), ("embeds", 5), ("text", 1), ("image", (1, 6, 4)),
     ("text", 4)],
    [("embeds", 4), ("text", 2), ("image", (1, 8, 4)), ("embeds", 3), ("video", (2, 4, 4)), ("text", 3)],
    [("text", 2), ("embeds", 7), ("image", (1, 2, 2))],  # ends on media: the delta comes from its grid
    [("image", (1, 4, 4)), ("video", (2, 2, 6)), ("embeds", 2)],  # back-to-back media items
]  # fmt: skip


def _build(prompt):
    """Our items plus transformers' inputs for the same prompt (passthrough rows are text, type 0)."""
    items, types, images, videos = [], [], [], []
    n = 0
    for kind, spec in prompt:
        if kind == "text":
            types += [0] * spec
            n += spec
            continue
        if kind == "embeds":
            items.append(MRopeItem(offset=n, length=spec))
            types += [0] * spec
            n += spec
            continue
        t, h, w = spec
        length = t * (h // MERGE) * (w // MERGE)
        items.append(MRopeItem(offset=n, length=length, grid_thw=spec))
        types += [1 if kind == "image" else 2] * length
        (images if kind == "image" else videos).append(list(spec))
        n += length
    return n, items, types, images, videos


@pytest.mark.parametrize("prompt", PROMPTS)
def test_mrope_positions_match_transformers_get_rope_index(qwen2_vl_model, prompt):
    n, items, types, images, videos = _build(prompt)
    ours, delta = compute_mrope_positions(n, items, spatial_merge_size=MERGE)
    ref, ref_delta = qwen2_vl_model.get_rope_index(
        torch.zeros(1, n, dtype=torch.long),
        mm_token_type_ids=torch.tensor([types], dtype=torch.int32),
        image_grid_thw=torch.tensor(images, dtype=torch.long) if images else None,
        video_grid_thw=torch.tensor(videos, dtype=torch.long) if videos else None,
    )
    assert ours.shape == (3, n) and ours.dtype == torch.int64
    assert torch.equal(ours, ref[:, 0])
    assert delta == int(ref_delta.item())


def test_passthrough_item_is_positioned_as_text_and_gets_no_grid(qwen2_vl_model):
    n, items, *_ = _build(PROMPTS[0])
    with_item, d1 = compute_mrope_positions(n, items, spatial_merge_size=MERGE)
    without_item, d2 = compute_mrope_positions(
        n, [it for it in items if it.grid_thw], spatial_merge_size=MERGE
    )
    assert torch.equal(with_item, without_item) and d1 == d2
    embeds = items[1]
    rows = with_item[:, embeds.offset : embeds.offset + embeds.length]
    assert torch.equal(rows[0], rows[1]) and torch.equal(rows[1], rows[2])
    assert torch.equal(rows[0], torch.arange(int(rows[0, 0]), int(rows[0, 0]) + embeds.length))


def test_adjacent_items_of_one_modality_each_get_their_own_grid():
    # transformers' get_rope_index groups adjacent same-type tokens into one item (real prompts put
    # vision start/end tokens between); Bridge items are explicit, so each keeps its own grid.
    items = [
        MRopeItem(offset=1, length=4, grid_thw=(1, 2, 2)),
        MRopeItem(offset=5, length=3, grid_thw=(1, 1, 3)),
    ]
    positions, delta = compute_mrope_positions(9, items)
    assert positions[:, 0].tolist() == [0, 0, 0]
    assert positions[:, 1:5].tolist() == [[1, 1, 1, 1], [1, 1, 2, 2], [1, 2, 1, 2]]
    assert positions[:, 5:8].tolist() == [[3, 3, 3], [3, 3, 3], [3, 4, 5]]
    assert positions[:, 8].tolist() == [6, 6, 6] and delta == 6 + 1 - 9


def test_grid_in_llm_tokens_equals_raw_grid_with_merge():
    raw = [MRopeItem(offset=2, length=6, grid_thw=(1, 4, 6))]
    llm = [MRopeItem(offset=2, length=6, grid_thw=(1, 2, 3))]
    a, da = compute_mrope_positions(10, raw, spatial_merge_size=2)
    b, db = compute_mrope_positions(10, llm)
    assert torch.equal(a, b) and da == db


def test_decode_and_chunked_windows_continue_with_the_delta(qwen2_vl_model):
    n, items, *_ = _build(PROMPTS[1])
    prompt_positions, delta = compute_mrope_positions(n, items, spatial_merge_size=MERGE)
    assert delta < 0  # the grids compress positions
    # Chunked prefill windows, the last one carrying the first generated tokens, then decode steps.
    pieces, start = [], 0
    for size in (5, 9, n - 14 + 2, 1, 1):
        pieces.append(mrope_positions_window(prompt_positions, delta, start, size))
        start += size
    whole = torch.cat(pieces, dim=1)
    assert torch.equal(whole[:, :n], prompt_positions)
    generated = torch.arange(n, start) + delta
    assert torch.equal(whole[:, n:], generated.expand(3, -1))
    # transformers' decode rule: position of cache index i is i + rope_delta in all three rows.
    assert int(whole[0, n]) == int(prompt_positions.max()) + 1
    assert MRopeModelState(qwen2_vl_model.config).compute_positions(n, [])[0].shape == (3, n)


def test_mrope_bad_items_raise():
    with pytest.raises(ValueError, match="rows"):
        compute_mrope_positions(10, [MRopeItem(offset=0, length=5, grid_thw=(1, 2, 2))])
    with pytest.raises(ValueError, match="overlaps"):
        compute_mrope_positions(10, [MRopeItem(offset=0, length=4), MRopeItem(offset=2, length=2)])
    with pytest.raises(ValueError, match="outside"):
        compute_mrope_positions(4, [MRopeItem(offset=2, length=4)])
    with pytest.raises(ValueError, match="divisible"):
        compute_mrope_positions(10, [MRopeItem(offset=0, length=3, grid_thw=(1, 3, 4))], spatial_merge_size=2)
