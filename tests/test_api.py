"""The Python API (ggwgpu.api) alone: a model trained from scratch, a LoRA finetune of it
stopped and resumed, evaluated, merged and sampled, with nothing of the CLI."""
import json

import numpy as np
import pytest

import ggwgpu
from ggwgpu.training.run import Reporter, TrainingError

TEXT = ("Full fathom five thy father lies;\nOf his bones are coral made;\n"
        "Those are pearls that were his eyes:\nNothing of him that doth fade,\n") * 12
TINY = dict(n_embd=32, n_head=2, n_layer=2, n_ff=64, n_ctx=32)
QUIET = Reporter()


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    d = tmp_path_factory.mktemp("api")
    (d / "text.txt").write_text(TEXT)
    run = ggwgpu.train([d / "text.txt"], out=str(d / "base.gguf"), steps=20, batch=4, lr=3e-3,
                       backend="numpy", reporter=QUIET, **TINY)
    assert run.step == 20 and run.last_loss < run.first_loss
    return d


def finetune(d, steps, **kw):
    return ggwgpu.finetune(str(d / "base.gguf"), [d / "text.txt"], steps=steps, batch=4,
                           lr=1e-2, warmup=2, lora_r=4, backend="numpy", reporter=QUIET, **kw)


def test_a_lora_finetune_stopped_and_resumed_equals_one_run_and_lowers_the_loss(base, tmp_path):
    straight = finetune(base, 6, out=str(tmp_path / "straight.gguf"))
    first = finetune(base, 3, out=str(tmp_path / "first.gguf"),
                     checkpoint=str(tmp_path / "ckpt.gguf"))
    assert first.step == 3 and (tmp_path / "ckpt.gguf").exists()
    resumed = ggwgpu.resume(str(tmp_path / "ckpt.gguf"), str(base / "base.gguf"),
                            [base / "text.txt"], out=str(tmp_path / "resumed.gguf"), steps=3,
                            backend="numpy", reporter=QUIET)
    assert resumed.step == 6 and resumed.last_loss == straight.last_loss   # bit-exact on NumPy
    a = ggwgpu.load(base / "base.gguf", adapters=[tmp_path / "straight.gguf"])
    b = ggwgpu.load(base / "base.gguf", adapters=[tmp_path / "resumed.gguf"])
    for name, tensor in a.adapters[0].tensors.items():
        np.testing.assert_array_equal(tensor, b.adapters[0].tensors[name])

    plain = ggwgpu.evaluate(base / "base.gguf", [base / "text.txt"], backend="numpy")
    tuned = ggwgpu.evaluate(a, [base / "text.txt"], backend="numpy")
    assert plain.windows == tuned.windows == len(a.tokenizer.encode(TEXT)) // TINY["n_ctx"]
    assert tuned.loss < plain.loss and tuned.perplexity == pytest.approx(np.exp(tuned.loss))
    merged = ggwgpu.merge(a)
    assert not merged.adapters
    assert ggwgpu.evaluate(merged, [base / "text.txt"], backend="numpy").loss == \
        pytest.approx(tuned.loss, rel=1e-5)
    merged.save(tmp_path / "merged.gguf")
    assert ggwgpu.evaluate(tmp_path / "merged.gguf", [base / "text.txt"],
                           backend="numpy").loss == pytest.approx(tuned.loss, rel=1e-5)
    text = ggwgpu.generate(a, "Full fathom", max_tokens=12, temperature=0, backend="numpy")
    assert text == ggwgpu.generate(merged, "Full fathom", max_tokens=12, temperature=0,
                                   backend="numpy")
    assert len(text) > 0


def test_resuming_refuses_another_base_and_a_fixed_option(base, tmp_path):
    finetune(base, 2, out=str(tmp_path / "a.gguf"), checkpoint=str(tmp_path / "ckpt.gguf"))
    with pytest.raises(ValueError, match="batch 4 \\(given: 8\\)"):
        ggwgpu.resume(str(tmp_path / "ckpt.gguf"), str(base / "base.gguf"), [base / "text.txt"],
                      steps=1, batch=8, backend="numpy", reporter=QUIET)
    other = ggwgpu.train([base / "text.txt"], out=str(tmp_path / "other.gguf"), steps=1,
                         seed=5, backend="numpy", reporter=QUIET, **TINY)
    assert other.step == 1
    with pytest.raises(ValueError, match="finetunes another base model"):
        ggwgpu.resume(str(tmp_path / "ckpt.gguf"), str(tmp_path / "other.gguf"),
                      [base / "text.txt"], steps=1, backend="numpy", reporter=QUIET)
    resumed = ggwgpu.resume(str(tmp_path / "ckpt.gguf"), str(base / "base.gguf"),
                            [base / "text.txt"], out=str(tmp_path / "b.gguf"), steps=1, lr=5e-3,
                            backend="numpy", reporter=QUIET)     # lr may change
    assert resumed.step == 3


