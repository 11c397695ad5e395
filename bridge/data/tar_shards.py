"""Local webdataset tar shards -> Examples (`data.source: webdataset`).

A shard is a plain tar whose files are grouped into samples by key, as webdataset groups them:
`KEY.EXT` with the key running up to the first dot of the file name (`train/0001.jpg` and
`train/0001.txt` are one sample, key `train/0001`; `a.seg.png` has the extension `seg.png`),
consecutive files with the same key forming one sample, extensions compared in lower case, metadata
(`__...__` names, and what lies in `__...__/` folders) ignored. A sample holds one media file (`png`,
`jpg`, `jpeg`, `webp`, `bmp`, `gif`, `tif`, `tiff`; `wav` for audio; `graph.json` for a graph) and
its text: `KEY.txt` (the target) or `KEY.json` (an object whose `data.target_field` is the target,
whose `prompt` may be the sample's own prompt, and whose fields the recipe's `{field}`s name).
`data.columns` picks other extensions (`{image: jpg, text: caption.txt}`). `data.train` takes a
brace pattern (`shards/train-{00000..00099}.tar`) or a glob.

Why plain `tarfile` and not the webdataset library's pipeline: the trainer's data order is a pure
function of (seed, step), which is what makes a resumed run continue exactly, ranks take disjoint
slices and any loader worker count give the same batches; a streaming pipeline's order depends on
its shuffle buffer, its workers and how far it has read. So each shard is streamed once, shard by
shard, reading only the tar headers and the small text files (never an image), into an index of
where each sample's files sit (a few numbers a sample, in NumPy arrays); a sample is then read with
two positioned reads (`os.pread`, safe in forked loader workers that share file descriptors). The
whole set is never loaded, and nothing is written. Shards must be uncompressed tars (webdataset's
usual form): a `.tar.gz` cannot be read at an offset without decompressing everything before it.

Problems found by streaming are named `shard:key`; a shard that cannot be read, is not a tar or ends
in the middle of a file is the whole shard's problem and is never skipped.
"""

from __future__ import annotations

import json
import os
import re
import string
import tarfile
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bridge.data.bad_rows import BadRow
from bridge.data.example import PLACEHOLDER_RE, PLACEHOLDERS, Example, target_words
from bridge.data.jsonl_check import TARGET_TOKEN_SLACK, DataScan, path_problem
from bridge.data.paths import expand_data_paths
from encoders.media_budget import MediaBudget, MediaLimits

#: media extensions per modality (webdataset's usual names)
MEDIA_EXTS: dict[str, tuple[str, ...]] = {
    "image": ("png", "jpg", "jpeg", "webp", "bmp", "gif", "tif", "tiff"),
    "audio": ("wav",),
    "graph": ("graph.json",),
}
#: webdataset's split of a file name into (key, extension): the key runs to the first dot of the
#: last path component (webdataset.tariterators.base_plus_ext)
_KEY_EXT = re.compile(r"^((?:.*/|)[^.]+)[.]([^/]*)$")
#: webdataset's metadata files (skipped)
_META = re.compile(r"__[^/]*__($|/)")
#: a text file larger than this is not a caption
MAX_TEXT_BYTES = 1 << 20


def split_key(name: str) -> tuple[str | None, str | None]:
    """(key, extension in lower case) of a tar member's name, as webdataset splits it."""
    match = _KEY_EXT.match(name)
    if not match:
        return None, None
    return match.group(1), match.group(2).lower()


@dataclass
class ShardFormat:
    """Which extensions play which role (from data.columns), and the JSON target field."""

    target_field: str = "text"
    media_exts: dict[str, tuple[str, ...]] = field(default_factory=lambda: dict(MEDIA_EXTS))
    text_exts: tuple[str, ...] = ("txt", "json")

    @classmethod
    def from_columns(cls, columns: Mapping[str, str] | None, target_field: str) -> ShardFormat:
        columns = dict(columns or {})
        if "prompt" in columns:
            raise ValueError("data.columns.prompt: a webdataset sample's own prompt is the 'prompt' field of "
                             "its KEY.json")
        fmt = cls(target_field)
        for mod in MEDIA_EXTS:
            if mod in columns:
                fmt.media_exts = {**fmt.media_exts, mod: (columns[mod].lower().lstrip("."),)}
        if "text" in columns:
            fmt.text_exts = (columns["text"].lower().lstrip("."),)
        return fmt


@dataclass
class _Sample:
    key: str
    members: dict[str, tarfile.TarInfo]


