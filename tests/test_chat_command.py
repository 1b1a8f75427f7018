"""Chatting: ChatSession keeps the KV cache across turns and the model sees exactly what the
template renders; `ggwgpu chat` and `ggwgpu generate --chat` on a tiny byte-vocabulary model."""
import io
import json

import numpy as np
import pytest
from click.testing import CliRunner

from ggwgpu import gguf_llama
from ggwgpu.backends import ENV_VAR
from ggwgpu.backends.numpy_backend import NumpyBackend
from ggwgpu.chat import ChatTemplate, rendered_ids
from ggwgpu.generate import ChatSession, Decoder, Sampling, TextStream
from ggwgpu.models import ModelConfig, init_parameters
from ggwgpu.tokenizer import ByteTokenizer
from ggwgpu_cli.main import cli

# one letter per role, so a byte vocabulary's conversations stay short
TEMPLATE = ("{% for m in messages %}{{ m['role'][0] }}:{{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}a:{% endif %}")
CFG = ModelConfig(n_vocab=ByteTokenizer.n_vocab, n_embd=16, n_head=2, n_layer=2, n_ff=24,
                  n_ctx=48)
GREEDY = Sampling(temperature=0.0)
# qwen35: a delta-net layer (a recurrent state that cannot go back) before an attention one
RECURRENT = ModelConfig(n_vocab=ByteTokenizer.n_vocab, n_embd=16, n_head=2, n_head_kv=1,
                        n_embd_head=8, n_rot=4, n_layer=2, n_ff=24, n_ctx=64,
                        recurrent_layers=(0,), conv_kernel=3, ssm_state=4, ssm_heads=2,
                        ssm_groups=2, rope_sections=(1, 1, 0, 0), arch="qwen35")


def session(backend, max_ctx=None, system="Be brief.", sampling=GREEDY, seed=0):
    decoder = Decoder(backend, CFG, init_parameters(CFG, seed=3), max_ctx)
    return ChatSession(decoder, ByteTokenizer(), ChatTemplate(TEMPLATE), system, sampling, seed)


class Recorder:
    """Wraps a decoder's sync: the tokens and logits of every call."""

    def __init__(self, decoder):
        self.calls, self.sync = [], decoder.sync
        decoder.sync = self

    def __call__(self, tokens):
        logits = self.sync(tokens)
        self.calls.append((list(tokens), logits))
        return logits


def test_turns_reuse_the_cache_and_give_the_logits_of_the_whole_conversation():
    backend = NumpyBackend(np.float64)
    s = session(backend)
    recorder = Recorder(s.decoder)
    first = list(s.reply("Hi?", 5))
    cached = list(s.decoder.tokens)
    second = list(s.reply("And?", 5))
    assert len(first) == len(second) == 5
    # the model saw the template's rendering of the conversation, answers included
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Hi?"},
                {"role": "assistant", "content": ByteTokenizer().decode(first)},
                {"role": "user", "content": "And?"}]
    assert s.messages[:4] == messages
    prompt = rendered_ids(ByteTokenizer(), ChatTemplate(TEMPLATE).render(messages, True))
    assert ByteTokenizer().decode(prompt) == "s:Be brief.\nu:Hi?\na:" + \
        ByteTokenizer().decode(first) + "\nu:And?\na:"
    tokens, logits = recorder.calls[-1]
    assert tokens == prompt
    # the second turn kept the first turn's prompt in the cache (the answer too, as far as
    # its bytes decode to the same text: a random model writes invalid UTF-8) ...
    first_prompt = recorder.calls[0][0]
    assert cached[:len(first_prompt)] == first_prompt
    assert recorder.calls[-1][0][:len(first_prompt)] == first_prompt
    # ... and its logits are those of the whole conversation computed from scratch
    fresh = Decoder(backend, CFG, init_parameters(CFG, seed=3)).prefill(prompt)
    np.testing.assert_allclose(logits, fresh, rtol=0, atol=1e-12)


def test_a_template_that_renders_only_with_a_generation_prompt_still_chats():
    """The snapshot's place needs the conversation rendered without the generation prompt;
    a template that refuses that keeps the snapshot at the prompt's end, and the turn runs."""
    template = ChatTemplate("{% if not add_generation_prompt %}{{ raise_exception('no') }}"
                            "{% endif %}" + TEMPLATE)
    cfg = RECURRENT
    s = ChatSession(Decoder(NumpyBackend(), cfg, init_parameters(cfg, seed=3)),
                    ByteTokenizer(), template, "Be brief.", GREEDY, 0)
    assert s.generation_prompt_length() == 0
    assert len(list(s.reply("Hi?", 3))) == 3
    assert s.decoder._snapshot[0] == s.ids(s.messages[:2])     # the whole first prompt


