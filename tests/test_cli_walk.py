"""Every `ggwgpu` command, walked with hostile files and hostile options: each run ends with
a message and exit code 1 or 2 (or runs, exit 0), never a Python exception.

Each command starts from a small valid command line (WALK); the walk puts every hostile
file (truncated or lying GGUF, a model of 2^31 - 1 or 1 token of context, a model whose
chat template loops or fails, a qwen35 hybrid of 16 or 2^31 - 1 tokens, empty, a
directory, a FIFO, a device, text that is not UTF-8, JSONL with a bad line) in each of its file arguments and options, and each
hostile number (0, -1, huge, NaN) in each of its number options. $GGWGPU_TRACEBACK=1 makes
an unexpected exception escape the command group (a bug, found here); a 1 GiB host limit
makes oversized configurations refusals, not allocations. A run still going after a few
seconds took its options as valid (a billion steps, say): it is cut and counted as such.
The counts are printed in pytest's closing summary."""
import collections
import os
import struct
import time

import click
import pytest
from click.testing import CliRunner

from ggwgpu import gguf_llama
from ggwgpu.backends import ENV_VAR
from ggwgpu.chat import time_limit
from ggwgpu.lora import init_adapter, lora_ranks, save_adapter
from ggwgpu.models import ModelConfig, init_parameters
from ggwgpu.tokenizer import ByteTokenizer
from ggwgpu_cli import main as cli_main

CUT_AFTER_S = 2          # a run past this took its options as valid: cut, not a failure
TINY_TRAIN = ["--n-embd", "8", "--n-head", "2", "--n-layer", "1", "--n-ff", "8", "--n-ctx",
              "8", "--batch", "2", "--steps", "1"]
# command -> a valid command line ({name}: a file of `files`)
WALK = {
    "info": [],
    "ops test": ["--op", "add"],
    "ops grad": ["--op", "add"],
    "ops list": [],
    "demo": ["--steps", "2"],
    "demo baby-llama": ["--seconds", "0.2"],
    "plot": ["{log}", "--out", "{out}"],
    "train": ["{text}", *TINY_TRAIN, "--out", "{out}"],
    "generate": ["{model}", "-n", "2"],
    "eval": ["{model}", "{text}", "--samples", "4"],
    "bench matmul": ["--sizes", "8x8x8", "--repeat", "1"],
    "bench train": ["--steps", "1", "--no-torch"],
    "bench ops": ["--top", "1", "--repeat", "1"],
    "bench memory": ["--layers", "1"],
    "bench ranks": ["--ranks", "1", "--steps", "1"],     # a cut kills its child process
    "quantize": ["{model}", "{out}", "--type", "q8_0"],
    "finetune": ["{model}", "{text}", "--steps", "1", "--batch", "2", "--out", "{out}"],
    "merge": ["{model}", "{adapter}", "--out", "{out}"],
    "chat": ["{model}", "-n", "2"],
}
# commands whose valid line the walk's --backend numpy (or a missing extra) refuses: their
# options are still walked, their work is not
REFUSED = {"plot": "needs matplotlib", "bench matmul": "times the wgpu backend",
           "bench ops": "times the wgpu backend"}
OUTPUTS = {"out", "target", "json_path", "checkpoint_out", "log_path"}
HOSTILE_INPUTS = ["truncated model", "lying model", "huge context model", "one-token model",
                  "looping template model", "failing template model", "hybrid model",
                  "huge context hybrid model",
                  "empty", "directory", "fifo", "device", "not utf-8", "bad jsonl"]
# chat templates come from model files: one that would loop for hours, one that includes
TEMPLATES = {"looping template model": "{% for i in range(100000) %}{% for j in range(100000)"
                                       " %}{% endfor %}{% endfor %}",
             "failing template model": "{% include 'other.j2' %}{{ 1 / 0 }}"}
HOSTILE_OUTPUTS = ["directory", "missing directory"]
HOSTILE_NUMBERS = {"int": ["0", "-1", str(2 ** 63), "nan"], "float": ["0", "-1", "1e308", "nan"]}
TALLY = collections.Counter()


class Cut(BaseException):
    """Raised by the alarm: passes every `except Exception` on its way out."""


def command_paths(group=cli_main.cli, prefix=()):
    for name, command in group.commands.items():
        if isinstance(command, click.Group):
            if command.invoke_without_command:     # `demo` runs alone, too
                yield " ".join(prefix + (name,)), command
            yield from command_paths(command, prefix + (name,))
        else:
            yield " ".join(prefix + (name,)), command


COMMANDS = dict(command_paths())


# a qwen35: a gated delta-net (its state and convolution cache) before gated attention
HYBRID = dict(n_layer=2, n_head_kv=1, n_embd_head=8, n_rot=4, recurrent_layers=(0,),
              conv_kernel=3, ssm_state=4, ssm_heads=2, ssm_groups=1, rope_sections=(1, 1, 0, 0),
              arch="qwen35")


