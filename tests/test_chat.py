"""Chat and instruction data: JSONL examples and their errors, chat templates rendered as
transformers and llama.cpp render them, which tokens are trained, and padded batches."""
import json
import re
from pathlib import Path

import numpy as np
import pytest

from ggwgpu.chat import (CHATML, IGNORE, ChatTemplate, ExampleBatches, encode_example,
                         load_dataset, pack_rows, read_jsonl)
from ggwgpu.data import DataError
from ggwgpu.tokenizer import ByteTokenizer

# Real templates, as their models' GGUF files carry them.
SMOLLM2 = ("{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
           "{{ '<|im_start|>system\\nYou are a helpful AI assistant named SmolLM, trained by "
           "Hugging Face<|im_end|>\\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\\n' "
           "+ message['content'] + '<|im_end|>' + '\\n'}}{% endfor %}{% if add_generation_prompt "
           "%}{{ '<|im_start|>assistant\\n' }}{% endif %}")
LLAMA3 = ("{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = "
          "'<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'+ "
          "message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = "
          "bos_token + content %}{% endif %}{{ content }}{% endfor %}{% if add_generation_prompt "
          "%}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}")
ZEPHYR = ("{% for message in messages %}\n{% if message['role'] == 'user' %}\n{{ '<|user|>\\n' + "
          "message['content'] + eos_token }}\n{% elif message['role'] == 'system' %}\n{{ "
          "'<|system|>\\n' + message['content'] + eos_token }}\n{% elif message['role'] == "
          "'assistant' %}\n{{ '<|assistant|>\\n'  + message['content'] + eos_token }}\n{% endif "
          "%}\n{% if loop.last and add_generation_prompt %}\n{{ '<|assistant|>' }}\n{% endif %}\n"
          "{% endfor %}")

CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi?"},
        {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Ünïcode ✓"},
        {"role": "assistant", "content": " Yes. "}]

# What each template gives for CHAT (and the generation prompt after the first user turn).
RENDERED = {
    "chatml": ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi?<|im_end|>\n"
               "<|im_start|>assistant\nHello.<|im_end|>\n<|im_start|>user\nÜnïcode ✓<|im_end|>\n"
               "<|im_start|>assistant\n Yes. <|im_end|>\n"),
    "smollm2": ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi?<|im_end|>\n"
                "<|im_start|>assistant\nHello.<|im_end|>\n<|im_start|>user\nÜnïcode ✓"
                "<|im_end|>\n<|im_start|>assistant\n Yes. <|im_end|>\n"),
    "llama3": ("<s><|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>"
               "<|start_header_id|>user<|end_header_id|>\n\nHi?<|eot_id|><|start_header_id|>"
               "assistant<|end_header_id|>\n\nHello.<|eot_id|><|start_header_id|>user"
               "<|end_header_id|>\n\nÜnïcode ✓<|eot_id|><|start_header_id|>assistant"
               "<|end_header_id|>\n\nYes.<|eot_id|>"),
    "zephyr": ("<|system|>\nBe brief.</s>\n<|user|>\nHi?</s>\n<|assistant|>\nHello.</s>\n"
               "<|user|>\nÜnïcode ✓</s>\n<|assistant|>\n Yes. </s>\n"),
}
TEMPLATES = {"chatml": CHATML, "smollm2": SMOLLM2, "llama3": LLAMA3, "zephyr": ZEPHYR}


# What llama.cpp's own template engine (llama_chat_apply_template, llama-cpp-python 0.3.36)
# made of CHAT with these templates: it writes no BOS text (it adds the BOS token when it
# tokenizes), so Llama 3's is compared with bos_token "". Zephyr's it renders its own way
# (no end-of-turn text), unlike jinja2 and llama.cpp's --jinja mode: not a fixture here.
LLAMA_CPP = {"chatml": RENDERED["chatml"], "smollm2": RENDERED["smollm2"],
             "llama3": RENDERED["llama3"][len("<s>"):]}


@pytest.mark.parametrize("name", LLAMA_CPP)
def test_templates_render_as_llama_cpp_does(name):
    assert ChatTemplate(TEMPLATES[name], eos_token="</s>").render(CHAT) == LLAMA_CPP[name]


@pytest.mark.parametrize("name", TEMPLATES)
def test_templates_render_conversations_as_their_models_expect(name):
    template = ChatTemplate(TEMPLATES[name], bos_token="<s>", eos_token="</s>")
    assert template.render(CHAT) == RENDERED[name]
    # the turns put back together are the whole text; assistant turns are what is trained
    turns = template.turns(CHAT)
    assert "".join(t for t, _ in turns) == RENDERED[name]
    answers = [t for t, trained in turns if trained]
    assert len(answers) == 2 and "Hello." in answers[0] and "Yes." in answers[1]
    assert not any("Hi?" in t or "assistant" in t for t in answers)


