"""A local Hugging Face `datasets` data set -> Examples (`data.source: hf`).

`data.train` is a `save_to_disk` folder, a parquet file, or a brace / glob pattern of either (several
are read as one set, in pattern order). Nothing is downloaded. Columns by default: `image`, `audio`,
`graph` (media; any of them may be absent), `text` (the target: `data.target_field`) and `prompt`
(a row's own prompt, else the recipe's template, whose `{field}`s name columns); `data.columns`
renames them (`{image: img, text: caption}`). Images and audio are stored as the datasets Image /
Audio features store them (`{bytes, path}`) or as bytes or paths; a column may hold a list of items.

Reading: the rows are read straight from the memory-mapped Arrow tables (not through `datasets`'
own decoding, so a broken image is a `BadRow` naming `file: row N` rather than an exception deep
inside a worker). A save_to_disk folder is mapped as it is. Parquet is compressed, so reading one
row means decoding its whole row group; the files are therefore converted once into the datasets
cache (`Dataset.from_parquet`, what `load_dataset("parquet")` does, under HF_DATASETS_CACHE) and
mapped from there. The check before a run reads parquet with pyarrow alone and writes nothing.

A row is named `file: row N`, N counting from 0 within that file (what `Dataset[N]` shows).
"""

from __future__ import annotations

import bisect
import contextlib
import os
import string
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bridge.data.bad_rows import BadRow
from bridge.data.example import PLACEHOLDER_RE, PLACEHOLDERS, Example, target_words
from bridge.data.jsonl_check import TARGET_TOKEN_SLACK, DataScan, path_problem
from bridge.data.paths import DATA_EXTRA, expand_data_paths
from encoders.media_budget import MediaBudget, MediaLimits

MEDIA_KEYS = tuple(PLACEHOLDERS.values())
#: rows read from Arrow at a time by the passes over a whole table
BATCH_ROWS = 1024


def _datasets():
    try:
        import datasets
    except ImportError:
        raise ValueError(f"data.source hf needs the datasets package (the data extra: {DATA_EXTRA})") \
            from None
    return datasets


@contextlib.contextmanager
def _quiet_datasets():
    """datasets' progress bars (converting parquet) would break the run's own output."""
    datasets = _datasets()
    was = datasets.is_progress_bar_enabled()
    datasets.disable_progress_bars()
    try:
        yield datasets
    finally:
        if was:
            datasets.enable_progress_bars()


@dataclass
class Columns:
    """Which column plays each role in one file."""

    text: str
    prompt: str | None
    media: dict[str, str]
    fields: list[str] = field(default_factory=list)  # the template's {field}s

    def names(self) -> list[str]:
        return list(dict.fromkeys([self.text, *([self.prompt] if self.prompt else []), *self.media.values(),
                                   *self.fields]))


def resolve_columns(names: list[str], *, template: str, target_field: str, columns: Mapping[str, str],
                    label: str) -> Columns:
    """The role -> column mapping for a file with columns `names`; ValueError (the file's problem)
    for a column that is named but missing, or a template placeholder with no media column."""
    def pick(role: str, default: str, required: bool) -> str | None:
        name = columns.get(role, default)
        if name in names:
            return name
        if required or role in columns:
            key = f"data.columns.{role}" if role in columns else ("data.target_field" if role == "text" else
                                                                   f"the default {role} column")
            raise ValueError(f"{label}: no column {name!r} ({key}); its columns: {', '.join(names[:30])}")
        return None

    text = pick("text", target_field, True)
    prompt = pick("prompt", "prompt", False)
    media = {m: c for m in MEDIA_KEYS if (c := pick(m, m, False)) is not None}
    fields = [n for _, n, _, _ in string.Formatter().parse(template) if n]
    missing = [f for f in fields if f not in names]
    if missing:
        raise ValueError(f"{label}: the prompt template references {missing}, which are not columns; its "
                         f"columns: {', '.join(names[:30])}")
    for match in PLACEHOLDER_RE.finditer(template):
        mod = PLACEHOLDERS[match.group(0)]
        if mod not in media and prompt is None:
            raise ValueError(f"{label}: the prompt template has {match.group(0)} but there is no {mod!r} "
                             "column "
                             f"(name it with data.columns.{mod}); its columns: {', '.join(names[:30])}")
    return Columns(text, prompt, media, fields)  # type: ignore[arg-type]


