"""Preference records tokenized as TRL 1.16's DPOTrainer prepares them (rayspeed.data.preference): the standard,
implicit-prompt and conversational forms give TRL's prompt, chosen and rejected ids (the chat form with a locally
made tokenizer's chat template; one TRL dataset per form, as a dataset mixing records with and without a prompt is
not one TRL prepares), the batch rows are TRL's collated ids with the labels on its completion mask, and a malformed
record is one message naming it."""

from __future__ import annotations

import pytest

from rayspeed.errors import ConfigError

STANDARD = [{"prompt": "What color is the sky? ", "chosen": "Blue.", "rejected": "Green, I think."},
            {"prompt": "2 + 2 = ", "chosen": "4", "rejected": "five"}]
IMPLICIT = [{"chosen": "Q: name a fruit. A: a banana.", "rejected": "Q: name a fruit. A: coal."}]
CHATS = [{"prompt": [{"role": "user", "content": "What color is snow?"}],
          "chosen": [{"role": "assistant", "content": "Snow is white."}],
          "rejected": [{"role": "assistant", "content": "Snow is black."}]},
         {"prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "A dog's legs?"}],
          "chosen": [{"role": "assistant", "content": "Four."}],
          "rejected": [{"role": "assistant", "content": "Eight."}]}]
_ITALY = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Capital of Italy?"}]
IMPLICIT_CHATS = [{"chosen": _ITALY + [{"role": "assistant", "content": "Rome."}],
                   "rejected": _ITALY + [{"role": "assistant", "content": "Paris."}]}]


def _trl_prepared(tokenizer_dir, records, tmp_path):
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig
    from trl import DPOConfig, DPOTrainer

    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    model = AutoModelForCausalLM.from_config(LlamaConfig(vocab_size=len(tok), hidden_size=16, intermediate_size=32,
                                                         num_hidden_layers=1, num_attention_heads=2,
                                                         num_key_value_heads=1))
    args = DPOConfig(output_dir=str(tmp_path / "trl"), report_to=[], use_cpu=True, bf16=False,
                     per_device_train_batch_size=len(records))
    trainer = DPOTrainer(model=model, ref_model=model.__class__(model.config), args=args,
                         train_dataset=Dataset.from_list(records), processing_class=tok)
    rows = [trainer.train_dataset[i] for i in range(len(records))]
    return rows, trainer.data_collator(rows), torch


@pytest.mark.parametrize("form", ["standard", "implicit", "conversational", "implicit-conversational"])
def test_pairs_tokenize_and_collate_as_trl(form, tmp_path, examples_home):
    from _hf_models import LLAMA_TIED, save
    from rayspeed.data.preference import pair_rows, tokenize_pair
    from rayspeed.data.tokenizer import TransformersTokenizer

    if form.endswith("conversational"):
        tokenizer_dir = examples_home[1]["model"]
        records = CHATS if form == "conversational" else IMPLICIT_CHATS
    else:
        tokenizer_dir = tmp_path / "llama"
        save(tokenizer_dir, LLAMA_TIED, tokenizer=True)
        records = STANDARD if form == "standard" else IMPLICIT
    want, collated, torch = _trl_prepared(tokenizer_dir, records, tmp_path)
    tok = TransformersTokenizer(tokenizer_dir)
    pairs = [tokenize_pair(r, tok, where=f"pairs.jsonl:{i + 1}") for i, r in enumerate(records)]
    for got, row in zip(pairs, want):
        assert (got.prompt, got.chosen, got.rejected) == (row["prompt_ids"], row["chosen_ids"], row["rejected_ids"])
    ids, labels = pair_rows(pairs, pad_id=tok.hf.pad_token_id or tok.hf.eos_token_id)
    attention, completion = collated["attention_mask"].bool(), collated["completion_mask"]
    assert ids.shape == tuple(collated["input_ids"].shape)
    assert torch.equal(torch.from_numpy(ids)[attention], collated["input_ids"][attention])
    assert torch.equal(torch.from_numpy(labels) != -100, completion[:, 1:].bool())


def test_a_malformed_record_is_named():
    from rayspeed.data.preference import split_record

    with pytest.raises(ConfigError, match="pairs.jsonl:3: a preference record needs 'chosen' and 'rejected'"):
        split_record({"prompt": "x", "chosen": "y"}, "pairs.jsonl:3")
    with pytest.raises(ConfigError, match="must all be strings or all be message lists"):
        split_record({"prompt": "x", "chosen": [{"role": "assistant", "content": "y"}], "rejected": "z"}, "f:1")
