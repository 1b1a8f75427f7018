"""Products timed on the device: which kernel, and how many chunks of K, each product runs.

No one tile fits every product on every card: a 64 x 64 tile leaves most of a large GPU idle
on the 576-wide products of a small model (72 workgroups), where cutting K into chunks
(ops/matmul.py split_k) or a smaller tile may win, and a larger tile on a large product, by
how much depending on the card. So where a product family's variant is a TunedMatmul
(kernels.py: hardware adapters, or $GGWGPU_TUNE=1), a plan meeting a product with more than
one choice (ops/matmul.py product_choices) first times each choice on a product of the same
key (shapes, element types, layouts) alone in a plan, on zeros, and keeps the fastest;
products of that key in every later plan run it. The 135M LoRA step has 29 keys, 174
choices in all: a second or two on a GPU.

The choices are kept in a file per adapter, driver and kernel source (choices_file, under
$GGWGPU_CACHE_DIR, else $XDG_CACHE_HOME/ggwgpu or ~/.cache/ggwgpu), read when a backend is
made: later processes on the machine run the same kernels without timing them again, so a
run resumed from a checkpoint computes as the run before it did (a cut of K changes the
order of a product's sums, so its rounding). Delete the file to time them anew.
"""
from __future__ import annotations

import hashlib
import json
import os
import tempfile
import time
import warnings
from pathlib import Path

import numpy as np
import wgpu

from .. import ops as O
from ..kernels import TunedMatmul
from ..ops.matmul import product_choices, product_key, product_of, transposed
from ..quant import Quantized, storage_bytes
from ..tensor import Tensor, constant, input_tensor
from .base import DeviceLimitError

# the products whose kernel may be timed, by the shader family their variant is chosen in
PRODUCT_FAMILIES = {"mul_mat": "matmul", "mul_mat_acc": "matmul", "out_prod": "matmul",
                    "mul_mat_q": "quant", "mul_mat_q_back": "quant"}
TIMED_RUNS = 3      # each choice's time: the least of these runs, after one to warm up
# A product whose operands and result take more bytes is not timed (it runs as kernels.py's
# rules say): its timing would hold a second copy of a large weight beside the model's, on
# a card the model may just fit. The 135M model's output head takes 214 MiB in f32.
TIMED_BYTES = 256 * 2**20


def tune_products(backend, nodes, plan_type):
    """Time the choices of every product among `nodes` whose key its family's TunedMatmul
    has not chosen for yet, and record the fastest (plan_type: the backend's Plan class);
    then keep them all in the backend's choices file, if it has one."""
    timed = False
    for node in nodes:
        tuned = backend.kernel_variants.get(PRODUCT_FAMILIES.get(node.op))
        if not isinstance(tuned, TunedMatmul) or backend.tuning_failed:
            continue
        product = product_of(node)
        key, choices = product_key(product), product_choices(product, tuned)
        if key in tuned.chosen or len(choices) < 2 or sum(
                t.storage_len * t.storage_dtype.itemsize
                for t in (product.a, product.b, product.dst)) > TIMED_BYTES:
            continue
        seconds = {}
        for choice in choices:
            try:
                seconds[choice] = choice_seconds(backend, node, choice, plan_type)
            except (DeviceLimitError, wgpu.GPUError):
                continue    # past the adapter's limits (a split's sums), or refused by it
            except Exception as e:  # timing is an optimization: it must not stop a run
                backend.tuning_failed = True
                warnings.warn(f"timing products on the device failed ({type(e).__name__}: "
                              f"{e}); they run as ggwgpu/kernels.py's rules say")
                return
        if seconds:
            tuned.seconds[key] = seconds
            tuned.chosen[key] = min(seconds, key=seconds.get)
            timed = True
    if timed and backend.tuning_file:
        save_choices(backend.kernel_variants, backend.tuning_file)


