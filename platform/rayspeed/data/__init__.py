"""Data pipeline: tokenizers, cached token files, layout-independent global batches.

    tf = build_token_file("python-stdlib", None, "bytes", cache_dir)
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
from rayspeed.data.tokenizer import ByteTokenizer, HFTokenizer, TokenizerDependencyError, load_tokenizer

_BATCHES = ("GlobalBatchSchedule", "RankBatches", "make_schedule", "val_batches")


def __getattr__(name: str):
    # batches imports torch (~1 s); load it only when used, so building a corpus stays light.
    if name in _BATCHES:
        from rayspeed.data import batches

        return getattr(batches, name)
    raise AttributeError(f"module 'rayspeed.data' has no attribute {name!r}")


__all__ = [
    "ByteTokenizer", "HFTokenizer", "TokenizerDependencyError", "load_tokenizer",
    "TokenFile", "TokenSplit", "build_token_file", "split_train_val", "stdlib_files", "bin_dtype",
    "token_dtype", "default_cache_dir", *_BATCHES,
]
