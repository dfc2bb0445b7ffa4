"""Chat records: rendered with the tokenizer's own chat template (a real tokenizer trained here, the example's
Llama-3-style template without generation markers, and the same template with markers), the loss on assistant
tokens only, and the loss of a step as the mean over the counted labels of its whole global batch."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from rayspeed.data import DataSpec, GlobalBatchSchedule, RankBatches, build_token_file, load_tokenizer
from rayspeed.data.chat import ChatRenderer
from rayspeed.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("make_tiny_chat_model", ROOT / "scripts" / "make_tiny_chat_model.py")
chat_example = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(chat_example)

CONVO = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What color is snow?"},
         {"role": "assistant", "content": "Snow is white."}, {"role": "user", "content": "What do bees make?"},
         {"role": "assistant", "content": "Bees make honey."}]
MARKED = chat_example.CHAT_TEMPLATE.replace(
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim + "
    "'<|eot_id|>' }}",
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' }}"
    "{%- if message['role'] == 'assistant' %}{% generation %}{{- message['content'] | trim + '<|eot_id|>' }}"
    "{% endgeneration %}{%- else %}{{- message['content'] | trim + '<|eot_id|>' }}{%- endif %}")


@pytest.fixture(scope="module")
def tok_dirs(tmp_path_factory):
    """The example's tokenizer (trained here with `tokenizers`) saved twice: its template, and with markers."""
    base = tmp_path_factory.mktemp("chat-tok")
    texts = [m["content"] for r in chat_example.conversations(200) for m in r["messages"]] + ["system user assistant"]
    plain = chat_example.train_tokenizer(texts)
    plain.save_pretrained(str(base / "plain"))
    marked = chat_example.train_tokenizer(texts)
    marked.chat_template = MARKED
    marked.save_pretrained(str(base / "marked"))
    return {"plain": str(base / "plain"), "marked": str(base / "marked")}


def test_assistant_turns_only_with_and_without_generation_markers(tok_dirs):
    plain, marked = ChatRenderer(load_tokenizer(tok_dirs["plain"])), ChatRenderer(load_tokenizer(tok_dirs["marked"]))
    assert not plain.markers and marked.markers
    ids, mask = plain.render(CONVO, "x")
    ids2, mask2 = marked.render(CONVO, "x")
    np.testing.assert_array_equal(ids, ids2)
    np.testing.assert_array_equal(mask, mask2)  # turn-by-turn rendering finds what the markers say
    tok = load_tokenizer(tok_dirs["plain"])
    assert tok.decode(ids[mask == 1]) == "Snow is white.<|eot_id|>Bees make honey.<|eot_id|>"
    text = tok.decode(ids)
    assert text.startswith("<|begin_of_text|><|start_header_id|>system") and text.count("<|begin_of_text|>") == 1
    assert "What color is snow?" in tok.decode(ids[mask == 0])


