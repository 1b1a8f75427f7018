"""Shader composition (named includes, generated kernels) and the kernel variants' one table."""
import re
from types import SimpleNamespace

import numpy as np
import pytest

from ggwgpu import kernels, testing
from ggwgpu.ops import OPS
from ggwgpu.wgsl import GENERATED, ShaderError, kernel_name, shader_dir, shader_source


def write(folder, **files):
    for name, text in files.items():
        (folder / f"{name}.wgsl").write_text(text)


def test_includes_are_resolved_once_each_in_first_include_order(tmp_path, monkeypatch):
    monkeypatch.setitem(GENERATED, "made", lambda: "fn made() {}\n")
    write(tmp_path, top="// #include mid\n// #include base\nfn top() {}\n// #include made\n",
          mid="// #include base\nfn mid() {}\n", base="fn base() {}\n")
    assert shader_source("top", tmp_path) == \
        "fn base() {}\nfn mid() {}\nfn top() {}\nfn made() {}\n"


def test_a_missing_include_is_refused_naming_file_and_line(tmp_path):
    write(tmp_path, top="fn top() {}\n// #include base\n", base="// #include nowhere\n")
    with pytest.raises(ShaderError, match=r"base\.wgsl line 1: includes 'nowhere', but there "
                                          r"is no nowhere\.wgsl"):
        shader_source("top", tmp_path)


def test_an_include_cycle_is_refused_naming_file_and_line(tmp_path):
    write(tmp_path, a="// #include b\n", b="\n\n// #include c\n", c="// #include a\n")
    with pytest.raises(ShaderError, match=r"c\.wgsl line 1: include cycle a -> b -> c -> a"):
        shader_source("a", tmp_path)
    write(tmp_path, d="fn d() {}\n// #include d\n")
    with pytest.raises(ShaderError, match=r"d\.wgsl line 2: include cycle d -> d"):
        shader_source("d", tmp_path)


def defined_functions(text: str) -> list[str]:
    return re.findall(r"^\s*fn\s+(\w+)\s*\(", re.sub(r"//[^\n]*", "", text), re.M)


def test_no_two_shader_parts_define_the_same_function():
    """Shared code lives in one include, not in copies: every function of every shader file
    and generated part is defined once across all of them, but for the row ops' variant
    preludes (row_workgroup.wgsl, row_rowwise.wgsl), which define one set of functions each:
    a row family is compiled with one of them; and for the two functions through which the
    tiled products' bodies (tiles.wgsl) read their operands, defined by each includer."""
    parts = {f"{f.name}": f.read_text() for f in sorted(shader_dir().glob("*.wgsl"))}
    parts.update({f"generated {name}": make() for name, make in GENERATED.items()})
    where = {}
    for part, text in parts.items():
        for fn in defined_functions(text):
            where.setdefault(fn, []).append(part)
    preludes = sorted(f"row_{variant}.wgsl" for variant in kernels.ROW_VARIANTS)
    tiled = ["matmul.wgsl", "quant_tiled.wgsl"]
    assert {fn: at for fn, at in where.items() if len(at) > 1 and at != preludes} == {
        "load_operand4": tiled, "operand_bases": tiled}
    assert {fn for fn, at in where.items() if at == preludes} == \
        {"row_index", "row_lane", "row_sum", "row_sum4", "row_ms"}
    assert len(where) > 100   # the parse found the shaders' functions


def test_each_row_op_is_one_pass_over_a_row_compiled_once_per_variant():
    """A row op's math is its <entry>_row function, written once in its family's file; each
    variant's module has the op's entry point and calls it."""
    for family in kernels.ROW_FAMILIES:
        math = (shader_dir() / f"{family}.wgsl").read_text()
        entries = {op.entry for op in OPS.values() if op.shader == family and op.variants}
        assert entries and all(op.variants == kernels.ROW_VARIANTS
                               for op in OPS.values() if op.entry in entries)
        for entry in entries:
            assert len(re.findall(rf"^fn {entry}_row\(w: Row\)", math, re.M)) == 1
        for variant in kernels.ROW_VARIANTS:
            source = shader_source(kernels.row_module(family, variant))
            for entry in entries:
                name = kernel_name(kernels.row_entry(entry, variant))
                body = re.search(rf"\bfn {name}\(.*?\n}}", source, re.S)
                assert body and f"{entry}_row(" in body[0], (variant, entry)


