"""The job's data, from the launcher and from the workers.

The launcher tokenizes once (`prepare`, before the MLflow run exists: a bad record or a tokenizer too large for the
model is exit 2 with nothing written): through a Ray Data pipeline on the cluster (`--launcher ray`) or a local
process pool (`--launcher local`), into token shards in the data cache. The workers (`load_corpus`, inline) then
find the committed shards and only memory-map them; so do restarts and retraining cycles.

    corpus = load_corpus(cfg, storage)                 # train (and the source's own val split) TokenFiles
    train, val = splits(corpus, cfg)                   # TokenSplits: windows, loss masks, documents
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass
from typing import Any, Optional

from rayspeed import paths
from rayspeed.config.schema import AUTO, JobConfig
from rayspeed.data.cache import discard_on_bad_input
from rayspeed.data.records import DataSpec
from rayspeed.errors import ConfigError

log = logging.getLogger("rayspeed")


@dataclass
class Corpus:
    train: Any
    """The TokenFile trained on."""
    val: Optional[Any] = None
    """The TokenFile of data.val_split (None: validation is the tail val_fraction of train)."""

    @property
    def content_hash(self) -> str:
        if self.val is None:
            return self.train.content_hash
        return hashlib.sha256((self.train.content_hash + self.val.content_hash).encode()).hexdigest()

    def __repr__(self) -> str:
        return f"{self.train!r}" + (f", validation {self.val!r}" if self.val is not None else "")


def tokenizer_spec(cfg: JobConfig) -> str:
    """data.tokenizer as load_tokenizer takes it: 'bytes' or a path ('model': model.pretrained's folder, a hub id
    resolved through the Hugging Face cache, downloaded once per machine)."""
    t = cfg.data.tokenizer
    if t != "model":
        return t
    if not cfg.model.pretrained:
        raise ConfigError("data.tokenizer: model means the tokenizer of model.pretrained, which is not set")
    from rayspeed.model.hf_weights import local_model_dir

    return str(local_model_dir(str(cfg.model.pretrained)))


def data_spec(cfg: JobConfig, tokenizer: Optional[str] = None) -> DataSpec:
    d = cfg.data
    return DataSpec(source=d.source, path=DataSpec.paths(d.path), tokenizer=tokenizer or tokenizer_spec(cfg),
                    text_field=d.text_field, format=d.format, dataset=d.dataset, split=d.split,
                    hf_cache_dir=d.hf_cache_dir, streaming=d.streaming, images=image_spec(cfg))


def image_spec(cfg: JobConfig) -> Optional[tuple[str, int, int]]:
    """A vision-language model's chat records: (its checkpoint's folder, whose image processor resizes the images;
    the placeholder token; tokens per image). None: a text model."""
    vision = cfg.model.image_path
    if vision is None or cfg.data.format != "chat" or not cfg.model.pretrained:
        return None
    from rayspeed.model.hf_weights import local_model_dir

    return str(local_model_dir(str(cfg.model.pretrained))), vision.image_token_id, vision.image_tokens


def cache_dir(cfg: JobConfig, storage: str) -> str:
    c = cfg.data
    return c.cache_dir if c.cache_dir != AUTO else paths.data_cache_dir(storage, cfg.storage.staging_dir, cfg.name)


def load_corpus(cfg: JobConfig, storage: str, executor: str = "inline") -> Corpus:
    """The job's corpus (tokenized now if the cache lacks it), with the checks that need the tokenizer."""
    from rayspeed.data import build_token_file, load_tokenizer

    spec = data_spec(cfg)
    cache = cache_dir(cfg, storage)
    tok = load_tokenizer(spec.tokenizer)
    if int(tok.vocab_size) > cfg.model.vocab_size:
        raise ConfigError(f"data.tokenizer: {tok!r} has {tok.vocab_size} ids but model.vocab_size is "
                          f"{cfg.model.vocab_size}: ids past the model's vocabulary have no embedding; use the model's "
                          "own tokenizer (data.tokenizer: model) or a model with a larger vocabulary")
    train = build_token_file(spec=spec, tokenizer=tok, cache_dir=cache, executor=executor)
    val = None
    if cfg.data.val_split:
        val = build_token_file(spec=spec.with_split(cfg.data.val_split), tokenizer=tok, cache_dir=cache,
                               executor=executor)
    for tf in (train, val):
        if tf is not None and tf.max_token_id is not None and tf.max_token_id >= cfg.model.vocab_size:
            raise ConfigError(f"data: {tf.source} holds token id {tf.max_token_id} but model.vocab_size is "
                              f"{cfg.model.vocab_size}")
        if tf is not None and cfg.data.format == "chat" and tf.mask is None:
            raise ConfigError(f"data.format: chat: {tf.source} carries no loss mask (token shards written for text)")
    return Corpus(train, val)


