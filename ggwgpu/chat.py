"""Instruction and chat data: JSONL examples, the model's chat template, and which tokens
are trained.

A dataset is a JSONL file, or a directory holding train.jsonl and optionally valid.jsonl
and test.jsonl (MLX-LM's layout). Each line is one example, in one of three forms:

    {"text": "..."}                                   plain text, every token trained
    {"prompt": "...", "completion": "..."}            the completion trained
    {"messages": [{"role": "system" | "user" | "assistant" | "tool", "content": "..."}, ...]}

Messages (and prompt/completion pairs, as a user turn and an assistant turn) are rendered
with the chat template: the model's `tokenizer.chat_template`, a file's, or ChatML when the
model has none. Rendering is jinja2 in a sandbox with what transformers gives a template
(messages, tools, add_generation_prompt, bos_token, eos_token, raise_exception,
strftime_now, a tojson that keeps non-ASCII) — llama.cpp renders the same templates the
same way.

Tool calling, as transformers and TRL take it: an example with messages may have "tools", a
list of function schemas ({"type": "function", "function": {"name", "description",
"parameters"}}) that the template renders (Qwen's in its system turn); an assistant message
may call tools, "tool_calls": [{"type": "function", "function": {"name", "arguments"}}]
(its content then may be left out or null, and is rendered as "", which most templates
need), and a "tool" message holds a call's result. A template that leaves a tool or a call
out of its rendering (ChatML does) is an error: the model would learn calls it was never
shown.

An example becomes token ids and a trained flag per token (`Example`). With `mask_prompt`
only the assistant turns are trained (their content and the end-of-turn text the template
puts after it), not the system and user turns nor the generation prompt that opens an
assistant turn; without it every token is. Each turn is rendered as the text the template
adds for it: the text of messages[:i + 1] less that of messages[:i], so a template must
render a conversation as a prefix of any longer one (all common ones do; one that does not
is an error naming the example).
"""
from __future__ import annotations

import json
import os
import signal
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from .data import DataError, EpochOrder
from .files import read_limited

if TYPE_CHECKING:
    from .tokenizer import Tokenizer

SPLITS = ("train", "valid", "test")
MAX_LINE_CHARS = 1 << 24    # one JSONL example: 16 Mi characters, thousands of contexts
# name -> directory under ggwgpu/data: usable as --data NAME
BUNDLED = {"chat-demo": "chat", "prefs-demo": "prefs"}
ROLES = ("system", "user", "assistant", "tool")

# ChatML, for models without a template of their own.
CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + "
          "message['content'] + '<|im_end|>' + '\\n' }}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")


# -- reading ----------------------------------------------------------------------------------

def load_dataset(path, check=None) -> dict[str, list[dict]]:
    """{split: examples} of a JSONL file (all "train"), a directory with train.jsonl and
    optionally valid.jsonl and test.jsonl, or a bundled dataset's name (`BUNDLED`) when no
    such file exists. Every line is checked (`check`, default `check_example`); a bad one is
    a DataError naming the file, the line and the problem."""
    path = Path(path)
    if str(path) in BUNDLED and not path.exists():
        path = Path(str(resources.files("ggwgpu").joinpath("data", BUNDLED[str(path)])))
    if path.is_dir():
        files = {s: path / f"{s}.jsonl" for s in SPLITS if (path / f"{s}.jsonl").exists()}
        if "train" not in files:
            raise DataError(f"{path}: a data directory needs train.jsonl (and may have "
                            f"valid.jsonl, test.jsonl)")
    elif path.exists():
        files = {"train": path}
    else:
        raise DataError(f"{path}: no such file or directory (nor a bundled dataset: "
                        f"{', '.join(BUNDLED)})")
    return {split: read_jsonl(file, check) for split, file in files.items()}


