"""Where documents come from: a source is cut into work units (the grain the tokenizer parallelises over), and
each unit yields its records with where they came from, for error messages.

    spec = DataSpec(source="files", path=["corpus/*.jsonl"], tokenizer="tok/", text_field="text")
    units, ident = plan_units(spec)          # deterministic: the same list wherever it is computed
    for record, loc in iter_records(units[0], spec): ...

Kinds of unit:
  text     whole files read as UTF-8 text, one document per file (any extension but the ones below)
  jsonl    a line-aligned byte range of a .jsonl file, one record per line
  parquet  a range of row groups of a .parquet file, one record per row
  arrow    a row range of a `datasets` Dataset saved with save_to_disk (data.path is its directory)
  hf       a row range of a Hugging Face dataset loaded with load_dataset (downloaded into data.hf_cache_dir)
  stream   one shard (data file) of a streamed Hugging Face dataset (data.streaming: nothing is stored)
"""

from __future__ import annotations

import glob as _glob
import json
import os
from dataclasses import dataclass, field
from typing import Any, Iterator, Optional, Union

from rayspeed.compat import dataset_fingerprint
from rayspeed.config.examples import prepare_hint
from rayspeed.errors import ConfigError

UNIT_BYTES = 64 << 20  # input bytes per work unit (a unit is tokenized by one process into one shard)
UNIT_ROWS = 100_000  # rows per unit for datasets loaded through `datasets`
_BATCH_ROWS = 1000
TOKEN_SUFFIXES = (".bin", ".rstok")


@dataclass(frozen=True)
class DataSpec:
    """What to tokenize and how: the data section of a job, with data.tokenizer resolved to 'bytes' or a path."""

    source: str = "python-stdlib"
    path: tuple[str, ...] = ()
    tokenizer: str = "bytes"
    text_field: str = "text"
    format: str = "text"
    dataset: Optional[str] = None
    split: str = "train"
    hf_cache_dir: Optional[str] = None
    streaming: bool = False
    images: Optional[tuple[str, int, int]] = None
    """Chat records with images: (the checkpoint directory whose image processor resizes them, the placeholder
    token's id, tokens per image). None: text only."""

    @staticmethod
    def paths(path: Union[None, str, list[str], tuple[str, ...]]) -> tuple[str, ...]:
        if path is None:
            return ()
        return (path,) if isinstance(path, str) else tuple(path)

    def with_split(self, split: str) -> "DataSpec":
        import dataclasses

        return dataclasses.replace(self, split=split)

    def describe(self) -> str:
        if self.source == "hf":
            return f"hf:{self.dataset}[{self.split}]"
        if self.source == "python-stdlib":
            return "python-stdlib"
        return f"{self.source}:{','.join(self.path)}"


@dataclass(frozen=True)
class Unit:
    index: int
    kind: str
    path: str
    start: int = 0
    stop: int = 0
    files: tuple[str, ...] = field(default=())
    nbytes: int = 0


def expand(patterns: tuple[str, ...], key: str = "data.path") -> list[str]:
    """Files and dataset directories matched by the paths or globs, in a stable order (sorted per pattern)."""
    out: list[str] = []
    for pattern in patterns:
        p = os.path.expanduser(pattern)
        if _glob.has_magic(p):
            found = sorted(os.path.abspath(f) for f in _glob.glob(p, recursive=True)
                           if os.path.isfile(f) or is_saved_dataset(f))
        else:
            found = [os.path.abspath(p)] if os.path.isfile(p) or is_saved_dataset(p) else []
            if not found and os.path.isdir(p):
                raise ConfigError(f"{key}: {p} is a directory but not one saved by datasets' save_to_disk; use a "
                                  f"glob such as {os.path.join(pattern, '*.jsonl')!r}")
        if not found:
            raise ConfigError(f"{key}: no files match {pattern!r}{prepare_hint(pattern)}")
        out += [f for f in found if f not in out]
    return out


def is_saved_dataset(path: str) -> bool:
    return os.path.isdir(path) and any(os.path.isfile(os.path.join(path, n))
                                       for n in ("dataset_info.json", "state.json", "dataset_dict.json"))


def _kind(path: str) -> str:
    if is_saved_dataset(path):
        return "arrow"
    if path.endswith(".jsonl"):
        return "jsonl"
    if path.endswith(".parquet"):
        return "parquet"
    return "text"


