"""Hugging Face format out: a rayspeed model written with config.json + sharded safetensors loads in
`transformers.AutoModelForCausalLM.from_pretrained` to the same logits; `rayspeed export <checkpoint dir> --format
hf OUT` consolidates real DeepSpeed checkpoints (ZeRO-2 over dp, tp2, pp2; engines built from a pretrained
checkpoint through engine/build.py, in a 2-process gloo world) after verifying the manifest; bad input exits 2
and writes nothing."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from _dist import run_distributed
from _hf_models import QWEN, save

SEQ = 16
TOL = dict(rtol=1e-5, atol=1e-5)


def _ids(vocab=256, seed=3):
    return torch.randint(0, vocab, (2, SEQ), generator=torch.Generator().manual_seed(seed))


def _hf_logits(model_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        return model(_ids(model.config.vocab_size)).logits


def test_rayspeed_model_written_as_hf_gives_the_same_logits(tmp_path):
    from rayspeed.config.load import parse
    from rayspeed.config.shape import ModelShape
    from rayspeed.model.hf_export import write_hf_dir
    from rayspeed.model.transformer import Transformer

    m = parse({"model": {"hidden_size": 32, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2, "ffn_hidden_size": 64,
                         "seq_len": SEQ, "tie_embeddings": True, "rope_theta": 500000.0,
                         "rope_scaling": {"rope_type": "llama3", "factor": 8, "low_freq_factor": 1,
                                          "high_freq_factor": 4, "original_max_position_embeddings": 256}}}).model
    shape = ModelShape.from_config(m)
    model = Transformer(shape, seed=4).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():  # norms away from 1, so a norm mix-up shows
            if "norm" in name:
                p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(len(name))) * 0.3)
        expected = model(_ids())
    report = write_hf_dir(model.full_state_dict(), shape, str(tmp_path / "hf"), max_shard_bytes=20_000)
    assert len(report["weights"]) > 1 and (tmp_path / "hf" / "model.safetensors.index.json").is_file()
    assert report["tokenizer"] == []  # the byte tokenizer has no files
    cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["rope_parameters"]["rope_type"] == "llama3"
    torch.testing.assert_close(_hf_logits(tmp_path / "hf"), expected, **TOL)


def test_the_source_models_stop_ids_are_exported_so_generate_stops(tmp_path):
    """A Qwen3-style checkpoint that stops at two ids (its generation_config.json, as Qwen3's <|im_end|> and
    <|endoftext|>): the export of a job on its tokenizer (data.tokenizer: model) keeps both; generate stops at the
    second."""
    from transformers import AutoModelForCausalLM, GenerationConfig

    from _hf_models import QWEN3, shape_of
    from _hf_parity import build
    from rayspeed.model.hf_export import write_hf_dir

    src = tmp_path / "src"
    save(src, QWEN3, seed=2, tokenizer=True)  # the byte tokenizer: EOS is id 0
    (src / "generation_config.json").write_text(json.dumps({"eos_token_id": [0, 7]}))
    shape = shape_of(str(src), SEQ)
    write_hf_dir(build(shape, str(src)).full_state_dict(), shape, str(tmp_path / "out"), tokenizer=str(src))
    assert json.loads((tmp_path / "out" / "config.json").read_text())["eos_token_id"] == [0, 7]
    assert GenerationConfig.from_pretrained(str(tmp_path / "out")).eos_token_id == [0, 7]
    model = AutoModelForCausalLM.from_pretrained(str(tmp_path / "out"), dtype=torch.float32).eval()
    with torch.no_grad():  # make id 7 the most likely next token everywhere: generation must stop right there
        model.lm_head.weight[7] = model.model.norm.weight.sign() * 50
        out = model.generate(torch.tensor([[65, 66]]), max_new_tokens=5, do_sample=False)
    assert out[0, 2:].tolist() == [7]


def test_byte_tokenizer_ids_are_the_bytes():
    from rayspeed.data.tokenizer import ByteTokenizer
    from rayspeed.model.hf_export import byte_tokenizer

    text = "def f(x):\n\treturn 'héllo wörld' + \"\\u00e9\"  # ünïcode ✓\x00"
    tok = byte_tokenizer()
    ids = tok(text)["input_ids"]
    assert ids == ByteTokenizer().encode(text)
    assert tok.decode(ids) == text and len(tok) == 256


# ---------------------------------------------------------------- checkpoints of real engines


LAYOUTS = {"zero2": (2, 1, 1, 2), "tp2": (1, 2, 1, 1), "pp2": (1, 1, 2, 1)}


def _save_checkpoints(rank, world_size, model_dir, root):
    import dataclasses

    import torch.distributed as dist

    from _deepspeed_world import _init_deepspeed
    from rayspeed.checkpoint import manifest
    from rayspeed.checkpoint.consolidate import manifest_model_meta
    from rayspeed.config import parse
    from rayspeed.engine.build import build_engine
    from rayspeed.engine.deepspeed_config import deepspeed_config
    from rayspeed.parallel.groups import ParallelGroups

    _init_deepspeed()
    for name, (dp, tp, pp, zero) in LAYOUTS.items():
        cfg = parse({
            "name": f"hf-{name}", "model": {"pretrained": model_dir, "seq_len": SEQ},
            "train": {"global_batch_size": 2 * dp, "precision": "fp32", "max_steps": 2, "warmup_steps": 0},
            "parallel": dict(dp=dp, tp=tp, pp=pp, zero_stage=zero, micro_batch_size=2, grad_accum=1,
                             sequence_parallel=False, activation_checkpointing="none"),
            "cluster": {"num_workers": 2},
        })
        groups = ParallelGroups(dp, tp, pp)
        engine, _ = build_engine(cfg, deepspeed_config(cfg), groups, torch.device("cpu"))
        d = Path(root) / name / manifest.dir_name(1)
        d.mkdir(parents=True, exist_ok=True)
        dist.barrier()
        engine.save_checkpoint(str(d), tag="ds", client_state={"step": 1}, save_latest=False)
        dist.barrier()
        if rank == 0:
            layout = {k: getattr(cfg.parallel, k) for k in ("dp", "tp", "pp", "zero_stage")}
            manifest.write_manifest(d, 1, {"layout": layout, **manifest_model_meta(cfg)})
        dist.barrier()
        del engine
    return dataclasses.asdict(cfg.model)["architecture"]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("ck")
    model_dir = root / "qwen"
    save(model_dir, QWEN, seed=2, shards=2)
    run_distributed(_save_checkpoints, 2, str(model_dir), str(root / "runs"), timeout_s=120)
    return {"hf": model_dir, "runs": root / "runs", "logits": _hf_logits(model_dir)}


def _export(*argv):
    from rayspeed.cli import main as _cli

    def main(argv):
        return _cli(["export", *argv])

    return main([str(a) for a in argv])


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_checkpoint_export_loads_in_transformers_with_the_checkpoints_logits(checkpoints, layout, tmp_path, capsys):
    # The engines were built from the pretrained checkpoint and not stepped: the export is that model again,
    # which also proves engine/build.py loaded each rank's slices right.
    out = tmp_path / "out"
    assert _export(checkpoints["runs"] / layout, "--format", "hf", out) == 0
    printed = capsys.readouterr().out
    assert f"tp={LAYOUTS[layout][1]} pp={LAYOUTS[layout][2]}" in printed and "none (byte tokenizer)" in printed
    assert not list(out.glob("tokenizer*"))
    torch.testing.assert_close(_hf_logits(out), checkpoints["logits"], **TOL)
    assert json.loads((out / "config.json").read_text())["architectures"] == ["Qwen2ForCausalLM"]


def test_export_bad_input_exits_2_and_writes_nothing(checkpoints, tmp_path, capsys):
    import shutil

    bad = tmp_path / "tampered"
    shutil.copytree(checkpoints["runs"] / "tp2", bad)
    shard = next((bad / "checkpoint_step00000001" / "ds").glob("mp_rank_01_*"))
    data = bytearray(shard.read_bytes())
    data[-10] ^= 0xFF
    shard.write_bytes(bytes(data))
    out = tmp_path / "out"
    assert _export(bad / "checkpoint_step00000001", "--format", "hf", out) == 2
    err = capsys.readouterr().err
    assert "does not match its sha256" in err and "nothing was loaded" in err and len(err.strip().splitlines()) == 1
    assert not out.exists()

    out.mkdir()
    (out / "x").write_text("keep")
    assert _export(checkpoints["runs"] / "tp2", "--format", "hf", out) == 2
    assert "not an empty directory" in capsys.readouterr().err
    assert _export("not-a-run-or-dir", "--format", "hf", tmp_path / "o2") == 2
    assert "neither a directory nor an MLflow run id" in capsys.readouterr().err
    assert _export(tmp_path, "--format", "hf", tmp_path / "o3") == 2
    assert "no verified rayspeed checkpoint" in capsys.readouterr().err
    assert not (tmp_path / "o2").exists() and not (tmp_path / "o3").exists()