# Templates written to behave as published ones do where a conversation's start does not
# render as the start of the whole: Qwen3's answers after the last user turn carry empty
# reasoning tags and earlier ones lose them; Gemma 4's generation prompt opens an empty
# thought that no answer has. Qwen3.5's refuses a conversation without a user turn (as
# Llama 3's does with tools): starts that end before an answer are never rendered alone.
REASONING = (
    "{% set ns = namespace(last=0) %}{% for m in messages %}{% if m['role'] == 'user' %}"
    "{% set ns.last = loop.index0 %}{% endif %}{% endfor %}{% for m in messages %}"
    "{% if m['role'] == 'assistant' and loop.index0 > ns.last %}{{ '<|im_start|>assistant\n"
    "<think>\n\n</think>\n\n' + m['content'] + '<|im_end|>\n' }}{% else %}"
    "{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
NEEDS_USER = ("{% if not (messages | selectattr('role', 'equalto', 'user') | list) %}"
              "{{ raise_exception('No user query found in messages.') }}{% endif %}" + CHATML)
THOUGHT = ("{% for m in messages %}{{ '<|turn>' + ('model' if m['role'] == 'assistant' else "
           "m['role']) + '\n' + m['content'] | trim + '<turn|>\n' }}{% endfor %}"
           "{% if add_generation_prompt %}{{ '<|turn>model\n<|channel>thought\n<channel|>' }}"
           "{% endif %}")


@pytest.mark.parametrize("source, last, first", [
    (REASONING, "<think>\n\n</think>\n\n Yes. <|im_end|>\n",
     "<think>\n\n</think>\n\nHello.<|im_end|>\n"),
    (THOUGHT, "Yes.<turn|>\n", "Hello.<turn|>\n")], ids=["reasoning", "thought"])
def test_a_template_that_renders_starts_otherwise_trains_the_last_answer(source, last, first):
    """As TRL cuts a completion from its prompt: the whole conversation as the template
    renders it, the last answer from where it parts from the rendering of the messages
    before it with the generation prompt; earlier answers are context (and counted)."""
    template = ChatTemplate(source, bos_token="<s>", eos_token="</s>")
    turns = template.turns(CHAT)
    assert "".join(t for t, _ in turns) == template.render(CHAT)
    assert [t for t, trained in turns if trained] == [last]
    assert template.last_answer_only == 1
    one = CHAT[1:3]       # one answer: the same cut, nothing left out
    assert [t for t, trained in template.turns(one) if trained] == [first]
    assert template.last_answer_only == 1
    assert not any(trained for _, trained in template.turns(CHAT[:4]))   # ends with a user
    assert not any(trained for _, trained in template.turns(CHAT, answers_from=5))
    assert template.last_answer_only == 1      # answers before answers_from are no answers


def test_a_template_that_needs_a_user_turn_trains_every_answer_after_one():
    template = ChatTemplate(NEEDS_USER)
    turns = template.turns(CHAT)
    assert [t for t, trained in turns if trained] == ["Hello.<|im_end|>\n",
                                                      " Yes. <|im_end|>\n"]
    assert "".join(t for t, _ in turns) == template.render(CHAT)
    assert template.last_answer_only == 0
    with pytest.raises(DataError, match="No user query"):
        template.turns(CHAT[:1] + [{"role": "assistant", "content": "x"}])


def test_a_template_without_generation_prompt_for_the_default_system_turn():
    """SmolLM2's template adds a system turn when there is none: it is part of the first
    turn's text, and the prompt of a one-turn conversation ends with the assistant header."""
    template = ChatTemplate(SMOLLM2)
    text = template.render([{"role": "user", "content": "2+2?"}], add_generation_prompt=True)
    assert text.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    assert text.endswith("<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n")


def test_template_errors_are_data_errors():
    with pytest.raises(DataError, match="does not parse"):
        ChatTemplate("{% for m in messages %}")
    failing = ChatTemplate("{{ raise_exception('roles must alternate') }}")
    with pytest.raises(DataError, match="roles must alternate"):
        failing.render(CHAT)
    with pytest.raises(DataError):      # the sandbox refuses what a template must not do
        ChatTemplate("{{ messages.__class__.__mro__ }}{{ ''.__class__.__subclasses__() }}"
                     ).render(CHAT)


# Templates come from model files: every way they fail is the user's "the chat template
# (origin) failed" message, and no render runs, or grows, without bound.
HOSTILE = {
    "loops": "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
    "output": "{% for i in range(100000) %}{% for j in range(100) %}xxxxxxxxxxxx{% endfor %}"
              "{% endfor %}",
    "time": "{% set s = 'x' * 100000 %}{% for a in s %}{% for b in s %}{% endfor %}{% endfor %}",
    "repeat": "{{ 'x' * 1000000000 }}",
    "power": "{{ 7 ** 100000000 }}",
    "include": "{% include 'other.j2' %}",
    "import": "{% import 'macros.j2' as m %}",
    "extends": "{% extends 'base.j2' %}",
    "recursion": "{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}",
    "zero": "{{ 1 / 0 }}",
    "range": "{{ range(100000000) | list }}",
    "types": "{{ [1] + 1 }}",
    "sandbox": "{{ ''.__class__.__subclasses__() }}",
}


@pytest.mark.parametrize("name", HOSTILE)
def test_a_hostile_template_fails_with_the_chat_template_message_and_a_bound(name, monkeypatch):
    import time
    from ggwgpu import chat
    monkeypatch.setattr(chat, "RENDER_SECONDS", 1.0)
    template = ChatTemplate(HOSTILE[name], origin="the model's tokenizer.chat_template")
    start = time.monotonic()
    with pytest.raises(DataError, match=r"^the chat template \(the model's tokenizer.chat_"
                                        r"template\) failed: \w+"):
        template.render(CHAT)
    assert time.monotonic() - start < 10


def test_a_template_that_escaped_jinja2_s_sandbox_before_3_1_6_renders_nothing_of_the_host():
    """CVE-2025-27516: |attr("format") reached str.format; jinja2 >= 3.1.6 (the floor)
    refuses it."""
    import os
    os.environ["GGWGPU_TEST_SECRET"] = "secret-value"
    escape = ('{{ ("{0.__globals__[Path].__new__.__globals__[os].environ}"|attr("format"))'
              '(raise_exception) }}')
    try:
        text = ChatTemplate(escape).render(CHAT)
    except DataError:
        text = ""
    assert "secret-value" not in text


def test_a_timer_set_before_a_render_is_put_back():
    """The render's SIGALRM bound restores an alarm set outside it (the CLI walk's)."""
    import signal
    signal.setitimer(signal.ITIMER_REAL, 30.0)
    try:
        ChatTemplate(CHATML).render(CHAT)
        left, _ = signal.getitimer(signal.ITIMER_REAL)
        assert 25.0 < left <= 30.0
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)


