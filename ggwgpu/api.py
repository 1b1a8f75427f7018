"""ggwgpu from Python: load a model, train one from scratch, finetune it (a LoRA adapter or
every weight, on text or on chat and instruction examples), resume a stopped run, evaluate,
generate and merge, with the same defaults, files and checks as the `ggwgpu` commands.

    import ggwgpu
    base = ggwgpu.load("SmolLM2-135M-Instruct-Q8_0.gguf")
    run = ggwgpu.finetune(base, data="chat-demo", out="adapter.gguf", steps=60, lr=1e-3)
    tuned = ggwgpu.load("SmolLM2-135M-Instruct-Q8_0.gguf", adapters=["adapter.gguf"])
    print(ggwgpu.evaluate(tuned, ["notes.txt"]).perplexity)
    print(ggwgpu.generate(tuned, [{"role": "user", "content": "What do I type to plot a run?"}],
                          max_tokens=40))

Training options (lr, batch, optimizer, warmup, ... : the fields of TrainOptions) are keyword
arguments. A run prints a line every ten steps on standard error (pass `reporter=` a
training.run.Reporter to show it otherwise); a run that cannot go on raises
training.run.TrainingError, one stopped by SIGINT/SIGTERM training.run.RunStopped, each
after saving its checkpoint where it could.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from . import evaluation, gguf_file, gguf_llama, lora
from .backends import get_backend
from .data import Samples
from .generate import ChatSession, Decoder, Sampling, generate as generate_text
from .models import ModelConfig, init_parameters
from .quant import Quantized, dequantize
from .tokenizer import ByteTokenizer
from .training import TrainOptions, Trainer
from .training import checkpoint as checkpoints
from .training import inputs
from .training.run import PrintReporter, Validation, run_steps
from .training.setup import FinetuneData, prepare_finetune

TRAIN_DEFAULTS = {"warmup": 50}          # `ggwgpu train`'s, as its --help shows
FINETUNE_DEFAULTS = {"warmup": 10}       # `ggwgpu finetune`'s


@dataclass
class Model:
    """A model in memory: its config, weights (block types kept as stored), tokenizer, and
    the LoRA adapters that evaluate and generate apply on top (not merged)."""
    cfg: ModelConfig
    values: dict
    tokenizer: object
    adapters: list = field(default_factory=list)
    path: str | None = None

    @property
    def digest(self) -> str:
        """Identifies the base weights (a finetune checkpoint records it)."""
        return lora.model_digest(self.cfg, self.values)

    def save(self, path):
        """Write the model (adapters merged, if any) as a GGUF that llama.cpp loads."""
        model = merge(self) if self.adapters else self
        gguf_llama.save_model(path, model.cfg, model.values, model.tokenizer)


@dataclass
class RunResult:
    """What a training run did: its last step, the first and last loss of this run's steps
    (None without steps), the seconds taken, the files written, and the best validation
    loss (None without a validation set)."""
    step: int
    first_loss: float | None
    last_loss: float | None
    seconds: float
    out: str
    checkpoint: str | None
    best_val_loss: float | None = None
    best: str | None = None


@dataclass
class Evaluation:
    """The mean cross-entropy in nats per counted token, its perplexity, the tokens
    counted and the windows of n_ctx tokens they came in."""
    loss: float
    perplexity: float
    tokens: int
    windows: int


def load(path, adapters=(), n_ctx: int | None = None) -> Model:
    """A GGUF model (any family ggwgpu reads), with LoRA `adapters` (paths) to apply; n_ctx
    replaces its context length (the window evaluate, generate and finetune use)."""
    cfg, values, tokenizer = gguf_llama.load_model(path, keep_quantized=True)
    loaded = [lora.load_adapter(p, cfg) for p in adapters]
    return Model(_with_context(cfg, n_ctx), values, tokenizer, loaded, str(path))


def _with_context(cfg: ModelConfig, n_ctx: int | None) -> ModelConfig:
    import dataclasses
    return cfg if n_ctx is None else dataclasses.replace(cfg, n_ctx=int(n_ctx))


def _model(model) -> Model:
    return model if isinstance(model, Model) else load(model)


def _reporter(reporter):
    return PrintReporter() if reporter is None else reporter


def train(texts=(), *, out: str = "model.gguf", steps: int = 300, corpus: str = "shakespeare",
          n_embd: int = 128, n_head: int = 4, n_head_kv: int | None = None, n_layer: int = 4,
          n_ff: int = 352, n_ctx: int = 64, tie_embeddings: bool = False, n_expert: int = 0,
          n_expert_used: int = 2, tokenizer=None,
          samples_after_nl: bool = False, checkpoint: str | None = None,
          save_every: int = 100, log: str | None = None, on_nan: str = "stop",
          backend=None, reporter=None, **options) -> RunResult:
    """Train a llama from scratch on text files (default: the bundled corpus) and write it
    to `out`; `tokenizer` (default bytes) gives the vocabulary; with `n_expert` each
    feed-forward is that many experts of `n_ff`, `n_expert_used` a token (Mixtral's llama).
    A checkpoint is written to
    `checkpoint` every `save_every` steps and at the end when given, and, when the run stops
    early, there or next to `out`."""
    tokenizer = tokenizer or ByteTokenizer()
    cfg = ModelConfig(n_vocab=tokenizer.n_vocab, n_embd=n_embd, n_head=n_head,
                      n_head_kv=n_head_kv, tied_embeddings=tie_embeddings, n_layer=n_layer,
                      n_ff=n_ff, n_ctx=n_ctx, n_expert=n_expert,
                      n_expert_used=n_expert_used if n_expert else 0)
    options = TrainOptions(**{**TRAIN_DEFAULTS, **options})
    text, _ = inputs.training_text(texts, corpus)
    _, digest, samples = inputs.text_samples(text, tokenizer, cfg.n_ctx, options,
                                             samples_after_nl)
    trainer = Trainer(cfg, init_parameters(cfg, options.seed), get_backend(backend), options,
                      samples)
    return _run_scratch(trainer, tokenizer, digest, steps, out, checkpoint, save_every, log,
                        on_nan, reporter)


def _run_scratch(trainer, tokenizer, digest, steps, out, checkpoint, save_every, log, on_nan,
                 reporter) -> RunResult:
    files = checkpoints.RunFiles(trainer, tokenizer,
                                 checkpoint or inputs.default_checkpoint_path(out),
                                 {"tokens_digest": digest})
    result = run_steps(trainer, steps, log_path=log, save_every=save_every if checkpoint else 0,
                       save_checkpoint=files.save_checkpoint,
                       checkpoint_path=files.checkpoint_path, on_nan=on_nan,
                       write_result=lambda: files.write(out), result_path=out,
                       reporter=_reporter(reporter))
    return RunResult(trainer.step, result.first, result.last, result.seconds, str(out),
                     checkpoint)


def finetune(model, texts=(), *, data=None, out: str = "adapter.gguf", steps: int = 100,
             full: bool = False, lora_r: int = 4, lora_alpha: float = 4.0,
             lora_ranks: dict | None = None, lora_layers=None, n_ctx: int | None = None,
             corpus: str = "shakespeare", samples_after_nl: bool = False,
             chat_template: str | None = None, chat_template_kwargs: dict | None = None,
             mask_prompt: bool = False, every_answer: bool = False, drop_long: bool = False,
             pack: bool = True,
             val_split: float | None = None, val_every: int = 0, val_batches: int = 0,
             early_stop: int = 0, checkpoint: str | None = None, save_every: int = 100,
             log: str | None = None, on_nan: str = "stop", backend=None, reporter=None,
             **options) -> RunResult:
    """Finetune `model` (a Model or a path) on text files (default: the bundled corpus), or
    on `data` (a JSONL file, a directory of splits or a bundled set) rendered through the
    model's chat template (or `chat_template`, a Jinja source), given
    `chat_template_kwargs` (variables: {"enable_thinking": False}). Writes a LoRA adapter to
    `out` (pairs of rank lora_r, or per target `lora_ranks` as lora.TARGETS names them, on
    `lora_layers`), or with `full` every weight as a model. With a validation set (the data's
    valid split, or `val_split`) the validation loss is taken every `val_every` steps (and at
    the end) and the best weights kept in OUT's .best.gguf; `early_stop` evaluations without
    a lower loss end the run. objective="dpo", "ipo", "orpo", "cpo", "simpo" (with beta,
    label_smoothing, orpo_lambda, simpo_gamma, cpo_alpha) or "kto" (beta, desirable_weight,
    undesirable_weight) finetunes on preference pairs (KTO's labelled examples) in `data`
    instead (pairs.py's forms, packed as examples are unless `pack` is False), the reference
    model being `model` as it starts."""
    model = _model(model)
    options = TrainOptions(**{**FINETUNE_DEFAULTS, **options})
    values, adapter = _trained_weights(model, full), None
    if not full:
        ranks = lora.lora_ranks(model.cfg, lora_r, lora_ranks, lora_layers)
        adapter = lora.init_adapter(model.cfg, ranks, lora_alpha, options.seed)
    setup = dict(n_ctx=n_ctx or model.cfg.n_ctx, samples_after_nl=samples_after_nl)
    template = _template(model, chat_template, chat_template_kwargs) if data else None
    return _run_finetune(model, values, adapter, options, 0, None, None, setup, texts, data,
                         corpus, template, mask_prompt, drop_long, pack, val_split,
                         val_every, val_batches, early_stop, out, steps, checkpoint,
                         save_every, log, on_nan, backend, reporter, every_answer)


def _trained_weights(model: Model, full: bool) -> dict:
    """The model's values as a finetune trains them: with `full` every weight as f32
    (refused for a base in block types), else as stored."""
    if not full:
        return model.values
    blocks = {v.dtype for v in model.values.values() if isinstance(v, Quantized)} - {"f16"}
    if blocks:
        raise ValueError(f"a full finetune trains f32 weights, but {model.path or 'the model'} "
                         f"holds {', '.join(sorted(blocks))} ones: finetune it with LoRA, or "
                         f"start from an f32/f16 model")
    return {n: dequantize(v) if isinstance(v, Quantized) else v
            for n, v in model.values.items()}


def resume(checkpoint_in, model=None, texts=(), *, data=None, out: str | None = None,
           steps: int = 100, corpus: str = "shakespeare", chat_template: str | None = None,
           chat_template_kwargs: dict | None = None, mask_prompt: bool = False,
           every_answer: bool = False, drop_long: bool = False, pack: bool = True,
           val_split: float | None = None,
           val_every: int = 0, val_batches: int = 0, early_stop: int = 0,
           checkpoint: str | None = None, save_every: int = 100, log: str | None = None,
           on_nan: str = "stop", backend=None, reporter=None, **options) -> RunResult:
    """Go on with the run saved in `checkpoint_in` for `steps` more steps: a from-scratch
    run (no `model`), or a finetune of `model` (the base it started from), on the same text
    or data. The checkpoint fixes the model, the data order and the options; of `options`
    only those TrainOptions lets change on resume (lr, flash_attn, checkpointing, precision)
    may differ from its own. `out` defaults to what the run writes beside the checkpoint."""
    kind = gguf_file.read_metadata(checkpoint_in).get(gguf_file.K_TYPE)
    if model is None:
        cfg, values, tokenizer, opt_state, state = checkpoints.load_checkpoint(checkpoint_in)
        if state.is_finetune:
            raise ValueError(f"{checkpoint_in} is a finetune's checkpoint: pass the base model "
                             f"it finetunes")
        options = inputs.resumed_options(state.options, options, checkpoint_in)
        text, _ = inputs.training_text(texts, corpus)
        _, digest, samples = inputs.text_samples(text, tokenizer, cfg.n_ctx, options,
                                                 bool(state.samples_after_nl), state,
                                                 checkpoint_in)
        trainer = Trainer(cfg, values, get_backend(backend), options, samples, opt_state,
                          state.step, loss_scaler=state.loss_scaler)
        return _run_scratch(trainer, tokenizer, digest, steps, out or "model.gguf",
                            checkpoint or checkpoint_in, save_every, log, on_nan, reporter)
    model = _model(model)
    full = kind != "adapter"
    values, adapter = _trained_weights(model, full), None
    if full:
        _, values, _, opt_state, state = checkpoints.load_checkpoint(checkpoint_in)
    else:
        adapter, opt_state, state = lora.load_adapter_checkpoint(checkpoint_in, model.cfg)
    checkpoints.check_finetune_state(state, model.digest, "full" if full else "lora",
                                     checkpoint_in, model.path or "this model")
    options = inputs.resumed_options(state.options, options, checkpoint_in)
    setup = dict(n_ctx=state.n_ctx or model.cfg.n_ctx, samples_after_nl=state.samples_after_nl)
    template = _template(model, chat_template, chat_template_kwargs) if data else None
    return _run_finetune(model, values, adapter, options, state.step, opt_state, state, setup,
                         texts, data, corpus, template, mask_prompt, drop_long, pack,
                         val_split, val_every, val_batches, early_stop,
                         out or ("model.gguf" if full else "adapter.gguf"), steps,
                         checkpoint or checkpoint_in, save_every, log, on_nan, backend,
                         reporter, every_answer)


def _template(model: Model, chat_template: str | None, chat_template_kwargs: dict | None):
    """The ChatTemplate of `chat_template` (a Jinja source), else the model's own, else
    ChatML, with `chat_template_kwargs` (variables)."""
    from .chat import ChatTemplate
    return ChatTemplate.of(model.tokenizer, chat_template,
                           chat_template and "the chat_template argument", chat_template_kwargs)


def _run_finetune(model, values, adapter, options, step, opt_state, state, setup, texts, data,
                  corpus, template, mask_prompt, drop_long, pack, val_split, val_every,
                  val_batches, early_stop, out, steps, checkpoint, save_every, log, on_nan,
                  backend, reporter, every_answer) -> RunResult:
    cfg = _with_context(model.cfg, setup["n_ctx"])
    spec = FinetuneData(tuple(texts), corpus, data, template, mask_prompt, drop_long, pack,
                        val_split, bool(val_every or early_stop), setup["samples_after_nl"],
                        every_answer)
    run = prepare_finetune(model.cfg, cfg, model.tokenizer, model.digest, values, adapter,
                           options, spec, get_backend(backend),
                           checkpoint or inputs.default_checkpoint_path(out), step=step,
                           opt_state=opt_state, state=state, checkpoint_in=state and checkpoint)
    trainer, files, held = run.trainer, run.files, run.valid
    best = inputs.best_path(out) if held is not None else None
    validation = None
    if held is not None:
        validation = Validation(lambda: trainer.evaluation(held.in_order(val_batches or None)),
                                val_every or steps, early_stop, lambda: files.write(best))
    result = run_steps(trainer, steps, log_path=log, save_every=save_every if checkpoint else 0,
                       save_checkpoint=files.save_checkpoint,
                       checkpoint_path=files.checkpoint_path, on_nan=on_nan,
                       validation=validation, write_result=lambda: files.write(out),
                       result_path=out, reporter=_reporter(reporter))
    return RunResult(trainer.step, result.first, result.last, result.seconds, str(out),
                     checkpoint, validation and validation.best, best)


def evaluate(model, texts=(), *, corpus: str = "shakespeare", windows: int | None = None,
             batch: int = 4, precision: str = "auto", backend=None) -> Evaluation:
    """The loss and perplexity of `model` (with its adapters) on text files (default: the
    bundled corpus): next-token cross-entropy over non-overlapping windows of the model's
    n_ctx tokens, each starting after BOS as in training; the first `windows` of them, or
    every one the text holds."""
    model = _model(model)
    text, _ = inputs.training_text(texts, corpus)
    samples = Samples(model.tokenizer.encode(text), model.cfg.n_ctx, 1, 0,
                      model.tokenizer.bos_id)
    starts = evaluation.window_starts(samples, first=windows)
    batch = max(1, min(batch, len(starts)))
    loss, counted = evaluation.mean_loss(get_backend(backend), model.cfg, model.values,
                                         evaluation.window_batches(samples, starts, batch),
                                         batch, model.adapters, precision)
    return Evaluation(loss, evaluation.perplexity_of(loss), counted, len(starts))


def generate(model, prompt, max_tokens: int = 128, *, temperature: float = 0.8,
             top_k: int = 40, top_p: float = 0.95, min_p: float = 0.05,
             repeat_penalty: float = 1.0, seed: int = 0, precision: str = "auto",
             tools=None, chat_template: str | None = None,
             chat_template_kwargs: dict | None = None, backend=None) -> str:
    """The text `model` (with its adapters) writes after `prompt`: up to max_tokens tokens,
    ending early at an end-of-generation token; temperature 0 is greedy.

    `prompt` a list of messages ([{"role", "content"}, ...], as chat data's, the last a
    user's or a tool's): the answer to that conversation, rendered through the model's chat
    template (or `chat_template`, a Jinja source; `chat_template_kwargs` its variables) with
    `tools` (function schemas) where given, as `ggwgpu chat` answers."""
    from .chat import check_messages, check_tools, renderable
    model = _model(model)
    if isinstance(prompt, str):
        if tools is not None or chat_template is not None or chat_template_kwargs:
            raise ValueError("tools and chat_template(_kwargs) go with a conversation: give "
                             "the prompt as a list of messages")
    elif not isinstance(prompt, list) or not prompt:
        raise ValueError("prompt must be a string or a non-empty list of messages")
    else:
        check_messages(prompt)
        if prompt[-1]["role"] not in ("user", "tool"):
            raise ValueError(f"a conversation to answer ends with a user's or a tool's "
                             f"message; this one ends with the {prompt[-1]['role']}'s")
        if tools is not None:
            check_tools(tools)
    backend = get_backend(backend)
    decoder = Decoder(backend, model.cfg, model.values, adapters=model.adapters,
                      precision=precision)
    if isinstance(prompt, str):
        return generate_text(backend, model.cfg, model.values, model.tokenizer, prompt,
                             max_tokens, temperature, top_k, top_p, repeat_penalty, seed=seed,
                             decoder=decoder, min_p=min_p)
    template = _template(model, chat_template, chat_template_kwargs)
    sampling = Sampling(temperature, top_k, top_p, repeat_penalty, min_p=min_p)
    session = ChatSession(decoder, model.tokenizer, template, None, sampling, seed, tools)
    session.messages = renderable(prompt[:-1])
    return model.tokenizer.decode(list(session.reply(prompt[-1]["content"], max_tokens,
                                                     prompt[-1]["role"])))


def merge(model, adapters=None, dtype: str = "auto") -> Model:
    """`model` with LoRA adapters (paths or lora.Adapters; default: the model's own) added
    into its weights, as llama.cpp applies them: a model without adapters, its weights
    stored as `dtype` says (lora.MERGE_TYPES: "auto", as llama.cpp's llama-export-lora, the
    changed weights f16 where the base is not f32 and the rest as stored; "f32"; or a block
    type, "q8_0", as `ggwgpu quantize` writes)."""
    model = _model(model)
    adapters = model.adapters if adapters is None else [
        a if isinstance(a, lora.Adapter) else lora.load_adapter(a, model.cfg) for a in adapters]
    cfg, values = lora.merge(model.cfg, model.values, adapters, dtype)
    return Model(cfg, values, model.tokenizer)


__all__ = ["Evaluation", "Model", "RunResult", "evaluate", "finetune", "generate", "load",
           "merge", "resume", "train"]
