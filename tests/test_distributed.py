"""DDP and FSDP2 on the CPU with the gloo backend: `bridge train --nproc 2` (which launches torchrun)
gives the same per-step losses as one rank with the same global batch, with or without DataLoader
workers (`train.num_workers`) building each rank's micro-batches.

Why they can match: every rank takes its slice of the same seeded global batch (sampler.py), the
loss is a per-sample mean averaged over samples (so the mean of two ranks' means is the global
mean) and DDP / FSDP2 average gradients. Stated tolerance: 1e-4 absolute on each logged loss
and on every saved weight (float reduction order differs between 1 and 2 processes; observed
differences are ~1e-7 on losses, ~3e-6 on weights).
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from helpers import tiny_graph_recipe_parts
from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parents[1]
TOLERANCE = 1e-4

RECIPE = {
    "name": "ddp",
    "seed": 0,
    "stage": "finetune",
    **tiny_graph_recipe_parts(),
    "train": {
        "max_steps": 4,
        "lr": 1e-2,
        "log_every": 1,
        "progress": False,
        "device": "cpu",
        "trainable": {"tower": True},
    },
    "eval": {"enabled": False},
}


def _losses(out: Path) -> list[float]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    return [r["loss"] for r in rows]


def _start(recipe: Path, out: Path, *args: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "bridge", "train", str(recipe), "--output-dir", str(out), *args],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def _finish(proc: subprocess.Popen) -> str:
    out, _ = proc.communicate(timeout=150)
    assert proc.returncode == 0, out[-3000:]
    return out


def test_two_gloo_ranks_match_one_rank_with_the_same_global_batch(tmp_path):
    recipe = tmp_path / "ddp.yaml"
    recipe.write_text(yaml.safe_dump(RECIPE))
    one = _start(recipe, tmp_path / "one", "train.batch_size=8")  # alongside the 2-rank run
    # the 2-rank run builds its batches in a loader worker per rank: the same rank slices
    two = _start(recipe, tmp_path / "two", "--nproc", "2", "train.batch_size=4", "train.num_workers=1")
    assert "bridge: launching 2 ranks" in _finish(two)  # --nproc really started two ranks
    _finish(one)
    meta = json.loads((tmp_path / "two" / "checkpoints" / "step_4" / "meta.json").read_text())
    assert meta["world_size"] == 2 and meta["wrapper"] == "ddp"  # auto: the LLM is frozen (LoRA)
    l1, l2 = _losses(tmp_path / "one"), _losses(tmp_path / "two")
    assert l1[-1] < l1[0]  # it trains
    for a, b in zip(l1, l2):
        assert abs(a - b) <= TOLERANCE, (l1, l2)


def _checkpoint_at_step_2(src: Path, dst: Path) -> Path:
    """A copy of run `src` as it was at step 2 (a step_4 checkpoint removed)."""
    shutil.copytree(src, dst)
    shutil.rmtree(dst / "checkpoints" / "step_4", ignore_errors=True)
    return dst


def _same_weights(a: Path, b: Path) -> None:
    """The same on-disk checkpoint whichever wrapper and rank count wrote it: a ready-to-serve LLM
    dir, the encoder and the trainable LLM tensors, to TOLERANCE."""
    for rel in ("llm/model.safetensors", "encoder/graph/model.safetensors", "llm_trainable.safetensors"):
        w1, w2 = load_file(str(a / rel)), load_file(str(b / rel))
        assert w1.keys() == w2.keys(), rel
        for key in w1:
            assert w1[key].shape == w2[key].shape, (rel, key)
            assert (w1[key] - w2[key]).abs().max().item() <= TOLERANCE, (b, rel, key)


def test_fsdp_unfrozen_llm_matches_one_rank_and_resumes_on_any_rank_count(tmp_path):
    """The whole LLM trains, so `train.distributed: auto` picks FSDP2 on 2 ranks (decoder layers
    sharded, then the root), with grad accumulation (no gradient sync on the first micro-step)
    and grad clipping on DTensors. The 2-rank run stops at step 2 (checkpoint gathered from both
    ranks) and is resumed to step 4 on 2 ranks, and (a copy) on 1 rank; the 1-rank reference's
    step-2 checkpoint is resumed on 2 ranks. Each matches the 1-rank run that went straight to step
    4, losses and final checkpoint (constant LR, so stopping at 2 changes no schedule; the global
    batch is kept: per-rank batch_size x ranks).
    """
    fsdp = copy.deepcopy(RECIPE)
    fsdp["name"] = "fsdp"
    fsdp["train"].update(
        {"trainable": {"llm": True}, "grad_accum_steps": 2, "schedule": "constant", "lr": 3e-3,
         "checkpoint_every": 2}
    )
    recipe = tmp_path / "fsdp.yaml"
    recipe.write_text(yaml.safe_dump(fsdp))
    one, two = tmp_path / "one", tmp_path / "two"
    # the 1-rank reference runs alongside the first 2-rank launch (independent runs: same results)
    reference = _start(recipe, one, "train.batch_size=4")
    first = _start(recipe, two, "--nproc", "2", "train.batch_size=2", "train.max_steps=2")
    assert "bridge: launching 2 ranks" in _finish(first)
    _finish(reference)
    two_to_one = _checkpoint_at_step_2(two, tmp_path / "two_to_one")
    one_to_two = _checkpoint_at_step_2(one, tmp_path / "one_to_two")
    # resumed with a loader worker per rank: the stream starts at the resumed micro-step
    resumed = _start(recipe, two, "--nproc", "2", "train.batch_size=2", "train.num_workers=1")
    down = _start(recipe, two_to_one, "train.batch_size=4")
    resumed, down = _finish(resumed), _finish(down)
    up = _finish(_start(recipe, one_to_two, "--nproc", "2", "train.batch_size=2"))
    for out in (resumed, down, up):
        assert '"resumed_from": "' in out and out.rstrip().endswith("}")
        assert json.loads(out[out.rindex("{\n") :])["resumed_from"].endswith("step_2")

    def meta(run: Path) -> dict:
        return json.loads((run / "checkpoints" / "step_4" / "meta.json").read_text())

    assert meta(two)["wrapper"] == "fsdp" and meta(two)["world_size"] == 2 and meta(two)["llm_dir"] == "llm"
    assert meta(one)["wrapper"] == meta(two_to_one)["wrapper"] == "none"
    assert meta(one_to_two)["wrapper"] == "fsdp"
    l1 = _losses(one)
    assert l1[-1] < l1[0]  # it trains
    for run in (two, two_to_one, one_to_two):
        for a, b in zip(l1, _losses(run)):
            assert abs(a - b) <= TOLERANCE, (run.name, l1, _losses(run))
        _same_weights(one / "checkpoints" / "step_4", run / "checkpoints" / "step_4")
    base = load_file(str(two / "base_model" / "model.safetensors"))
    trained = load_file(str(two / "checkpoints" / "step_4" / "llm_trainable.safetensors"))
    assert set(trained) == set(base)  # every LLM weight trains
    moved = [k for k in base if not base[k].equal(trained[k])]
    assert moved, "no LLM weight changed: the unfrozen LLM did not train"


def _rank_pid(launcher: int, rank: int) -> int | None:
    """The pid of the child of `launcher` whose environment says RANK=rank (Linux /proc)."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) != launcher:
                continue
            env = dict(v.split(b"=", 1) for v in (entry / "environ").read_bytes().split(b"\0") if b"=" in v)
        except (OSError, ValueError, IndexError):
            continue
        if env.get(b"RANK") == str(rank).encode():
            return int(entry.name)
    return None


@pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="finds the rank's process through /proc")
def test_a_dead_rank_ends_the_run_with_one_message_and_a_loadable_checkpoint(tmp_path):
    """Rank 1 is killed (SIGKILL) mid-run: the launcher stops rank 0 and says once which rank
    failed, how, and where a rerun resumes; no traceback. The last checkpoint loads (manifest
    verified) and the run resumes from it on one rank."""
    recipe = tmp_path / "ddp.yaml"
    recipe.write_text(yaml.safe_dump(RECIPE))
    out = tmp_path / "run"
    proc = _start(recipe, out, "--nproc", "2", "train.batch_size=2", "train.max_steps=100000",
                  "train.checkpoint_every=2", "train.log_every=100")
    try:
        deadline = time.monotonic() + 120
        while not (out / "checkpoints" / "step_2" / "meta.json").is_file():
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[0][-3000:]
            time.sleep(0.1)
        pid = _rank_pid(proc.pid, 1)
        assert pid is not None
        os.kill(pid, signal.SIGKILL)
        text, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 1 and "Traceback" not in text, text[-3000:]
    last = [line for line in text.splitlines() if line.strip()][-1]
    assert last.startswith("bridge: rank 1 of 2 failed (killed by SIGKILL); stopped the other 1 rank. "
                           "The last checkpoint is step_"), text[-3000:]
    assert last.endswith("; rerun the same command to resume from it.")
    ckpt = Path(last.split(" (", 2)[2].split(")")[0])
    from bridge.api import Bridge

    assert Bridge.from_checkpoint(ckpt, device="cpu").encoders  # verified against its manifest
    step = int(ckpt.name.removeprefix("step_"))
    resumed = _finish(_start(recipe, out, "train.batch_size=4", f"train.max_steps={step + 1}"))
    assert json.loads(resumed[resumed.rindex("{\n") :])["resumed_from"] == str(ckpt)


