"""Encoder cache: index mapping, windowed gather, bisect, LRU with refs, passthrough, realtime."""

from __future__ import annotations

import random

import pytest
import torch

from runner.multimodal.encoder_cache import (
    EncoderCache,
    MultiModalFeature,
    PlaceholderRange,
    RequestWindow,
    make_feature,
    sort_features,
)
from runner.multimodal.encoder_protocol import (
    PROMPT_EMBEDS_MODALITY,
    EncoderProtocol,
    check_encoders,
    tensor_content_hash,
)

HIDDEN = 8
F, T = False, True


class CountingEncoder:
    """A test encoder meeting the protocol: item = (seed, rows); output is deterministic."""

    def __init__(self, modality: str = "image", is_realtime: bool = False, hidden: int = HIDDEN):
        self.modality = modality
        self.is_realtime = is_realtime
        self.hidden = hidden
        self.calls: list[list] = []

    def num_rows(self, item) -> int:
        return item[1]

    def content_hash(self, item) -> str:
        return f"{item[0]}x{item[1]}"

    def encode(self, items: list) -> list[torch.Tensor]:
        self.calls.append(list(items))
        return [self.rows_of(item) for item in items]

    def rows_of(self, item) -> torch.Tensor:
        gen = torch.Generator().manual_seed(1000 + item[0])
        return torch.randn(item[1], self.hidden, generator=gen)


def _cache(budget: int = 1000) -> EncoderCache:
    return EncoderCache(budget, HIDDEN, torch.float32, "cpu")


def _image(encoder: CountingEncoder, seed: int, offset: int, length: int, is_embed=None) -> MultiModalFeature:
    mask = None if is_embed is None else torch.tensor(is_embed)
    ph = PlaceholderRange(offset, length, mask)
    return make_feature("image", (seed, ph.num_embeds), ph, {"image": encoder})


def _reference_gather(rows_by_id, windows):
    """Plain per-position reference: for each step token, find its feature by linear scan."""
    rows, mask = [], []
    for window in windows:
        for pos in range(
            window.num_computed_tokens, window.num_computed_tokens + window.num_scheduled_tokens
        ):
            hit = False
            for feature in window.features:
                ph = feature.placeholder
                if ph.offset <= pos < ph.end:
                    rel = pos - ph.offset
                    emb = [True] * ph.length if ph.is_embed is None else ph.is_embed.tolist()
                    if emb[rel]:
                        rows.append(rows_by_id[feature.identifier][sum(emb[:rel])])
                        hit = True
            mask.append(hit)
    return (torch.stack(rows) if rows else None), torch.tensor(mask, dtype=torch.bool)


# ---- index mapping ------------------------------------------------------------------------


def test_embeds_range_matches_issue_example():
    ph = PlaceholderRange(2, 5, torch.tensor([F, T, F, T, T]))
    assert ph.num_embeds == 3
    assert ph.embeds_range(3, 5) == (1, 3)
    assert ph.embeds_range(0, 5) == (0, 3)
    assert ph.embeds_range(0, 1) == (0, 0)
    assert PlaceholderRange(2, 5).embeds_range(3, 5) == (3, 5)


def test_gather_maps_window_through_is_embed_mask():
    enc = CountingEncoder()
    feat = _image(enc, seed=1, offset=2, length=5, is_embed=[F, T, F, T, T])
    cache = _cache()
    cache.ensure([feat], {"image": enc})
    rows = enc.rows_of((1, 3))
    # Absolute positions [5, 7) are placeholder positions [3, 5): embeds 1 and 2.
    out = cache.gather([RequestWindow([feat], 5, 2, prompt_len=10)])
    torch.testing.assert_close(out.mm_embeds, rows[1:3], rtol=0, atol=0)
    assert out.is_mm_embed.tolist() == [T, T]
    # Positions [3, 5) are placeholder positions [1, 3): is_embed [T, F] -> embed 0 only.
    out = cache.gather([RequestWindow([feat], 3, 2, prompt_len=10)])
    torch.testing.assert_close(out.mm_embeds, rows[0:1], rtol=0, atol=0)
    assert out.is_mm_embed.tolist() == [T, F]
    # A window that only covers the non-embed position gathers nothing.
    assert not cache.gather([RequestWindow([feat], 2, 1, prompt_len=10)]).has_embeds


