"""How `Bridge.generate` reads a prompt dict's media: a list is several items, `(waveform, rate)` is one."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from bridge.api import _as_example


def test_a_waveform_and_rate_tuple_is_one_audio_item():
    wave = torch.zeros(160)
    ex = _as_example({"prompt": "<audio>", "audio": (wave, 8000)})
    assert len(ex.media["audio"]) == 1 and ex.media["audio"][0][1] == 8000
    ex = _as_example({"prompt": "<audio>", "audio": (np.zeros(160, dtype=np.float32), 16000)})
    assert len(ex.media["audio"]) == 1


def test_lists_and_other_tuples_are_several_items():
    a, b = torch.zeros(160), torch.ones(160)
    assert len(_as_example({"prompt": "<audio><audio>", "audio": [a, b]}).media["audio"]) == 2
    assert len(_as_example({"prompt": "<audio><audio>", "audio": (a, b)}).media["audio"]) == 2
    assert len(_as_example({"prompt": "<audio><audio>", "audio": [(a, 8000), (b, 8000)]}).media["audio"]) == 2
    # a bool is no sample rate
    assert len(_as_example({"prompt": "<audio>", "audio": (a, True)}).media["audio"]) == 2


def test_a_bad_prompt_is_named():
    with pytest.raises(ValueError, match="unknown prompt keys"):
        _as_example({"prompt": "x", "imgae": 1})
