"""Tokenizing a corpus once per content into token shards in the cache, reused by every rank, restart and
retraining cycle.

    index, built = build_shards(spec, cache_dir, executor="ray")   # or "pool" (a local process pool), "inline"

The source is cut into work units (rayspeed.data.records); each unit becomes one shard file, written by whichever
process tokenizes it: a Ray Data pipeline on the cluster (`ray`: the units as a dataset, `map_batches` reads,
tokenizes and writes each one, spread over every node), a local process pool (`pool`, for `--launcher local`) or
this process (`inline`). A unit's shard depends only on the unit and the tokenizer, so all three write the same
bytes. Shards go into a temporary folder; the index (`index.json`: shards, sizes, sha256s, totals) is written last
and the folder renamed into place: the rename is the commit. A bad record (named with its file and line) fails the
build and leaves nothing behind. Progress, with an ETA, is logged while it runs.

Cache entry: <cache>/shards-<key>/ with shard-NNNNN.rstok and index.json; key = hash of (format, source identity
(file sizes and modification times, or the dataset's fingerprint), tokenizer fingerprint, format, text field).
content_hash = sha256 of the shards' sha256s in order.
"""

from __future__ import annotations

import glob
import hashlib
import json
import logging
import os
import shutil
import time
from typing import Any, Callable, Optional

import numpy as np

from rayspeed.data.cache import atomic_write_json, building, cache_key, note_written, tmp_name
from rayspeed.data.records import DataSpec, Unit, describe, iter_records, plan_units
from rayspeed.data.shards import SUFFIX, ShardWriter
from rayspeed.data.tokenizer import encode_document, load_tokenizer
from rayspeed.errors import ConfigError

log = logging.getLogger("rayspeed.data")
SHARDS_FORMAT = "rayspeed-shards-v1"
INDEX = "index.json"
PROGRESS_EVERY_S = 5.0
_TOKENIZERS: dict[str, Any] = {}  # per process: loaded once, reused by every unit this process tokenizes


def shard_name(unit: Unit) -> str:
    return f"shard-{unit.index:05d}{SUFFIX}"


def _tokenizer(spec: DataSpec) -> Any:
    tok = _TOKENIZERS.get(spec.tokenizer)
    if tok is None:
        tok = _TOKENIZERS[spec.tokenizer] = load_tokenizer(spec.tokenizer)
    return tok


def _documents(unit: Unit, spec: DataSpec, tok: Any, pictures: Optional["_Pictures"] = None) -> Any:
    """(ids, mask or None, location, images) of every document of the unit; images: (the position of its first
    placeholder, uint8 pixels) of each of the document's images."""
    renderer = None
    if spec.format == "chat":
        from rayspeed.data.chat import ChatRenderer

        renderer = ChatRenderer(tok)
    for record, loc in iter_records(unit, spec):
        if unit.kind == "text":
            yield encode_document(tok, record), None, loc, ()
            continue
        if not isinstance(record, dict):
            raise ConfigError(f"data.path: {describe(loc)} is not an object with fields")
        if renderer is not None and pictures is not None:
            yield from pictures.documents(renderer, record, loc)
            continue
        if renderer is not None:
            for ids, mask in renderer.render_documents(record.get("messages"), describe(loc)):
                yield ids, mask, loc, ()
            continue
        text = record.get(spec.text_field)
        if not isinstance(text, str):
            fields = ", ".join(sorted(map(str, record))[:8]) or "none"
            what = "has no field" if spec.text_field not in record else "has a non-text field"
            raise ConfigError(f"data.text_field: {describe(loc)} {what} {spec.text_field!r} (its fields: {fields})")
        yield encode_document(tok, text), None, loc, ()