def load_pairs(cfg: JobConfig, storage: str) -> Corpus:
    """A DPO job's preference pairs (rayspeed.data.pairs), tokenized now (inline) if the cache lacks them."""
    from rayspeed.data import load_tokenizer
    from rayspeed.data.pairs import build_pairs

    spec = data_spec(cfg)
    cache = cache_dir(cfg, storage)
    tok = load_tokenizer(spec.tokenizer)
    train = build_pairs(spec, cache, tok)
    val = build_pairs(spec.with_split(cfg.data.val_split), cache, tok) if cfg.data.val_split else None
    for pf in (train, val):
        if pf is not None and pf.tokens.size and int(pf.tokens.max()) >= cfg.model.vocab_size:
            raise ConfigError(f"data: {pf.source} holds token id {int(pf.tokens.max())} but model.vocab_size is "
                              f"{cfg.model.vocab_size}")
    return Corpus(train, val)


def load_prompts(cfg: JobConfig) -> Corpus:
    """A GRPO job's prompt records (rayspeed.data.prompts), each cut from the left to leave max_new_tokens."""
    from rayspeed.data import load_tokenizer
    from rayspeed.data.prompts import read_prompts

    spec = data_spec(cfg)
    tok = load_tokenizer(spec.tokenizer)
    room = cfg.model.seq_len - cfg.train.grpo.max_new_tokens
    train = read_prompts(spec, tok, room)
    val = read_prompts(spec.with_split(cfg.data.val_split), tok, room) if cfg.data.val_split else None
    for ps in (train, val):
        top = max((max(r.ids) for r in ps.records), default=0) if ps is not None else 0
        if ps is not None and top >= cfg.model.vocab_size:
            raise ConfigError(f"data: {ps.source} holds token id {top} but model.vocab_size is {cfg.model.vocab_size}")
    return Corpus(train, val)


def prompt_splits(corpus: Corpus, cfg: JobConfig) -> tuple[list[Any], list[Any]]:
    """(train, val) prompt records: the source's own validation split, or the last val_fraction of the records."""
    if corpus.val is None:
        return corpus.train.split(cfg.data.val_fraction)
    return corpus.train.records, corpus.val.records


def prepare_prompts(cfg: JobConfig) -> Corpus:
    from rayspeed.config.grpo_keys import prompts_per_step

    corpus = load_prompts(cfg)
    train, val = prompt_splits(corpus, cfg)
    per_step = prompts_per_step(cfg)
    if len(train) < per_step:
        raise ConfigError(f"data: {len(train)} training prompts, fewer than one step's {per_step} "
                          "(train.global_batch_size / train.grpo.num_generations); add prompts or lower the batch")
    log.info("data: %s; %d training and %d validation prompts%s (%d cut from the left to leave %d tokens for the "
             "completion)", corpus.train, len(train), len(val), "" if val else " (no val/reward: data.val_fraction 0)",
             corpus.train.cut, cfg.train.grpo.max_new_tokens)
    return corpus


def pair_splits(corpus: Corpus, cfg: JobConfig) -> tuple[Any, Any]:
    """(train, val) PairSplits: the source's own validation split, or the tail val_fraction of the pairs."""
    s = cfg.model.seq_len
    if corpus.val is None:
        return corpus.train.split(cfg.data.val_fraction, s)
    return corpus.train.whole("train", s), corpus.val.whole("val", s)


def prepare_pairs(cfg: JobConfig, storage: str) -> Corpus:
    corpus = load_pairs(cfg, storage)
    train, val = pair_splits(corpus, cfg)
    g = cfg.train.global_batch_size
    key = "data.val_split" if corpus.val is not None else "data.val_fraction"
    if val.num_pairs < g:  # validation reads whole global batches
        raise ConfigError(f"{key}: the validation data holds {val.num_pairs} preference pairs, fewer than one global "
                          f"batch ({g}); raise {key} (or lower train.global_batch_size)")
    log.info("data: %s; %d training and %d validation preference pairs (%d left out: the prompt alone fills "
             "model.seq_len + 1 tokens)", corpus, train.num_pairs, val.num_pairs, train.dropped)
    return corpus