def _media_counts(array, modality: str) -> tuple[list[int], list[str | None]]:
    """Per row of an Arrow array of media values: how many items it holds, and the path to check
    when the item is a file rather than stored bytes (None when there is none)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    n = len(array)
    valid = array.is_valid().to_pylist()
    t = array.type
    paths: list[str | None] = [None] * n
    if pa.types.is_struct(t) and t.get_field_index("bytes") >= 0:
        sizes = pc.binary_length(array.field("bytes")).to_pylist()
        given = array.field("path").to_pylist() if t.get_field_index("path") >= 0 else [None] * n
        counts = []
        for i in range(n):
            has_bytes = bool(sizes[i])
            counts.append(1 if valid[i] and (has_bytes or given[i]) else 0)
            if valid[i] and not has_bytes and given[i]:
                paths[i] = given[i]
        return counts, paths
    if pa.types.is_binary(t) or pa.types.is_large_binary(t):
        sizes = pc.binary_length(array).to_pylist()
        return [1 if s else 0 for s in sizes], paths
    if (pa.types.is_string(t) or pa.types.is_large_string(t)) and modality != "graph":
        given = array.to_pylist()
        return [1 if g else 0 for g in given], [g or None for g in given]
    if pa.types.is_list(t) or pa.types.is_large_list(t):
        lengths = pc.list_value_length(array).to_pylist()
        return [n_ or 0 for n_ in lengths], paths
    return [1 if v else 0 for v in valid], paths


def check_batch(batch, cols: Columns, *, template: str, root: str, checked: dict, byte_limit: int | None,
                ) -> Iterator[tuple[int, str | None, str | None]]:
    """(row in batch, its problem or None, a target that may exceed the token limit or None) for
    every row of an Arrow record batch: the target, the row's prompt, placeholders against its
    media, and each media path that is a file (exists, readable)."""
    texts = batch.column(cols.text).to_pylist()
    prompts = batch.column(cols.prompt).to_pylist() if cols.prompt else [None] * len(texts)
    values = {f: batch.column(f).to_pylist() for f in cols.fields}
    media = {m: _media_counts(batch.column(c), m) for m, c in cols.media.items()}
    memo: dict[str, dict[str, int]] = {}
    for i, text in enumerate(texts):
        if not isinstance(text, str):
            what = "null" if text is None else type(text).__name__
            yield i, f"the text column {cols.text!r} is {what}", None
            continue
        own = prompts[i]
        if own is not None and not isinstance(own, str):
            yield i, f"the prompt column {cols.prompt!r} holds a {type(own).__name__}", None
            continue
        if own:
            prompt = own
        elif cols.fields:
            try:
                prompt = template.format_map({f: values[f][i] for f in cols.fields})
            except (ValueError, KeyError, IndexError, AttributeError) as exc:
                yield i, f"prompt template {template[:80]!r}: {exc}", None
                continue
        else:
            prompt = template
        wanted = memo.get(prompt)
        if wanted is None:
            wanted = {}
            for m in PLACEHOLDER_RE.finditer(prompt):
                wanted[PLACEHOLDERS[m.group(0)]] = wanted.get(PLACEHOLDERS[m.group(0)], 0) + 1
            if len(memo) < 4096:
                memo[prompt] = wanted
        given = {m: counts[i] for m, (counts, _) in media.items() if counts[i]}
        if wanted != given:
            yield i, (f"prompt {prompt[:80]!r} has placeholders {wanted or '{}'} but the row's media are "
                      f"{given or '{}'} (columns {cols.media or '{}'})"), None
            continue
        problem = None
        for m, (_, paths) in media.items():
            rel = paths[i]
            if rel is None:
                continue
            file = rel if os.path.isabs(rel) else os.path.join(root, rel)
            why = checked.get(file, checked)
            if why is checked:
                why = checked[file] = path_problem(file)
            if why:
                problem = f"{m} file {file}: {why}"
                break
        long = None
        if byte_limit is not None and len(text) > byte_limit // 4 and len(text.encode()) > byte_limit:
            long = text
        yield i, problem, long


@dataclass
class _Part:
    label: str  # the file or folder, as rows are named
    path: Path
    kind: str  # "arrow" (a save_to_disk folder) or "parquet"

    @property
    def root(self) -> str:
        return str(self.path if self.kind == "arrow" else self.path.parent)


def _parts(spec: str | os.PathLike) -> list[_Part]:
    out = []
    for path in expand_data_paths(spec):
        if path.is_dir():
            out.append(_Part(str(path), path, "arrow"))
        elif path.suffix == ".parquet":
            out.append(_Part(str(path), path, "parquet"))
        else:
            raise ValueError(f"{path}: not a datasets save_to_disk folder or a .parquet file")
    return out


def _load_folder(part: _Part):
    """The save_to_disk folder's Dataset (memory-mapped; nothing written)."""
    with _quiet_datasets() as datasets:
        try:
            ds = datasets.load_from_disk(str(part.path))
        except Exception as exc:  # noqa: BLE001  datasets raises many types for a folder it cannot read
            raise ValueError(f"{part.label}: not a readable datasets save_to_disk folder "
                             f"({type(exc).__name__}: {str(exc)[:200]})") from None
    if isinstance(ds, datasets.DatasetDict):
        raise ValueError(f"{part.label}: a DatasetDict with splits {sorted(ds)}; name one split's folder "
                         f"(e.g. {part.label}/{next(iter(ds), 'train')})")
    if ds._indices is not None:  # a selection saved as indices: the rows it names, in order
        ds = ds.flatten_indices()
    return ds