def test_the_render_bound_waits_for_an_import_to_end(slow_import):
    """A bound that passes inside an import raises when the import is done, never in it."""
    import time

    from ggwgpu.chat import RenderTimeout, time_limit
    with pytest.raises(RenderTimeout):
        with time_limit(0.2):
            slow_import()
            time.sleep(5)
    assert slow_import().done


def test_tojson_keeps_non_ascii():
    template = ChatTemplate("{{ messages[0] | tojson }}")
    assert json.loads(template.render([{"role": "user", "content": "é"}]))["content"] == "é"
    assert "é" in template.render([{"role": "user", "content": "é"}])
    escaped = ChatTemplate("{{ messages[0].content | tojson(ensure_ascii=True) }}")
    assert escaped.render([{"role": "user", "content": "é"}]) == '"\\u00e9"'   # as GLM asks


def test_transformers_generation_tag_renders_its_body_and_answers_are_found_as_ever():
    marked = CHATML.replace("message['content'] + '<|im_end|>'",
                            "'' }}{% if message['role'] == 'assistant' %}{% generation %}"
                            "{{ message['content'] + '<|im_end|>' }}{% endgeneration %}{% else %}"
                            "{{ message['content'] + '<|im_end|>' }}{% endif %}{{ ''")
    template = ChatTemplate(marked)
    assert template.render(CHAT) == RENDERED["chatml"]
    assert template.turns(CHAT) == ChatTemplate(CHATML).turns(CHAT)


# -- files ------------------------------------------------------------------------------------

def write(path, lines):
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return path


@pytest.mark.parametrize("line,message", [
    ("{not json", "not valid JSON"),
    ('["a list"]', "must be a JSON object"),
    ('{"txt": "typo"}', "exactly one of"),
    ('{"text": "a", "prompt": "b", "completion": "c"}', "exactly one of"),
    ('{"text": 3}', "'text' must be a string"),
    ('{"prompt": "p"}', "'completion' must be a string"),
    ('{"messages": []}', "non-empty list"),
    ('{"messages": [{"role": "robot", "content": "x"}]}', "message 0 must be"),
    ('{"messages": [{"role": "user", "content": 5}]}', "message 0 must be"),
    ('{"messages": [{"role": "user", "content": "x"}]}', "no assistant turn"),
    ("[" * 100_000, "not valid JSON"),                # nested past the recursion limit
])
def test_a_bad_line_is_an_error_naming_file_and_line(tmp_path, line, message):
    path = write(tmp_path / "d.jsonl", ['{"text": "fine"}', "", line])
    with pytest.raises(DataError, match=message) as e:
        read_jsonl(path)
    assert f"{path}:3: " in str(e.value)


def test_datasets_are_a_file_or_a_directory_of_splits(tmp_path):
    write(tmp_path / "train.jsonl", ['{"text": "a"}', '{"text": "b"}'])
    write(tmp_path / "valid.jsonl", ['{"prompt": "p", "completion": "c"}'])
    data = load_dataset(tmp_path)
    assert set(data) == {"train", "valid"} and len(data["train"]) == 2
    assert set(load_dataset(tmp_path / "train.jsonl")) == {"train"}
    only_valid = tmp_path / "only-valid"
    only_valid.mkdir()
    write(only_valid / "valid.jsonl", ['{"text": "a"}'])
    with pytest.raises(DataError, match="needs train.jsonl"):
        load_dataset(only_valid)
    with pytest.raises(DataError, match="no such file"):
        load_dataset(tmp_path / "missing")
    with pytest.raises(DataError, match="holds no examples"):
        read_jsonl(write(tmp_path / "empty.jsonl", ["", "  "]))


# -- tokens and batches -----------------------------------------------------------------------

class Vocab(ByteTokenizer):
    """Bytes plus the special tokens of ChatML (parsed only when asked), BOS added."""
    SPECIAL = ("<|im_start|>", "<|im_end|>")

    def __init__(self):
        super().__init__()
        self.add_bos = True

    @property
    def tokens(self):
        return super().tokens + list(self.SPECIAL)

    def encode(self, text, parse_special=False):
        if not parse_special:
            return super().encode(text)
        out, rest = [], text
        while rest:
            cut = min(((rest.find(s), j) for j, s in enumerate(self.SPECIAL) if s in rest),
                      default=None)
            if cut is None:
                out.extend(super().encode(rest))
                break
            at, j = cut
            out.extend(super().encode(rest[:at]))
            out.append(ByteTokenizer.n_vocab + j)
            rest = rest[at + len(self.SPECIAL[j]):]
        return np.array(out, np.int32)

    def gguf_metadata(self):
        return {}