def read_jsonl(path, check=None) -> list[dict]:
    """The examples of one JSONL file; blank lines are skipped, anything else must be an
    example (`check`, default `check_example`: it raises DataError)."""
    check = check or check_example
    path = Path(path)
    try:
        text = read_limited(path, DataError).decode("utf-8")
    except UnicodeDecodeError as e:
        raise DataError(f"{path}: not valid UTF-8 at byte offset {e.start}") from None
    examples = []
    # "\n" ends a line, as JSONL says: str.splitlines would also cut at U+2028, U+2029 and
    # U+0085, which JSON strings may hold raw (json.dumps(..., ensure_ascii=False) writes them)
    for number, line in enumerate(text.split("\n"), 1):
        if not line.strip():
            continue
        if len(line) > MAX_LINE_CHARS:     # json.loads of one takes 30x its size
            raise DataError(f"{path}:{number}: a line of {len(line)} characters; one example "
                            f"may hold at most {MAX_LINE_CHARS} (a context's worth of text is "
                            f"far less)")
        try:
            example = json.loads(line)
        except (ValueError, RecursionError) as e:      # RecursionError: nested too deeply
            raise DataError(f"{path}:{number}: not valid JSON ({e})") from None
        try:
            check(example)
        except DataError as e:
            raise DataError(f"{path}:{number}: {e}") from None
        examples.append(example)
    if not examples:
        raise DataError(f"{path}: holds no examples")
    return examples


def check_example(example) -> None:
    """Raise DataError unless `example` is one of the three forms of the module docstring."""
    if not isinstance(example, dict):
        raise DataError(f"an example must be a JSON object, got {type(example).__name__}")
    forms = [k for k in ("text", "prompt", "messages") if k in example]
    if len(forms) != 1:
        raise DataError(f"an example has exactly one of 'text', 'prompt' + 'completion' or "
                        f"'messages'; this one has keys {sorted(example)}")
    if forms[0] == "text":
        _need_string(example, "text")
    elif forms[0] == "prompt":
        _need_string(example, "prompt")
        _need_string(example, "completion")
    else:
        messages = example["messages"]
        if not isinstance(messages, list) or not messages:
            raise DataError("'messages' must be a non-empty list")
        check_messages(messages)
        if not any(m["role"] == "assistant" for m in messages):
            raise DataError("the messages have no assistant turn to learn from")
    if "tools" in example:
        if forms[0] != "messages":
            raise DataError("'tools' goes with 'messages' (a conversation that calls them)")
        check_tools(example["tools"])


def check_messages(messages, where: str = "") -> None:
    """Raise DataError unless each of `messages` is {"role": one of ROLES, "content": a
    string}, an assistant's content optional where it has "tool_calls" (a non-empty list of
    calls, each {"function": {"name": a string, "arguments": an object or a string}},
    "type" and "id" optional, or the function's fields themselves). `where` names the list
    in the messages ("'chosen' ")."""
    for i, m in enumerate(messages):
        calls = m.get("tool_calls") if isinstance(m, dict) else None
        content = m.get("content") if isinstance(m, dict) else None
        if not isinstance(m, dict) or m.get("role") not in ROLES or not (
                isinstance(content, str)
                or (calls is not None and m["role"] == "assistant" and content is None)):
            raise DataError(f"{where}message {i} must be {{\"role\": one of "
                            f"{', '.join(ROLES)}, \"content\": a string}} (an assistant's "
                            f"that has \"tool_calls\" may leave out its content), got "
                            f"{json.dumps(m)[:80]}")
        if content is not None:
            _need_unicode(content, f"{where}message {i}'s content")
        if calls is None:
            continue
        if m["role"] != "assistant" or not isinstance(calls, list) or not calls:
            raise DataError(f"{where}message {i}: \"tool_calls\" is a non-empty list, and "
                            f"only an assistant's message has one")
        for k, call in enumerate(calls):
            function = call.get("function", call) if isinstance(call, dict) else None
            if not isinstance(function, dict) or not isinstance(function.get("name"), str) \
                    or not isinstance(function.get("arguments"), (dict, str)):
                raise DataError(f"{where}message {i}, tool call {k} must be {{\"function\": "
                                f"{{\"name\": a string, \"arguments\": an object or a "
                                f"string}}}}, got {json.dumps(call)[:80]}")
        _need_unicode_in(calls, f"{where}message {i}'s tool calls")


