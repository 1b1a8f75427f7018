"""`ggwgpu ops test|grad`: the op matrix of the test suite, forward results against the
NumPy references and gradients against finite differences, as ggml's test-backend-ops;
`ggwgpu ops list [--markdown]`: the registry's ops (docs/ops.md is its markdown).
Registered on the `ggwgpu` group by main.py.

Only absolute imports of `ggwgpu` here (see main.py).
"""
from __future__ import annotations

import time

import click
import numpy as np

import ggwgpu
from ggwgpu import testing

from .common import describe_backend, select_backend

def op_names(ctx, param, values) -> list[str]:
    names = []
    for value in values:
        name = value.lower()
        if name not in ggwgpu.OPS:
            raise click.BadParameter(f"unknown op {value!r}; valid ops: "
                                     f"{', '.join(sorted(ggwgpu.OPS))}")
        names.append(name)
    return names or list(ggwgpu.OPS)


op_option = click.option("--op", "names", multiple=True, callback=op_names, metavar="NAME",
                          help="Only this op (repeatable; RMS_NORM style accepted). "
                               "Default: every registered op.")


def run_cases(title: str, work) -> None:
    """Run `work` [(opdef, case, check)], print one line per case and a summary; exit 1 on
    any failure. A case that raises is a failure, not the end of the run."""
    descs = [testing.describe(case) for _, case, _ in work]
    op_w = max([len(opdef.name) for opdef, _, _ in work] + [2])
    case_w = min(36, max([len(d) for d in descs] + [4]))
    passed = failed = 0
    t0 = time.perf_counter()
    for (opdef, case, check), desc in zip(work, descs):
        try:
            result = check(opdef, case)
        except Exception as e:  # a broken kernel must not hide the other cases' results
            result = testing.Result(opdef.name, desc, False, f"{type(e).__name__}: {e}")
        passed, failed = passed + result.ok, failed + (not result.ok)
        status = "OK" if result.ok else click.style("FAIL", fg="red")
        click.echo(f"{result.op:<{op_w}}  {result.case:<{case_w}}  {status:<4}  {result.detail}")
    click.echo(f"{title}: {passed} passed, {failed} failed "
               f"({time.perf_counter() - t0:.1f} s)")
    if failed:
        raise SystemExit(1)


@click.group()
def ops():
    """Check ops against their NumPy references, or list them.

    The op matrix of the test suite, as ggml's test-backend-ops: `ops test` for forward
    results, `ops grad` for gradients, optionally only for some ops (--op NAME); `ops list`
    says what each op computes and which ops its backward builds.
    """


@ops.command("test")
@op_option
@click.pass_context
def ops_test(ctx, names):
    """Forward results of every case against the NumPy reference.

    Each case runs on the backend and is compared with the float64 NumPy reference: NaN and
    infinity placement, then normalized MSE; sentinels around every buffer catch stray writes.
    """
    backend = select_backend(ctx)
    work = [(ggwgpu.OPS[name], case, lambda o, c: testing.forward(o, c, backend))
            for name in names for case in testing.cases_of(name)]
    title = f"ops test on {describe_backend(backend)}"
    if backend.name != "wgpu":
        title += ": float32 references against float64 ones, no shader ran"
    run_cases(title, work)


def grad_check(backend):
    def check(opdef, case):
        fd = testing.finite_differences(opdef, case)
        if backend.name == "numpy":
            return fd
        dev = testing.backward_on(opdef, case, backend)
        return testing.Result(opdef.name, fd.case, fd.ok and dev.ok,
                              f"fd: {fd.detail}; {backend.name}: {dev.detail}")
    return check


@ops.command("grad")
@op_option
@click.pass_context
def ops_grad(ctx, names):
    """Backward of every gradient case against finite differences.

    The backward graph in float64 against central finite differences of the NumPy forward
    and, on a device backend, the device backward against the NumPy backward.
    """
    backend = select_backend(ctx)
    check = grad_check(backend)
    work = [(ggwgpu.OPS[name], case, check)
            for name in names for case in testing.cases_of(name, grad_only=True)]
    if backend.name == "numpy":
        title = "ops grad: finite differences only (numpy backend, no device backward)"
    else:
        title = f"ops grad: finite differences and backward on {describe_backend(backend)}"
    run_cases(title, work)


def describe_backward(name: str) -> str:
    """The ops the backward rule of op `name` builds over its gradient cases (the first case
    when it has none), or what it does without any."""
    from ggwgpu.graph import topo_order
    from ggwgpu.tensor import input_tensor
    opdef = ggwgpu.OPS[name]
    if opdef.backward is None:
        return "none: an optimizer update, never differentiated"
    built, gives = set(), False
    for case in testing.cases_of(name, grad_only=True) or testing.cases_of(name)[:1]:
        _, _, node = testing.build_case(opdef, case, np.random.default_rng(0))
        grad = input_tensor(node.shape, node.dtype)
        src_grads = [g for g in opdef.backward(node, grad) if g is not None]
        forward = {id(t) for t in topo_order([node])} | {id(grad)}
        built |= {t.op for t in topo_order(src_grads) if t.op and id(t) not in forward}
        gives = gives or bool(src_grads)
    if built:
        return ", ".join(sorted(built))
    return "the output's gradient, as it is" if gives else "none: the gradient is zero"


def ops_markdown() -> str:
    """docs/ops.md: every registered op, what it computes (its doc), its sources and
    parameters, dtypes, kernel variants and the ops its backward builds."""
    lines = ["# Ops", "",
             "Every op of the registry (`ggwgpu.OPS`), generated by `ggwgpu ops list "
             "--markdown > docs/ops.md`;",
             "tests/test_docs.py fails when this file differs from what the registry gives.",
             "Sources are tensors and parameters Python values (`ggwgpu.<op>(*sources, "
             "*params)`). f16: the",
             "kernel reads f16 sources (else f32 only). Variants: kernel variants the backend "
             "picks per adapter.",
             "Backward: the ops the op's backward rule builds (`ggwgpu ops grad --op NAME` "
             "checks it).", "",
             "| op | computes | sources; params | f16 | variants | backward |",
             "|---|---|---|---|---|---|"]
    for name in sorted(ggwgpu.OPS):
        opdef = ggwgpu.OPS[name]
        doc = " ".join(opdef.doc.split())
        if opdef.frozen_variant:
            doc += f" A frozen block-type weight as source 0 builds {opdef.frozen_variant}."
        args = ", ".join(opdef.src_names) + (f"; {', '.join(opdef.param_names)}"
                                             if opdef.param_names else "")
        cells = [f"`{name}`", doc, args, "yes" if opdef.f16 else "no",
                 ", ".join(opdef.variants) or "-", describe_backward(name)]
        lines.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    return "\n".join(lines) + "\n"


@ops.command("list")
@click.option("--markdown", is_flag=True, help="As docs/ops.md: a markdown table.")
def ops_list(markdown):
    """Every registered op: what it computes and which ops its backward builds."""
    if markdown:
        click.echo(ops_markdown(), nl=False)
        return
    width = max(map(len, ggwgpu.OPS))
    for name in sorted(ggwgpu.OPS):
        click.echo(f"{name:<{width}}  {' '.join(ggwgpu.OPS[name].doc.split())}  "
                   f"[backward: {describe_backward(name)}]")