class _Pictures:
    """Chat records with images (rayspeed.data.images): each image read and resized once, its placeholder repeated
    to one token per feature."""

    def __init__(self, images: tuple[str, int, int]):
        from rayspeed.data.images import ImagePrep

        self.prep = ImagePrep.from_model(images[0])
        self.token_id, self.tokens = int(images[1]), int(images[2])

    @property
    def meta(self) -> dict[str, Any]:
        return {"tokens": self.tokens, "rescale": self.prep.rescale, "mean": self.prep.mean.ravel().tolist(),
                "std": self.prep.std.ravel().tolist()}

    def documents(self, renderer: Any, record: dict[str, Any], loc: tuple[Any, ...]) -> Any:
        from rayspeed.data.images import ImageParts, expand_placeholders

        where = describe(loc)
        parts = ImageParts(record, where, os.path.dirname(str(loc[1])))
        documents = renderer.render_documents(parts.messages, where)
        for ids, mask in documents:
            found = int((ids == self.token_id).sum())
            if found != len(parts.sources):
                raise ConfigError(f"data.format: chat: {where}: the chat template renders {found} image "
                                  f"placeholder(s) for the record's {len(parts.sources)} image(s); its template must "
                                  "render each image part once (and a conversation split per assistant turn cannot "
                                  "carry images yet)")
            ids, mask, starts = expand_placeholders(ids, mask, self.token_id, self.tokens)
            pixels = [self.prep.to_uint8(parts.open(i)) for i in range(len(parts.sources))]
            yield ids, mask, loc, list(zip(starts.tolist(), pixels))


def tokenize_unit(unit: Unit, spec: DataSpec, out_dir: str, tokenizer: Any = None) -> dict[str, Any]:
    """Tokenize one unit into out_dir/shard-NNNNN.rstok; returns the shard's index entry, or {"index", "error"}
    when the input is wrong (the message names the file and line)."""
    try:
        tok = tokenizer if tokenizer is not None else _tokenizer(spec)
        vocab = int(tok.vocab_size)
        pictures = _Pictures(spec.images) if spec.images else None
        writer = ShardWriter(with_mask=spec.format == "chat", vocab_size=vocab,
                             images=pictures.meta if pictures else None)
        for ids, mask, loc, images in _documents(unit, spec, tok, pictures):
            if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= vocab):
                raise ConfigError(f"data.tokenizer: {tok!r} produced id {int(ids.max())} for {describe(loc)}, "
                                  f"outside its vocabulary of {vocab}")
            writer.add(ids, mask, images)
        entry = writer.write(os.path.join(out_dir, shard_name(unit)))
    except ConfigError as e:
        # The problems, not str(e): the driver raises them again as a ConfigError, which adds its own prefix.
        return {"index": unit.index, "error": e.problems}
    return {"index": unit.index, "name": shard_name(unit), "nbytes_in": unit.nbytes, **entry}


class Progress:
    """Logs units and input bytes done, the rate and an ETA every PROGRESS_EVERY_S seconds."""

    def __init__(self, what: str, units: list[Unit], every_s: float = PROGRESS_EVERY_S):
        self.what, self.total_units = what, len(units)
        self.total_bytes = sum(u.nbytes for u in units)
        self.units = self.bytes = 0
        self.t0 = self.last = time.monotonic()
        self.every_s = every_s

    def line(self) -> str:
        dt = max(1e-6, time.monotonic() - self.t0)
        if self.total_bytes:
            frac = self.bytes / self.total_bytes
            bps = self.bytes / dt
            rate = f"{bps / 1e6:.2f} MB/s" if bps >= 1e5 else f"{bps / 1e3:.1f} kB/s"
        else:
            frac, rate = self.units / max(1, self.total_units), f"{self.units / dt:.2f} units/s"
        eta = f"ETA {dt * (1 - frac) / frac:.0f} s" if 0 < frac < 1 else ("done" if frac >= 1 else "ETA unknown")
        return (f"tokenizing {self.what}: {self.units}/{self.total_units} units ({100 * frac:.0f}%), {rate}, "
                f"{eta}, {dt:.0f} s so far")

    def add(self, entry: dict[str, Any]) -> None:
        self.units += 1
        self.bytes += int(entry.get("nbytes_in", 0))
        now = time.monotonic()
        if now - self.last >= self.every_s or self.units == self.total_units:
            self.last = now
            log.info("%s", self.line())