def check_tools(tools) -> None:
    """Raise DataError unless `tools` is a non-empty list of function schemas, each
    {"type": "function", "function": {"name": a string, ...}} (or the function itself)."""
    if not isinstance(tools, list) or not tools:
        raise DataError("'tools' must be a non-empty list of function schemas")
    for k, tool in enumerate(tools):
        function = tool.get("function", tool) if isinstance(tool, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise DataError(f"tool {k} must be {{\"type\": \"function\", \"function\": "
                            f"{{\"name\": a string, ...}}}}, got {json.dumps(tool)[:80]}")
    _need_unicode_in(tools, "'tools'")


def renderable(messages) -> list[dict]:
    """`messages` (checked) with a tool call's missing or null content as "", which most
    templates need (Qwen3's tests it for reasoning tags)."""
    return [m if m.get("content") is not None else {**m, "content": ""} for m in messages]


def check_tools_rendered(example: dict, rendered: str, template, messages) -> None:
    """Raise DataError where `rendered`, the example's conversation as `template` renders
    it, lacks the name of a tool the example offers, or where the rendering of `messages`
    without the tools lacks the name of a tool they call (a template that shows the tools
    but not the calls: the calls' names came from the tools)."""
    offered = [t.get("function", t)["name"] for t in example.get("tools", ())]
    called = [c.get("function", c)["name"] for m in messages for c in m.get("tool_calls") or ()]
    left_out = [name for name in offered + called if name not in rendered]
    if called and offered and not left_out:
        try:
            bare = template.render(messages)
        except DataError:       # a template that wants the tools with the calls: no check
            bare = None
        left_out = [name for name in called if bare is not None and name not in bare]
    if left_out:
        raise DataError(f"the chat template ({template.origin}) leaves out tool "
                        f"{left_out[0]!r}: it renders no tools or tool calls (give one that "
                        f"does: --chat-template)")


def _need_string(example, key):
    if not isinstance(example.get(key), str):
        raise DataError(f"{key!r} must be a string")
    _need_unicode(example[key], repr(key))


def _need_unicode_in(value, what: str):
    """_need_unicode of every string (keys too) in a JSON value, however deeply nested (a
    stack, not recursion: JSON as deep as the parser allows must not overflow Python's)."""
    todo = [value]
    while todo:
        value = todo.pop()
        if isinstance(value, str):
            _need_unicode(value, what)
        elif isinstance(value, dict):
            todo += [*value.keys(), *value.values()]
        elif isinstance(value, list):
            todo += value


def _need_unicode(text: str, what: str):
    """JSON's \\ud800 escapes make strings that are not Unicode: refused here, where the
    line is known, rather than when the text is tokenized."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise DataError(f"{what}: character {e.start} is a lone surrogate "
                        f"U+{ord(text[e.start]):04X}, not Unicode") from None


# -- chat templates ---------------------------------------------------------------------------

# A template comes from the model file, so it is hostile input: a render is bounded.
RENDER_SECONDS = 10.0           # wall time of one render
RENDER_CHARS = 1 << 24          # its text, and a string or list its operators may make
RENDER_STEPS = 1_000_000        # loop iterations and operator calls of one render


class ChatTemplate:
    """A Jinja chat template, rendered as transformers and llama.cpp render it, in jinja2's
    immutable sandbox with bounds (RENDER_*): whatever fails in a template, from a syntax
    error, an include or a recursion to a loop that would not end, is a DataError "the chat
    template (`origin`) failed: ...". `origin` says where it came from (a model file, a
    --chat-template file); `variables` are passed to every render (template_variables:
    {"enable_thinking": False} for Qwen3's)."""

    def __init__(self, source: str, bos_token: str = "", eos_token: str = "",
                 origin: str = "ChatML", variables: dict | None = None):
        from jinja2 import TemplateError
        from jinja2.ext import loopcontrols

        def raise_exception(message):
            raise TemplateError(message)

        def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
            return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent,
                              separators=separators, sort_keys=sort_keys)

        self.source, self.bos_token, self.eos_token = source, bos_token, eos_token
        self.variables = template_variables(variables)
        self.origin, self.budget = origin, RenderBudget()
        self.last_answer_only = 0    # conversations whose earlier answers `turns` left out
        self.split_conversations = 0     # those made one example per answer instead
        env = bounded_environment(self.budget)(trim_blocks=True, lstrip_blocks=True,
                                               extensions=[loopcontrols, generation_tag()])
        env.filters["tojson"] = tojson
        env.globals.update(raise_exception=raise_exception, range=self.budget.range,
                           strftime_now=lambda fmt: datetime.now().strftime(fmt))
        try:
            self.template = env.from_string(source)
        except Exception as e:     # noqa: BLE001 - any failure of a hostile template
            raise DataError(f"the chat template ({origin}) does not parse: "
                            f"{type(e).__name__}: {e}") from None

    @classmethod
    def of(cls, tokenizer: Tokenizer, source: str | None = None, origin: str | None = None,
           variables: dict | None = None) -> ChatTemplate:
        """The template `source` (from `origin`), else the tokenizer's own
        (tokenizer.chat_template in its GGUF), else ChatML; bos_token and eos_token are the
        tokenizer's; `variables` as the constructor takes them."""
        from .tokenizer import CHAT_TEMPLATE
        own = tokenizer.gguf_metadata().get(CHAT_TEMPLATE)
        if source is None:
            source, origin = (own, f"the model's {CHAT_TEMPLATE}") if own else (CHATML, "ChatML")
        text = lambda i: tokenizer.tokens[i] if i is not None else ""   # noqa: E731
        return cls(source, text(tokenizer.bos_id), text(tokenizer.eos_id),
                   origin or "a given template", variables)

    def render(self, messages, add_generation_prompt: bool = False, tools=None) -> str:
        """The text of `messages` (and the `tools` they may call, None: none), as transformers'
        apply_chat_template renders it (tools None when there are none)."""
        self.budget.start()
        try:
            with time_limit(RENDER_SECONDS):
                parts, size = [], 0
                for part in self.template.generate(
                        **self.variables, messages=messages, tools=tools,
                        add_generation_prompt=add_generation_prompt,
                        bos_token=self.bos_token, eos_token=self.eos_token):
                    size += len(part)
                    self.budget.tick(size)
                    parts.append(part)
                return "".join(parts)
        except Exception as e:     # noqa: BLE001 - any failure of a hostile template
            raise DataError(f"the chat template ({self.origin}) failed: "
                            f"{type(e).__name__}: {e}") from None

    def turns(self, messages, answers_from: int = 0, tools=None) -> list[tuple[str, bool]]:
        """The rendered conversation cut into (text, is_answer) pieces: each assistant
        turn's generation prompt is a piece of its own (not an answer), then its content and
        end-of-turn text (an answer, if the message's index is at least `answers_from`).

        That needs every start of the conversation that ends at an answer to render as the
        start of the whole. Where the template renders otherwise (Qwen3's and Qwen3.5's
        earlier answers lose their reasoning tags; Gemma 4's generation prompt opens an empty
        thought that an answer does not have; Qwen3.5 refuses a conversation without a user
        turn, so an answer before the first user message), the
        conversation is cut as TRL cuts a prompt from its completion: the last message, if
        an assistant's, is the answer from where the whole and the rendering of the messages
        before it with the generation prompt part; earlier answers stay context (not answers:
        `last_answer_only` counts the conversations that had some from `answers_from` on).
        Every rendering gets `tools` (render)."""
        try:
            return self._turns_of_prefixes(messages, answers_from, tools)
        except DataError:
            full = self.render(messages, tools=tools)   # one that fails on the whole: its error
        last = len(messages) - 1
        if messages[last]["role"] != "assistant":
            return [(full, False)]
        prompt = self.render(messages[:last], add_generation_prompt=True, tools=tools)
        start = len(os.path.commonprefix([prompt, full]))
        if start < len(prompt):     # they part inside the generation prompt (Gemma 4's
            # thought before a "<|tool_call>"): at a line's or a tag's end, so that no
            # control token is cut in two
            start = max(full.rfind("\n", 0, start), full.rfind(">", 0, start)) + 1
        self.last_answer_only += any(m["role"] == "assistant"
                                     for m in messages[answers_from:last])
        return [(t, trained) for t, trained in ((full[:start], False),
                                                (full[start:], last >= answers_from)) if t]

    def _turns_of_prefixes(self, messages, answers_from: int, tools) -> list[tuple[str, bool]]:
        """The pieces from renderings of the conversation's starts at the assistant turns
        (and the whole): the turns between two answers are one untrained piece, so no start
        that ends elsewhere is rendered (Llama 3's template, which puts the tools in the
        first user message, refuses a start without one)."""
        pieces, done = [], ""
        for i, message in enumerate(messages):
            if message["role"] != "assistant" and i < len(messages) - 1:
                continue
            parts = []
            if message["role"] == "assistant":
                parts.append((self.render(messages[:i], add_generation_prompt=True, tools=tools),
                              False))
            parts.append((self.render(messages[:i + 1], tools=tools),
                          message["role"] == "assistant" and i >= answers_from))
            for text, trained in parts:
                if not text.startswith(done):
                    raise DataError("the chat template does not render a conversation as the "
                                    "start of a longer one, so turns cannot be told apart")
                pieces.append((text[len(done):], trained))
                done = text
        return [(t, trained) for t, trained in pieces if t]