def compiled_modules() -> list[str]:
    """Every shader module a dispatch can name: each file but the row families, which are
    compiled once per variant instead."""
    files = [f.stem for f in sorted(shader_dir().glob("*.wgsl"))
             if f.stem not in kernels.ROW_FAMILIES]
    return files + [kernels.row_module(family, variant) for family in kernels.ROW_FAMILIES
                    for variant in kernels.ROW_VARIANTS]


def test_the_elementwise_kernels_come_from_one_table_and_one_template():
    source = shader_source("elementwise")
    family = {name for name, op in OPS.items() if op.shader == "elementwise"}
    from ggwgpu.ops.elementwise import WGSL
    assert set(WGSL) == family
    for name in family:
        assert len(re.findall(rf"\bfn {kernel_name(OPS[name].entry)}\(", source)) == 1
    assert not re.search(r"^// #include", source, re.M)   # every include resolved


@pytest.mark.parametrize("dtype", ["f32", "f16"])
def test_every_shader_compiles_and_every_kernel_makes_a_pipeline(wgpu, dtype):
    """With every common binding of either element type (kernel variants and entry points
    that no op-matrix case reaches included)."""
    for stem in compiled_modules():
        source = shader_source(stem)
        parts = {"part_words": 1024} if "override SRC0_PART_WORDS" in source else {}
        for entry in re.findall(r"\bfn k_(\w+)\(", source):
            assert wgpu.pipeline(stem, entry, dtypes=(dtype,) * 5, **parts) is not None


# -- kernel variants: one table (ggwgpu/kernels.py), every variant run on lavapipe -------------

FAMILIES = {"matmul": tuple(kernels.MATMUL_KERNELS), "quant": tuple(kernels.QUANT_KERNELS),
            "norm": kernels.ROW_VARIANTS, "softmax": kernels.ROW_VARIANTS}


def test_the_ops_variants_are_the_tables_of_ggwgpu_kernels():
    gpu = SimpleNamespace(info={"adapter_type": "DiscreteGPU", "vendor": "nvidia"})
    chosen = kernels.choose_variants(gpu, SimpleNamespace(features=set()))
    assert set(chosen) == set(FAMILIES)
    for name, op in OPS.items():
        if op.variants:
            assert op.variants == FAMILIES[op.shader], name
            assert chosen[op.shader] in op.variants


SWITCHED = {"matmul": "mul_mat", "quant": "mul_mat_q", "norm": "rms_norm_mul",
            "softmax": "soft_max"}   # one op per family


def entries_on(name, case, variants):
    _, _, node = testing.build_case(OPS[name], case, np.random.default_rng(0))
    return [d.entry for d in OPS[name].dispatches_on(node, variants)]


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_the_variant_switch_runs_each_variant(wgpu, monkeypatch, family):
    """Forcing a family's variant changes the kernels the backend's plan dispatches, and
    each variant matches the reference."""
    name = SWITCHED[family]
    case = next(c for c in testing.cases_of(name)   # the first case the variants split
                if len({tuple(entries_on(name, c, {family: v})) for v in FAMILIES[family]}) > 1)
    seen = set()
    for variant in FAMILIES[family]:
        monkeypatch.setitem(wgpu.kernel_variants, family, variant)
        _, _, node = testing.build_case(OPS[name], case, np.random.default_rng(0))
        seen.add(tuple(d.entry for _, d in wgpu.plan([node]).dispatches))
        result = testing.forward(OPS[name], case, wgpu)
        assert result.ok, (variant, result.detail)
    assert len(seen) == len(FAMILIES[family]), seen