def _samples(tf: tarfile.TarFile, label: str) -> Iterator[tuple[_Sample, str | None]]:
    """The shard's samples in order, each with a problem of its own (a repeated extension) or None.
    Raises tarfile.ReadError / OSError for a shard that cannot be read to its end."""
    current: _Sample | None = None
    problem = None
    seen = 0
    while True:
        member = tf.next()
        seen += 1
        if seen % 1024 == 0:
            tf.members = []  # only the offsets are kept (below): a shard's TarInfo list would grow
        if member is None:
            break
        name = member.name
        if not member.isfile() or _META.match(name) or ("/" not in name and name[:2] == name[-2:] == "__"):
            continue
        key, ext = split_key(member.name)
        if key is None:
            continue
        if current is None or key != current.key:
            if current is not None:
                yield current, problem
            current, problem = _Sample(key, {}), None
        if ext in current.members:
            problem = f"two files with the extension {ext!r} (a sample's files are consecutive, each once)"
        current.members[ext] = member
    if current is not None:
        yield current, problem


@dataclass
class ShardIndex:
    """Where every good sample's files are: shard, key, and per role (offset, size) in the shard
    (-1 when the sample has none), in NumPy arrays (see the module docstring)."""

    shards: list[str] = field(default_factory=list)
    shard: list[int] = field(default_factory=list)
    keys: list[str] = field(default_factory=list)
    media: dict[str, tuple[list[int], list[int]]] = field(default_factory=dict)
    text: tuple[list[int], list[int]] = field(default_factory=lambda: ([], []))
    text_json: list[bool] = field(default_factory=list)

    def add(self, shard: int, key: str, media: dict[str, tarfile.TarInfo], text: tarfile.TarInfo,
            is_json: bool) -> None:
        self.shard.append(shard)
        self.keys.append(key)
        for mod in MEDIA_EXTS:
            offs, sizes = self.media.setdefault(mod, ([], []))
            info = media.get(mod)
            offs.append(info.offset_data if info else -1)
            sizes.append(info.size if info else -1)
        self.text[0].append(text.offset_data)
        self.text[1].append(text.size)
        self.text_json.append(is_json)

    def freeze(self) -> _FrozenIndex:
        import numpy as np

        return _FrozenIndex(
            self.shards,
            np.asarray(self.shard, dtype=np.int32),
            np.asarray([k.encode() for k in self.keys], dtype=np.bytes_),
            {m: (np.asarray(o, dtype=np.int64), np.asarray(s, dtype=np.int64))
             for m, (o, s) in self.media.items()},
            (np.asarray(self.text[0], dtype=np.int64), np.asarray(self.text[1], dtype=np.int64)),
            np.asarray(self.text_json, dtype=bool),
        )


@dataclass
class _FrozenIndex:
    shards: list[str]
    shard: Any
    keys: Any
    media: dict[str, tuple[Any, Any]]
    text: tuple[Any, Any]
    text_json: Any

    def __len__(self) -> int:
        return len(self.shard)

    def select(self, keep) -> _FrozenIndex:
        return _FrozenIndex(self.shards, self.shard[keep], self.keys[keep],
                            {m: (o[keep], s[keep]) for m, (o, s) in self.media.items()},
                            (self.text[0][keep], self.text[1][keep]), self.text_json[keep])


@dataclass
class _Text:
    target: str
    prompt: str | None
    fields: dict[str, Any]


def _read_text(data: bytes, is_json: bool, target_field: str) -> _Text:
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"the text is not UTF-8 (byte {exc.start})") from None
    if not is_json:
        return _Text(text.strip(), None, {})
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"the .json is not valid JSON ({exc.msg} at line {exc.lineno})") from None
    if not isinstance(obj, dict):
        raise ValueError("the .json must be an object")
    target = obj.get(target_field)
    if not isinstance(target, str):
        raise ValueError(f"the .json has no string field {target_field!r}")
    own = obj.get("prompt")
    if own is not None and not isinstance(own, str):
        raise ValueError(f"the .json's 'prompt' must be a string, got {type(own).__name__}")
    return _Text(target, own, obj)


def _render(template: str, fields: list[str], text: _Text) -> str:
    if text.prompt:
        return text.prompt
    if not fields:
        return template
    missing = [f for f in fields if f not in text.fields]
    if missing:
        raise ValueError(f"the prompt template references {missing}, which the sample's .json lacks")
    try:
        return template.format_map(text.fields)
    except (ValueError, KeyError, IndexError, AttributeError) as exc:
        raise ValueError(f"prompt template {template[:80]!r}: {exc}") from None