# what every render sets itself: chat template variables may not name these
RENDER_VARIABLES = ("messages", "tools", "add_generation_prompt", "bos_token", "eos_token")


def template_variables(variables) -> dict:
    """`variables` (None: none), what transformers' apply_chat_template passes a template
    beside the conversation (its chat_template_kwargs, llama.cpp's --chat-template-kwargs:
    Qwen3's enable_thinking), checked: a dict of names to JSON values, none of them one a
    render sets itself (RENDER_VARIABLES)."""
    if variables is not None and not isinstance(variables, dict):
        raise ValueError(f"chat template variables are a dict of names to values, not a "
                         f"{type(variables).__name__}")
    variables = dict(variables or {})
    for name in variables:
        if not isinstance(name, str) or not name.isidentifier():
            raise ValueError(f"a chat template variable's name is an identifier, not "
                             f"{name!r}")
        if name in RENDER_VARIABLES:
            raise ValueError(f"the chat template variable {name!r} is set by each rendering "
                             f"itself")
    _need_unicode_in(variables, "the chat template variables")
    return variables


def generation_tag():
    """The jinja2 extension of transformers' {% generation %} ... {% endgeneration %}, which
    marks an answer for its assistant-token masks: rendered as its body (the answers
    trained are found by rendering the conversation's starts, ChatTemplate.turns)."""
    from jinja2.ext import Extension

    class Generation(Extension):
        tags = {"generation"}

        def parse(self, parser):
            next(parser.stream)
            return parser.parse_statements(("name:endgeneration",), drop_needle=True)
    return Generation


