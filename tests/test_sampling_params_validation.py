"""SamplingParams refuses every bad field at construction with a ValueError that names the field."""

from __future__ import annotations

import math

import pytest

from runner.sampling_params import SamplingParams


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"temperature": math.nan}, "temperature"),
        ({"temperature": math.inf}, "temperature"),
        ({"temperature": -0.5}, "temperature"),
        ({"temperature": "0.7"}, "temperature"),
        ({"repetition_penalty": math.nan}, "repetition_penalty"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"presence_penalty": math.nan}, "presence_penalty"),
        ({"frequency_penalty": 3.0}, "frequency_penalty"),
        ({"top_p": math.nan}, "top_p"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_k": 2.5}, "top_k"),
        ({"top_k": -2}, "top_k"),
        ({"top_k": True}, "top_k"),
        ({"max_tokens": "5"}, "max_tokens"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": None}, "max_tokens"),
        ({"max_tokens": 5.0}, "max_tokens"),
        ({"min_tokens": 9, "max_tokens": 4}, "min_tokens"),
        ({"stop": 123}, "stop"),
        ({"stop": ""}, "stop"),
        ({"stop": [""]}, r"stop\[0\]"),
        ({"stop": ["ok", 7]}, r"stop\[1\]"),
        ({"stop_token_ids": [1, 2.0]}, r"stop_token_ids\[1\]"),
        ({"stop_token_ids": [2**64]}, r"stop_token_ids\[0\]"),
        ({"stop_token_ids": 5}, "stop_token_ids"),
        ({"seed": 1.5}, "seed"),
        ({"seed": 2**70}, "seed"),
        ({"logprobs": -1}, "logprobs"),
        ({"logprobs": "3"}, "logprobs"),
        ({"prompt_logprobs": 1.0}, "prompt_logprobs"),
        ({"ignore_eos": "yes"}, "ignore_eos"),
        ({"skip_special_tokens": 0}, "skip_special_tokens"),
        ({"include_stop_str_in_output": 1}, "include_stop_str_in_output"),
    ],
)
def test_bad_field_is_a_value_error_naming_it(kwargs, field):
    with pytest.raises(ValueError, match=rf"^{field} "):
        SamplingParams(**kwargs)


def test_messages_are_bounded_for_huge_values():
    with pytest.raises(ValueError) as info:
        SamplingParams(stop=["a", "b", b"y" * 100_000])
    assert len(str(info.value)) < 400
    with pytest.raises(ValueError) as info:
        SamplingParams(max_tokens="9" * 100_000)
    assert len(str(info.value)) < 400


def test_good_values_are_normalised():
    p = SamplingParams(max_tokens=3, temperature=0, top_k=0, stop="end", stop_token_ids=(4, 5), seed=-3)
    assert p.temperature == 0.0 and isinstance(p.temperature, float) and p.is_greedy
    assert p.top_k == -1 and p.stop_strings == ["end"] and p.stop_token_ids == [4, 5]
    assert SamplingParams(stop=["a", "bc"]).stop_strings == ["a", "bc"]
    assert SamplingParams(top_k=None).top_k == -1
    import numpy as np

    assert SamplingParams(max_tokens=np.int64(7), temperature=np.float32(0.5)).max_tokens == 7
