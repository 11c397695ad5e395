"""Multi-GPU training over NCCL: `bridge train --nproc 2` (DDP, FSDP2) against one GPU, same global batch.

One command, a machine with 2 GPUs (about 4 minutes on two H200s):

    python benchmarks/multi_gpu_train.py [--steps 40] [--batch 32] [--out results.json]

Workload: the shapes vision recipe on a Qwen3-0.6B-shaped LLM body (hidden 1024, 28 layers, 16 heads,
8 KV heads, head_dim 128, intermediate 3072; the vocabulary is the caption words, built by
`model.tiny`, random weights) with a conv image tower, bf16 autocast, global batch `--batch`.

Two settings, each run on one GPU (`train.batch_size=B`) and on two (`--nproc 2`, `train.batch_size=B/2`,
so the global batch is the same), through the real CLI (`python -m bridge train`, which starts the
ranks with torchrun's environment; NCCL backend):

- ddp: stage align (the projector trains, tower and LLM frozen), `train.distributed=ddp`;
- fsdp: stage finetune with the whole LLM and the projector training, `train.distributed=fsdp`
  (FSDP2, one unit per decoder layer; fp32 weights, so its math matches the 1-GPU run);
- fsdp_bf16 (`--settings fsdp_bf16`): the same with `train.mixed_precision=bf16` (bf16 all-gathers,
  fp32 reduction).

`--precision fp32` trains without autocast and with TF32 off (NVIDIA_TF32_OVERRIDE=0): the run that
shows the 1- and 2-GPU losses agree to float rounding; bf16 (the default) is the speed run.

Reported per setting: the largest per-step difference of the logged losses between the 1-GPU and the
2-GPU run (the same global batch is drawn on both; reduction order differs, so bf16 autocast gives
small differences, not bit equality), and steady-state samples/s (steps 10 to the end, derived from the
trainer's cumulative `samples_per_s` in metrics.jsonl) for the 2-GPU run in total and per rank, next to
the 1-GPU run's.

`--workloads T1,T2` runs the LLaVA-shaped workloads of `train_scale.py` instead (T1 align on DDP, T2
whole-LLM finetune on FSDP2, their data as image files on disk) on 1 GPU and on `--nproc` GPUs at the
same global batch: samples/s per GPU against one GPU (scaling efficiency), the loss curves side by side,
and for T2 a resume of the N-GPU run's mid-run checkpoint onto one GPU, whose losses must follow the
one-GPU run's. `--smoke` runs the same on the CPU (gloo, tiny shapes, 2 ranks).

    python benchmarks/multi_gpu_train.py --workloads T1,T2 --nproc 2 [--steps 50]
    python benchmarks/multi_gpu_train.py --workloads T1,T2 --smoke

Writes JSON to `--out`, else `$OUT/multi_gpu_train.json` when `$OUT` is set.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time

import yaml

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))
from generate import QWEN3_06B, write_results  # noqa: E402

LLM_SHAPE = {k: QWEN3_06B[k] for k in ("hidden_size", "num_heads", "num_kv_heads", "head_dim",
                                       "intermediate_size")}
SETTINGS = {
    "ddp": {"stage": "align", "trainable": {"projector": True}, "distributed": "ddp"},
    "fsdp": {"stage": "finetune", "trainable": {"projector": True, "llm": True}, "distributed": "fsdp"},
    "fsdp_bf16": {"stage": "finetune", "trainable": {"projector": True, "llm": True}, "distributed": "fsdp",
                  "mixed_precision": "bf16"},
}
WARM_STEPS = 10


def recipe(setting: str, steps: int, num_layers: int, precision: str) -> dict:
    s = SETTINGS[setting]
    extra = {"mixed_precision": s["mixed_precision"]} if "mixed_precision" in s else {}
    return {
        "name": f"multi-gpu-{setting}",
        "seed": 0,
        "stage": s["stage"],
        "model": {"tiny": {"family": "qwen3", "num_layers": num_layers, "dtype": "float32", **LLM_SHAPE}},
        "encoder": {"modality": "image",
                    "tower": {"name": "conv", "image_size": 32, "channels": [32, 64, 128]},
                    "projector": {"name": "mlp", "num_layers": 2}},
        "data": {"source": "shapes", "prompt": "<image>", "num_train": 20000, "num_eval": 10,
                 "options": {"image_size": 32}},
        "train": {"trainable": s["trainable"], "max_steps": steps, "lr": 1e-4, "schedule": "constant",
                  "log_every": 1, "precision": precision, "device": "cuda", "distributed": s["distributed"],
                  "progress": False, "checkpoint_every": 0, "grad_clip": 1.0, **extra},
        "eval": {"enabled": False},
    }


def train(recipe_path: pathlib.Path, out: pathlib.Path, batch: int, nproc: int, gpus: str,
          extra: tuple[str, ...] = (), force: bool = True) -> dict:
    cmd = [sys.executable, "-m", "bridge", "train", str(recipe_path), "--output-dir", str(out),
           *(["--force"] if force else []), f"train.batch_size={batch}", *extra]
    if nproc > 1:
        cmd[4:4] = ["--nproc", str(nproc)]
    env = {**os.environ, **({"CUDA_VISIBLE_DEVICES": gpus} if gpus else {}),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}):\n"
                           f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "loss" in r]
    return {"losses": [r["loss"] for r in rows], "steps": [r["step"] for r in rows],
            "cumulative_samples_per_s": [r["samples_per_s"] for r in rows],
            "wall_seconds": wall, "command": " ".join(cmd[1:]), "log_tail": proc.stderr[-600:]}


def steady_samples_per_s(run: dict, batch: int) -> float:
    """Samples/s between step WARM_STEPS and the last step, from the cumulative rates the trainer logs."""
    rates = run["cumulative_samples_per_s"]
    n = len(rates)
    elapsed = [(i + 1) * batch / r for i, r in enumerate(rates)]
    return (n - WARM_STEPS) * batch / (elapsed[-1] - elapsed[WARM_STEPS - 1])


def _allreduce_worker(rank: int, world: int, port: int, nbytes: int, queue) -> None:
    import torch
    import torch.distributed as dist

    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    torch.cuda.set_device(rank)
    x = torch.ones(nbytes // 4, device="cuda")
    for _ in range(3):
        dist.all_reduce(x)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(10):
        dist.all_reduce(x)
    torch.cuda.synchronize()
    dt = (time.perf_counter() - t0) / 10
    if rank == 0:  # NCCL's bus bandwidth convention: 2 (n - 1) / n of the buffer crosses each link
        queue.put(2 * (world - 1) / world * nbytes / dt)
    dist.destroy_process_group()


def nccl_allreduce_bus_bandwidth(nbytes: int = 1 << 28) -> float:
    """All-reduce bus bandwidth between the two GPUs (bytes/s): what FSDP's gathers and reductions ride on."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    mp.start_processes(_allreduce_worker, args=(2, port, nbytes, queue), nprocs=2, start_method="spawn")
    return queue.get()