class RenderTimeout(Exception):
    def __str__(self):
        return f"it runs longer than {RENDER_SECONDS:g} s"


IMPORT_WAIT_S = 0.05     # how soon a SIGALRM that found an import running looks again


def importing(frame) -> bool:
    """Whether `frame` (a signal handler's) runs inside an import. An exception raised there
    leaves the modules being imported half made, and every later import of them in the
    process fails: a handler that finds an import running waits for it to end instead."""
    while frame is not None:
        if frame.f_code.co_filename.startswith("<frozen importlib._bootstrap"):
            return True
        frame = frame.f_back
    return False


@contextmanager
def time_limit(seconds: float, error=RenderTimeout):
    """Raise `error` in the block after `seconds` of wall time, by SIGALRM: in the
    main thread where the platform has setitimer (elsewhere RenderBudget's own checks of the
    clock bound a render, at its loops and operators only). A timer set before (the CLI
    walk's) is put back, less the time spent here."""
    if threading.current_thread() is not threading.main_thread() or \
            not hasattr(signal, "setitimer"):
        yield
        return

    def expire(signum, frame):
        if importing(frame):
            signal.setitimer(signal.ITIMER_REAL, IMPORT_WAIT_S)
            return
        raise error()
    before = signal.signal(signal.SIGALRM, expire)
    delay, interval = signal.setitimer(signal.ITIMER_REAL, seconds)
    start = time.monotonic()
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, before)
        if delay:
            signal.setitimer(signal.ITIMER_REAL,
                             max(delay - (time.monotonic() - start), 1e-3), interval)


class RenderBudget:
    """The bounds of one render (RENDER_*), counted by the template's loops over range() and
    its operators; past one, TemplateError."""

    def __init__(self):
        self.start()

    def start(self):
        self.steps, self.deadline = 0, time.monotonic() + RENDER_SECONDS

    def tick(self, chars: int = 0):
        from jinja2 import TemplateError
        self.steps += 1
        if chars > RENDER_CHARS:
            raise TemplateError(f"its text passes {RENDER_CHARS} characters")
        if self.steps > RENDER_STEPS:
            raise TemplateError(f"it takes more than {RENDER_STEPS} steps")
        if self.steps % 4096 == 0 and time.monotonic() > self.deadline:
            raise TemplateError(f"it runs longer than {RENDER_SECONDS:g} s")

    def range(self, *args):
        """jinja2's sandboxed range (at most MAX_RANGE items), each item a step."""
        from jinja2.sandbox import safe_range
        for i in safe_range(*args):
            self.tick()
            yield i