def test_feature_cut_by_chunk_boundaries_reassembles_exactly():
    enc = CountingEncoder()
    feats = sort_features(
        [
            _image(enc, seed=2, offset=9, length=6, is_embed=[T, T, F, T, F, T]),
            _image(enc, seed=1, offset=3, length=4),
        ]
    )
    cache = _cache()
    cache.ensure(feats, {"image": enc})
    prompt_len = 18
    expected = torch.cat([cache.get(f.identifier) for f in feats])
    for chunk in (1, 2, 4, 5, 7, 18):
        pieces, masks = [], []
        for nc in range(0, prompt_len, chunk):
            ns = min(chunk, prompt_len - nc)
            out = cache.gather([RequestWindow(feats, nc, ns, prompt_len)])
            if out.has_embeds:
                pieces.append(out.mm_embeds)
                masks.append(out.is_mm_embed_cpu)
                assert int(out.is_mm_embed.sum()) == out.mm_embeds.shape[0]
            else:
                masks.append(torch.zeros(ns, dtype=torch.bool))
        torch.testing.assert_close(torch.cat(pieces), expected, rtol=0, atol=0)
        full_mask = torch.cat(masks)
        assert full_mask[3:7].all() and full_mask[9:15].tolist() == [T, T, F, T, F, T]
        assert int(full_mask.sum()) == expected.shape[0]


def test_batch_layout_and_bisect_against_linear_reference():
    rng = random.Random(0)
    enc = CountingEncoder()
    cache = _cache(budget=100_000)
    requests = []
    for r in range(6):
        feats, pos = [], rng.randint(0, 3)
        for k in range(rng.randint(0, 30)):
            length = rng.randint(1, 6)
            mask = [rng.random() < 0.7 for _ in range(length)]
            mask[rng.randrange(length)] = True
            feats.append(_image(enc, seed=100 * r + k, offset=pos, length=length, is_embed=mask))
            pos += length + rng.randint(0, 4)
        rng.shuffle(feats)
        requests.append((sort_features(feats), pos + 3))
    cache.ensure([f for feats, _ in requests for f in feats], {"image": enc})
    assert cache.num_encoder_calls == 1
    rows_by_id = {f.identifier: cache.get(f.identifier) for feats, _ in requests for f in feats}
    for _ in range(40):
        windows = []
        for feats, plen in requests:
            nc = rng.randint(0, plen - 1)
            windows.append(RequestWindow(feats, nc, rng.randint(0, plen - nc), plen))
        out = cache.gather(windows)
        ref_rows, ref_mask = _reference_gather(rows_by_id, windows)
        if ref_rows is None:
            assert not out.has_embeds
            continue
        torch.testing.assert_close(out.mm_embeds, ref_rows, rtol=0, atol=0)
        assert torch.equal(out.is_mm_embed_cpu, ref_mask)


def test_sort_features_rejects_overlap():
    enc = CountingEncoder()
    with pytest.raises(ValueError, match="overlap"):
        sort_features([_image(enc, 1, 0, 4), _image(enc, 2, 3, 2)])


def test_placeholder_validation():
    with pytest.raises(ValueError):
        PlaceholderRange(0, 3, torch.tensor([T, F]))
    with pytest.raises(ValueError):
        PlaceholderRange(0, 2, torch.tensor([F, F]))
    with pytest.raises(ValueError):
        PlaceholderRange(0, 0)


# ---- LRU, refs, budget --------------------------------------------------------------------


def test_lru_eviction_respects_request_refs():
    enc = CountingEncoder()
    cache = _cache(budget=10)
    a, b, c, d = (_image(enc, s, 0, 4) for s in range(4))
    cache.ensure([a], {"image": enc})
    cache.add_request_refs("req-a", [a.identifier])
    cache.ensure([b], {"image": enc})
    cache.ensure([c], {"image": enc})  # 12 > 10: a is older but referenced, so b goes
    assert a.identifier in cache and c.identifier in cache and b.identifier not in cache
    assert cache.num_evictions == 1 and cache.num_cached_tokens == 8
    cache.release_request("req-a")
    cache.get(c.identifier)  # c is now the most recently used; a the least
    cache.ensure([d], {"image": enc})
    assert a.identifier not in cache and c.identifier in cache and d.identifier in cache
    cache.release_request("req-a")  # releasing twice is harmless


def test_shared_item_stays_until_every_request_releases():
    enc = CountingEncoder()
    cache = _cache(budget=4)
    a, b = _image(enc, 0, 0, 4), _image(enc, 1, 0, 4)
    cache.add_request_refs("r1", [a.identifier, a.identifier])
    cache.add_request_refs("r2", [a.identifier])
    cache.ensure([a], {"image": enc})
    cache.release_request("r1")
    cache.ensure([b], {"image": enc})  # a still needed by r2: kept, soft over budget
    assert a.identifier in cache and cache.num_over_budget_inserts == 1
    cache.release_request("r2")
    cache.evict_unreferenced()
    assert len(cache) == 0 and cache.num_cached_tokens == 0


