"""Products timed on the device: which kernel, and how many chunks of K, each product runs.

No one tile fits every product on every card: a 64 x 64 tile leaves most of a large GPU idle
on the 576-wide products of a small model (72 workgroups), where cutting K into chunks
(ops/matmul.py split_k) or a larger tile for a large product may win, and by how much
depends on the card. So where the backend's matmul variant is a TunedMatmul (kernels.py:
hardware adapters, or $GGWGPU_TUNE=1), a plan meeting a product with more than one choice
(ops/matmul.py product_choices) first times each choice on a product of the same key
(shapes, element types, layouts) alone in a plan, on zeros, and keeps the fastest; products
of that key in every later plan of the backend run it. The 135M LoRA step has about twenty
keys of two to five choices each: well under a second on a GPU, once per process.
"""
from __future__ import annotations

import time

from .. import ops as O
from ..kernels import TunedMatmul
from ..ops.matmul import product_choices, product_key, product_of
from ..tensor import Tensor, input_tensor

PRODUCT_OPS = ("mul_mat", "mul_mat_acc", "out_prod")
TIMED_RUNS = 3      # each choice's time: the least of these runs, after one to warm up


def tune_products(backend, nodes, plan_type):
    """Time the choices of every product among `nodes` whose key the backend's TunedMatmul
    has not chosen for yet, and record the fastest (plan_type: the backend's Plan class)."""
    tuned = backend.kernel_variants["matmul"]
    for node in nodes:
        if node.op not in PRODUCT_OPS:
            continue
        product = product_of(node)
        key, choices = product_key(product), product_choices(product, tuned)
        if key in tuned.chosen or len(choices) < 2:
            continue
        seconds = {choice: choice_seconds(backend, node, choice, plan_type)
                   for choice in choices}
        tuned.seconds[key] = seconds
        tuned.chosen[key] = min(seconds, key=seconds.get)


def operand_like(t: Tensor, k_outermost: bool) -> Tensor:
    """A view of a fresh leaf with t's shape and element type, read along K, or stored
    K-outermost with rows padded to 4 elements (as a backward's transposed weights are)."""
    if not k_outermost:
        return input_tensor(t.shape, t.dtype, name="timed operand")
    rows, k = t.shape[-2:]
    stored = t.shape[:-2] + (k, rows)
    leaf = input_tensor(stored[:-1] + (-(-rows // 4) * 4,), t.dtype, name="timed operand")
    return O.transpose(O.view(leaf, stored, leaf.strides, 0))


def timed_product(node) -> Tensor:
    """A mul_mat of fresh operands whose product has node's key (product_key): what
    choice_seconds times for it."""
    timed = product_of(node)
    key = product_key(timed)
    a, b = (operand_like(t, key[-1] & bit) for t, bit in ((timed.a, 1), (timed.b, 2)))
    product = O.mul_mat(a, b)
    if product_key(product_of(product)) != key:
        raise AssertionError(f"timed a product of key {product_key(product_of(product))}, "
                             f"not {key}")
    return product


def choice_seconds(backend, node, choice, plan_type) -> float:
    """Device seconds of `node`'s product run as `choice` (variant, chunks), alone in a plan
    (timed_product): the least of TIMED_RUNS runs (timestamp queries where the adapter has
    them, else each run waited for)."""
    product = timed_product(node)
    forced = TunedMatmul(backend.kernel_variants["matmul"])
    forced.chosen[product_key(product_of(product))] = choice
    plan = plan_type(backend, [product], variants={**backend.kernel_variants, "matmul": forced})
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
    tuned = (getattr(backend, "kernel_variants", None) or {}).get("matmul")
    seconds = getattr(tuned, "seconds", {}).get(key)
    return seconds and {"chosen": choice_name(tuned.chosen[key]),
                        "ms": {choice_name(c): s * 1e3 for c, s in seconds.items()}}


def tuning_report(backend) -> list[dict]:
    """Each product key the backend timed: operand shapes, element types, layouts (p.u.y)
    and its timings (bench's JSON reports)."""
    tuned = (getattr(backend, "kernel_variants", None) or {}).get("matmul")
    return [{"a": list(a), "b": list(b), "dtypes": [ta, tb], "layouts": layouts,
             **timings(backend, key)}
            for key in getattr(tuned, "seconds", {}) for a, b, ta, tb, layouts in [key]]


def summary(report: list[dict]) -> str:
    """One line: how many products were timed and the choices kept, by how often."""
    kept = {}
    for r in report:
        kept[r["chosen"]] = kept.get(r["chosen"], 0) + 1
    return (f"{len(report)} products timed on the device, kept: "
            + ", ".join(f"{name} {n}" for name, n in sorted(kept.items(), key=lambda x: -x[1])))


__all__ = ["PRODUCT_OPS", "choice_name", "summary", "timed_product", "timings",
           "tune_products", "tuning_report"]