def bounded_environment(budget: RenderBudget):
    """jinja2's immutable sandbox whose operators count against `budget` and refuse results
    past RENDER_CHARS ("x" * 10**9) or powers past a few thousand bits before computing
    them."""
    from jinja2 import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Bounded(ImmutableSandboxedEnvironment):
        intercepted_binops = frozenset(["*", "**", "+"])

        def call_binop(self, context, operator, left, right):
            budget.tick()
            sized = (str, list, tuple)
            if operator == "*" and isinstance(left, sized) != isinstance(right, sized):
                seq, n = (left, right) if isinstance(left, sized) else (right, left)
                if isinstance(n, int) and len(seq) * n > RENDER_CHARS:
                    raise TemplateError(f"a repetition of {n} passes {RENDER_CHARS} items")
            if operator == "**" and isinstance(left, int) and isinstance(right, int) and \
                    right > 0 and abs(left) > 1 and right * abs(left).bit_length() > 1 << 16:
                raise TemplateError(f"{left} ** {right} has more than {1 << 16} bits")
            if operator == "+" and isinstance(left, sized) and isinstance(right, sized) and \
                    len(left) + len(right) > RENDER_CHARS:
                raise TemplateError(f"a sum passes {RENDER_CHARS} items")
            return super().call_binop(context, operator, left, right)

    return Bounded


def adds_bos(tokenizer: Tokenizer, rendered: str) -> bool:
    """Whether BOS goes before `rendered` text: the vocabulary adds one and the template did
    not write it already (many templates start with {{ bos_token }})."""
    bos = tokenizer.bos_id
    return tokenizer.add_bos and bos is not None \
        and not (rendered and rendered.startswith(tokenizer.tokens[bos]))


def rendered_ids(tokenizer: Tokenizer, rendered: str) -> list[int]:
    """The token ids of a rendered conversation, as the model sees it at inference: BOS as
    `adds_bos` says, special tokens (<|im_start|>, ...) recognised — in the messages' text
    too, as llama.cpp and transformers tokenize a rendered chat."""
    ids = [int(i) for i in tokenizer.encode(rendered, parse_special=True)]
    return [tokenizer.bos_id] * adds_bos(tokenizer, rendered) + ids


# -- examples as tokens -----------------------------------------------------------------------

@dataclass
class Example:
    """One example as tokens: ids, and for each a flag saying whether it is trained."""
    ids: np.ndarray         # int32
    trained: np.ndarray     # bool, same length

    def __len__(self):
        return len(self.ids)


def encode_example(example: dict, tokenizer: Tokenizer, template: ChatTemplate | None,
                   mask_prompt: bool, answers_from: int = 0) -> Example:
    """The tokens of an example: BOS first when the vocabulary adds one (and the template
    did not write it), special tokens in templated text recognised, EOS after plain text and
    after a prompt/completion without a template (so the model learns to stop). With
    mask_prompt, the messages before index `answers_from` are not trained, assistant turns
    among them neither."""
    if "messages" in example or ("prompt" in example and template is not None):
        messages = renderable(example["messages"]) if "messages" in example else [
            {"role": "user", "content": example["prompt"]},
            {"role": "assistant", "content": example["completion"]}]
        pieces, special, eos = template.turns(messages, answers_from,
                                              example.get("tools")), True, False
        check_tools_rendered(example, "".join(text for text, _ in pieces), template, messages)
    elif "prompt" in example:
        pieces = [(example["prompt"], False), (example["completion"], True)]
        special, eos = False, True
    else:
        pieces, special, eos = [(example["text"], True)], False, True
    ids, trained = [], []
    if adds_bos(tokenizer, pieces[0][0] if special else ""):
        ids.append(tokenizer.bos_id)
        trained.append(False)
    for text, is_answer in pieces:
        piece = tokenizer.encode(text, parse_special=special) if special \
            else tokenizer.encode(text)
        ids.extend(int(i) for i in piece)
        trained.extend([is_answer or not mask_prompt] * len(piece))
    if eos and tokenizer.eos_id is not None:
        ids.append(tokenizer.eos_id)
        trained.append(True)
    return Example(np.array(ids, np.int32), np.array(trained, bool))


def encode_examples(example: dict, tokenizer: Tokenizer, template: ChatTemplate | None,
                    mask_prompt: bool, every_answer: bool = False) -> list[Example]:
    """[encode_example's Example]; with `every_answer` (and mask_prompt), a conversation
    whose earlier answers the template renders otherwise in a longer one (ChatTemplate.turns
    then trains its last answer only: Qwen3's reasoning) becomes one Example per answer, the
    conversation up to it, its last answer trained as the template writes a last answer:
    every answer is trained as the model writes it (`template.split_conversations` counts
    them, not `last_answer_only`)."""
    before = template.last_answer_only if template is not None else 0
    last = encode_example(example, tokenizer, template, mask_prompt)
    if not (every_answer and mask_prompt) or template is None \
            or template.last_answer_only == before:
        return [last]
    messages = example["messages"]
    earlier = [encode_example({**example, "messages": messages[:i + 1]}, tokenizer, template,
                              mask_prompt)
               for i, m in enumerate(messages[:-1]) if m["role"] == "assistant"]
    template.last_answer_only = before
    template.split_conversations += 1
    return earlier + [last]