def test_a_stopped_answer_joins_the_conversation_as_far_as_it_went():
    s = session(NumpyBackend())
    reply = s.reply("Hi?", 10)
    partial = [next(reply), next(reply)]
    reply.close()
    assert s.messages[-1] == {"role": "assistant", "content": ByteTokenizer().decode(partial)}
    list(s.reply("More?", 2))
    assert [m["role"] for m in s.messages] == ["system", "user", "assistant", "user",
                                               "assistant"]


def test_a_full_context_keeps_the_system_message_and_the_latest_turns():
    s = session(NumpyBackend(), max_ctx=64)
    recorder = Recorder(s.decoder)
    for text in ("one", "two", "three", "four", "five"):
        list(s.reply(text, 4))
    ids = recorder.calls[-1][0]         # what the last turn started from
    assert len(ids) <= 64 // 2
    text = ByteTokenizer().decode(ids)
    assert text.startswith("s:Be brief.\nu:") and text.endswith("u:five\na:")
    assert "u:one" not in text
    # the latest turns that fit: one more would not
    kept = next(k for k in range(1, len(s.messages), 2)
                if ids == s.ids(s.messages[:1] + s.messages[k:-1]))
    assert kept > 1 and len(s.ids(s.messages[:1] + s.messages[kept - 2:-1])) > 64 // 2


def test_a_reply_slides_when_the_context_is_full():
    s = session(NumpyBackend(), max_ctx=24, system=None)
    answer = list(s.reply("Hi?", 40))
    assert len(answer) == 40        # the window slid instead of the cache overflowing
    assert s.decoder.past <= 24


# -- the commands ------------------------------------------------------------------------------

def invoke(*args, input=None):
    return CliRunner().invoke(cli, list(args), input=input, env={ENV_VAR: None})


@pytest.fixture
def files(tmp_path):
    model, template = tmp_path / "m.gguf", tmp_path / "t.jinja"
    gguf_llama.save_model(model, CFG, init_parameters(CFG, seed=3), ByteTokenizer())
    template.write_text(TEMPLATE)
    return str(model), str(template)


def expected_transcript(users, n, temp="0", seed=0):
    """What `ggwgpu chat` prints for `users`, from ChatSession itself."""
    sampling = Sampling(temperature=float(temp))
    s = session(NumpyBackend(), system="Be brief.", sampling=sampling, seed=seed)
    out = ""
    for text in users:
        stream = TextStream(ByteTokenizer())
        out += f"> {text}\n" + "".join(stream.push(t) for t in s.reply(text, n)) + \
            stream.finish() + "\n"
    return out + "> \n"


@pytest.mark.parametrize("temp", ["0", "1.0"])
def test_chat_prints_the_sessions_answers_and_ends_at_eof(files, temp):
    model, template = files
    users = ["Hi?", "And then?"]
    r = invoke("--backend", "numpy", "chat", model, "--chat-template", template, "--system",
               "Be brief.", "-n", "6", "--temp", temp, "--seed", "2",
               input="".join(u + "\n" for u in users))
    assert r.exit_code == 0, r.output
    assert r.stdout == expected_transcript(users, 6, temp, seed=2)


def test_ctrl_c_stops_an_answer_and_the_session_goes_on(files, monkeypatch):
    model, template = files
    step, calls = Decoder.step, []

    def interrupted(self, token):
        calls.append(token)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return step(self, token)
    monkeypatch.setattr(Decoder, "step", interrupted)
    r = invoke("--backend", "numpy", "chat", model, "--chat-template", template, "-n", "6",
               input="Hi?\nAgain?\n")
    assert r.exit_code == 0, r.output
    assert r.stderr.count("(answer stopped)") == 1
    assert r.stdout.count("> ") == 3 and r.stdout.endswith("> \n")


def test_generate_chat_answers_the_rendered_prompt(files):
    """generate --chat prints what plain generate writes after the rendered conversation."""
    model, template = files
    args = ("--backend", "numpy", "generate", model, "-n", "12", "--seed", "5", "--temp", "1")
    r = invoke(*args, "--chat", "-p", "Hi?", "--system", "Be brief.", "--chat-template",
               template)
    assert r.exit_code == 0, r.output
    prompt = "s:Be brief.\nu:Hi?\na:"
    plain = invoke(*args, "-p", prompt)
    assert plain.stdout.startswith(prompt)
    assert r.stdout == plain.stdout[len(prompt):] and len(r.stdout) > 1
    assert invoke(*args, "--system", "x").exit_code == 2


class InterruptedInput(io.BytesIO):
    """Standard input whose reader gets Ctrl-C (KeyboardInterrupt) once `data` is read."""

    def read(self, size=-1):
        return self._interrupt_at_end(super().read(size), size)

    def read1(self, size=-1):
        return self._interrupt_at_end(super().read1(size), size)

    def _interrupt_at_end(self, data, size):
        if not data and size != 0:
            raise KeyboardInterrupt
        return data


