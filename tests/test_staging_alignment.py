"""Every per-step view starts on a 16-byte boundary, whatever the step's shape.

Triton specialises each kernel on whether its pointer arguments are 16-byte aligned; with views
packed back to back, a step whose token or request count had another residue than the warm-up's
built the attention kernels again (up to a second, inside a server's step)."""

from __future__ import annotations

import itertools

import torch

from runner.worker.staging import StagingBuffers


def test_every_view_is_16_byte_aligned_and_views_do_not_overlap():
    st = StagingBuffers(max_tokens=64, max_reqs=13, max_blocks=5, device=torch.device("cpu"))
    for t, r, w, n_logits in itertools.product((1, 2, 3, 7, 64), (1, 2, 3, 5, 13), (1, 3, 5), (0, 1, 3)):
        if r > t:
            continue
        v = st.views(st.dev64, st.dev32, t, r, w, n_logits)
        spans = []
        for name in ("input_ids", "positions", "slot_mapping", "logits_indices", "num_computed_by_slot",
                     "query_start_loc", "seq_lens", "idx_mapping", "block_tables"):
            view = getattr(v, name)
            assert view.data_ptr() % 16 == 0, (name, t, r, w, n_logits)
            spans.append((view.dtype, view.data_ptr(), view.data_ptr() + view.numel() * view.element_size()))
        assert v.input_ids.numel() == t and v.query_start_loc.numel() == r + 1
        assert v.block_tables.shape == (r, w) and v.logits_indices.numel() == n_logits
        for (d1, a1, e1), (d2, a2, e2) in itertools.combinations(spans, 2):
            assert d1 != d2 or e1 <= a2 or e2 <= a1  # one buffer per dtype: no two views overlap
        o64, o32 = st.offsets(t, r, w, n_logits)
        assert o64[-1] <= st.dev64.numel() and o32[-1] <= st.dev32.numel()
