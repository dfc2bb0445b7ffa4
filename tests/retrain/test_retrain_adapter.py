"""Retraining an adapter job: the second cycle warm-starts from the champion's own adapter (its PEFT files beside the
merged model it registered), continued on model.pretrained, so the new version is still an adapter of that base:
peft applies its exported adapter to the base and gets the registered (merged) model's logits. A new adapter
stacked on the champion's merged weights would fail that: its PEFT files would leave the champion's adapter out.
Two cycles of real training jobs (--launcher local), a real MLflow store in tmp_path."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_retrain import _corpus, home  # noqa: F401  (the fixture)

pytestmark = pytest.mark.slow  # two real training cycles: the adapters' share of make test-slow


def _job(where: Path, base: Path) -> str:
    _corpus(where / "corpus")
    cfg = where / "job.yaml"
    cfg.write_text(f"""
name: rta
model: {{pretrained: "{base}", init: pretrained, seq_len: 32, adapter: {{type: lora, rank: 4, alpha: 8}}}}
data: {{source: files, path: "{where}/corpus/*.py", tokenizer: bytes, val_fraction: 0.05}}
train: {{global_batch_size: 8, max_steps: 6, lr: 5.0e-3, min_lr: 5.0e-4, warmup_steps: 0, precision: fp32,
        eval_every_steps: 0, eval_batches: 2}}
cluster: {{num_workers: 1}}
resilience: {{checkpoint_every_steps: 0}}
tracking: {{log_every_steps: 3, system_metrics: false, loss_landscape: false, charts_every_checkpoints: 0}}
health: {{preflight: false}}
""")
    return str(cfg)


def test_an_adapter_job_retrains_from_the_champion_adapter_on_the_same_base(home, capfd):  # noqa: F811
    import json

    import mlflow
    import torch
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from _hf_models import tiny
    from rayspeed.compat import mlflow_process_store
    from rayspeed.retrain.cycle import run_cycle

    base = home / "base"
    tiny.main([str(base)])
    cfg = _job(home, base)
    r1 = run_cycle(cfg, launcher="local")
    assert (r1.outcome, r1.version) == ("promoted", "1"), r1.reason

    _corpus(home / "corpus", ("textwrap.py",))  # new data: the next cycle trains
    capfd.readouterr()
    r2 = run_cycle(cfg, launcher="local")
    assert r2.version == "2" and r2.warm_start_from == "models:/rayspeed-rta/1", r2.reason
    said = capfd.readouterr().err
    assert "adapter warm start from the PEFT adapter" in said and "rayspeed-rta/v1/" in said  # the job's own line

    with mlflow_process_store(f"sqlite:///{home / 'mlflow.db'}"):
        local = [Path(mlflow.artifacts.download_artifacts(f"models:/rayspeed-rta/{v}", dst_path=str(home / f"v{v}")))
                 for v in (1, 2)]  # model/: the transformers flavor's merged model; rayspeed/adapter/: PEFT's files
    adapters = [d / "rayspeed" / "adapter" for d in local]
    peft_config = json.loads((adapters[1] / "adapter_config.json").read_text())
    assert Path(peft_config["base_model_name_or_path"]) == base
    first, second = (load_file(str(d / "adapter_model.safetensors")) for d in adapters)
    b = next(k for k in second if k.endswith("lora_B.weight"))
    assert first[b].abs().max() > 0 and not torch.equal(first[b], second[b])  # continued, and trained on

    # Evaluated in fp64: in fp32, (W + s B A) x and W x + s B (A x) are two rounding orders whose logits here each
    # lie about 1.2e-5 from the exact ones; in fp64 only the merged weights' own fp32 storage remains (about 2e-6).
    ids, f64 = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(0)), torch.float64
    with torch.no_grad():
        merged = AutoModelForCausalLM.from_pretrained(str(local[1] / "model"), dtype=f64).eval()(ids).logits
        on_base = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(str(base), dtype=f64),
                                            str(adapters[1])).eval()(ids).logits
        champion = AutoModelForCausalLM.from_pretrained(str(local[0] / "model"), dtype=f64).eval()(ids).logits
    assert (merged - champion).abs().max() > 1e-3  # the two versions differ by more than the tolerance below
    torch.testing.assert_close(on_base, merged, rtol=1e-5, atol=1e-5)

    # A champion adapter trained on another base (a version warm-started from a merged champion names that one):
    # not continued on model.pretrained; the merged warm start instead.
    import shutil

    from rayspeed.config.load import load
    from rayspeed.retrain import champion

    job = load(cfg)
    assert champion.adapter_warm_start(job, str(local[1] / "rayspeed"), True) == str(adapters[1])
    other = home / "other" / "adapter"
    shutil.copytree(adapters[1], other)
    (other / "adapter_config.json").write_text(json.dumps({**peft_config, "base_model_name_or_path": "models:/x/1"}))
    assert champion.adapter_warm_start(job, str(other.parent), True) is None
    assert champion.adapter_warm_start(job, str(local[1] / "rayspeed"), False) is None  # a URI storage
