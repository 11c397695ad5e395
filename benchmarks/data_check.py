"""The check `bridge train` makes of a JSONL data set before it writes anything, on a million rows.

Workload: a JSONL file of `--rows` rows (default 1,000,000) like `{"image": "imgs/00042.png", "text":
"a red circle"}`, each naming one of `--files` real small PNG files (default 4,096: a data set that
names a few thousand files many times, as LLaVA-style sets reuse their images across conversations).
Everything is written under a temp folder (or `--dir`) and removed afterwards.

Contenders, on the same file:
- the check (`bridge.data.jsonl_check.scan_jsonl`, what `bridge.run_check.check_run` runs for the train
  and eval files): every row parsed, every media path checked once; median of `--repeats` runs;
- its peer, the data set's own load (`bridge.data.jsonl.JsonlDataset`, which reads each row's image
  header), timed on the first `--peer-rows` rows and reported per row and extrapolated to all rows,
  because the whole file would take minutes.

The files sit in the page cache after they are written, as they do on a machine that just prepared
its data; a cold cache adds one `stat` per distinct file to the check.

    python3 benchmarks/data_check.py                    # 1M rows (CPU only; no GPU needed)
    python3 benchmarks/data_check.py --rows 20000 --files 256 --peer-rows 2000 --repeats 1   # smoke
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

CAPTIONS = ("a red circle", "a blue triangle", "two green squares on a dark background", "a wheel")


def build(folder: Path, rows: int, files: int) -> Path:
    import numpy as np
    from PIL import Image

    imgs = folder / "imgs"
    imgs.mkdir(parents=True)
    rng = np.random.default_rng(0)
    for i in range(files):
        Image.fromarray(rng.integers(0, 255, (8, 8, 3), dtype=np.uint8)).save(imgs / f"{i:05d}.png")
    path = folder / "train.jsonl"
    with path.open("w") as f:
        for i in range(rows):
            f.write(json.dumps({"image": f"imgs/{i % files:05d}.png", "text": CAPTIONS[i % len(CAPTIONS)]}))
            f.write("\n")
    return path


def time_check(path: Path, repeats: int) -> tuple[float, int]:
    from bridge.data.jsonl_check import scan_jsonl

    times, problems = [], 0
    for _ in range(repeats):
        t0 = time.perf_counter()
        scan = scan_jsonl(path, prompt="<image>", max_target_tokens=1024)
        times.append(time.perf_counter() - t0)
        problems = scan.num_problems
    return statistics.median(times), problems


def time_peer(path: Path, rows: int) -> float:
    """Seconds per row of JsonlDataset's load over the first `rows` rows."""
    from bridge.data.jsonl import JsonlDataset

    head = path.with_name("head.jsonl")
    with path.open() as src, head.open("w") as dst:
        for _, line in zip(range(rows), src):
            dst.write(line)
    t0 = time.perf_counter()
    JsonlDataset(head, prompt="<image>")
    return (time.perf_counter() - t0) / rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--files", type=int, default=4096)
    parser.add_argument("--peer-rows", type=int, default=20_000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", default=None, help="where to write the data set (default: a temp folder)")
    args = parser.parse_args()
    folder = Path(tempfile.mkdtemp(prefix="bridge-data-check-", dir=args.dir))
    try:
        t0 = time.perf_counter()
        path = build(folder, args.rows, args.files)
        built = time.perf_counter() - t0
        size = path.stat().st_size
        check_s, problems = time_check(path, args.repeats)
        assert problems == 0, problems
        per_row = time_peer(path, min(args.peer_rows, args.rows))
        print(f"data set: {args.rows:,} rows naming {args.files:,} PNG files, "
              f"{size / 2**20:.0f} MiB of JSONL (built in {built:.1f} s)")
        print(f"check (jsonl_check.scan_jsonl): {check_s:.2f} s median of {args.repeats} "
              f"({args.rows / check_s / 1e3:.0f}k rows/s)")
        peer_rows = min(args.peer_rows, args.rows)
        print(f"peer (JsonlDataset load, first {peer_rows:,} rows): {per_row * 1e6:.1f} us/row, "
              f"{per_row * args.rows:.1f} s extrapolated to {args.rows:,} rows")
    finally:
        shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