# ---------------------------------------------------------------- executors


def run_inline(units: list[Unit], spec: DataSpec, out_dir: str, on_done: Callable[[dict], None],
               tokenizer: Any = None) -> None:
    for u in units:
        entry = tokenize_unit(u, spec, out_dir, tokenizer)
        on_done(entry)
        if "error" in entry:
            return


def run_pool(units: list[Unit], spec: DataSpec, out_dir: str, on_done: Callable[[dict], None],
             workers: Optional[int] = None) -> None:
    import concurrent.futures as cf
    import multiprocessing

    n = max(1, min(workers or os.cpu_count() or 1, len(units)))
    if n == 1:
        return run_inline(units, spec, out_dir, on_done)
    # spawn: the driver may hold threads (logging, Ray) that a fork would copy mid-flight.
    with cf.ProcessPoolExecutor(n, mp_context=multiprocessing.get_context("spawn")) as pool:
        futures = [pool.submit(tokenize_unit, u, spec, out_dir) for u in units]
        for f in cf.as_completed(futures):
            entry = f.result()
            on_done(entry)
            if "error" in entry:
                for other in futures:
                    other.cancel()
                return


def _ray_batch(batch: dict[str, np.ndarray], spec_json: str, out_dir: str) -> dict[str, np.ndarray]:
    """map_batches body: each row is one unit (as JSON); returns one row per unit with its shard entry as JSON."""
    fields = json.loads(spec_json)
    spec = DataSpec(**{**fields, "path": tuple(fields["path"]),
                       "images": tuple(fields["images"]) if fields.get("images") else None})
    out = []
    for raw in batch["unit"]:
        u = json.loads(str(raw))
        out.append(json.dumps(tokenize_unit(Unit(**{**u, "files": tuple(u["files"])}), spec, out_dir)))
    return {"entry": np.asarray(out, dtype=object)}


def run_ray(units: list[Unit], spec: DataSpec, out_dir: str, on_done: Callable[[dict], None]) -> None:
    """The units as a Ray Data dataset, tokenized by map_batches tasks spread over the cluster (each writes its
    shard into out_dir, which every node sees: the job's storage)."""
    import dataclasses

    import ray.data

    ctx = ray.data.DataContext.get_current()
    ctx.enable_progress_bars = False  # the driver logs its own progress line with an ETA
    ctx.print_on_execution_start = False
    items = [{"unit": json.dumps(dataclasses.asdict(u))} for u in units]
    spec_json = json.dumps(dataclasses.asdict(spec))
    ds = ray.data.from_items(items, override_num_blocks=len(items)).map_batches(
        _ray_batch, batch_size=1, fn_kwargs={"spec_json": spec_json, "out_dir": out_dir}, num_cpus=1)
    for row in ds.iter_rows():
        entry = json.loads(row["entry"])
        on_done(entry)
        if "error" in entry:
            return


# ---------------------------------------------------------------- the cache entry


def spec_key(spec: DataSpec, ident: Any, fingerprint: str) -> str:
    return cache_key([SHARDS_FORMAT, spec.source, ident, fingerprint, spec.format,
                      spec.text_field if spec.format == "text" else "messages"])


def read_index(entry_dir: str) -> Optional[dict[str, Any]]:
    try:
        with open(os.path.join(entry_dir, INDEX)) as f:
            index = json.load(f)
    except (OSError, ValueError):
        return None
    if index.get("format") != SHARDS_FORMAT:
        return None
    index["dir"] = entry_dir
    return index