def _check_sample(sample: _Sample, fmt: ShardFormat, template: str, fields: list[str], tf: tarfile.TarFile
                  ) -> tuple[dict[str, tarfile.TarInfo], tarfile.TarInfo, bool, _Text]:
    """The sample's media member per modality, its text member (and whether it is JSON) and text;
    ValueError saying what is wrong with the sample."""
    media: dict[str, tarfile.TarInfo] = {}
    for mod, exts in fmt.media_exts.items():
        found = [e for e in exts if e in sample.members]
        if len(found) > 1:
            raise ValueError(f"several {mod} files ({', '.join(found)}); a sample holds one "
                             f"(data.columns.{mod} picks the extension)")
        if found:
            media[mod] = sample.members[found[0]]
    text_ext = next((e for e in fmt.text_exts if e in sample.members), None)
    if text_ext is None:
        raise ValueError(f"no text file ({' or '.join('.' + e for e in fmt.text_exts)}); its files: "
                         f"{', '.join(sorted(sample.members))}")
    info = sample.members[text_ext]
    if info.size > MAX_TEXT_BYTES:
        raise ValueError(f"the .{text_ext} file is {info.size} bytes, over {MAX_TEXT_BYTES}")
    handle = tf.extractfile(info)
    data = handle.read() if handle is not None else b""
    if len(data) != info.size:
        raise tarfile.ReadError(f"unexpected end of data in {sample.key}.{text_ext}")
    is_json = text_ext.endswith("json")
    text = _read_text(data, is_json, fmt.target_field)
    prompt = _render(template, fields, text)
    wanted: dict[str, int] = {}
    for m in PLACEHOLDER_RE.finditer(prompt):
        wanted[PLACEHOLDERS[m.group(0)]] = wanted.get(PLACEHOLDERS[m.group(0)], 0) + 1
    given = {mod: 1 for mod in media}
    if wanted != given:
        raise ValueError(f"prompt {prompt[:80]!r} has placeholders {wanted or '{}'} but the sample's media "
                         f"are {given or '{}'} (its files: {', '.join(sorted(sample.members))})")
    return media, info, is_json, text


def _open_shard(path: Path) -> tarfile.TarFile:
    why = path_problem(path)
    if why:
        raise ValueError(f"{path}: {why}")
    with open(path, "rb") as f:
        magic = f.read(3)
    if magic[:2] == b"\x1f\x8b" or magic == b"BZh" or magic[:3] == b"\xfd7z":
        raise ValueError(f"{path}: a compressed tar; shards are read at offsets, so they must be plain .tar "
                         "(uncompress it)")
    try:
        return tarfile.open(path, "r:")
    except (tarfile.TarError, OSError) as exc:
        raise ValueError(f"{path}: not a readable tar file ({exc})") from None


def index_shards(spec: str, *, template: str, fmt: ShardFormat, scan: DataScan, index: ShardIndex | None,
                 byte_limit: int | None = None, texts: list[str] | None = None) -> None:
    """Stream every shard `spec` names, shard by shard: each sample's problem goes to `scan` (named
    `shard:key`), each good sample to `index` (when given) and its target to `texts` (when given).
    A shard that cannot be read to its end is the shard's problem (`scan.file_problems`)."""
    fields = [n for _, n, _, _ in string.Formatter().parse(template) if n]
    try:
        shards = expand_data_paths(spec)
    except ValueError as exc:
        scan.add(f"{spec}: {exc}")
        return
    for path in shards:
        label = str(path)
        try:
            tf = _open_shard(path)
        except ValueError as exc:
            scan.add(str(exc))
            continue
        number = len(index.shards) if index is not None else 0
        if index is not None:
            index.shards.append(label)
        try:
            with tf:
                for sample, problem in _samples(tf, label):
                    scan.rows += 1
                    where = f"{label}:{sample.key}"
                    if problem is None:
                        try:
                            media, info, is_json, text = _check_sample(sample, fmt, template, fields, tf)
                        except ValueError as exc:
                            problem = str(exc)
                    if problem is not None:
                        scan.add(f"{where}: {problem}", where)
                        continue
                    if index is not None:
                        index.add(number, sample.key, media, info, is_json)
                    if texts is not None:
                        texts.append(text.target)
                    if byte_limit is not None and len(text.target.encode()) > byte_limit:
                        scan.long_targets.append((where, text.target))
        except (tarfile.TarError, OSError) as exc:
            scan.add(f"{label}: not a readable tar file ({exc}); the shard is cut short or damaged")
    if scan.rows == 0 and not scan.file_problems:
        scan.add(f"{spec}: no samples")


def scan_shards(spec: str, *, prompt: str, target_field: str = "text",
                columns: Mapping[str, str] | None = None, max_target_tokens: int | None = None) -> DataScan:
    """The check before a run: every sample of every shard (see `index_shards`); nothing written."""
    scan = DataScan(Path(spec))
    try:
        fmt = ShardFormat.from_columns(columns, target_field)
    except ValueError as exc:
        scan.add(str(exc))
        return scan
    byte_limit = None if max_target_tokens is None else max_target_tokens - TARGET_TOKEN_SLACK
    index_shards(spec, template=prompt, fmt=fmt, scan=scan, index=None, byte_limit=byte_limit)
    return scan


