"""Make the chat fine-tuning example, locally (nothing is downloaded): a small Llama-family checkpoint with its own
tokenizer and chat template, and a small chat corpus in JSONL files.

    make examples                                       # runs this with the default OUT
    python scripts/make_tiny_chat_model.py [OUT]        # default runs/examples/tiny-chat in the repository
    make train CONFIG=configs/tiny-chat-finetune-cpu.yaml    # makes the example first when it is missing

OUT/model/   LlamaForCausalLM (hidden 64, 2 layers, GQA, tied embeddings, transformers' own initialisation) saved
             with save_pretrained, and its tokenizer: a byte-level BPE of 512 ids trained here with `tokenizers` on
             the corpus, Llama-3 special tokens (<|begin_of_text|>, <|start_header_id|>, <|end_header_id|>,
             <|eot_id|> as EOS) and a Llama-3-style chat template without generation markers (like most published
             ones: rayspeed finds the assistant turns by rendering the conversation turn by turn).
OUT/chats/   chats-0.jsonl .. chats-3.jsonl: {"messages": [{"role", "content"}, ...]} records: short questions
             about a fixed set of facts, some with a system prompt, some with two exchanges.
OUT/preferences/prefs.jsonl: conversational preference pairs (TRL's form: {"prompt": [messages], "chosen":
             [the assistant's right answer], "rejected": [a hedged answer to another question]}) for the DPO example
             (configs/tiny-dpo-cpu.yaml).

`--arch qwen3` makes a Qwen3ForCausalLM instead (head_dim 32 over 4 heads of a 64-wide model, ChatML tokens, a
template that drops the reasoning of earlier assistant turns as Qwen3's does, answers with an empty
`<think></think>`, stopping at <|im_end|> or <|endoftext|>); `--arch gemma3_text` a Gemma3ForCausalLM (local layers
with an 8-token window, <start_of_turn>/<end_of_turn>, the assistant as `model`, a system prompt folded into the
first user turn as Gemma 3's template does, stopping at <eos> or <end_of_turn>).

Re-running with the same OUT rewrites the same files (fixed seed).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
from typing import Any

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "platform"))

# Inside the repository (runs/ is ignored by git), where configs/tiny-chat-finetune-cpu.yaml looks for it.
DEFAULT_OUT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "runs", "examples", "tiny-chat")
FACTS = [
    ("What color is the sky?", "The sky is blue."),
    ("What color is grass?", "Grass is green."),
    ("What color is snow?", "Snow is white."),
    ("What color is a banana?", "A banana is yellow."),
    ("What color is coal?", "Coal is black."),
    ("What is the capital of France?", "The capital of France is Paris."),
    ("What is the capital of Italy?", "The capital of Italy is Rome."),
    ("What is the capital of Japan?", "The capital of Japan is Tokyo."),
    ("What is the capital of Spain?", "The capital of Spain is Madrid."),
    ("What is the capital of Egypt?", "The capital of Egypt is Cairo."),
    ("How many legs does a spider have?", "A spider has eight legs."),
    ("How many legs does a dog have?", "A dog has four legs."),
    ("How many days are in a week?", "A week has seven days."),
    ("How many months are in a year?", "A year has twelve months."),
    ("What do bees make?", "Bees make honey."),
    ("What do cows drink?", "Cows drink water."),
    ("Where does the sun rise?", "The sun rises in the east."),
    ("Where does the sun set?", "The sun sets in the west."),
    ("What is two plus two?", "Two plus two is four."),
    ("What is three plus four?", "Three plus four is seven."),
]
GREETINGS = [("Hello!", "Hello! How can I help you?"), ("Thank you!", "You are welcome.")]
SYSTEMS = ["You are a helpful assistant.", "Answer in one short sentence."]
SPECIAL = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
# Llama 3's template, minus tools and dates: no {% generation %} markers.
CHAT_TEMPLATE = (
    "{{- bos_token }}"
    "{%- for message in messages %}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim"
    " + '<|eot_id|>' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
)


# Written here with the behaviour of the published templates (their text is not shipped).
QWEN3_SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
QWEN3_TEMPLATE = (
    "{%- set ns = namespace(last_user=-1) %}{%- for m in messages %}{%- if m['role'] == 'user' %}"
    "{%- set ns.last_user = loop.index0 %}{%- endif %}{%- endfor %}"
    "{%- for m in messages %}{%- set content = m['content'] %}"
    "{%- if m['role'] == 'assistant' %}{%- set answer = content.split('</think>')[-1].lstrip('\n') %}"
    "{%- if loop.index0 > ns.last_user and '</think>' not in content %}"
    "{%- set content = '<think>\n\n</think>\n\n' + content %}{%- endif %}"
    "{%- if loop.index0 > ns.last_user %}{{- '<|im_start|>assistant\n' + content + '<|im_end|>\n' }}"
    "{%- else %}{{- '<|im_start|>assistant\n' + answer + '<|im_end|>\n' }}{%- endif %}"
    "{%- else %}{{- '<|im_start|>' + m['role'] + '\n' + content + '<|im_end|>\n' }}{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}")
GEMMA_SPECIAL = ["<pad>", "<eos>", "<bos>", "<start_of_turn>", "<end_of_turn>"]
GEMMA_TEMPLATE = (
    "{{- bos_token }}{%- if messages[0]['role'] == 'system' %}{%- set first = messages[0]['content'] + '\n\n' %}"
    "{%- set loop_messages = messages[1:] %}{%- else %}{%- set first = '' %}{%- set loop_messages = messages %}"
    "{%- endif %}{%- for m in loop_messages %}{%- set role = 'model' if m['role'] == 'assistant' else m['role'] %}"
    "{{- '<start_of_turn>' + role + '\n' + (first if loop.first else '') + m['content'] | trim + "
    "'<end_of_turn>\n' }}{%- endfor %}{%- if add_generation_prompt %}{{- '<start_of_turn>model\n' }}{%- endif %}")
FLAVOURS = {  # arch -> (special tokens, template, bos, eos, pad, the other stop token)
    "llama": (SPECIAL, CHAT_TEMPLATE, "<|begin_of_text|>", "<|eot_id|>", "<|end_of_text|>", None),
    "qwen3": (QWEN3_SPECIAL, QWEN3_TEMPLATE, None, "<|im_end|>", "<|endoftext|>", "<|endoftext|>"),
    "gemma3_text": (GEMMA_SPECIAL, GEMMA_TEMPLATE, "<bos>", "<eos>", "<pad>", "<end_of_turn>"),
}


def conversations(n: int = 800, seed: int = 0) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        msgs: list[dict[str, str]] = []
        if rng.random() < 0.3:
            msgs.append({"role": "system", "content": rng.choice(SYSTEMS)})
        if rng.random() < 0.15:
            q, a = rng.choice(GREETINGS[:1])
            msgs += [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
        for _ in range(1 if rng.random() < 0.7 else 2):
            q, a = rng.choice(FACTS)
            msgs += [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
        out.append({"messages": msgs})
    return out


def preferences(n: int = 240, seed: int = 1) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        (q, a), (_, wrong) = rng.sample(FACTS, 2)
        prompt = ([{"role": "system", "content": rng.choice(SYSTEMS)}] if rng.random() < 0.3 else [])
        hedged = f"I am not sure, maybe {wrong[0].lower()}{wrong[1:]}"
        out.append({"prompt": prompt + [{"role": "user", "content": q}],
                    "chosen": [{"role": "assistant", "content": a}],
                    "rejected": [{"role": "assistant", "content": hedged}]})
    return out


def train_tokenizer(texts: list[str], vocab: int = 512, arch: str = "llama") -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    special, template, bos, eos, pad, _ = FLAVOURS[arch]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=special,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer)
    extra = [t for t in ("<start_of_turn>", "<end_of_turn>", "<|im_start|>") if t in special]
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=bos, eos_token=eos, pad_token=pad,
                                   additional_special_tokens=extra, chat_template=template)


def model_config(arch: str, tokenizer: Any) -> Any:
    import transformers

    ids = dict(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
               pad_token_id=tokenizer.pad_token_id)
    common = dict(vocab_size=512, hidden_size=64, intermediate_size=192, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=True,
                  initializer_range=0.02, **ids)
    if arch == "qwen3":
        return transformers.Qwen3Config(**common, head_dim=32, rms_norm_eps=1e-6, use_sliding_window=False,
                                        rope_parameters={"rope_type": "default", "rope_theta": 1e6})
    if arch == "gemma3_text":
        return transformers.Gemma3TextConfig(**common, head_dim=32, rms_norm_eps=1e-6, sliding_window=8,
                                             layer_types=["sliding_attention", "full_attention"],
                                             query_pre_attn_scalar=32)
    return transformers.LlamaConfig(**common, rms_norm_eps=1e-5,
                                    rope_parameters={"rope_type": "default", "rope_theta": 10000.0})


def save(out: str, seed: int = 0, arch: str = "llama") -> dict[str, Any]:
    import torch
    import transformers

    records = conversations(seed=seed)
    chats = os.path.join(out, "chats")
    os.makedirs(chats, exist_ok=True)
    for i in range(4):  # a multi-file corpus
        with open(os.path.join(chats, f"chats-{i}.jsonl"), "w") as f:
            for r in records[i::4]:
                f.write(json.dumps(r) + "\n")
    prefs = os.path.join(out, "preferences")
    os.makedirs(prefs, exist_ok=True)
    with open(os.path.join(prefs, "prefs.jsonl"), "w") as f:
        for r in preferences(seed=seed + 1):
            f.write(json.dumps(r) + "\n")
    texts = [m["content"] for r in records for m in r["messages"]] + ["system user assistant"] * 10
    tokenizer = train_tokenizer(texts, arch=arch)
    model_dir = os.path.join(out, "model")
    tokenizer.save_pretrained(model_dir)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(model_config(arch, tokenizer), dtype=torch.float32)
    other_stop = FLAVOURS[arch][5]
    if other_stop is not None:  # the turn's end and the document's end both stop generation, as published
        model.generation_config.eos_token_id = [tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids(other_stop)]
    model.save_pretrained(model_dir)
    return {"model": model_dir, "chats": chats, "records": len(records), "vocab": len(tokenizer), "preferences": prefs}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", nargs="?", default=DEFAULT_OUT)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--arch", choices=sorted(FLAVOURS), default="llama")
    a = ap.parse_args(argv)
    made = save(a.out, a.seed, a.arch)
    print(f"model and tokenizer (vocab {made['vocab']}, chat template): {made['model']}")
    print(f"{made['records']} chat records in {made['chats']}/chats-*.jsonl")
    print(f"preference pairs in {made['preferences']}/prefs.jsonl")
    return 0


if __name__ == "__main__":
    sys.exit(main())
