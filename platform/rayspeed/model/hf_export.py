"""Full fp32 weights -> a Hugging Face model directory that `transformers.AutoModelForCausalLM.from_pretrained`
loads to the same function:

    write_hf_dir(state, shape, "out/")                  # config.json, sharded safetensors (+ index), tokenizer
    hf_dir_from_export("runs/job/model", "out/")        # from a rayspeed export (weights.pt + model_config.json)

Tokenizer files: a tokenizer object (saved with save_pretrained), a path to a tokenizer.json, or a directory
holding a saved tokenizer. The byte tokenizer has no files of its own: nothing is written for it unless the
caller passes `byte_tokenizer()`, a transformers tokenizer whose ids are exactly the UTF-8 bytes.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Optional

import torch

from rayspeed.config.hf_checkpoint import INDEX_FILE, SINGLE_FILE, TOKENIZER_FILES
from rayspeed.config.hf_config import to_hf_config
from rayspeed.config.shape import ModelShape
from rayspeed.config.vision_shape import vision_language_config
from rayspeed.model.image_weights import vision_language_tensors

DEFAULT_SHARD_BYTES = 2 << 30  # transformers' own default shard size (2 GB files, many of them for big models)


def _shards(tensors: dict[str, torch.Tensor], max_bytes: int) -> list[dict[str, torch.Tensor]]:
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in tensors.items():
        n = t.numel() * t.element_size()
        if shards[-1] and size + n > max_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += n
    return shards


def write_weights(tensors: dict[str, torch.Tensor], out: Path, max_shard_bytes: int = DEFAULT_SHARD_BYTES) -> list[str]:
    """safetensors files as save_pretrained writes them: one model.safetensors, or model-0000i-of-0000n files
    plus model.safetensors.index.json. Returns the file names."""
    from safetensors.torch import save_file

    shards = _shards(tensors, max_shard_bytes)
    if len(shards) == 1:
        save_file(shards[0], str(out / SINGLE_FILE), metadata={"format": "pt"})
        _readable(out / SINGLE_FILE)
        return [SINGLE_FILE]
    names, weight_map = [], {}
    for i, shard in enumerate(shards, 1):
        fname = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(out / fname), metadata={"format": "pt"})
        _readable(out / fname)
        names.append(fname)
        weight_map.update({k: fname for k in shard})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    (out / INDEX_FILE).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    return names


def _readable(path: Path) -> None:
    """safetensors writes through a private temporary file (mode 0600): give the weights the mode every other
    file of the folder gets (0666 less the umask), so whoever may read the export may read its weights."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(path, 0o666 & ~umask)


def write_tokenizer(tokenizer: Any, out: Path) -> list[str]:
    """Save the tokenizer files into out; returns their names ([] for None)."""
    if tokenizer is None:
        return []
    before = set(p.name for p in out.iterdir())
    if hasattr(tokenizer, "save_pretrained"):
        tokenizer.save_pretrained(str(out))
    else:
        src = Path(str(tokenizer))
        if src.is_file():  # a tokenizer.json: wrap it so transformers finds a complete tokenizer
            from transformers import PreTrainedTokenizerFast

            PreTrainedTokenizerFast(tokenizer_file=str(src)).save_pretrained(str(out))
        elif src.is_dir():
            for name in TOKENIZER_FILES:
                if (src / name).is_file():
                    shutil.copy2(src / name, out / name)
        else:
            raise FileNotFoundError(f"tokenizer {src}: no such file or directory")
    return sorted(set(p.name for p in out.iterdir()) - before)


PROCESSOR_FILES = ("processor_config.json", "preprocessor_config.json", "chat_template.json")


def write_processor(source: Any, out: Path) -> list[str]:
    """A vision-language model's processor files (image processor, the processor's own settings), copied from the
    checkpoint it was trained from; their names."""
    src = Path(str(source)) if isinstance(source, (str, Path)) else None
    if src is None or not src.is_dir():
        return []
    copied = [name for name in PROCESSOR_FILES if (src / name).is_file()]
    for name in copied:
        shutil.copy2(src / name, out / name)
    return copied