def test_a_chat_finetune_keeps_the_best_adapter_and_a_bad_run_raises(base, tmp_path):
    out = tmp_path / "chat.gguf"
    run = ggwgpu.finetune(str(base / "base.gguf"), data="chat-demo", out=str(out), steps=4,
                          batch=2, lr=1e-3, n_ctx=256, mask_prompt=True,
                          val_every=2, val_batches=1, backend="numpy", reporter=QUIET)
    assert run.best == str(tmp_path / "chat.best.gguf") and run.best_val_loss < 10
    assert out.exists() and (tmp_path / "chat.best.gguf").exists()
    with pytest.raises(TrainingError, match="not finite"):
        ggwgpu.finetune(str(base / "base.gguf"), [base / "text.txt"], out=str(tmp_path / "x"),
                        steps=2, lr=1e30, warmup=0, backend="numpy", reporter=QUIET)


def test_from_ggwgpu_import_star_takes_the_api_not_every_op():
    names = {}
    exec("from ggwgpu import *", names)
    assert {"load", "train", "finetune", "resume", "evaluate", "generate", "merge"} <= set(names)
    assert "mul_mat" not in names and hasattr(ggwgpu, "mul_mat")


def test_a_tool_calling_finetune_renders_the_tools_and_trains_the_calls(base, tmp_path):
    from test_chat import CALLING, QWEN25, WEATHER
    lines = [{"messages": CALLING, "tools": [WEATHER]},
             {"messages": CALLING[:1] + CALLING[3:]}]
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines * 2))
    run = ggwgpu.finetune(str(base / "base.gguf"), data=str(tmp_path), chat_template=QWEN25,
                          mask_prompt=True, out=str(tmp_path / "a.gguf"), steps=2, batch=2,
                          n_ctx=1024, backend="numpy", reporter=QUIET)
    assert run.step == 2 and run.last_loss < run.first_loss
    with pytest.raises(ValueError, match=r"\(ChatML\) leaves out tool 'get_weather'"):
        ggwgpu.finetune(str(base / "base.gguf"), data=str(tmp_path), steps=1,
                        out=str(tmp_path / "b.gguf"), backend="numpy", reporter=QUIET)


def test_generate_answers_a_conversation_through_the_chat_template(base):
    from ggwgpu.chat import CHATML, ChatTemplate
    from test_chat import CALLING, QWEN25, WEATHER
    model = ggwgpu.load(base / "base.gguf")
    greedy = dict(max_tokens=8, temperature=0, backend="numpy")
    for messages, template, tools in (([{"role": "user", "content": "Full fathom"}], None, None),
                                      (CALLING[:3], QWEN25, [WEATHER])):
        answer = ggwgpu.generate(model, messages, chat_template=template, tools=tools, **greedy)
        rendered = ChatTemplate(template or CHATML).render(
            [dict(m, content=m.get("content") or "") for m in messages], True, tools)
        assert answer == ggwgpu.generate(model, rendered, **greedy) and answer
    who = CHATML.replace("'<|im_start|>assistant\\n'", "'<|im_start|>' + who + '\\n'")
    asked = [{"role": "user", "content": "Full fathom"}]
    assert ggwgpu.generate(model, asked, chat_template=who, chat_template_kwargs={"who": "bot"},
                           **greedy) == ggwgpu.generate(
        model, ChatTemplate(who, variables={"who": "bot"}).render(asked, True), **greedy)
    with pytest.raises(ValueError, match="ends with a user's or a tool's message"):
        ggwgpu.generate(model, CALLING, **greedy)
    with pytest.raises(ValueError, match=r"tools and chat_template\(_kwargs\) go with a conversation"):
        ggwgpu.generate(model, "Full fathom", tools=[WEATHER], **greedy)