def tiny_model(path, n_ctx=16, template=None, **family):
    cfg = ModelConfig(**{**dict(n_vocab=ByteTokenizer().n_vocab, n_embd=16, n_head=2,
                                n_layer=1, n_ff=32, n_ctx=n_ctx), **family})
    gguf_llama.save_model(path, cfg, init_parameters(cfg, 0), ByteTokenizer(),
                          template and {"tokenizer.chat_template": template})
    return cfg


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("walk")
    cfg = tiny_model(d / "model.gguf")
    save_adapter(d / "adapter.gguf", init_adapter(cfg, lora_ranks(cfg, r=2), alpha=4.0), cfg)
    (d / "text.txt").write_text("To be, or not to be, that is the question.\n" * 20)
    (d / "log.jsonl").write_text('{"step": 1, "loss": 2.0}\n{"step": 2, "loss": 1.5}\n')
    data = (d / "model.gguf").read_bytes()
    (d / "truncated model").write_bytes(data[:len(data) // 2])
    key = b"tokenizer.ggml.tokens"          # its array says 2^40 strings
    at = data.index(struct.pack("<Q", len(key)) + key) + 8 + len(key) + 8
    (d / "lying model").write_bytes(data[:at] + struct.pack("<Q", 2 ** 40) + data[at + 8:])
    tiny_model(d / "huge context model", n_ctx=2 ** 31 - 1)
    tiny_model(d / "one-token model", n_ctx=1)
    tiny_model(d / "hybrid model", **HYBRID)
    tiny_model(d / "huge context hybrid model", n_ctx=2 ** 31 - 1, **HYBRID)
    for name, template in TEMPLATES.items():
        tiny_model(d / name, template=template)
    (d / "empty").write_bytes(b"")
    (d / "directory").mkdir()
    os.mkfifo(d / "fifo")
    (d / "not utf-8").write_bytes(b"caf\xe9 au lait\n")
    (d / "bad jsonl").write_text('{"text": "fine"}\n{"text": oops}\n')
    paths = {name: str(d / name) for name in ["model.gguf", "adapter.gguf", "text.txt",
                                              "log.jsonl", *HOSTILE_INPUTS]}
    paths.update(model=paths["model.gguf"], adapter=paths["adapter.gguf"],
                 text=paths["text.txt"], log=paths["log.jsonl"], device="/dev/zero",
                 out=str(d / "out" / "written"))
    paths["missing directory"] = str(d / "no such dir" / "x")
    (d / "out").mkdir()
    return paths


def cut_after(seconds):
    """Raise Cut in the block after `seconds`, but never inside an import (chat.time_limit):
    a cut import (a first `import matplotlib.pyplot` building its font cache on a fresh
    HOME) would leave its modules half made, and every later import of them in the process
    would fail."""
    return time_limit(seconds, Cut)


def run(args, files):
    """(outcome, output) of `ggwgpu --backend numpy *args`."""
    args = [a.format(**files) if a.startswith("{") else a for a in args]

    try:
        with cut_after(CUT_AFTER_S):
            result = CliRunner().invoke(cli_main.cli, ["--backend", "numpy", *args],
                                        input="hi\n",
                                        env={ENV_VAR: None, cli_main.TRACEBACK_VAR: "1",
                                             "GGWGPU_MAX_HOST_BYTES": str(2 ** 30)})
    except Cut:
        return "cut", ""
    if isinstance(result.exception, Cut):
        return "cut", ""
    crashed = (result.exception is not None and not isinstance(result.exception, SystemExit)) \
        or "Traceback" in result.output or result.exit_code not in (0, 1, 2)
    if crashed:
        return "crashed", f"{' '.join(args)}\n{result.output}\n{result.exception!r}"
    return ("ran" if result.exit_code == 0 else "refused"), result.output


def variants(path):
    """(what, args) for every hostile file in every file parameter and every hostile number
    in every number option of command `path`."""
    base = WALK[path]
    for p in COMMANDS[path].params:
        if isinstance(p.type, click.Path):
            hostile = HOSTILE_OUTPUTS if p.name in OUTPUTS else HOSTILE_INPUTS
            for name in hostile:
                if isinstance(p, click.Argument):
                    slots = [i for i, a in enumerate(base) if a.startswith("{")]
                    index = [q for q in COMMANDS[path].params
                             if isinstance(q, click.Argument)].index(p)
                    if index >= len(slots):
                        continue
                    args = base[:slots[index]] + [name] + base[slots[index] + 1:]
                else:
                    args = base + [p.opts[0], name]
                yield f"{p.name}={name}", [files_key(a) for a in args]
        elif isinstance(p.type, (click.IntRange, click.types.IntParamType, click.FloatRange)):
            kind = "float" if isinstance(p.type, click.FloatRange) else "int"
            for value in HOSTILE_NUMBERS[kind]:
                yield f"{p.opts[0]}={value}", base + [p.opts[0], value]


def files_key(arg):
    return "{" + arg + "}" if arg in HOSTILE_INPUTS + HOSTILE_OUTPUTS else arg


class _Summary:
    def pytest_terminal_summary(self, terminalreporter):
        if TALLY["runs"]:
            terminalreporter.write_line(
                f"cli walk: {TALLY['runs']} runs of {TALLY['commands']} commands: "
                f"{TALLY['refused']} refused with a message, {TALLY['ran']} ran, "
                f"{TALLY['cut']} cut while running, {TALLY['crashed']} crashed")


def test_the_walk_covers_every_command():
    assert set(WALK) == set(COMMANDS), set(WALK) ^ set(COMMANDS)


def test_the_cut_waits_for_an_import_to_end(slow_import):
    with pytest.raises(Cut):
        with cut_after(0.2):
            slow_import()
            time.sleep(5)
    assert slow_import().done


@pytest.mark.parametrize("path", list(WALK))
def test_no_hostile_input_gets_a_traceback(path, files, request):
    if not request.config.pluginmanager.has_plugin("cli-walk-summary"):
        request.config.pluginmanager.register(_Summary(), "cli-walk-summary")
    outcome, output = run(path.split() + WALK[path], files)
    assert outcome in ("ran", "cut") or (path in REFUSED and REFUSED[path] in output), \
        f"{path}: the valid command line fails:\n{output}"
    TALLY["commands"] += 1
    crashes = []
    for what, args in variants(path):
        outcome, output = run(path.split() + args, files)
        TALLY["runs"] += 1
        TALLY[outcome] += 1
        if outcome == "crashed":
            crashes.append(f"{path} {what}: {output}")
    assert not crashes, "\n\n".join(crashes)