def _parquet_file(part: _Part):
    import pyarrow.parquet as pq

    try:
        return pq.ParquetFile(str(part.path))
    except Exception as exc:  # noqa: BLE001  pyarrow raises ArrowInvalid, OSError, ...
        raise ValueError(f"{part.label}: not a readable parquet file ({type(exc).__name__}: "
                         f"{str(exc)[:200]})") from None


def _part_batches(part: _Part) -> tuple[list[str], Any]:
    """(the file's column names, a function of the columns to read -> their record batches)."""
    if part.kind == "parquet":
        pf = _parquet_file(part)
        return pf.schema_arrow.names, lambda cols: pf.iter_batches(batch_size=BATCH_ROWS, columns=cols)
    table = _load_folder(part).data.table
    return table.schema.names, lambda cols: iter(table.select(cols).to_batches(max_chunksize=BATCH_ROWS))


def scan_hf(spec: str, *, prompt: str, target_field: str = "text", columns: Mapping[str, str] | None = None,
            media_root: str | Path | None = None, max_target_tokens: int | None = None,
            checked: dict | None = None) -> DataScan:
    """The check before a run: every row of every file `spec` names (see `check_batch`); a file that
    cannot be read or lacks a column is the file's problem. Nothing is written."""
    scan = DataScan(Path(spec))
    checked = {} if checked is None else checked
    byte_limit = None if max_target_tokens is None else max_target_tokens - TARGET_TOKEN_SLACK
    try:
        _datasets()  # pyarrow comes with it
        parts = _parts(spec)
    except ValueError as exc:
        scan.add(f"{spec}: {exc}" if str(spec) not in str(exc) else str(exc))
        return scan
    for part in parts:
        try:
            names, batches = _part_batches(part)
            cols = resolve_columns(names, template=prompt, target_field=target_field, columns=columns or {},
                                   label=part.label)
            root = str(media_root) if media_root else part.root
            start = 0
            for batch in batches(cols.names()):
                for i, problem, long in check_batch(batch, cols, template=prompt, root=root, checked=checked,
                                                    byte_limit=byte_limit):
                    where = f"{part.label}: row {start + i}"
                    if problem:
                        scan.add(f"{where}: {problem}", where)
                    elif long is not None:
                        scan.long_targets.append((where, long))
                start += batch.num_rows
                scan.rows += batch.num_rows
        except ValueError as exc:
            scan.add(str(exc))
        except OSError as exc:
            scan.add(f"{part.label}: cannot be read ({exc})")
    if scan.rows == 0 and not scan.file_problems:
        scan.add(f"{spec}: no rows")
    return scan


def hf_target_texts(spec: str, *, target_field: str = "text", columns: Mapping[str, str] | None = None
                    ) -> Iterator[str]:
    """Every target of the files `spec` names (a tiny model's vocabulary)."""
    for part in _parts(spec):
        names, batches = _part_batches(part)
        text = (columns or {}).get("text", target_field)
        if text not in names:
            continue
        for batch in batches([text]):
            yield from (t for t in batch.column(0).to_pylist() if isinstance(t, str))