def scale_workloads(args, work: pathlib.Path) -> dict:
    """T1 (DDP) and T2 (FSDP2) of train_scale.py on one GPU and on `args.nproc`, same global batch."""
    import random

    import train_scale as ts

    from bridge.tiny_models import build_tiny_model

    n, smoke = args.nproc, args.smoke
    ns = argparse.Namespace(smoke=smoke, batch=args.batch, steps=args.steps, warmup=0,
                            device="cpu" if smoke else "cuda", num_workers=0 if smoke else 8,
                            eager_variant=False)
    shape = dict(ts.LLMS["tiny-qwen3" if smoke else "qwen3-1.7b"])
    family = shape.pop("family")
    import torch

    llm_dir = build_tiny_model(work / "llm", family, vocab_words=ts.WORDS + ts.PROMPT_WORDS,
                               dtype=torch.float32 if smoke else torch.bfloat16, **shape)
    gpus_one, gpus_all = ("", "") if smoke else ("0", ",".join(str(i) for i in range(n)))
    out: dict = {}
    for name in args.workloads.split(","):
        data = ts.build_workload_data(name, work / name, ns, random.Random(0))
        r = ts.recipe_for(name, ns, llm_dir, data, work / name / "media")
        r["train"].update(max_steps=args.steps, log_every=1, checkpoint_every=0,
                          distributed="ddp" if name == "T1" else "fsdp")
        path = work / f"{name}.yaml"
        path.write_text(yaml.safe_dump(r))
        print(f"[{time.strftime('%H:%M:%S')}] {name}: one {'rank' if smoke else 'GPU'}, batch {args.batch}",
              flush=True)
        one = train(path, work / f"{name}_1", args.batch, 1, gpus_one)
        print(f"[{time.strftime('%H:%M:%S')}] {name}: {n} ranks, batch {args.batch // n} each", flush=True)
        many = train(path, work / f"{name}_{n}", args.batch // n, n, gpus_all)
        warm = min(WARM_STEPS, args.steps // 2)
        rate_one, rate_many = (_steady(run, args.batch, warm) for run in (one, many))
        diffs = [abs(a - b) for a, b in zip(one["losses"], many["losses"])]
        entry = {"one": one, "many": many, "ranks": n, "samples_per_s_one": rate_one,
                 "samples_per_s_many": rate_many, "per_gpu_scaling": rate_many / n / rate_one,
                 "max_abs_loss_diff": max(diffs), "mean_abs_loss_diff": sum(diffs) / len(diffs)}
        if name == "T2":  # N ranks write a checkpoint halfway; one rank resumes it to the end
            half = args.steps // 2
            run = work / f"{name}_{n}_to_1"
            train(path, run, args.batch // n, n, gpus_all,
                  (f"train.max_steps={half}", f"train.checkpoint_every={half}"))
            resumed = train(path, run, args.batch, 1, gpus_one, force=False)
            after = {s: loss for s, loss in zip(resumed["steps"], resumed["losses"]) if s > half}
            ref = {s: loss for s, loss in zip(one["steps"], one["losses"]) if s > half}
            entry["resume_n_to_1_max_abs_loss_diff"] = max(abs(after[s] - ref[s]) for s in ref)
            entry["resume_steps_compared"] = len(ref)
        out[name] = entry
        print(f"{name}: 1 = {rate_one:.1f} samples/s, {n} = {rate_many:.1f} samples/s, per-GPU scaling "
              f"{entry['per_gpu_scaling']:.2f}, max |dloss| {entry['max_abs_loss_diff']:.2e}"
              + (f", resumed {n}->1 max |dloss| {entry['resume_n_to_1_max_abs_loss_diff']:.2e}"
                 if "resume_n_to_1_max_abs_loss_diff" in entry else ""), flush=True)
    return out


def _steady(run: dict, batch: int, warm: int) -> float:
    rates = run["cumulative_samples_per_s"]
    elapsed = [(i + 1) * batch / r for i, r in enumerate(rates)]
    return (len(rates) - warm) * batch / (elapsed[-1] - elapsed[warm - 1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--batch", type=int, default=32, help="global batch (each of 2 ranks takes half)")
    ap.add_argument("--num-layers", type=int, default=QWEN3_06B["num_layers"])
    ap.add_argument("--settings", nargs="+", default=["ddp", "fsdp"], choices=list(SETTINGS))
    ap.add_argument("--precision", default="bf16", choices=("bf16", "fp32"),
                    help="bf16 autocast (speed) or fp32 with TF32 off (the 1- vs 2-GPU match)")
    ap.add_argument("--out", default=None)
    ap.add_argument("--workloads", default=None,
                    help="T1,T2: train_scale.py's workloads instead of --settings")
    ap.add_argument("--nproc", type=int, default=2, help="ranks for --workloads")
    ap.add_argument("--smoke", action="store_true", help="--workloads on the CPU: gloo, tiny shapes")
    args = ap.parse_args()
    import torch

    if args.workloads:
        if not args.smoke and torch.cuda.device_count() < args.nproc:
            print(f"needs {args.nproc} GPUs, found {torch.cuda.device_count()}")
            return 2
        if args.smoke:
            args.steps, args.batch = min(args.steps, 6), min(args.batch, 8)
        work = pathlib.Path(tempfile.mkdtemp(prefix="bridge_multi_gpu_"))
        results = {"workloads": scale_workloads(args, work), "global_batch": args.batch,
                   "steps": args.steps, "torch": torch.__version__,
                   "device": "cpu" if args.smoke else torch.cuda.get_device_name(0)}
        write_results(results, args.out, "multi_gpu_train.json")
        return 0

    if torch.cuda.device_count() < 2:
        print(f"needs 2 GPUs, found {torch.cuda.device_count()}")
        return 2
    work = pathlib.Path(tempfile.mkdtemp(prefix="bridge_multi_gpu_"))
    if args.precision == "fp32":  # no TF32 in the children either: torch reads this at start-up
        os.environ["NVIDIA_TF32_OVERRIDE"] = "0"
    results: dict = {"precision": args.precision, "device": torch.cuda.get_device_name(0),
                     "gpus": torch.cuda.device_count(), "torch": torch.__version__,
                     "global_batch": args.batch, "steps": args.steps, "settings": {}}
    results["nccl_allreduce_bus_GBps"] = nccl_allreduce_bus_bandwidth() / 1e9
    print(f"NCCL all-reduce bus bandwidth: {results['nccl_allreduce_bus_GBps']:.1f} GB/s", flush=True)
    for setting in args.settings:
        path = work / f"{setting}.yaml"
        path.write_text(yaml.safe_dump(recipe(setting, args.steps, args.num_layers, args.precision)))
        print(f"[{time.strftime('%H:%M:%S')}] {setting}: one GPU, batch {args.batch}", flush=True)
        one = train(path, work / f"{setting}_1gpu", args.batch, 1, "0")
        print(f"[{time.strftime('%H:%M:%S')}] {setting}: two GPUs, batch {args.batch // 2} per rank",
              flush=True)
        two = train(path, work / f"{setting}_2gpu", args.batch // 2, 2, "0,1")
        diffs = [abs(a - b) for a, b in zip(one["losses"], two["losses"])]
        entry = {
            "one_gpu": one, "two_gpus": two,
            "max_abs_loss_diff": max(diffs), "loss_first_last_1gpu": [one["losses"][0], one["losses"][-1]],
            "loss_first_last_2gpu": [two["losses"][0], two["losses"][-1]],
            "samples_per_s_1gpu": steady_samples_per_s(one, args.batch),
            "samples_per_s_2gpu": steady_samples_per_s(two, args.batch),
        }
        entry["samples_per_s_per_rank_2gpu"] = entry["samples_per_s_2gpu"] / 2
        entry["scaling"] = entry["samples_per_s_2gpu"] / entry["samples_per_s_1gpu"]
        results["settings"][f"{setting}/{args.precision}"] = entry
    print()
    header = (f"{'setting':<15}{'max |dloss|':>13}{'1 GPU sam/s':>13}{'2 GPU sam/s':>13}"
              f"{'per rank':>10}{'scaling':>9}")
    print(header)
    print("-" * len(header))
    for name, e in results["settings"].items():
        print(f"{name:<15}{e['max_abs_loss_diff']:>13.2e}{e['samples_per_s_1gpu']:>13.1f}{e['samples_per_s_2gpu']:>13.1f}"
              f"{e['samples_per_s_per_rank_2gpu']:>10.1f}{e['scaling']:>9.2f}")
        print(f"  losses 1 GPU {e['loss_first_last_1gpu']}, 2 GPUs {e['loss_first_last_2gpu']}")
    write_results(results, args.out, "multi_gpu_train.json")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
