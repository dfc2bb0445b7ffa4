"""Decoding with rayspeed's own model (rayspeed.model.generate) against transformers' generate on the same weights:
a batch of prompts of different lengths (left-padded on both sides), greedy, gives the same tokens for each family's
attention form (GQA with llama3 RoPE, per-head and whole-projection q/k norms, soft-capped scores, sliding windows
shorter than the sequence, local and global RoPE bases, sink logits); a row ends at its first end token (one of
several) while the others go on. Decoding over the KV cache gives the tokens the whole-sequence recomputation gives,
and sampling is the caller's generator's: the same seed, the same completions."""

from __future__ import annotations

import pytest
import torch

from _hf_models import GEMMA2, GEMMA3, LLAMA_TIED, MISTRAL_SWA, OLMO2, QWEN3, save, shape_of
from _hf_parity import build

PROMPTS = [[5, 17, 99, 3, 42, 8, 61], [7, 7, 200], [120, 33, 9, 14, 77]]
NEW = 10
PAD = 0
FAMILIES = {"llama": LLAMA_TIED, "qwen3": QWEN3, "olmo2": OLMO2, "gemma2": GEMMA2, "gemma3": GEMMA3,
            "mistral": MISTRAL_SWA}


def _gpt_oss(out):
    from test_model_gpt_oss import CONFIG
    from transformers import GptOssConfig, GptOssForCausalLM

    torch.manual_seed(3)
    model = GptOssForCausalLM(GptOssConfig(**dict(CONFIG, output_router_logits=False))).float()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("sinks"):
                p.normal_(0.0, 0.3)
    model.save_pretrained(out)


@pytest.fixture(scope="module", params=[*sorted(FAMILIES), "gpt_oss"])
def family(request, tmp_path_factory):
    out = tmp_path_factory.mktemp(request.param)
    if request.param == "gpt_oss":
        _gpt_oss(out)
    else:
        save(out, FAMILIES[request.param], seed=11)
    return out


def _transformers(model_dir, eos):
    from transformers import AutoModelForCausalLM

    from rayspeed.model.generate import left_padded

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    ids, valid = left_padded(PROMPTS, PAD)
    out = model.generate(ids, attention_mask=valid.long(), max_new_tokens=NEW, do_sample=False,
                         eos_token_id=eos, pad_token_id=PAD)[:, ids.shape[1]:]
    rows = []
    for row in out.tolist():
        cut = next((i + 1 for i, t in enumerate(row) if t in (eos or [])), len(row))
        rows.append(row[:cut])
    return rows


def test_greedy_equals_transformers_generate(family):
    from rayspeed.model.generate import Sampling, caches, generate

    model = build(shape_of(family, 64), family)
    assert caches(model)
    free = _transformers(family, None)
    # Two end tokens: the first one row 0 makes after its second token, and one no row makes.
    end = next(i for i in range(2, NEW) if free[0][i] not in free[0][:i])
    eos = [free[0][end], next(t for t in range(255, 0, -1) if all(t not in row for row in free))]
    want = _transformers(family, eos)
    got = generate(model, PROMPTS, Sampling(NEW, greedy=True), eos, PAD)
    assert got.ids == want
    assert len(got.ids[0]) == end + 1 and got.truncated[0] is False
    assert any(len(row) == NEW for row in got.ids)  # another row went on past row 0's end
    assert got.truncated == [not (row and row[-1] in eos) for row in want]


def test_the_cache_decodes_what_recomputing_decodes(family):
    from rayspeed.model.generate import Sampling, generate

    model = build(shape_of(family, 64), family)
    sampling = Sampling(NEW, temperature=0.9, top_p=0.9, top_k=50)
    cached = generate(model, PROMPTS, sampling, [], PAD, generator=torch.Generator().manual_seed(5), cache=True)
    whole = generate(model, PROMPTS, sampling, [], PAD, generator=torch.Generator().manual_seed(5), cache=False)
    again = generate(model, PROMPTS, sampling, [], PAD, generator=torch.Generator().manual_seed(5))
    other = generate(model, PROMPTS, sampling, [], PAD, generator=torch.Generator().manual_seed(6))
    assert cached.ids == whole.ids == again.ids
    assert other.ids != cached.ids
    assert all(len(row) == NEW for row in cached.ids) and all(cached.truncated)


def test_nucleus_and_top_k_cut_as_transformers_warpers():
    from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    from rayspeed.model.generate import nucleus

    scores = torch.randn(4, 256, generator=torch.Generator().manual_seed(0)) * 3
    for p in (0.3, 0.8, 0.95):
        want = TopPLogitsWarper(p)(None, scores.clone())
        torch.testing.assert_close(nucleus(scores.clone(), p), want)
    t = TemperatureLogitsWarper(0.7)(None, scores.clone())
    k = TopKLogitsWarper(20)(None, t)
    assert int(torch.isfinite(k).sum(-1).max()) == 20


def test_latent_attention_decodes_by_recomputing(tmp_path):
    from test_model_deepseek_v3 import CONFIG
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    from rayspeed.model.generate import Sampling, caches, generate

    torch.manual_seed(3)
    DeepseekV3ForCausalLM(DeepseekV3Config(**CONFIG)).float().save_pretrained(tmp_path)
    model = build(shape_of(tmp_path, 64), tmp_path)
    assert not caches(model)  # DeepSeek-V3's latent attention keeps no cache here: each token reruns the sequence
    got = generate(model, PROMPTS, Sampling(NEW, greedy=True), [], PAD)
    assert got.ids == _transformers(tmp_path, None)


def test_each_sampled_tokens_entropy_is_the_whole_forwards(tmp_path):
    """A sampled token's entropy (Completions.entropies, TRL's `entropy` on-policy) is the entropy of the
    temperature-scaled distribution at its position in one forward over the prompt and the completion (the cache's
    numbers are the whole sequence's), over the whole vocabulary whatever top_p cut; greedy decoding reports none."""
    from rayspeed.model.generate import Sampling, entropy, generate

    save(tmp_path / "llama", LLAMA_TIED, seed=11)
    model = build(shape_of(tmp_path / "llama", 64), tmp_path / "llama").eval()
    prompt = PROMPTS[0]
    sampling = Sampling(NEW, temperature=0.7, top_p=0.9)
    got = generate(model, [prompt], sampling, [], PAD, generator=torch.Generator().manual_seed(3))
    row = got.ids[0]
    with torch.no_grad():
        logits = model(torch.tensor([prompt + row]))[0]
    want = entropy(logits[len(prompt) - 1:len(prompt) - 1 + len(row)], 0.7)
    torch.testing.assert_close(torch.tensor(got.entropies[0]), want, rtol=1e-5, atol=1e-5)
    assert want.min() > 0.1  # a spread-out distribution: the check is not of zeros
    assert generate(model, [prompt], Sampling(NEW, greedy=True), [], PAD).entropies == []