def build_shards(spec: DataSpec, cache_dir: str, executor: str = "inline", tokenizer: Any = None,
                 workers: Optional[int] = None) -> tuple[dict[str, Any], bool]:
    """(index, built): the committed cache entry of the spec's corpus, tokenized now if it is not there yet."""
    if executor != "inline" and not os.path.exists(spec.tokenizer) and spec.tokenizer not in ("bytes", "byte"):
        raise ValueError(f"executor {executor!r} loads the tokenizer in other processes: spec.tokenizer must be "
                         f"'bytes' or a path, not {spec.tokenizer!r}")
    tok = tokenizer if tokenizer is not None else load_tokenizer(spec.tokenizer)
    units, ident = plan_units(spec)
    key = spec_key(spec, ident, tok.fingerprint)
    final = os.path.join(cache_dir, f"shards-{key}")
    index = read_index(final)
    if index is not None:
        return index, False
    with building(cache_dir, f"shards-{key}"):  # a failed first build leaves nothing behind
        index = read_index(final)  # another builder committed it while we waited
        if index is not None:
            return index, False
        return _build_locked(spec, units, ident, key, final, tok, executor, workers), True


def _build_locked(spec: DataSpec, units: list[Unit], ident: Any, key: str, final: str, tok: Any, executor: str,
                  workers: Optional[int]) -> dict[str, Any]:
    stem = os.path.join(os.path.dirname(final), f".shards-{key}")
    for stale in glob.glob(glob.escape(stem) + ".*.tmp"):  # only the lock holder builds: these are from a crash
        shutil.rmtree(stale, ignore_errors=True)
    tmp = tmp_name(stem)
    os.makedirs(tmp)
    entries: list[dict[str, Any]] = []
    progress = Progress(spec.describe(), units)

    def done(entry: dict[str, Any]) -> None:
        entries.append(entry)
        if "error" not in entry:
            progress.add(entry)

    t0 = time.monotonic()
    try:
        if executor == "ray":
            run_ray(units, spec, tmp, done)
        elif executor == "pool":
            run_pool(units, spec, tmp, done, workers)
        else:
            run_inline(units, spec, tmp, done, tok if executor == "inline" else None)
        errors = sorted((e for e in entries if "error" in e), key=lambda e: e["index"])
        if errors:
            raise ConfigError(errors[0]["error"])
        entries.sort(key=lambda e: e["index"])
        if len(entries) != len(units):
            raise RuntimeError(f"tokenization returned {len(entries)} shards for {len(units)} units")
        for e in entries:
            f = os.path.join(tmp, e["name"])
            if not os.path.isfile(f) or os.path.getsize(f) != e["bytes"]:
                raise ConfigError(f"data.cache_dir: shard {e['name']} written by a tokenizing task is not in {tmp}: "
                                  "the data cache must be a folder every node sees (storage.path on shared storage, "
                                  "or data.cache_dir), or tokenize with --launcher local")
        docs = sum(e["documents"] for e in entries)
        if docs == 0:
            raise ConfigError(f"data.path: {spec.describe()} holds no records (an empty dataset)")
        digest = hashlib.sha256("".join(e["sha256"] + e.get("images_sha256", "") for e in entries).encode()).hexdigest()
        index = {"format": SHARDS_FORMAT, "key": key, "source": spec.describe(), "identity": ident,
                 "tokenizer": tok.fingerprint, "vocab_size": int(tok.vocab_size), "format_kind": spec.format,
                 "num_tokens": sum(e["tokens"] for e in entries), "num_documents": docs,
                 "max_token_id": max(e["max_token_id"] for e in entries), "content_hash": digest,
                 "has_mask": spec.format == "chat", "executor": executor, "seconds": round(time.monotonic() - t0, 3),
                 "shards": [{k: e[k] for k in ("name", "tokens", "documents", "sha256", "bytes")} for e in entries]}
        atomic_write_json(os.path.join(tmp, INDEX), index)
        os.rename(tmp, final)  # the commit
        note_written("entry", final)
    finally:
        if os.path.isdir(tmp):
            shutil.rmtree(tmp, ignore_errors=True)
    log.info("tokenized %s: %d documents, %d tokens in %d shards (%.1f s, %s)", spec.describe(), docs,
             index["num_tokens"], len(entries), index["seconds"], executor)
    index["dir"] = final
    return index