# -- batches ----------------------------------------------------------------------------------

def split_off(examples: list, fraction: float, seed: int) -> tuple[list, list]:
    """(kept, held out): a seeded random `fraction` of the examples held out for validation
    (at least one, and at least one kept)."""
    if len(examples) < 2:
        raise DataError(f"{len(examples)} example(s) cannot be split for validation")
    n = min(len(examples) - 1, max(1, round(fraction * len(examples))))
    order = np.random.default_rng(seed).permutation(len(examples))
    held = set(order[:n].tolist())
    return ([e for i, e in enumerate(examples) if i not in held],
            [e for i, e in enumerate(examples) if i in held])


def examples_digest(examples: list[Example], labels=None) -> str:
    """Identifies encoded examples (ids and trained flags, and KTO's labels when given), for
    a resume to check its data."""
    import hashlib
    h = hashlib.sha256()
    for e in examples:
        h.update(e.ids.tobytes() + e.trained.tobytes() + b"|")
    if labels is not None:
        h.update(np.asarray(labels, bool).tobytes())
    return h.hexdigest()[:16]


IGNORE = -1         # the target of a position that is not trained (padding, masked prompt)
STATE_VERSION = 2   # 2: rows may be packed (the state says whether)


def pack_rows(lengths, n_ctx: int) -> list[list[int]]:
    """Items of these lengths (each <= n_ctx) in rows of n_ctx: first-fit decreasing (the
    longest first, each into the first row with room, ties in index order), so the same
    lengths always give the same rows. Returns each row's item indices in the order placed.
    An item may span several rows side by side: `lengths` (items, k) then fills units of k
    rows, an item fitting where each of its k parts does (preference pairs: pairs.pack_pairs),
    the longest by the sum of its parts."""
    lengths = np.asarray(lengths, np.int64)
    lengths = lengths.reshape(len(lengths), -1)
    rows, room = [], np.empty(lengths.shape, np.int64)
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i].sum(), i)):
        fits = np.flatnonzero((room[:len(rows)] >= lengths[i]).all(axis=1))
        if len(fits):
            rows[fits[0]].append(i)
            room[fits[0]] -= lengths[i]
        else:
            room[len(rows)] = n_ctx - lengths[i]
            rows.append([i])
    return rows


def place(example: Example, inputs, targets, at: int = 0) -> int:
    """Write `example` into a row's inputs and targets from position `at`: inputs its ids but
    the last, targets the ids after them (IGNORE where not trained), at most n_ctx (the
    row's length) tokens from `at`; returns where it ends."""
    n_ctx = len(inputs)
    ids, trained = example.ids[:n_ctx + 1], example.trained[:n_ctx + 1]
    end = at + len(ids) - 1
    inputs[at:end] = ids[:-1]
    targets[at:end] = np.where(trained[1:], ids[1:], IGNORE)
    return end


class RowBatches:
    """What batches of rows (`inputs`, `targets`) taken in an `order` (data.EpochOrder)
    share."""

    @property
    def epoch(self) -> float:
        return self.order.progress

    @property
    def trained_tokens(self) -> int:
        return int((self.targets != IGNORE).sum())