def operand_like(t: Tensor, k_outermost: bool) -> Tensor:
    """A view of a fresh leaf with t's shape and element type, read along K, or stored
    K-outermost with rows padded to 4 elements (as a backward's transposed weights are)."""
    if not k_outermost:
        return input_tensor(t.shape, t.dtype, name="timed operand")
    rows, k = t.shape[-2:]
    stored = t.shape[:-2] + (k, rows)
    leaf = input_tensor(stored[:-1] + (-(-rows // 4) * 4,), t.dtype, name="timed operand")
    return O.transpose(O.view(leaf, stored, leaf.strides, 0))


def frozen_like(t: Tensor) -> Tensor:
    """A frozen weight of t's shape and block type, its blocks zeros."""
    blocks = np.zeros(storage_bytes(t.dtype, t.nelements), np.uint8)
    return constant(Quantized(t.dtype, t.shape, blocks), name="timed weight")


def timed_product(node) -> Tensor:
    """A product of fresh operands (a frozen weight's of zero blocks) with node's key
    (product_key): what choice_seconds times for it."""
    timed = product_of(node)
    key = product_key(timed)
    b = operand_like(timed.b, key[-1] & 2)
    if node.op == "mul_mat_q_back":     # product_of reads the weight transposed
        product = O.mul_mat_q_back(frozen_like(transposed(timed.a)), b)
    elif node.op == "mul_mat_q":
        product = O.mul_mat_q(frozen_like(timed.a), b)
    else:
        product = O.mul_mat(operand_like(timed.a, key[-1] & 1), b)
    if product_key(product_of(product)) != key:
        raise AssertionError(f"timed a product of key {product_key(product_of(product))}, "
                             f"not {key}")
    return product


def choice_seconds(backend, node, choice, plan_type) -> float:
    """Device seconds of `node`'s product run as `choice` (variant, chunks), alone in a plan
    (timed_product): the least of TIMED_RUNS runs (timestamp queries where the adapter has
    them, else each run waited for)."""
    product = timed_product(node)
    family = PRODUCT_FAMILIES[node.op]
    forced = TunedMatmul(backend.kernel_variants[family])
    forced.chosen[product_key(product_of(product))] = choice
    plan = plan_type(backend, [product], variants={**backend.kernel_variants, family: forced})
    plan.run()
    times = []
    for _ in range(TIMED_RUNS):
        start = time.perf_counter()
        seconds = plan.device_seconds()
        if seconds is None:
            plan.sync()
            seconds = time.perf_counter() - start
        times.append(seconds)
    return min(times)


def choice_name(choice) -> str:
    variant, chunks = choice
    return variant if chunks == 1 else f"{variant} in {chunks} chunks"


def timings(backend, key) -> dict | None:
    """The choice kept for product `key` and every choice's device milliseconds; None where
    the backend timed no product of that key."""
    for tuned in tuned_families(backend):
        if key in tuned.seconds:
            return {"chosen": choice_name(tuned.chosen[key]),
                    "ms": {choice_name(c): s * 1e3 for c, s in tuned.seconds[key].items()}}
    return None


def tuned_families(backend) -> list[TunedMatmul]:
    """The backend's product families whose kernels are timed."""
    variants = getattr(backend, "kernel_variants", None) or {}
    return [v for v in variants.values() if isinstance(v, TunedMatmul)]


def tuning_report(backend, nodes=None) -> list[dict]:
    """Each product key the backend timed (or read from its choices file), of the products
    among `nodes` if given: operand shapes, element types, layouts (p.u.y) and its timings
    (bench's JSON reports)."""
    keys = None if nodes is None else {product_key(product_of(n)) for n in nodes
                                       if n.op in PRODUCT_FAMILIES}
    return [{"a": list(a), "b": list(b), "dtypes": [ta, tb], "layouts": layouts,
             **timings(backend, key)}
            for tuned in tuned_families(backend)
            for key in tuned.seconds if keys is None or key in keys
            for a, b, ta, tb, layouts in [key]]


def summary(report: list[dict]) -> str:
    """One line: how many products were timed and the choices kept, by how often."""
    kept = {}
    for r in report:
        kept[r["chosen"]] = kept.get(r["chosen"], 0) + 1
    return (f"{len(report)} products timed on the device, kept: "
            + ", ".join(f"{name} {n}" for name, n in sorted(kept.items(), key=lambda x: -x[1])))


# -- the choices kept between processes -------------------------------------------------------

CACHE_ENV = "GGWGPU_CACHE_DIR"
FORMAT = 1          # of the choices file; another number is a file to ignore
# the shader modules whose kernels the choices run: a change to one times them anew
TIMED_MODULES = ("matmul", "quant_tiled")


def choices_file(info: dict) -> Path:
    """Where the choices of an adapter (its `info`) are kept: one file per adapter, driver,
    ggwgpu version and source of the product kernels."""
    from .. import __version__
    from ..wgsl import shader_source
    ident = [__version__, FORMAT] + [str(info.get(k)) for k in (
        "vendor", "vendor_id", "device", "device_id", "description", "backend_type")]
    digest = hashlib.sha256(json.dumps(ident).encode())
    for stem in TIMED_MODULES:
        digest.update(shader_source(stem).encode())
    base = os.environ.get(CACHE_ENV) or Path(
        os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "ggwgpu"
    return Path(base) / f"products-{digest.hexdigest()[:20]}.json"


def save_choices(variants: dict, path: Path) -> None:
    """Write the TunedMatmul choices and times of `variants` to `path` (a temporary file
    renamed into place); a file that cannot be written is left as it is (the choices stay
    this process's)."""
    families = {family: [{"key": [list(a), list(b), ta, tb, layouts],
                          "chosen": list(tuned.chosen[key]),
                          "seconds": [[list(c), s] for c, s in tuned.seconds[key].items()]}
                         for key in tuned.seconds for a, b, ta, tb, layouts in [key]]
                for family, tuned in variants.items() if isinstance(tuned, TunedMatmul)}
    temporary = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=path.parent, suffix=".tmp",
                                         delete=False) as f:
            temporary = f.name
            json.dump({"format": FORMAT, "families": families}, f)
        os.replace(temporary, path)
    except OSError:
        if temporary:
            Path(temporary).unlink(missing_ok=True)


def load_choices(variants: dict, path: Path) -> int:
    """Read the choices kept at `path` into the TunedMatmul families of `variants`; returns
    how many. A missing, unreadable or malformed file gives none (they are timed again)."""
    from ..kernels import MATMUL_KERNELS, QUANT_KERNELS
    loaded = []
    try:
        kept = json.loads(path.read_text())
        if kept["format"] != FORMAT:
            return 0
        for family, rows in kept["families"].items():
            for entry in rows if isinstance(variants.get(family), TunedMatmul) else ():
                a, b, ta, tb, layouts = entry["key"]
                seconds = {(str(c[0]), int(c[1])): float(s) for c, s in entry["seconds"]}
                chosen = (str(entry["chosen"][0]), int(entry["chosen"][1]))
                if chosen not in seconds or chosen[0] not in {**MATMUL_KERNELS, **QUANT_KERNELS}:
                    return 0
                loaded.append((variants[family], (tuple(a), tuple(b), ta, tb, layouts),
                               chosen, seconds))
    except (OSError, ValueError, KeyError, TypeError, IndexError, AttributeError):
        return 0
    for tuned, key, chosen, seconds in loaded:
        tuned.chosen[key], tuned.seconds[key] = chosen, seconds
    return len(loaded)


__all__ = ["PRODUCT_FAMILIES", "choice_name", "choices_file", "load_choices", "save_choices",
           "summary", "timed_product", "timings", "tune_products", "tuning_report"]