def test_masking_trains_the_assistant_turns_only():
    vocab, template = Vocab(), ChatTemplate(CHATML)
    example = {"messages": CHAT}
    full = encode_example(example, vocab, template, mask_prompt=False)
    masked = encode_example(example, vocab, template, mask_prompt=True)
    np.testing.assert_array_equal(full.ids, masked.ids)
    assert full.ids[0] == vocab.bos_id and full.trained[1:].all()
    answer = _text(vocab, full.ids[masked.trained])
    assert answer == "Hello.<|im_end|>\n Yes. <|im_end|>\n"
    assert (full.ids == ByteTokenizer.n_vocab).sum() == 5      # <|im_start|> parsed as one


def _text(vocab, ids):
    """The text of ids: bytes, and special tokens (BOS, EOS, ChatML's) as their text."""
    return b"".join(bytes([i - 3]) if 3 <= i < ByteTokenizer.n_vocab
                    else vocab.tokens[i].encode() for i in ids).decode()


def test_prompt_completion_with_and_without_a_template():
    vocab = Vocab()
    example = {"prompt": "Q: 1+1?", "completion": " 2"}
    plain = encode_example(example, vocab, None, mask_prompt=True)
    assert _text(vocab, plain.ids[plain.trained]) == " 2" + vocab.tokens[vocab.eos_id]
    chat = encode_example(example, vocab, ChatTemplate(CHATML), mask_prompt=True)
    assert _text(vocab, chat.ids[chat.trained]) == " 2<|im_end|>\n"
    text = encode_example({"text": "abc"}, vocab, ChatTemplate(CHATML), mask_prompt=True)
    assert text.trained[1:].all() and text.ids[-1] == vocab.eos_id


def test_padded_batches_ignore_padding_and_masked_positions_and_resume():
    vocab, template = Vocab(), ChatTemplate(CHATML)
    examples = [encode_example({"prompt": "p" * n, "completion": "c" * n}, vocab, template,
                               mask_prompt=True) for n in (1, 3, 20, 40)]
    batches = ExampleBatches(examples, n_ctx=48, batch=2, seed=5)
    # the last one's completion starts past the window: nothing to learn, left out
    assert batches.n_samples == 3 and batches.truncated == 1 and batches.dropped == 1
    inputs, targets = batches.next_batch()
    assert inputs.shape == targets.shape == (2, 48)
    for row in range(3):
        e, t = examples[row], batches.targets[row]
        n = min(len(e), 49) - 1
        np.testing.assert_array_equal(batches.inputs[row, :n], e.ids[:n])
        np.testing.assert_array_equal(t[:n], np.where(e.trained[1:n + 1], e.ids[1:n + 1], IGNORE))
        assert (t[n:] == IGNORE).all()
    state = batches.state()
    after = [batches.next_batch() for _ in range(3)]
    again = ExampleBatches(examples, n_ctx=48, batch=2, seed=0)
    again.load_state(state)
    for (a, b), (c, d) in zip(after, [again.next_batch() for _ in range(3)]):
        np.testing.assert_array_equal(a, c)
        np.testing.assert_array_equal(b, d)
    dropped = ExampleBatches(examples, n_ctx=48, batch=2, seed=5, drop_long=True)
    assert dropped.n_samples == 2 and dropped.dropped == 2
    assert 0 < dropped.fill < 1


def test_a_padded_batch_has_the_loss_of_its_examples_one_at_a_time():
    """Rows of different lengths and masks in one batch: the loss per trained token equals
    the token-weighted mean of each example alone (padding and other rows change nothing)."""
    from ggwgpu.backends.numpy_backend import NumpyBackend
    from ggwgpu.models import ModelConfig, build_train_graph, init_parameters
    vocab, template = Vocab(), ChatTemplate(SMOLLM2)
    cfg = ModelConfig(n_vocab=len(vocab.tokens), n_embd=8, n_head=2, n_layer=1, n_ff=12,
                      n_ctx=120)
    values = init_parameters(cfg, seed=3)
    examples = [encode_example({"messages": CHAT[:n]}, vocab, template, mask_prompt=True)
                for n in (3, 5)] + [encode_example({"text": "plain"}, vocab, template, True)]
    backend = NumpyBackend(np.float64)

    def loss(batch):
        rows = ExampleBatches(examples, cfg.n_ctx, batch, seed=0)
        g = build_train_graph(cfg, values, batch)
        plan = backend.plan([g.loss])
        plan.write(g.positions, np.arange(cfg.n_ctx, dtype=np.int32))
        out = []
        for inputs, targets in rows.in_order():
            plan.run(g.feeds(inputs, targets))
            out.append((float(plan.read(g.loss)[0]), int((targets >= 0).sum())))
        return out

    together = loss(3)
    alone = loss(1)
    assert len(together) == 1 and len(alone) == 3
    weighted = sum(l * n for l, n in alone) / sum(n for _, n in alone)
    assert together[0][0] == pytest.approx(weighted, rel=1e-6)   # f32 row weights


def test_the_bundled_chat_demo_loads_by_name_renders_and_holds_out_a_valid_split():
    sets = load_dataset("chat-demo")
    assert sorted(sets) == ["train", "valid"] and len(sets["train"]) >= 200
    template, vocab = ChatTemplate(CHATML), ByteTokenizer()
    seen = {json.dumps(e, sort_keys=True) for e in sets["train"]}
    for split, examples in sets.items():
        for example in examples:
            text = template.render(example["messages"])
            assert text.startswith("<|im_start|>user\n") and text.endswith("<|im_end|>\n")
            e = encode_example(example, vocab, template, mask_prompt=True)
            answers = [m["content"] for m in example["messages"] if m["role"] == "assistant"]
            assert _text(vocab, e.ids[e.trained]) == "".join(a + "<|im_end|>\n"
                                                             for a in answers)
            assert all(a.startswith("Run `ggwgpu") for a in answers)   # the style it teaches
    # valid asks about the same commands in words train never uses
    assert not seen & {json.dumps(e, sort_keys=True) for e in sets["valid"]}
    train_questions = {m["content"] for e in sets["train"] for m in e["messages"]}
    assert not train_questions & {e["messages"][0]["content"] for e in sets["valid"]}