def _stat(path: str) -> list[Any]:
    if os.path.isdir(path):
        return [path, [_stat(os.path.join(d, f)) for d, _, fs in sorted(os.walk(path)) for f in sorted(fs)]]
    st = os.stat(path)
    return [path, st.st_size, st.st_mtime_ns]


def _jsonl_units(path: str) -> list[tuple[int, int]]:
    """Line-aligned byte ranges of about UNIT_BYTES."""
    size = os.path.getsize(path)
    cuts = [0]
    with open(path, "rb") as f:
        while cuts[-1] + UNIT_BYTES < size:
            f.seek(cuts[-1] + UNIT_BYTES)
            f.readline()
            if f.tell() >= size:
                break
            cuts.append(f.tell())
    cuts.append(size)
    return list(zip(cuts[:-1], cuts[1:]))


def _parquet_units(path: str) -> list[tuple[int, int, int]]:
    import pyarrow.parquet as pq

    try:
        meta = pq.ParquetFile(path).metadata
    except Exception as e:
        why = str(e).splitlines()[0][:200]
        raise ConfigError(f"data.path: {path} is not a readable Parquet file ({why})") from None
    units, start, acc = [], 0, 0
    for g in range(meta.num_row_groups):
        acc += meta.row_group(g).total_byte_size
        if acc >= UNIT_BYTES or g == meta.num_row_groups - 1:
            units.append((start, g + 1, acc))
            start, acc = g + 1, 0
    return units


def load_hf(spec: DataSpec, unit_path: Optional[str] = None) -> Any:
    """The Dataset (or IterableDataset) of a spec: a save_to_disk directory, or load_dataset of a hub name or a local
    dataset folder."""
    try:
        import datasets
    except ImportError as e:
        raise ConfigError("data.source: reading Hugging Face datasets needs the 'datasets' package: "
                          "pip install datasets") from e
    if unit_path is not None:  # a save_to_disk directory
        ds = datasets.load_from_disk(unit_path)
        if isinstance(ds, datasets.DatasetDict):
            if spec.split not in ds:
                raise ConfigError(f"data.split: {unit_path} has splits {sorted(ds)}, not {spec.split!r}")
            ds = ds[spec.split]
        return ds
    try:
        return datasets.load_dataset(spec.dataset, split=spec.split, cache_dir=spec.hf_cache_dir,
                                     streaming=spec.streaming)
    except (FileNotFoundError, ValueError) as e:
        raise ConfigError(f"data.dataset: cannot load {spec.dataset!r} split {spec.split!r} "
                          f"({str(e).splitlines()[0][:300]})") from None
    except Exception as e:  # offline, no such repo, gated: say so, in one line
        raise ConfigError(f"data.dataset: {spec.dataset!r} could not be loaded ({type(e).__name__}: "
                          f"{str(e).splitlines()[0][:300]}); check the name, HF_TOKEN and the network, or "
                          "pre-fill data.hf_cache_dir") from None


def _row_units(n: int) -> list[tuple[int, int]]:
    return [(a, min(n, a + UNIT_ROWS)) for a in range(0, n, UNIT_ROWS)] or [(0, 0)]