def test_budget_fits_and_item_check():
    enc = CountingEncoder()
    cache = _cache(budget=10)
    a = _image(enc, 0, 0, 6)
    cache.ensure([a], {"image": enc})
    assert cache.fits(10)  # a is unreferenced: evictable
    cache.add_request_refs("r", [a.identifier])
    assert cache.fits(4) and not cache.fits(5)
    with pytest.raises(ValueError, match="budget"):
        cache.check_item_rows(11)
    cache.check_item_rows(10)
    # Items of one ensure() call never evict each other, and the budget holds once released.
    cache.release_request("r")
    feats = [_image(enc, s, 0, 3) for s in range(1, 4)]
    cache.ensure(feats, {"image": enc})
    assert all(f.identifier in cache for f in feats)
    assert cache.num_cached_tokens <= cache.budget_tokens


# ---- passthrough and encoder calls --------------------------------------------------------


def _passthrough(tensor: torch.Tensor, offset: int = 0) -> MultiModalFeature:
    return make_feature(PROMPT_EMBEDS_MODALITY, tensor, PlaceholderRange(offset, tensor.shape[0]))


def test_passthrough_calls_no_encoder_and_uploads_once():
    cache = EncoderCache(100, HIDDEN, torch.bfloat16, "cpu")
    user = torch.randn(5, HIDDEN)
    f1 = _passthrough(user)
    f2 = _passthrough(user.clone(), offset=7)  # same content, another tensor: same identifier
    assert f1.identifier == f2.identifier
    enc = CountingEncoder()
    cache.ensure([f1, f2], {"image": enc})
    cache.ensure([f1], None)
    assert cache.num_uploads == 1 and cache.num_encoder_calls == 0 and enc.calls == []
    stored = cache.get(f1.identifier)
    assert stored.dtype == torch.bfloat16 and torch.equal(stored, user.to(torch.bfloat16))
    # An item already in the cache dtype/device is copied, so later edits cannot leak in.
    same = torch.randn(3, HIDDEN, dtype=torch.bfloat16)
    f3 = _passthrough(same)
    cache.ensure([f3])
    snapshot = same.clone()
    same.add_(1.0)
    assert torch.equal(cache.get(f3.identifier), snapshot)


def test_one_encoder_call_per_modality_per_batch():
    image, audio = CountingEncoder("image"), CountingEncoder("audio")
    encoders = {"image": image, "audio": audio}
    cache = _cache()
    img1 = _image(image, 1, 0, 3)
    img2 = _image(image, 2, 10, 2)
    img1_again = _image(image, 1, 20, 3)
    aud = make_feature("audio", (9, 4), PlaceholderRange(30, 4), encoders)
    embeds = _passthrough(torch.randn(2, HIDDEN), offset=40)
    cache.ensure([img1, img2, img1_again, aud, embeds], encoders)
    assert len(image.calls) == 1 and len(image.calls[0]) == 2  # the repeated item once
    assert len(audio.calls) == 1 and cache.num_encoder_calls == 2 and cache.num_uploads == 1
    cache.ensure([img1, aud, embeds], encoders)  # all cached: nothing runs, nothing uploads
    assert cache.num_encoder_calls == 2 and cache.num_uploads == 1
    # The same content under another modality is another identifier.
    assert img1.identifier != make_feature("audio", (1, 3), PlaceholderRange(0, 3), encoders).identifier


def test_mixed_media_and_passthrough_gather_in_prompt_order():
    image = CountingEncoder("image")
    cache = _cache()
    user = torch.randn(3, HIDDEN)
    feats = sort_features([_passthrough(user, offset=6), _image(image, 5, 1, 4)])
    cache.ensure(feats, {"image": image})
    out = cache.gather([RequestWindow(feats, 0, 10, prompt_len=10)])
    expected = torch.cat([image.rows_of((5, 4)), user])
    torch.testing.assert_close(out.mm_embeds, expected, rtol=0, atol=0)
    assert out.is_mm_embed.tolist() == [F, T, T, T, T, F, T, T, T, F]