def test_jsonl_from_a_fifo_or_a_device_or_not_utf8_is_refused(tmp_path):
    import os
    os.mkfifo(tmp_path / "fifo.jsonl")
    for path in (tmp_path / "fifo.jsonl", "/dev/zero"):
        with pytest.raises(DataError, match="is not a regular file"):
            read_jsonl(path)
    (tmp_path / "latin1.jsonl").write_bytes(b'{"text": "caf\xe9"}\n')
    with pytest.raises(DataError, match="not valid UTF-8 at byte offset 13"):
        read_jsonl(tmp_path / "latin1.jsonl")


# -- packed rows ------------------------------------------------------------------------------

def test_first_fit_decreasing_places_the_longest_first_into_the_first_row_with_room():
    assert pack_rows([5, 4, 3, 3, 1], 8) == [[0, 2], [1, 3, 4]]
    assert pack_rows([8, 8], 8) == [[0], [1]]


COMPACT = ("{% for m in messages %}{{ m['role'][0] }}:{{ m['content'] }}\n{% endfor %}"
           "{% if add_generation_prompt %}a:{% endif %}")


def sums(vocab, n=12):
    """Short prompt/completion examples of different lengths, the answers trained."""
    return [encode_example({"prompt": f"{i}+{i % 5}=", "completion": str(i + i % 5) * (1 + i % 4)},
                           vocab, ChatTemplate(COMPACT), mask_prompt=True) for i in range(n)]


def test_packed_rows_hold_whole_examples_from_position_0_and_never_predict_the_next():
    from ggwgpu.models import packed_inputs
    vocab = Vocab()
    examples = sums(vocab) + [encode_example({"prompt": "p" * 20, "completion": "c" * 40},
                                             vocab, ChatTemplate(CHATML), mask_prompt=True)]
    packed = ExampleBatches(examples, n_ctx=48, batch=2, seed=5, pack=True)
    padded = ExampleBatches(examples, n_ctx=48, batch=2, seed=5)
    assert packed.packed and not padded.packed
    assert packed.n_examples == padded.n_samples == len(examples) > packed.n_samples
    assert packed.truncated == padded.truncated == 1
    assert packed.trained_tokens == padded.trained_tokens
    assert packed.fill > packed.padded_fill == pytest.approx(padded.fill)
    positions, _ = packed_inputs(packed.segments)
    found = []
    for row in range(packed.n_samples):
        segments = packed.segments[row]
        for s in np.unique(segments):
            at = np.flatnonzero(segments == s)
            assert (np.diff(at) == 1).all()                   # one run, from position 0
            np.testing.assert_array_equal(positions[row, at], np.arange(len(at)))
            inputs, targets = packed.inputs[row, at], packed.targets[row, at]
            # one example's inputs and targets: its own tokens, never the next one's
            match = [i for i, e in enumerate(examples) if len(at) == min(len(e) - 1, 48)
                     and np.array_equal(e.ids[:len(at)], inputs)]
            if not match:                                     # the padding, at the end
                assert at[-1] == 47 and s == segments.max()
                assert (inputs == 0).all() and (targets == IGNORE).all()
                continue
            e = examples[match[0]]
            want = np.where(e.trained[1:len(at) + 1], e.ids[1:len(at) + 1], IGNORE)
            np.testing.assert_array_equal(targets, want)
            found.append(match[0])
    assert sorted(found) == list(range(len(examples)))


def test_packed_rows_resume_exactly_and_refuse_another_packing_or_an_old_state():
    vocab = Vocab()
    examples = sums(vocab)
    batches = ExampleBatches(examples, n_ctx=48, batch=2, seed=5, pack="auto")
    assert batches.packed
    batches.next_batch()
    state = batches.state()
    after = [batches.next_batch() for _ in range(4)]
    again = ExampleBatches(examples, n_ctx=48, batch=2, seed=0, pack="auto")
    again.load_state(state)
    for a, b in zip(after, [again.next_batch() for _ in range(4)]):
        assert len(a) == len(b) == 3
        for x, y in zip(a, b):
            np.testing.assert_array_equal(x, y)
    with pytest.raises(DataError, match="same data, vocabulary, n_ctx and packing"):
        ExampleBatches(examples, n_ctx=48, batch=2, seed=0).load_state(state)
    with pytest.raises(DataError, match="version 1"):
        again.load_state({**state, "version": 1})
    # auto pads when no two examples share a row
    assert not ExampleBatches(examples, n_ctx=20, batch=2, seed=0, pack="auto").packed


# A grouped-query llama over Vocab, and the loss and gradients of one batch on a backend.
PACK_CFG = dict(n_embd=8, n_head=4, n_head_kv=2, n_layer=2, n_ff=12, n_ctx=48)