def test_wrapper_choice_and_recipe_key():
    from bridge.recipe import RecipeError, validate
    from bridge.training.distributed import DistInfo
    from bridge.training.fsdp import resolve_wrapper

    two, one = DistInfo(0, 2, 0), DistInfo()
    assert resolve_wrapper("auto", True, two) == "fsdp"
    assert resolve_wrapper("auto", False, two) == "ddp"
    assert resolve_wrapper("ddp", True, two) == "ddp" and resolve_wrapper("fsdp", False, two) == "fsdp"
    assert resolve_wrapper("auto", True, one) == "none"  # one process: nothing to wrap
    assert resolve_wrapper("fsdp", False, one) == "fsdp"  # unless FSDP2 is asked for by name
    assert validate(RECIPE).train.distributed == "auto"
    with pytest.raises(
        RecipeError, match=r"train.distributed: 'zero3' is not one of \['auto', 'ddp', 'fsdp'\]"
    ):
        validate({**RECIPE, "train": {**RECIPE["train"], "distributed": "zero3"}})


def _union_rank(rank: int, port: int, out: str) -> None:
    import torch.distributed as dist

    from bridge.training.distributed import DistInfo, union_across_ranks

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        mine = {"a.jsonl:3", "a.jsonl:9"} if rank == 0 else {"a.jsonl:9", "a.jsonl:12"}
        union = union_across_ranks(mine, DistInfo(rank=rank, world_size=2))
        Path(out, f"rank{rank}.json").write_text(json.dumps(sorted(union)))
    finally:
        dist.destroy_process_group()


def test_skipped_rows_are_counted_over_every_rank(tmp_path):
    """`data.skip_bad_rows` counts the rows any rank passed over (each reads its own slice), once each: the
    union across ranks, which every rank gets (so rank 0's metrics and summary say the whole run's)."""
    import socket

    import torch.multiprocessing as mp

    from bridge.training.distributed import DistInfo, union_across_ranks

    assert union_across_ranks({"x:1"}, DistInfo()) == {"x:1"}  # one rank: its own
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(_union_rank, args=(port, str(tmp_path)), nprocs=2, start_method="spawn")
    want = ["a.jsonl:12", "a.jsonl:3", "a.jsonl:9"]
    assert [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)] == [want, want]