def test_bad_inputs_raise_clear_errors():
    cache = _cache()
    enc = CountingEncoder()
    with pytest.raises(ValueError, match="no encoder"):
        cache.ensure([_image(enc, 0, 0, 2)], {})
    with pytest.raises(ValueError, match="shape"):
        cache.ensure([_passthrough(torch.randn(2, HIDDEN + 1))])
    bad = MultiModalFeature("image:x", "image", PlaceholderRange(0, 3), (0, 2))  # encoder makes 2 rows
    with pytest.raises(ValueError, match="expects"):
        cache.ensure([bad], {"image": enc})
    with pytest.raises(ValueError, match="no item"):
        cache.ensure([MultiModalFeature("image:y", "image", PlaceholderRange(0, 2), None)], {"image": enc})
    missing = _image(enc, 42, 0, 2)
    with pytest.raises(RuntimeError, match="ensure"):
        cache.gather([RequestWindow([missing], 0, 2, prompt_len=4)])


# ---- realtime -----------------------------------------------------------------------------


def test_decode_steps_gather_only_for_realtime():
    stream = CountingEncoder("audio", is_realtime=True)
    cache = _cache()
    prompt_len = 4
    # A chunk streamed into the live request lands at decode position 6.
    streamed = make_feature("audio", (7, 1), PlaceholderRange(6, 1), {"audio": stream})
    decode = RequestWindow([streamed], num_computed_tokens=6, num_scheduled_tokens=1, prompt_len=prompt_len)
    # Non-realtime: an all-decode step returns at once, before looking anything up.
    assert not cache.gather([decode]).has_embeds
    cache.ensure([streamed], {"audio": stream})
    out = cache.gather([decode], realtime=True)
    torch.testing.assert_close(out.mm_embeds, stream.rows_of((7, 1)), rtol=0, atol=0)
    assert out.is_mm_embed.tolist() == [T]
    # Mixed step: the prefill request gathers; the decode request only when realtime.
    img = CountingEncoder("image")
    pre = _image(img, 3, 0, 2)
    cache.ensure([pre], {"image": img})
    prefill = RequestWindow([pre], 0, 3, prompt_len=3)
    out = cache.gather([prefill, decode])
    assert out.is_mm_embed.tolist() == [T, T, F, F] and out.mm_embeds.shape[0] == 2
    out = cache.gather([prefill, decode], realtime=True)
    assert out.is_mm_embed.tolist() == [T, T, F, T] and out.mm_embeds.shape[0] == 3


# ---- protocol and hashing -----------------------------------------------------------------


def test_protocol_and_check_encoders():
    enc = CountingEncoder("image")
    assert isinstance(enc, EncoderProtocol)
    assert check_encoders({"image": enc}) == {"image": enc}
    with pytest.raises(ValueError, match="declares modality"):
        check_encoders({"audio": enc})
    with pytest.raises(ValueError, match="passthrough"):
        check_encoders({PROMPT_EMBEDS_MODALITY: enc})
    with pytest.raises(ValueError, match="missing: .*encode"):
        check_encoders({"image": object()})


def test_tensor_content_hash_is_content_dtype_and_shape_sensitive():
    x = torch.randn(4, 6)
    assert tensor_content_hash(x) == tensor_content_hash(x.clone())
    assert tensor_content_hash(x.t().contiguous().t()) == tensor_content_hash(x)  # layout-free
    assert tensor_content_hash(x) != tensor_content_hash(x.reshape(6, 4))
    assert tensor_content_hash(x.to(torch.bfloat16)) != tensor_content_hash(x.to(torch.float16))
    y = x.clone()
    y[2, 3] += 1
    assert tensor_content_hash(x) != tensor_content_hash(y)


@pytest.mark.gpu
def test_gpu_cache_serves_device_rows_and_mask():
    device = torch.device("cuda")
    cache = EncoderCache(100, HIDDEN, torch.bfloat16, device)
    image = CountingEncoder("image")
    user = torch.randn(3, HIDDEN)
    feats = sort_features([_passthrough(user, offset=6), _image(image, 5, 1, 4, is_embed=[T, F, T, T])])
    cache.ensure(feats, {"image": image})
    assert cache.get(feats[1].identifier).device.type == "cuda" and cache.num_uploads == 1
    out = cache.gather([RequestWindow(feats, 0, 6, prompt_len=10), RequestWindow(feats, 6, 4, prompt_len=10)])
    assert out.mm_embeds.device.type == "cuda" and out.is_mm_embed.device.type == "cuda"
    expected = torch.cat([image.rows_of((5, 3)), user]).to(torch.bfloat16)
    assert torch.equal(out.mm_embeds.cpu(), expected)
    assert out.is_mm_embed.cpu().tolist() == [F, T, F, T, T, F, T, T, T, F]