def pack_model(vocab):
    from ggwgpu.models import ModelConfig, init_parameters
    cfg = ModelConfig(n_vocab=len(vocab.tokens), **PACK_CFG)
    rng = np.random.default_rng(4)
    values = {k: v if v.ndim > 1 else rng.uniform(0.5, 1.5, v.shape).astype(np.float32)
              for k, v in init_parameters(cfg, seed=2).items()}
    return cfg, values


def loss_and_gradients(backend, cfg, values, rows, packed, flash=False):
    import ggwgpu as gg
    from ggwgpu.models import build_train_graph
    g = build_train_graph(cfg, values, len(rows[0]), flash=flash, packed=packed)
    grads = gg.build_backward(g.loss, list(g.params.values()))
    plan = backend.plan([g.loss, *grads.values()])
    if not packed:
        plan.write(g.positions, np.arange(cfg.n_ctx, dtype=np.int32))
    plan.run(g.feeds(*rows))
    return float(plan.read(g.loss)[0]), {p.name: plan.read(d) for p, d in grads.items()}


@pytest.mark.parametrize("flash", [False, True])
@pytest.mark.parametrize("backend_name", ["numpy", "wgpu"])
def test_a_packed_batch_has_the_loss_and_gradients_of_its_examples_one_at_a_time(
        backend_name, flash, request):
    """The mean loss per trained token of packed rows, and its gradient w.r.t. every weight,
    equal the token-weighted combination of each example alone in a padded row (unfused
    attention, or flash_attn_ext over the mask against flash_attn's causal rule)."""
    from ggwgpu.backends.numpy_backend import NumpyBackend
    backend = NumpyBackend(np.float64) if backend_name == "numpy" \
        else request.getfixturevalue("wgpu")
    vocab = Vocab()
    cfg, values = pack_model(vocab)
    examples = sums(vocab, 10)
    packed = ExampleBatches(examples, cfg.n_ctx, batch=3, seed=0, pack=True)
    assert packed.n_samples == 3 and packed.packed
    loss, grads = loss_and_gradients(backend, cfg, values, next(packed.in_order()), True, flash)
    alone = ExampleBatches(examples, cfg.n_ctx, batch=1, seed=0)
    total_loss, total_grads, total = 0.0, {}, 0
    for rows in alone.in_order():
        n = int((rows[1] >= 0).sum())
        l, g = loss_and_gradients(backend, cfg, values, rows, False, flash)
        total_loss += n * l
        total_grads = {k: total_grads.get(k, 0) + n * v for k, v in g.items()}
        total += n
    tol = 1e-7 if backend_name == "numpy" else 2e-5    # the loss weights 1 / count are f32
    assert loss == pytest.approx(total_loss / total, rel=tol)
    for name, g in grads.items():
        want = total_grads[name] / total
        assert np.abs(g - want).max() <= tol * 10 * np.abs(want).max(), name


@pytest.mark.parametrize("flash", [False, True])
def test_no_packed_example_sees_another_and_each_has_its_logits_alone(flash):
    from ggwgpu.backends.numpy_backend import NumpyBackend
    from ggwgpu.models import build_train_graph
    backend = NumpyBackend(np.float64)
    vocab = Vocab()
    cfg, values = pack_model(vocab)
    examples = sums(vocab, 5)
    packed = ExampleBatches(examples, cfg.n_ctx, batch=1, seed=0, pack=True)

    def logits(inputs, segments=None):
        g = build_train_graph(cfg, values, len(inputs), flash, packed=segments is not None)
        plan = backend.plan(g.logits)
        if segments is None:
            plan.write(g.positions, np.arange(cfg.n_ctx, dtype=np.int32))
        plan.run({t: v for t, v in g.feeds(inputs, np.zeros_like(inputs), segments).items()
                  if t in (g.tokens, g.positions, g.mask)})
        return g.read_logits(plan)

    inputs, segments = packed.inputs[:1], packed.segments[:1]
    assert segments.max() >= 2                                 # at least two examples
    before = logits(inputs, segments)
    for s in range(segments.max()):                            # every example but the padding
        at = np.flatnonzero(segments[0] == s)
        changed = inputs.copy()
        changed[0, at] = (changed[0, at] + 7) % 200 + 3         # other bytes
        after = logits(changed, segments)
        others = segments[0] != s
        np.testing.assert_array_equal(after[0, others], before[0, others])
        assert not np.allclose(after[0, at], before[0, at])
        # alone in a row of its own, at positions 0 .., it has the same logits
        row = np.zeros((1, cfg.n_ctx), np.int32)
        row[0, :len(at)] = inputs[0, at]
        np.testing.assert_allclose(logits(row)[0, :len(at)], before[0, at], rtol=1e-12,
                                   atol=1e-12)


def test_a_packed_graph_refuses_unpacked_feeds_and_the_unpacked_graph_keeps_its_ops():
    from ggwgpu.models import build_train_graph
    vocab = Vocab()
    cfg, values = pack_model(vocab)
    tokens = np.zeros((2, cfg.n_ctx), np.int32)
    with pytest.raises(ValueError, match="needs the segments"):
        build_train_graph(cfg, values, 2, packed=True).feeds(tokens, tokens)
    plain = build_train_graph(cfg, values, 2)
    with pytest.raises(ValueError, match="segments need a packed"):
        plain.feeds(tokens, tokens, tokens)
    # the unpacked graph keeps its causal softmax (no mask tensor) and one row of positions
    from ggwgpu.graph import topo_order
    causal = {t.params["n_past"] for t in topo_order([plain.loss]) if t.op == "soft_max"}
    assert causal == {0} and "soft_max_ext" not in {t.op for t in topo_order([plain.loss])}
    assert plain.positions.shape == (cfg.n_ctx,) and plain.mask is None


