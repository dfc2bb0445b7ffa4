"""Data pipeline: tokenizers, sources, token shards tokenized once into the cache (Ray Data, a process pool or
inline), chat rendering with loss masks, layout-independent global batches.

    tf = build_token_file("python-stdlib", None, "bytes", cache_dir)
    tf = build_token_file(spec=DataSpec(source="files", path=("c/*.jsonl",), tokenizer="tok/"), cache_dir=cache_dir)
    train, val = tf.split(val_fraction, seq_len)
    schedule = GlobalBatchSchedule(train.num_sequences(seq_len), global_batch_size, seed)
    for step, micro_batches in RankBatches(train, seq_len, schedule, rank, dp, b, accum): ...
"""

from rayspeed.data.corpus import (
    TokenFile,
    TokenSplit,
    bin_dtype,
    build_token_file,
    default_cache_dir,
    split_train_val,
    stdlib_files,
    token_dtype,
)
from rayspeed.data.records import DataSpec
from rayspeed.data.tokenizer import (
    ByteTokenizer,
    HFTokenizer,
    TokenizerDependencyError,
    TransformersTokenizer,
    load_tokenizer,
)

_BATCHES = ("GlobalBatchSchedule", "RankBatches", "make_schedule", "val_batches", "make_batch")


def __getattr__(name: str):
    # batches imports torch (~1 s); load it only when used, so building a corpus stays light.
    if name in _BATCHES:
        from rayspeed.data import batches

        return getattr(batches, name)
    raise AttributeError(f"module 'rayspeed.data' has no attribute {name!r}")


__all__ = [
    "ByteTokenizer", "HFTokenizer", "TransformersTokenizer", "TokenizerDependencyError", "load_tokenizer", "DataSpec",
    "TokenFile", "TokenSplit", "build_token_file", "split_train_val", "stdlib_files", "bin_dtype",
    "token_dtype", "default_cache_dir", *_BATCHES,
]