def test_ctrl_c_at_the_prompt_ends_the_session(files):
    model, template = files
    r = invoke("--backend", "numpy", "chat", model, "--chat-template", template, "-n", "3",
               input=InterruptedInput(b"Hi?\n"))
    assert r.exit_code == 0, r.output
    assert r.stdout.startswith("> Hi?\n") and r.stdout.endswith("> \n")
    assert r.stdout.count("> ") == 2


def test_chat_with_standard_input_closed_says_so_in_one_line(files, tmp_path):
    """`ggwgpu chat MODEL 0<&-` (no stdin at all) ended in "internal error"."""
    import subprocess
    import sys
    model, _ = files
    r = subprocess.run([sys.executable, "-m", "ggwgpu_cli.main", "--backend", "numpy", "chat",
                        model], stdin=subprocess.DEVNULL, capture_output=True, text=True,
                       timeout=120, preexec_fn=lambda: __import__("os").close(0))
    assert r.returncode == 1, r.stderr
    assert "standard input, which is closed" in r.stderr and "internal error" not in r.stderr


def test_train_predict_in_a_context_of_one_is_refused_before_training(tmp_path):
    r = invoke("--backend", "numpy", "train", "--n-ctx", "1", "--predict", "3", "--steps", "2",
               "--out", str(tmp_path / "m.gguf"))
    assert r.exit_code == 2 and "--predict needs a context of at least 2" in r.output
    assert not (tmp_path / "m.gguf").exists()


def test_a_long_chat_renders_a_bounded_number_of_windows_a_turn():
    """Each turn rendered the whole history and every suffix of it (200 turns: 75 s); the
    window now goes on from where the last one started: a few renders a turn, however long
    the conversation."""
    s = session(NumpyBackend(), max_ctx=48, system=None)
    calls, render = [], s.template.render
    s.template.render = lambda *a, **k: (calls.append(1), render(*a, **k))[1]
    per_turn = []
    for _ in range(60):
        before = len(calls)
        list(s.reply("Hi?", 3))
        per_turn.append(len(calls) - before)
    assert max(per_turn) <= 6 and s.start > 50


def test_a_recurrent_model_chats_where_the_template_rewrites_earlier_answers():
    """qwen35 (delta-net states that cannot go back) under a template that drops the
    reasoning tags of answers before the last user turn, as Qwen3.5's does: the next turn's
    rendering departs from the cache inside the generation prompt, so the decoder goes on
    from the snapshot of its states kept where that began (not from the start), with the
    logits of a fresh prefill of the whole conversation."""
    template = ChatTemplate(
        "{% set ns = namespace(last=0) %}{% for m in messages %}{% if m['role'] == 'user' %}"
        "{% set ns.last = loop.index0 %}{% endif %}{% endfor %}{% for m in messages %}"
        "{{ m['role'][0] }}:{% if m['role'] == 'assistant' and loop.index0 > ns.last %}<t></t>"
        "{% endif %}{{ m['content'] }}\n{% endfor %}{% if add_generation_prompt %}a:<t>"
        "{% endif %}")
    cfg = RECURRENT
    values = init_parameters(cfg, seed=3)
    backend = NumpyBackend(np.float64)
    s = ChatSession(Decoder(backend, cfg, values), ByteTokenizer(), template, "Be brief.",
                    GREEDY, 0)
    recorder = Recorder(s.decoder)
    runs, append = [], s.decoder.append
    s.decoder.append = lambda tokens: runs.append(s.decoder.past) or append(tokens)
    list(s.reply("Hi?", 4))
    stable = len(s.ids(s.messages[:2], add_generation_prompt=False))    # "s:..\nu:Hi?\n"
    first = recorder.calls[0][0]
    assert ByteTokenizer().decode(first[stable:]) == "a:<t>"
    assert s.decoder._snapshot[0] == first[:stable]
    list(s.reply("And?", 4))
    tokens, logits = recorder.calls[-1]
    assert ByteTokenizer().decode(tokens).endswith("\nu:And?\na:<t>") and runs == [0, stable]
    np.testing.assert_allclose(logits, Decoder(backend, cfg, values).prefill(tokens),
                               rtol=0, atol=1e-12)


# -- tools ------------------------------------------------------------------------------------

# TEMPLATE with the tools' names first, and a tool message as "t:"
TOOLS_TEMPLATE = ("{% if tools %}T:{% for t in tools %}{{ t['function']['name'] }}"
                  "{% endfor %}{{ '\n' }}{% endif %}" + TEMPLATE)
TOOLS = [{"type": "function", "function": {"name": "clock", "parameters": {}}}]