def shard_target_texts(spec: str, *, prompt: str = "<image>", target_field: str = "text",
                       columns: Mapping[str, str] | None = None) -> list[str]:
    """Every good sample's target (a tiny model's vocabulary: what `ShardDataset.vocab_words` reads)."""
    texts: list[str] = []
    index_shards(spec, template=prompt, fmt=ShardFormat.from_columns(columns, target_field),
                 scan=DataScan(Path(spec)), index=None, texts=texts)
    return texts


#: per process: shard path -> an open descriptor (forked workers open their own: see _fd)
_FDS: dict[tuple[int, str], int] = {}


def _read_at(path: str, offset: int, size: int) -> bytes:
    key = (os.getpid(), path)
    fd = _FDS.get(key)
    if fd is None:
        fd = _FDS[key] = os.open(path, os.O_RDONLY)
    data = os.pread(fd, size, offset)
    if len(data) != size:
        raise OSError(f"{path}: ends early (a file at byte {offset} should hold {size} bytes); was the shard "
                      "changed after the run started?")
    return data


class ShardDataset:
    """Samples of local tar shards as Examples (see the module docstring). `media_root` is taken for
    the file sources' common signature; a shard holds its media itself."""

    def __init__(self, spec: str, *, prompt: str = "<image>", target_field: str = "text",
                 columns: Mapping[str, str] | None = None, media_root: str | Path | None = None,
                 media_limits: MediaLimits | None = None, skip_bad_rows: bool = False):
        self.spec = str(spec)
        self.prompt = prompt
        self.fmt = ShardFormat.from_columns(columns, target_field)
        self.fields = [n for _, n, _, _ in string.Formatter().parse(prompt) if n]
        self.media_limits = media_limits or MediaLimits()
        self.skip_bad_rows = skip_bad_rows
        scan = DataScan(Path(spec), keep=1 << 62)  # every bad sample is named in `skipped`
        index = ShardIndex()
        index_shards(self.spec, template=prompt, fmt=self.fmt, scan=scan, index=index)
        if scan.file_problems:
            raise ValueError(scan.file_problems[0])
        if scan.num_problems and not skip_bad_rows:
            raise BadRow(scan.problems[0])
        #: "shard:key: why" of every sample left out (skip_bad_rows)
        self.skipped: list[str] = list(scan.problems)
        self.index = index.freeze()
        if len(self.index) == 0:
            left = " left after skipping bad ones" if self.skipped else ""
            raise ValueError(f"{self.spec}: no samples{left}")

    def __len__(self) -> int:
        return len(self.index)

    def where(self, i: int) -> str:
        return f"{self.index.shards[self.index.shard[i]]}:{self.index.keys[i].decode()}"

    def _text(self, i: int) -> _Text:
        path = self.index.shards[self.index.shard[i]]
        data = _read_at(path, int(self.index.text[0][i]), int(self.index.text[1][i]))
        return _read_text(data, bool(self.index.text_json[i]), self.fmt.target_field)

    def __getitem__(self, i: int) -> Example:
        from bridge.data.media_values import media_item

        path = self.index.shards[self.index.shard[i]]
        text = self._text(i)
        budget = MediaBudget(self.media_limits, scope="row")
        media: dict[str, list[Any]] = {}
        for mod, (offs, sizes) in self.index.media.items():
            if offs[i] < 0:
                continue
            data = _read_at(path, int(offs[i]), int(sizes[i]))
            try:
                media[mod] = [media_item(mod, data, Path(path).parent, budget)]
            except ValueError as exc:
                raise BadRow(f"{self.where(i)}: {mod}: {exc}") from None
        return Example(_render(self.prompt, self.fields, text), text.target, media)

    def vocab_words(self) -> list[str]:
        return target_words(self._text(i).target for i in range(len(self)))

    def check_all_items(self) -> None:
        """Decode every sample (the eval set, before training); a bad one raises BadRow, or with
        skip_bad_rows is dropped."""
        import numpy as np

        keep = []
        for i in range(len(self)):
            try:
                self[i]
            except BadRow as exc:
                if not self.skip_bad_rows:
                    raise
                self.skipped.append(str(exc))
                continue
            keep.append(i)
        if len(keep) < len(self):
            self.index = self.index.select(np.asarray(keep, dtype=np.int64))
            if len(self.index) == 0:
                raise ValueError(f"{self.spec}: no samples left after skipping bad ones")