class ExampleBatches(RowBatches):
    """Shuffled batches of rows of n_ctx positions holding examples: an example of n tokens
    fills n - 1 positions with inputs ids[:-1] and targets ids[1:], IGNORE where the token
    is not trained; the rest of a row is padding (IGNORE too). An example longer than
    n_ctx + 1 tokens is cut to that (`truncated` counts them), or with `drop_long` left out;
    one with no trained token in its window is left out too (`dropped` counts both).

    Padded (pack False): one example per row. Causal attention keeps it to itself (padding
    comes after it), so no attention mask is needed; a batch is (inputs, targets).
    Packed (pack True): several whole examples per row (`pack_rows`), built once. A batch is
    (inputs, targets, segments), segments giving each position's example within its row
    (the padding a segment of its own), for a packed training graph (TrainGraph.feeds):
    each example then sits at positions from 0 and attends to itself only. An example's
    last target is its own last token, never the next example's first. pack "auto" packs
    when that makes fewer rows than examples (nearly always).

    The order is `data.EpochOrder`'s over the rows, as for text samples; `state()` and
    `load_state()` resume exactly."""

    def __init__(self, examples: list[Example], n_ctx: int, batch: int, seed: int,
                 pad_id: int = 0, drop_long: bool = False, pack: bool | str = False):
        long = [len(e) > n_ctx + 1 for e in examples]
        kept = [e for e, is_long in zip(examples, long)       # with something to learn
                if not (drop_long and is_long) and e.trained[1:n_ctx + 1].any()]
        self.dropped = len(examples) - len(kept)
        self.truncated = sum(len(e) > n_ctx + 1 for e in kept)
        if not kept:
            raise DataError(f"no example has a trained token within n_ctx {n_ctx} (of "
                            f"{len(examples)} examples)")
        if pack not in (True, False, "auto"):
            raise ValueError(f"pack must be True, False or 'auto', got {pack!r}")
        self.n_ctx, self.batch, self.n_examples = int(n_ctx), int(batch), len(kept)
        spans = [min(len(e), n_ctx + 1) - 1 for e in kept]   # positions each one fills
        self._used = sum(spans)
        rows = pack_rows(spans, n_ctx) if pack else [[i] for i in range(len(kept))]
        if pack == "auto" and len(rows) == len(kept):
            rows = [[i] for i in range(len(kept))]
        self.packed = len(rows) < len(kept) or pack is True
        self.inputs = np.full((len(rows), n_ctx), pad_id, np.int32)
        self.targets = np.full((len(rows), n_ctx), IGNORE, np.int32)
        self.segments = np.zeros((len(rows), n_ctx), np.int32)
        for row, members in enumerate(rows):
            at = 0
            for segment, i in enumerate(members):
                end = place(kept[i], self.inputs[row], self.targets[row], at)
                self.segments[row, at:end] = segment
                at = end
            self.segments[row, at:] = len(members)             # the padding sees itself only
        self.order = EpochOrder(len(rows), seed)

    @property
    def n_samples(self) -> int:
        """Rows (one example each when padded)."""
        return len(self.inputs)

    @property
    def fill(self) -> float:
        """The share of the rows' positions that hold an example rather than padding."""
        return self._used / self.inputs.size

    @property
    def padded_fill(self) -> float:
        """What `fill` is with one example per row."""
        return self._used / (self.n_examples * self.n_ctx)

    def _rows(self, rows, targets=None):
        targets = self.targets[rows] if targets is None else targets
        if self.packed:
            return self.inputs[rows], targets, self.segments[rows]
        return self.inputs[rows], targets

    def in_order(self, limit: int | None = None):
        """Batches of the rows in order, the same every time (for evaluation): at most
        `limit` batches; the last one is filled up with rows that have no target."""
        n = self.n_samples if limit is None else min(self.n_samples, limit * self.batch)
        for start in range(0, n, self.batch):
            rows = np.arange(start, start + self.batch)
            targets = self.targets[rows % n].copy()
            targets[rows >= n] = IGNORE
            yield self._rows(rows % n, targets)

    def next_batch(self) -> tuple[np.ndarray, ...]:
        """(inputs, targets), or packed (inputs, targets, segments): TrainGraph.feeds's
        arguments."""
        return self._rows(self.order.take(self.batch))

    def state(self) -> dict:
        return {"version": STATE_VERSION, **self.order.state(), "n_samples": self.n_samples,
                "n_ctx": self.n_ctx, "packed": self.packed}

    def load_state(self, state: dict) -> None:
        try:
            version = int(state["version"])
            same = (int(state["n_samples"]), int(state["n_ctx"]), state["packed"]) == (
                self.n_samples, self.n_ctx, self.packed)
        except (KeyError, TypeError, ValueError):
            version, same = None, False
        if version is not None and version != STATE_VERSION:
            raise DataError(f"the saved example order is of version {version}, this ggwgpu "
                            f"reads version {STATE_VERSION} (rows may be packed): start the "
                            f"finetune again ({state!r})")
        if not same:
            raise DataError(f"the saved example order does not fit these examples: resume "
                            f"with the same data, vocabulary, n_ctx and packing ({state!r})")
        self.order.load_state(state)