def test_jsonl_lines_end_at_newlines_only_not_at_unicode_line_separators(tmp_path):
    """U+2028, U+2029 and U+0085 are valid raw in JSON strings (json.dumps with
    ensure_ascii=False writes them); a line ends at "\\n" (and a "\\r" before it is blank)."""
    from ggwgpu.chat import read_jsonl
    texts = ["a\u2028b", "c\u2029d", "e\u0085f"]
    path = tmp_path / "u.jsonl"
    path.write_text("".join(json.dumps({"text": t}, ensure_ascii=False) + "\r\n" for t in texts),
                    encoding="utf-8")
    assert [e["text"] for e in read_jsonl(path)] == texts


def test_a_jsonl_line_too_long_for_one_example_is_refused_naming_it(tmp_path, monkeypatch):
    """A 100 MB line took 2.9 GB to parse; a line's size is bounded (MAX_LINE_CHARS)."""
    from ggwgpu import chat
    monkeypatch.setattr(chat, "MAX_LINE_CHARS", 1000)
    path = tmp_path / "long.jsonl"
    path.write_text(json.dumps({"text": "short"}) + "\n" + json.dumps({"text": "x" * 2000}) + "\n")
    with pytest.raises(DataError, match=r"long.jsonl:2: a line of 2012 characters; one example "
                                        r"may hold at most 1000"):
        read_jsonl(path)


@pytest.mark.parametrize("example, what", [
    ('{"text": "a \\ud800 b"}', "'text': character 2 is a lone surrogate U+D800"),
    ('{"prompt": "p", "completion": "\\udc80"}', "'completion': character 0 is a lone"),
    ('{"messages": [{"role": "user", "content": "x\\udfff"}, {"role": "assistant", '
     '"content": "y"}]}', "message 0's content: character 1 is a lone surrogate U+DFFF")])
def test_a_lone_surrogate_in_jsonl_is_refused_with_its_file_and_line(tmp_path, example, what):
    path = tmp_path / "s.jsonl"
    path.write_text('{"text": "fine"}\n' + example + "\n")
    with pytest.raises(DataError, match=re.escape(f"s.jsonl:2: {what}")):
        read_jsonl(path)


# -- tool calling -----------------------------------------------------------------------------

# Qwen2.5-Instruct's template (its tokenizer_config.json's chat_template), which renders tools
# in the system turn, calls as <tool_call> blocks and results as a user turn's <tool_response>
QWEN25 = (Path(__file__).parent / "data" / "templates" / "qwen2.5-instruct.jinja").read_text()
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}
CALLING = [{"role": "user", "content": "Weather in Zürich?"},
           {"role": "assistant", "tool_calls": [
               {"type": "function", "function": {"name": "get_weather",
                                                 "arguments": {"city": "Zürich"}}}]},
           {"role": "tool", "name": "get_weather", "content": '{"temp": 3}'},
           {"role": "assistant", "content": "3 degrees."}]
QWEN25_CALLING = (
    "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant."
    "\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou "
    "are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
    '{"type": "function", "function": {"name": "get_weather", "description": "The weather in '
    'a city", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, '
    '"required": ["city"]}}}\n</tools>\n\nFor each function call, return a json object with '
    "function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n'
    "<|im_start|>user\nWeather in Zürich?<|im_end|>\n<|im_start|>assistant\n<tool_call>\n"
    '{"name": "get_weather", "arguments": {"city": "Zürich"}}\n</tool_call><|im_end|>\n'
    '<|im_start|>user\n<tool_response>\n{"temp": 3}\n</tool_response><|im_end|>\n'
    "<|im_start|>assistant\n3 degrees.<|im_end|>\n")


def test_tools_and_tool_calls_render_as_the_template_has_them_and_calls_are_trained():
    template = ChatTemplate(QWEN25)
    assert template.render(CALLING, tools=[WEATHER]) == QWEN25_CALLING
    # without tools the template renders its plain system turn, as transformers' does
    assert template.render(CALLING[:1]).startswith(
        "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful "
        "assistant.<|im_end|>\n<|im_start|>user\n")
    vocab = Vocab()
    example = encode_example({"messages": CALLING, "tools": [WEATHER]}, vocab, template,
                             mask_prompt=True)
    assert _text(vocab, example.ids[1:]) == QWEN25_CALLING
    assert _text(vocab, example.ids[example.trained]) == (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Zürich"}}\n</tool_call>'
        "<|im_end|>\n3 degrees.<|im_end|>\n")      # the call and the answer, not the result


def test_a_template_without_tools_is_refused_rather_than_training_unseen_calls():
    vocab = Vocab()
    with pytest.raises(DataError, match=r"\(ChatML\) leaves out tool 'get_weather'"):
        encode_example({"messages": CALLING}, vocab, ChatTemplate(CHATML), True)
    with pytest.raises(DataError, match="leaves out tool 'get_weather'"):
        encode_example({"messages": CALLING[:1] + CALLING[3:], "tools": [WEATHER]}, vocab,
                       ChatTemplate(CHATML), True)
    # a template that knows tools but drops some calls' names from its rendering
    dropping = QWEN25.replace("{{- tool_call.name }}", "")
    with pytest.raises(DataError, match="leaves out tool 'get_weather'"):
        encode_example({"messages": CALLING}, vocab, ChatTemplate(dropping), True)
    # one that shows the tools (their names) but no call (LFM2's takes calls as content)
    no_calls = QWEN25.replace("{%- for tool_call in message.tool_calls %}",
                              "{%- for tool_call in [] %}")
    with pytest.raises(DataError, match="leaves out tool 'get_weather'"):
        encode_example({"messages": CALLING, "tools": [WEATHER]}, vocab,
                       ChatTemplate(no_calls), True)