def test_a_record_without_an_assistant_turn_is_named(tok_dirs, tmp_path):
    rows = [{"messages": CONVO}, {"messages": CONVO[:2]}]
    (tmp_path / "c.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    spec = DataSpec(source="files", path=(str(tmp_path / "c.jsonl"),), tokenizer=tok_dirs["plain"], format="chat")
    with pytest.raises(ConfigError, match=r"c.jsonl:2 has no assistant turn"):
        build_token_file(spec=spec, cache_dir=str(tmp_path / "cache"))
    assert not (tmp_path / "cache").exists()
    with pytest.raises(ConfigError, match="message 0 is not a"):
        ChatRenderer(load_tokenizer(tok_dirs["plain"])).render([{"role": "user"}], "r")


def test_a_template_that_rewrites_earlier_turns_is_refused(tok_dirs, tmp_path):
    tok = load_tokenizer(tok_dirs["plain"])
    tok.hf.chat_template = ("{% for m in messages %}{% if loop.last %}[last]{% endif %}{{ m['role'] }}: "
                            "{{ m['content'] }}\n{% endfor %}{% if add_generation_prompt %}assistant: {% endif %}")
    with pytest.raises(ConfigError, match="generation"):
        ChatRenderer(tok).render(CONVO, "r")


def test_labels_count_assistant_tokens_and_the_step_loss_is_their_mean(tok_dirs, tmp_path):
    rows = chat_example.conversations(60, seed=3)
    (tmp_path / "c.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    spec = DataSpec(source="files", path=(str(tmp_path / "c.jsonl"),), tokenizer=tok_dirs["plain"], format="chat")
    tf = build_token_file(spec=spec, cache_dir=str(tmp_path / "cache"))
    assert tf.mask is not None and tf.num_documents == 60
    train, _ = tf.split(0.1, 32)
    sched = GlobalBatchSchedule(train.num_sequences(32), 8, 5)
    for dm in (False, True):
        one = RankBatches(train, 32, sched, 0, 1, 8, 1, document_masking=dm)
        (x, y, *seg) = one.get(0)[0]
        assert len(seg) == int(dm)
        counted = y != -100
        # A label counts exactly where the predicted token is an assistant token (and, with document masking,
        # is not the first token of a conversation).
        idx = sched.indices(0)
        mask = np.stack([np.asarray(tf.mask[train.start + j * 33: train.start + (j + 1) * 33]) for j in idx])
        expect = mask[:, 1:].astype(bool)
        if dm:
            expect &= train.segments(idx, 32)[:, 1:] == train.segments(idx, 32)[:, :-1]
            np.testing.assert_array_equal(seg[0].numpy(), train.segments(idx, 32)[:, :-1])
        np.testing.assert_array_equal(counted.numpy(), expect)
        assert one.step_tokens(0) == int(counted.sum()) > 0
        # Any layout: the step's counted labels are the same number, and the per-micro-batch weights make the loss
        # the mean over all of them.
        logits = torch.randn(8, 32, 50, generator=torch.Generator().manual_seed(0))
        y_all = y.clamp(max=49).where(counted, torch.tensor(-100))
        ref = torch.nn.functional.cross_entropy(logits.reshape(-1, 50), y_all.reshape(-1), ignore_index=-100)
        for dp, b, acc in ((2, 2, 2), (4, 1, 2), (1, 2, 4)):
            total = 0.0
            for r in range(dp):
                rb = RankBatches(train, 32, sched, r, dp, b, acc, document_masking=dm)
                assert rb.step_tokens(0) == one.step_tokens(0)
                scale = dp * acc / rb.step_tokens(0)
                for k, pos in enumerate(rb.positions(k) for k in range(acc)):
                    yk = rb.get(0)[k][1]
                    lk = torch.nn.functional.cross_entropy(logits[pos].reshape(-1, 50),
                                                           yk.clamp(max=49).where(yk != -100, torch.tensor(-100))
                                                           .reshape(-1), ignore_index=-100)
                    total += float(lk) * int((yk != -100).sum()) * scale
            # DeepSpeed divides by accumulation and averages over data-parallel ranks.
            assert total / (acc * dp) == pytest.approx(float(ref), rel=1e-5)


# Written here with the behaviour of Qwen3's published template (its text is not shipped): an assistant turn
# before the last user message is rendered without its reasoning, the turns after it with `<think>...</think>`.
REASONING_TEMPLATE = (
    "{%- set ns = namespace(last_user=-1) %}{%- for m in messages %}{%- if m['role'] == 'user' %}"
    "{%- set ns.last_user = loop.index0 %}{%- endif %}{%- endfor %}"
    "{%- for m in messages %}{%- set content = m['content'] %}"
    "{%- if m['role'] == 'assistant' %}{%- set answer = content.split('</think>')[-1] %}"
    "{%- if loop.index0 > ns.last_user %}{{- '<|im_start|>assistant\\n' + content + '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>assistant\\n' + answer + '<|im_end|>\\n' }}{%- endif %}"
    "{%- else %}{{- '<|im_start|>' + m['role'] + '\\n' + content + '<|im_end|>\\n' }}{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")
THINKING = [{"role": "user", "content": "What color is snow?"},
            {"role": "assistant", "content": "<think>cold</think>Snow is white."},
            {"role": "user", "content": "What do bees make?"},
            {"role": "assistant", "content": "<think>sweet</think>Bees make honey."}]


def test_a_template_that_drops_earlier_reasoning_trains_each_turn_as_it_is_generated(tok_dirs):
    """Qwen3's rule: the full conversation renders turn 1 without its reasoning, which is not what the model
    produced at turn 1. Each assistant turn becomes its own document: the conversation up to it as the template
    renders it then, its reasoning and answer trained, nothing else."""
    tok = load_tokenizer(tok_dirs["plain"])
    tok.hf.chat_template = REASONING_TEMPLATE
    renderer = ChatRenderer(tok)
    (ids1, mask1), (ids2, mask2) = renderer.render_documents(THINKING, "r")
    assert tok.decode(ids1[mask1 == 1]) == "<think>cold</think>Snow is white.<|im_end|>\n"
    assert tok.decode(ids2[mask2 == 1]) == "<think>sweet</think>Bees make honey.<|im_end|>\n"
    context = tok.decode(ids2[mask2 == 0])
    assert "Snow is white." in context and "cold" not in context  # turn 1 as the template shows it later
    with pytest.raises(ConfigError, match="one document per assistant turn"):
        renderer.render(THINKING, "r")
    assert len(renderer.render_documents(THINKING[:2], "r")) == 1  # one turn: one document, as before


def test_a_template_that_refuses_a_role_is_exit_2_naming_the_record(tok_dirs, tmp_path):
    """Gemma 2's template raises on a system turn (`raise_exception('System role not supported')`): a record with
    one is a clear error naming its line, not a traceback, and nothing is written."""
    tok = load_tokenizer(tok_dirs["plain"])
    template = ("{%- if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}"
                "{%- endif %}{%- for m in messages %}"
                "{%- set role = 'model' if m['role'] == 'assistant' else m['role'] %}"
                "{{ '<start_of_turn>' + role + '\\n' + m['content'] + "
                "'<end_of_turn>\\n' }}{%- endfor %}{%- if add_generation_prompt %}{{ '<start_of_turn>model\\n' }}"
                "{%- endif %}")
    tok.hf.chat_template = template
    tok.hf.save_pretrained(str(tmp_path / "tok"))
    rows = [{"messages": CONVO[1:3]}, {"messages": CONVO}]
    (tmp_path / "c.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    spec = DataSpec(source="files", path=(str(tmp_path / "c.jsonl"),), tokenizer=str(tmp_path / "tok"), format="chat")
    with pytest.raises(ConfigError, match=r"c.jsonl:2: the chat template .* refuses this conversation: System role "
                                          r"not supported"):
        build_token_file(spec=spec, cache_dir=str(tmp_path / "cache"))
    assert not (tmp_path / "cache").exists()


# gpt-oss's message logic as published (its text is not shipped; the header, tool namespaces and reasoning channel
# left out): a first system or developer message becomes the developer instructions, a tool result needs the
# assistant's tool call before it (else raise_exception), and a turn of a role it does not know is left out silently.
GPT_OSS_TEMPLATE = (
    "{%- if messages[0]['role'] in ['developer', 'system'] %}"
    "{{- '<|start|>developer<|message|># Instructions\\n\\n' + messages[0]['content'] + '<|end|>' }}"
    "{%- set loop_messages = messages[1:] %}{%- else %}{%- set loop_messages = messages %}{%- endif %}"
    "{%- set last_tool_call = namespace(name=none) %}"
    "{%- for message in loop_messages %}"
    "{%- if message['role'] == 'assistant' %}"
    "{%- if 'tool_calls' in message %}{%- set call = message['tool_calls'][0]['function'] %}"
    "{{- '<|start|>assistant to=functions.' + call['name'] + '<|channel|>commentary json<|message|>' + "
    "call['arguments'] | tojson + '<|call|>' }}{%- set last_tool_call.name = call['name'] %}"
    "{%- else %}{{- '<|start|>assistant<|channel|>final<|message|>' + message['content'] + '<|end|>' }}"
    "{%- set last_tool_call.name = none %}{%- endif %}"
    "{%- elif message['role'] == 'tool' %}{%- if last_tool_call.name is none %}"
    "{{- raise_exception('Message has tool role, but there was no previous assistant message with a tool call!') }}"
    "{%- endif %}{{- '<|start|>functions.' + last_tool_call.name + ' to=assistant<|channel|>commentary<|message|>' + "
    "message['content'] | tojson + '<|end|>' }}"
    "{%- elif message['role'] == 'user' %}{{- '<|start|>user<|message|>' + message['content'] + '<|end|>' }}"
    "{%- endif %}{%- endfor %}{%- if add_generation_prompt %}{{- '<|start|>assistant' }}{%- endif %}")
# Mistral's first one: user and assistant turns, alternating from a user turn (so an assistant turn renders only
# after one), every other role refused with raise_exception.
USER_ASSISTANT_ONLY_TEMPLATE = (
    "{%- for m in messages %}{%- if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{- raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{%- endif %}"
    "{%- if m['role'] == 'user' %}{{- '[INST] ' + m['content'] + ' [/INST]' }}"
    "{%- elif m['role'] == 'assistant' %}{{- m['content'] + '</s>' }}"
    "{%- else %}{{- raise_exception('Only user and assistant roles are supported!') }}{%- endif %}{%- endfor %}")
# Llama 2's: a system prompt is folded into the first user turn (alone, it renders nothing; after a user turn, it is
# left out), other roles are left out.
LLAMA2_TEMPLATE = (
    "{%- if messages[0]['role'] == 'system' %}{%- set system = messages[0]['content'] %}"
    "{%- set loop_messages = messages[1:] %}{%- else %}{%- set system = '' %}{%- set loop_messages = messages %}"
    "{%- endif %}{%- for m in loop_messages %}{%- if m['role'] == 'user' %}"
    "{%- set sys = '<<SYS>>\n' + system + '\n<</SYS>>\n\n' if loop.first and system else '' %}"
    "{{- '[INST] ' + sys + m['content'] + ' [/INST]' }}"
    "{%- elif m['role'] == 'assistant' %}{{- ' ' + m['content'] + ' </s>' }}{%- endif %}{%- endfor %}")
TOOL_CALL = {"type": "function", "function": {"name": "weather", "arguments": {"city": "Paris"}}}
TOOL_CONVO = [{"role": "user", "content": "Weather in Paris?"},
              {"role": "assistant", "content": "", "tool_calls": [TOOL_CALL]},
              {"role": "tool", "content": "Sunny, 21 C"}, {"role": "assistant", "content": "Sunny in Paris."}]


def _template_dir(tok_dirs, tmp_path, template):
    tok = load_tokenizer(tok_dirs["plain"])
    tok.hf.chat_template = template
    tok.hf.save_pretrained(str(tmp_path / "tok"))
    return str(tmp_path / "tok")


def _build(tmp_path, tok_dir, conversations):
    (tmp_path / "c.jsonl").write_text("".join(json.dumps({"messages": c}) + "\n" for c in conversations))
    spec = DataSpec(source="files", path=(str(tmp_path / "c.jsonl"),), tokenizer=tok_dir, format="chat")
    return build_token_file(spec=spec, cache_dir=str(tmp_path / "cache"))


@pytest.mark.parametrize("template, renders", [
    (GPT_OSS_TEMPLATE, "system, user, assistant, tool, developer"),  # leaves an unknown role out
    (USER_ASSISTANT_ONLY_TEMPLATE, "user, assistant"),  # refuses it
])
def test_a_role_the_template_does_not_render_is_named_with_the_roles_it_does(template, renders, tok_dirs, tmp_path):
    tok_dir = _template_dir(tok_dirs, tmp_path, template)
    robot = [{"role": "user", "content": "Hi"}, {"role": "robot", "content": "Beep."}, *CONVO[3:]]
    with pytest.raises(ConfigError) as e:
        _build(tmp_path, tok_dir, [CONVO[1:3], robot])
    assert str(e.value) == (f"config error: data.format: chat: {tmp_path / 'c.jsonl'}:2: role 'robot' is not rendered "
                            f"by the chat template of TransformersTokenizer('{tok_dir}') (it refuses that turn or "
                            f"leaves it out); the template renders {renders}: give the turn one of those roles, or use "
                            "a tokenizer whose template renders it")
    assert not (tmp_path / "cache").exists()


def test_roles_a_template_renders_only_in_context_keep_working(tok_dirs, tmp_path):
    """The probe of a role is one turn of it, alone and where templates want it: gpt-oss renders a developer or system
    message only as the first one and a tool result only after the assistant's tool call; Llama 2 renders a system
    prompt only folded into the user turn after it."""
    tok_dir = _template_dir(tok_dirs, tmp_path, GPT_OSS_TEMPLATE)
    developer = [{"role": "developer", "content": "Answer in French."}, *CONVO[1:3]]
    tf = _build(tmp_path, tok_dir, [developer, CONVO, TOOL_CONVO])
    assert tf.num_documents == 3
    tok = load_tokenizer(tok_dir)
    text = tok.decode(np.asarray(tf.tokens))
    assert "# Instructions\n\nAnswer in French." in text and "# Instructions\n\nBe brief." in text
    assert 'commentary<|message|>"Sunny, 21 C"' in text
    assert "Sunny in Paris." in tok.decode(np.asarray(tf.tokens)[np.asarray(tf.mask) == 1])

    llama2_dir = _template_dir(tok_dirs, tmp_path / "llama2", LLAMA2_TEMPLATE)
    hf = load_tokenizer(llama2_dir).hf
    for alone_or_after_user in (CONVO[:1], [CONVO[1], CONVO[0]]):
        assert "Be brief." not in hf.apply_chat_template(alone_or_after_user, tokenize=False)
    tf = _build(tmp_path / "llama2", llama2_dir, [CONVO])
    assert "[INST] <<SYS>>\nBe brief.\n<</SYS>>\n\nWhat color is snow? [/INST]" in hf.decode(tf.tokens.tolist())