def write_hf_dir(state: dict[str, torch.Tensor], shape: ModelShape, out_dir: str, tokenizer: Any = None,
                 max_shard_bytes: int = DEFAULT_SHARD_BYTES, dtype: torch.dtype = torch.float32) -> dict[str, Any]:
    """Write state (rayspeed names, full shapes) as a Hugging Face checkpoint into out_dir (created).
    Returns {"dir", "weights": [files], "tokenizer": [files], "parameters"}."""
    from rayspeed.model.hf_weights import hf_tensors

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tensors = hf_tensors(state, shape)
    if shape.image_path is not None:
        tensors = vision_language_tensors(tensors, state, shape.image_path)
    tensors = {k: v.to(dtype) for k, v in tensors.items()}
    files = write_weights(tensors, out, max_shard_bytes)
    tok_files = write_tokenizer(tokenizer, out)
    if shape.image_path is not None:
        tok_files += write_processor(tokenizer, out)
    source = Path(str(tokenizer)) if isinstance(tokenizer, (str, Path)) and Path(str(tokenizer)).is_dir() else None
    bos = eos = None
    if tokenizer is not None and not hasattr(tokenizer, "eos_token_id") and tok_files:
        try:  # tokenizer files copied from a path: their special tokens go into config.json (generation stops at EOS)
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(str(out))
        except Exception:
            tokenizer = None
    if tokenizer is not None and hasattr(tokenizer, "eos_token_id"):
        bos, eos = tokenizer.bos_token_id, tokenizer.eos_token_id
    eos = stop_ids(eos, source)
    config = to_hf_config(shape, bos, eos, dtype=str(dtype).replace("torch.", ""))
    if shape.image_path is not None:
        config = vision_language_config(shape.image_path, config)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    gen = {k: v for k, v in {"bos_token_id": bos, "eos_token_id": eos}.items() if v is not None}
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    return {"dir": str(out), "weights": files, "tokenizer": tok_files,
            "parameters": sum(t.numel() for t in tensors.values())}


def stop_ids(eos: Any, source: Optional[Path]) -> Any:
    """The ids generation stops at: the tokenizer's EOS and every EOS id of the source model's
    generation_config.json (Qwen3 stops at <|im_end|> and <|endoftext|>, Gemma 3 at <eos> and <end_of_turn>);
    one id as an int, several as a list, as transformers writes them."""
    ids = [] if eos is None else [int(i) for i in (eos if isinstance(eos, (list, tuple)) else [eos])]
    gen = source / "generation_config.json" if source is not None else None
    if gen is not None and gen.is_file():
        try:
            theirs = json.loads(gen.read_text()).get("eos_token_id")
        except (OSError, ValueError):
            theirs = None
        for i in theirs if isinstance(theirs, list) else ([theirs] if theirs is not None else []):
            if int(i) not in ids:
                ids.append(int(i))
    if not ids:
        return None
    return ids[0] if len(ids) == 1 else ids


def hf_dir_from_export(export_dir: str, out_dir: str, tokenizer: Any = None,
                       max_shard_bytes: int = DEFAULT_SHARD_BYTES) -> dict[str, Any]:
    """Convert a rayspeed export (model/export.py: weights.pt + model_config.json) into a Hugging Face dir."""
    from rayspeed.model.export import CONFIG, WEIGHTS

    src = Path(export_dir)
    spec = json.loads((src / CONFIG).read_text())
    if not (src / WEIGHTS).is_file():
        raise FileNotFoundError(f"{src / WEIGHTS} is missing (an incomplete export)")
    state = torch.load(src / WEIGHTS, map_location="cpu", weights_only=True)
    shape = ModelShape.from_config(SimpleNamespace(**spec["model"]))
    return write_hf_dir(state, shape, out_dir, tokenizer, max_shard_bytes)


def byte_tokenizer() -> Any:
    """A transformers tokenizer whose ids are the UTF-8 bytes of the text, like rayspeed's byte tokenizer: byte
    b is id b (a byte-level BPE with no merges over GPT-2's printable byte alphabet)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    table = _byte_table()
    tok = Tokenizer(models.BPE(vocab={table[b]: b for b in range(256)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    # rayspeed's byte tokenizer ends every document with byte 0 (ByteTokenizer.eos_id): the exported model stops
    # generating there too.
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=table[0])


def _byte_table() -> dict[int, str]:
    """GPT-2's byte -> printable character table (what the ByteLevel pre-tokenizer maps bytes to)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, (chr(c) for c in cs)))