def test_a_session_renders_its_tools_and_takes_a_tool_s_result():
    decoder = Decoder(NumpyBackend(), CFG, init_parameters(CFG, seed=3))
    s = ChatSession(decoder, ByteTokenizer(), ChatTemplate(TOOLS_TEMPLATE), None, GREEDY,
                    tools=TOOLS)
    recorder = Recorder(s.decoder)
    call = ByteTokenizer().decode(list(s.reply("Time?", 4)))
    list(s.reply("9:00", 4, role="tool"))
    assert [m["role"] for m in s.messages] == ["user", "assistant", "tool", "assistant"]
    assert ByteTokenizer().decode(recorder.calls[-1][0]) == \
        f"T:clock\nu:Time?\na:{call}\nt:9:00\na:"


def test_chat_takes_tools_and_a_tool_result_line(files, tmp_path):
    model, template = files
    (tmp_path / "tools.jinja").write_text(TOOLS_TEMPLATE)
    tools = tmp_path / "tools.json"
    tools.write_text(json.dumps(TOOLS))
    r = invoke("--backend", "numpy", "chat", model, "--chat-template",
               str(tmp_path / "tools.jinja"), "--tools", str(tools), "-n", "4", "--temp", "0",
               input="Time?\n/tool 9:00\n")
    assert r.exit_code == 0, r.output
    decoder = Decoder(NumpyBackend(), CFG, init_parameters(CFG, seed=3))
    s = ChatSession(decoder, ByteTokenizer(), ChatTemplate(TOOLS_TEMPLATE), None, GREEDY,
                    tools=TOOLS)
    answers = []
    for text, role in (("Time?", "user"), ("9:00", "tool")):
        stream = TextStream(ByteTokenizer())
        answers.append("".join(stream.push(t) for t in s.reply(text, 4, role))
                       + stream.finish())
    assert r.stdout == f"> Time?\n{answers[0]}\n> /tool 9:00\n{answers[1]}\n> \n"
    # a template that renders no tools, tools that are no list of schemas, no --chat
    plain = invoke("--backend", "numpy", "chat", model, "--chat-template", template, "--tools",
                   str(tools), input="")
    assert plain.exit_code == 2 and "leaves out tool 'clock'" in plain.output
    (tmp_path / "bad.json").write_text('{"name": "clock"}')
    bad = invoke("--backend", "numpy", "chat", model, "--tools", str(tmp_path / "bad.json"))
    assert bad.exit_code == 2 and "bad.json: 'tools' must be a non-empty list" in bad.output
    no_chat = invoke("--backend", "numpy", "generate", model, "--tools", str(tools))
    assert no_chat.exit_code == 2 and "--tools go with --chat" in no_chat.output


def test_generate_chat_takes_template_variables(files, tmp_path):
    model, _ = files
    template = tmp_path / "v.jinja"
    template.write_text(TEMPLATE.replace("a:", "{{ who }}:"))
    args = ("--backend", "numpy", "generate", model, "-n", "4", "--temp", "0")
    r = invoke(*args, "--chat", "-p", "Hi?", "--chat-template", str(template),
               "--chat-template-kwargs", '{"who": "bot"}')
    assert r.exit_code == 0, r.output
    plain = invoke(*args, "-p", "u:Hi?\nbot:")
    assert r.stdout == plain.stdout[len("u:Hi?\nbot:"):]
    for given, message in (("{nope", "--chat-template-kwargs: not JSON"),
                           ("[1]", "a JSON object of variables"),
                           ('{"messages": 1}', "set by each rendering itself")):
        bad = invoke(*args, "--chat", "-p", "Hi?", "--chat-template-kwargs", given)
        assert bad.exit_code == 2 and message in bad.output, bad.output
    assert invoke(*args, "--chat-template-kwargs", "{}").exit_code == 2     # no --chat


def test_finetune_every_answer_says_how_many_conversations_it_split(files, tmp_path):
    from test_chat import CHAT, REASONING
    model, _ = files
    (tmp_path / "r.jinja").write_text(REASONING)
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"messages": CHAT}) + "\n" for _ in range(3)))
    args = ("--backend", "numpy", "finetune", model, "--data", str(data), "--chat-template",
            str(tmp_path / "r.jinja"), "--mask-prompt", "--n-ctx", "256", "--steps", "1",
            "--batch", "2")
    r = invoke(*args, "--out", str(tmp_path / "a.gguf"))
    assert r.exit_code == 0, r.output
    assert "3 conversations train their last answer only" in r.output
    assert "--every-answer trains each" in r.output
    r = invoke(*args, "--every-answer", "--out", str(tmp_path / "b.gguf"))
    assert r.exit_code == 0, r.output
    assert "3 conversations made one example per answer" in r.output
    assert "last answer only" not in r.output and "6 examples" in r.output, r.output