def prepare(cfg: JobConfig, storage: str, launcher: str) -> Corpus:
    """The launcher's step: tokenize on the cluster (Ray Data) or in a local process pool, check, log. Bad input is
    a ConfigError with nothing left in the data cache: what this step built is removed again (some checks need the
    tokens, so they come after the build)."""
    with discard_on_bad_input():
        return _prepare(cfg, storage, launcher)


def _prepare(cfg: JobConfig, storage: str, launcher: str) -> Corpus:
    if cfg.train.objective == "dpo":
        return prepare_pairs(cfg, storage)
    if cfg.train.objective == "grpo":
        return prepare_prompts(cfg)
    executor = "pool" if launcher == "local" or paths.is_uri(storage) else "ray"
    corpus = load_corpus(cfg, storage, executor)
    train, val = splits(corpus, cfg)
    s, g = cfg.model.seq_len, cfg.train.global_batch_size
    key = "data.val_split" if corpus.val is not None else "data.val_fraction"
    if val.num_sequences(s) < g:  # validation reads whole global batches
        raise ConfigError(f"{key}: the validation data holds {val.num_sequences(s)} sequences of {s} tokens, fewer "
                          f"than one global batch ({g}); raise {key} (or lower train.global_batch_size)")
    if cfg.data.format == "chat" or cfg.data.document_masking:
        counts = train.label_counts(s, cfg.data.document_masking)
        if counts is not None and not counts.any():
            raise ConfigError(f"data: no label of {corpus.train.source} counts towards the loss (no assistant "
                              "tokens after packing)")
    log.info("data: %s; %d training and %d validation sequences of %d tokens", corpus, train.num_sequences(s),
             val.num_sequences(s), s)
    return corpus


def splits(corpus: Corpus, cfg: JobConfig) -> tuple[Any, Any]:
    """(train, val) TokenSplits: the source's own validation split, or the tail val_fraction of the training data."""
    if corpus.val is None:
        return corpus.train.split(cfg.data.val_fraction, cfg.model.seq_len)
    w = cfg.model.seq_len + 1
    if corpus.val.num_tokens < w:
        raise ConfigError(f"data.val_split: {corpus.val.source} has {corpus.val.num_tokens} tokens, fewer than one "
                          f"window of {w}")
    return corpus.train.whole("train"), corpus.val.whole("val")


def dataset_inputs(corpus: Corpus, cfg: JobConfig) -> list[dict[str, Any]]:
    """What MLflow records as the run's dataset inputs: one per split, with source, digest and sizes."""
    d = cfg.data
    source = d.dataset if d.source == "hf" else (", ".join(DataSpec.paths(d.path)) or d.source)
    out: list[dict[str, Any]] = []
    if cfg.train.objective == "dpo":
        for context, split, pf in zip(("training", "validation"), pair_splits(corpus, cfg),
                                      (corpus.train, corpus.val or corpus.train)):
            out.append({"context": context, "name": f"{cfg.name}-{context}", "source_type": d.source,
                        "source": source, "split": d.split if context == "training" or not d.val_split else d.val_split,
                        "digest": pf.content_hash[:32], "num_documents": split.num_pairs, "format": "preference",
                        "tokenizer": d.tokenizer})
        return out
    if cfg.train.objective == "grpo":
        for context, records, ps in zip(("training", "validation"), prompt_splits(corpus, cfg),
                                        (corpus.train, corpus.val or corpus.train)):
            out.append({"context": context, "name": f"{cfg.name}-{context}", "source_type": d.source,
                        "source": source, "split": d.split if context == "training" or not d.val_split else d.val_split,
                        "digest": ps.content_hash[:32], "num_documents": len(records), "format": "prompts",
                        "tokenizer": d.tokenizer})
        return out
    train, val = splits(corpus, cfg)
    for context, split, tf in (("training", train, corpus.train), ("validation", val, corpus.val or corpus.train)):
        docs = tf.num_documents
        if tf.doc_starts is not None and split.num_tokens != tf.num_tokens and split.num_tokens:
            import numpy as np

            # Documents with tokens in the split (one cut by the train/val boundary counts in both).
            first, last = np.searchsorted(tf.doc_starts, [split.start, split.stop - 1], side="right") - 1
            docs = int(last - first + 1)
        out.append({"context": context, "name": f"{cfg.name}-{context}", "source_type": d.source,
                    "source": source, "split": d.split if context == "training" or not d.val_split else d.val_split,
                    "digest": tf.content_hash[:32], "num_documents": docs, "num_tokens": split.num_tokens,
                    "format": d.format, "tokenizer": d.tokenizer})
    return out