@pytest.mark.parametrize("line,message", [
    ({"messages": CALLING, "tools": {"name": "x"}}, "'tools' must be a non-empty list"),
    ({"messages": CALLING, "tools": [{"type": "function"}]}, "tool 0 must be"),
    ({"text": "x", "tools": [WEATHER]}, "'tools' goes with 'messages'"),
    ({"messages": [{"role": "assistant", "tool_calls": []}]}, "non-empty list"),
    ({"messages": [{"role": "user", "tool_calls": [WEATHER]}]}, "message 0 must be"),
    ({"messages": [{"role": "user", "content": "x", "tool_calls": [WEATHER]}]},
     "only an assistant's message"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"function": {"name": "f"}}]}]},
     "tool call 0 must be"),
    ({"messages": [{"role": "assistant", "tool_calls": [
        {"function": {"name": "f", "arguments": {"a": "\ud800"}}}]}]}, "lone surrogate"),
])
def test_a_bad_tool_calling_line_is_an_error_naming_it(tmp_path, line, message):
    path = write(tmp_path / "d.jsonl", [json.dumps(line)])
    with pytest.raises(DataError, match=message) as e:
        read_jsonl(path)
    assert f"{path}:1: " in str(e.value)


def test_a_tool_call_may_be_the_function_itself_with_arguments_as_a_string(tmp_path):
    call = {"role": "assistant", "content": None,
            "tool_calls": [{"name": "get_weather", "arguments": '{"city": "Bern"}'}]}
    path = write(tmp_path / "d.jsonl", [json.dumps({"messages": CALLING[:1] + [call],
                                                    "tools": [WEATHER["function"]]})])
    (example,) = read_jsonl(path)
    text = ChatTemplate(QWEN25).render(example["messages"], tools=example["tools"])
    assert '{"name": "get_weather", "arguments": "{\\"city\\": \\"Bern\\"}"}' in text


def test_tools_nested_deeper_than_python_recurses_are_checked_without_recursion():
    from ggwgpu.chat import check_example
    deep = "\ud800"
    for _ in range(5000):
        deep = [deep]
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"x": deep}}}]
    with pytest.raises(DataError, match="'tools': character 0 is a lone surrogate"):
        check_example({"messages": CALLING, "tools": tools})


def test_template_variables_reach_every_render_and_cannot_replace_its_own():
    # as Qwen3's generation prompt, whose enable_thinking false writes an empty thought
    source = CHATML.replace("'<|im_start|>assistant\\n'", "'<|im_start|>assistant\\n' + ("
                            "'<think>\\n\\n</think>\\n\\n' if enable_thinking is defined and "
                            "not enable_thinking else '')")
    plain = ChatTemplate(source).render(CHAT[:2], True)
    quiet = ChatTemplate(source, variables={"enable_thinking": False}).render(CHAT[:2], True)
    assert quiet == plain + "<think>\n\n</think>\n\n"
    assert ChatTemplate(source, variables={"enable_thinking": True}).render(CHAT[:2], True) \
        == plain
    for bad, message in (({"messages": []}, "'messages' is set by each rendering itself"),
                         ({"add_generation_prompt": 1}, "set by each rendering"),
                         ({"not a name": 1}, "an identifier, not 'not a name'"),
                         ({"x": "\ud800"}, "lone surrogate"),
                         (["enable_thinking"], "a dict of names to values, not a list")):
        with pytest.raises(ValueError, match=message):
            ChatTemplate(CHATML, variables=bad)


def test_every_answer_makes_a_rewriting_template_s_conversation_one_example_per_answer():
    from ggwgpu.chat import encode_examples
    vocab, example = Vocab(), {"messages": CHAT}
    template = ChatTemplate(REASONING)
    (alone,) = encode_examples(example, vocab, template, mask_prompt=True)
    assert template.last_answer_only == 1
    first, last = encode_examples(example, vocab, template, mask_prompt=True, every_answer=True)
    assert template.last_answer_only == 1 and template.split_conversations == 1
    np.testing.assert_array_equal(last.ids, alone.ids)
    np.testing.assert_array_equal(last.trained, alone.trained)
    # the first answer as the template writes a last one: with its reasoning tags
    assert _text(vocab, first.ids[first.trained]) == "<think>\n\n</think>\n\nHello.<|im_end|>\n"
    assert _text(vocab, first.ids) == _text(vocab, [vocab.bos_id]) + template.render(CHAT[:3])
    # a template that renders starts as the whole, or no masking: one example as ever
    for source, mask in ((CHATML, True), (REASONING, False)):
        assert len(encode_examples(example, vocab, ChatTemplate(source), mask, True)) == 1


def test_the_last_answer_s_cut_never_falls_inside_a_control_token():
    """Gemma 4's generation prompt opens "<|channel>": an answer that begins "<|tool_call>"
    shares "<|" with it, and the cut moves back to the line's end, not between "<|" and the
    rest of the token."""
    call = [CHAT[1], {"role": "assistant", "content": "<|tool_call>f()<tool_call|>"}]
    turns = ChatTemplate(THOUGHT).turns(call)
    assert [t for t, trained in turns if trained] == ["<|tool_call>f()<tool_call|><turn|>\n"]