def plan_units(spec: DataSpec) -> tuple[list[Unit], list[Any]]:
    """(units, identity): the work units of a files or hf source, and what identifies their content (file sizes and
    modification times, or the dataset's fingerprint) for the cache key."""
    raw: list[tuple[str, str, int, int, tuple[str, ...], int]] = []
    if spec.source == "hf":
        ds = load_hf(spec)
        if spec.streaming:
            n = int(getattr(ds, "num_shards", 1))
            info = getattr(ds, "info", None)
            ident: list[Any] = ["stream", spec.dataset, spec.split, n, repr(getattr(info, "splits", None)),
                                repr(getattr(info, "download_checksums", None))]
            raw = [("stream", str(spec.dataset), i, i + 1, (), 0) for i in range(n)]
        else:
            ident = ["hf", spec.dataset, spec.split, dataset_fingerprint(ds), len(ds)]
            per_row = max(1, int(ds.data.nbytes) // max(1, len(ds)))
            raw = [("hf", str(spec.dataset), a, b, (), (b - a) * per_row) for a, b in _row_units(len(ds))]
        return [Unit(i, *r) for i, r in enumerate(raw)], ident
    files = expand(spec.path)
    tokens = [f for f in files if f.endswith(TOKEN_SUFFIXES)]
    if tokens:
        raise ConfigError(f"data.path: {tokens[0]} is a token file; a glob of token files is read as tokens, never "
                          "as text: use data.source: tokens (or a .bin with data.source: files)")
    text_batch: list[str] = []
    text_bytes = 0

    def flush_text() -> None:
        nonlocal text_batch, text_bytes
        if text_batch:
            raw.append(("text", text_batch[0], 0, len(text_batch), tuple(text_batch), text_bytes))
        text_batch, text_bytes = [], 0

    for f in files:
        kind = _kind(f)
        if kind == "text":
            text_batch.append(f)
            text_bytes += os.path.getsize(f)
            if text_bytes >= UNIT_BYTES:
                flush_text()
            continue
        flush_text()
        if kind == "jsonl":
            raw += [("jsonl", f, a, b, (), b - a) for a, b in _jsonl_units(f)]
        elif kind == "parquet":
            raw += [("parquet", f, a, b, (), n) for a, b, n in _parquet_units(f)]
        else:
            ds = load_hf(spec, f)
            per_row = max(1, int(ds.data.nbytes) // max(1, len(ds)))
            raw += [("arrow", f, a, b, (), (b - a) * per_row) for a, b in _row_units(len(ds))]
    flush_text()
    ident = [_stat(f) for f in files] + [spec.split if any(_kind(f) == "arrow" for f in files) else None]
    return [Unit(i, *r) for i, r in enumerate(raw)], ident


# ---------------------------------------------------------------- reading


def line_of(path: str, offset: int) -> int:
    """1-based line number of the byte at `offset` (counted only when an error needs it)."""
    n, done = 1, 0
    with open(path, "rb") as f:
        while done < offset:
            chunk = f.read(min(8 << 20, offset - done))
            if not chunk:
                break
            n += chunk.count(b"\n")
            done += len(chunk)
    return n


def describe(loc: tuple[Any, ...]) -> str:
    kind, where, pos = loc
    if kind == "line":
        return f"{where}:{line_of(where, pos)}"
    if kind == "row":
        return f"{where} row {pos}"
    if kind == "file":
        return where
    return f"{where} record {pos}"


def iter_records(unit: Unit, spec: DataSpec) -> Iterator[tuple[Any, tuple[Any, ...]]]:
    """(record, location) of every record of the unit, in order. A text file's record is its text."""
    if unit.kind == "text":
        for p in unit.files:
            with open(p, encoding="utf-8", errors="replace") as f:
                yield f.read(), ("file", p, 0)
    elif unit.kind == "jsonl":
        with open(unit.path, "rb") as f:
            f.seek(unit.start)
            pos = unit.start
            while pos < unit.stop:
                line = f.readline()
                if not line:
                    break
                if line.strip():
                    try:
                        record = json.loads(line)
                    except ValueError as e:
                        raise ConfigError(f"data.path: {describe(('line', unit.path, pos))} is not valid JSON "
                                          f"({e})") from None
                    yield record, ("line", unit.path, pos)
                pos += len(line)
    elif unit.kind == "parquet":
        import pyarrow.parquet as pq

        pf = pq.ParquetFile(unit.path)
        row = sum(pf.metadata.row_group(g).num_rows for g in range(unit.start))
        for g in range(unit.start, unit.stop):
            for rec in pf.read_row_group(g).to_pylist():
                yield rec, ("row", unit.path, row)
                row += 1
    elif unit.kind in ("arrow", "hf"):
        ds = load_hf(spec, unit.path if unit.kind == "arrow" else None)
        for a in range(unit.start, unit.stop, _BATCH_ROWS):
            cols = ds[a:min(unit.stop, a + _BATCH_ROWS)]
            names = list(cols)
            for j in range(len(cols[names[0]]) if names else 0):
                yield {k: cols[k][j] for k in names}, ("row" if unit.kind == "arrow" else "record", unit.path, a + j)
    elif unit.kind == "stream":
        full = load_hf(spec)
        for j, rec in enumerate(full.shard(num_shards=max(1, int(getattr(full, "num_shards", 1))), index=unit.start)):
            yield rec, ("record", f"{unit.path}[{spec.split}] shard {unit.start}", j)
    else:
        raise ValueError(f"unknown unit kind {unit.kind!r}")
