"""The names the issues promise at package level are importable from the package itself."""

import bridge
import encoders
import runner


def test_runner_exports():
    for name in ["LLM", "SamplingParams", "StructuredOutputsParams", "RequestOutput",
                 "resolve_model_state_cls", "PromptEmbedsState", "EncoderCache"]:
        assert hasattr(runner, name), name
        assert name in runner.__all__


def test_bridge_exports():
    assert callable(bridge.encode_prompt_embeds)
    assert callable(bridge.load_prompt_embeds)


def test_encoders_exports():
    assert callable(encoders.build_encoder)
    assert "build_encoder" in encoders.__all__