class HFDataset:
    """Rows of local datasets files as Examples (see the module docstring)."""

    def __init__(self, spec: str, *, prompt: str = "<image>", target_field: str = "text",
                 columns: Mapping[str, str] | None = None, media_root: str | Path | None = None,
                 media_limits: MediaLimits | None = None, skip_bad_rows: bool = False):
        _datasets()
        self.spec = str(spec)
        self.prompt = prompt
        self.media_root = Path(media_root) if media_root else None
        self.media_limits = media_limits or MediaLimits()
        self.skip_bad_rows = skip_bad_rows
        self.skipped: list[str] = []
        parts = _parts(spec)
        self._tables: list[Any] = []  # per part: the Arrow table of the columns read
        self._cols: list[Columns] = []
        self._labels: list[str] = []
        self._roots: list[Path] = []
        self._starts: list[int] = [0]  # global row where each part starts
        parquet = [p for p in parts if p.kind == "parquet"]
        converted = self._convert_parquet(parquet) if parquet else {}
        for part in parts:
            table = converted[part.label] if part.kind == "parquet" else _load_folder(part).data.table
            cols = resolve_columns(table.schema.names, template=prompt, target_field=target_field,
                                   columns=columns or {}, label=part.label)
            self._tables.append(table.select(cols.names()))
            self._cols.append(cols)
            self._labels.append(part.label)
            self._roots.append(self.media_root or Path(part.root))
            self._starts.append(self._starts[-1] + table.num_rows)
        self._rows = self._good_rows()
        if len(self._rows) == 0:
            left = " left after skipping bad ones" if self.skipped else ""
            raise ValueError(f"{self.spec}: no rows{left}")

    def _convert_parquet(self, parts: list[_Part]) -> dict[str, Any]:
        """Each parquet file's rows as a memory-mapped Arrow table (one conversion into the datasets
        cache for all of them), in file order."""
        sizes = [_parquet_file(p).metadata.num_rows for p in parts]
        with _quiet_datasets() as datasets:
            try:
                ds = datasets.Dataset.from_parquet([str(p.path) for p in parts])
            except Exception as exc:  # noqa: BLE001
                raise ValueError(f"{self.spec}: the parquet files could not be read "
                                 f"({type(exc).__name__}: {str(exc)[:200]})") from None
        table = ds.data.table
        if table.num_rows != sum(sizes):
            raise ValueError(f"{self.spec}: the parquet files hold {sum(sizes)} rows but {table.num_rows} "
                             "were read")
        out, start = {}, 0
        for part, size in zip(parts, sizes):
            out[part.label] = table.slice(start, size)
            start += size
        return out

    def _good_rows(self):
        """Global indices of the rows that pass `check_batch` (a bad one raises BadRow, or is
        skipped and named with skip_bad_rows)."""
        import numpy as np

        keep = []
        checked: dict = {}
        for p, table in enumerate(self._tables):
            start = 0
            for batch in table.to_batches(max_chunksize=BATCH_ROWS):
                for i, problem, _ in check_batch(batch, self._cols[p], template=self.prompt,
                                                 root=str(self._roots[p]), checked=checked, byte_limit=None):
                    if problem:
                        where = f"{self._labels[p]}: row {start + i}"
                        if not self.skip_bad_rows:
                            raise BadRow(f"{where}: {problem}")
                        self.skipped.append(f"{where}: {problem}")
                    else:
                        keep.append(self._starts[p] + start + i)
                start += batch.num_rows
        return np.asarray(keep, dtype=np.int64)

    def __len__(self) -> int:
        return len(self._rows)

    def _locate(self, index: int) -> tuple[int, int]:
        g = int(self._rows[index])
        p = bisect.bisect_right(self._starts, g) - 1
        return p, g - self._starts[p]

    def _row(self, index: int) -> tuple[str, int, dict]:
        p, local = self._locate(index)
        return f"{self._labels[p]}: row {local}", p, self._tables[p].slice(local, 1).to_pylist()[0]

    def __getitem__(self, index: int) -> Example:
        from bridge.data.media_values import media_item

        where, p, row = self._row(index)
        cols = self._cols[p]
        budget = MediaBudget(self.media_limits, scope="row")
        media: dict[str, list[Any]] = {}
        for mod, col in cols.media.items():
            value = row[col]
            values = value if isinstance(value, list) else [] if value is None else [value]
            items = []
            for k, v in enumerate(values):
                try:
                    items.append(media_item(mod, v, self._roots[p], budget))
                except ValueError as exc:
                    at = f"{mod} (column {col!r}{f', item {k}' if len(values) > 1 else ''})"
                    raise BadRow(f"{where}: {at}: {exc}") from None
            if items:
                media[mod] = items
        own = row.get(cols.prompt) if cols.prompt else None
        template = self.prompt
        prompt = own or (template.format_map({f: row[f] for f in cols.fields}) if cols.fields else template)
        return Example(prompt, row[cols.text], media)

    def vocab_words(self) -> list[str]:
        texts = []
        for p, table in enumerate(self._tables):
            texts.extend(t for t in table.column(self._cols[p].text).to_pylist() if isinstance(t, str))
        return target_words(texts)

    def check_all_items(self) -> None:
        """Decode every row's media (the eval set, before training); a bad row raises BadRow, or with
        skip_bad_rows is dropped."""
        keep = []
        for index in range(len(self)):
            try:
                self[index]
            except BadRow as exc:
                if not self.skip_bad_rows:
                    raise
                self.skipped.append(str(exc))
                continue
            keep.append(index)
        if len(keep) < len(self):
            self._rows = self._rows[keep]
            if len(self._rows) == 0:
                raise ValueError(f"{self.spec}: no rows left after skipping bad rows")
