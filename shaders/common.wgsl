// Included first by every shader family (`// #include common`, resolved by
// ggwgpu/wgsl.py's shader_source): the parameter block, the bindings, index helpers.
// Sizes (ne) and strides (nb) are in ggml order (x = innermost dim) and counted in elements;
// off holds the element offsets of dst, src0, src1, src2 in their buffers, off3.x src3's.
// This struct is the layout's one description: the backend reads it (wgsl.py's
// params_layout) to place each value, so fields may move but keep their names and types.
struct Params {
    n: u32, _pad0: u32, _pad1: u32, _pad2: u32,   // invocations (or rows) that do work
    off: vec4u,
    off3: vec4u,
    ne_d: vec4u, nb_d: vec4u,
    ne_0: vec4u, nb_0: vec4u,
    ne_1: vec4u, nb_1: vec4u,
    ne_2: vec4u, nb_2: vec4u,
    ne_3: vec4u, nb_3: vec4u,
    f: vec4f,                                     // op parameters
    u: vec4u,
}

@group(0) @binding(0) var<uniform> p: Params;
// Every binding is read_write: a buffer bound twice in one dispatch is then no validation
// error, and in-place ops need no special case.
// Element types: TD, T0 .. T3 are f32 or f16, aliases the backend declares before this file
// from the dispatch's tensors (wgsl.py's dtype_prelude). Kernels compute in f32: every
// load is f32(src0[i]) (vec4f(..) for the vec4 views), every store dst[i] = to_TD(v)
// (to_TD4 for a vec4; to_T0 .. for the sources an update writes), from the same prelude.
@group(0) @binding(1) var<storage, read_write> dst: array<TD>;
@group(0) @binding(2) var<storage, read_write> src0: array<T0>;
@group(0) @binding(3) var<storage, read_write> src1: array<T1>;
@group(0) @binding(4) var<storage, read_write> src2: array<T2>;
@group(0) @binding(5) var<storage, read_write> src3: array<T3>;

// Kernels are named k_<entry> so that e.g. k_exp does not shadow the builtin exp.
const WG: u32 = 64u;

// The flat invocation index of a grid that may be folded into 2-D (> 65535 workgroups).
fn flat_id(gid: vec3u, nwg: vec3u) -> u32 {
    return gid.x + gid.y * nwg.x * WG;
}

fn flat_group(wid: vec3u, nwg: vec3u) -> u32 {
    return wid.x + wid.y * nwg.x;
}

// Flat row-major index -> 4-D index (x innermost).
fn unravel(i: u32, ne: vec4u) -> vec4u {
    let i0 = i % ne.x;
    let r1 = i / ne.x;
    let i1 = r1 % ne.y;
    let r2 = r1 / ne.y;
    let i2 = r2 % ne.z;
    return vec4u(i0, i1, i2, r2 / ne.z);
}

fn at_d(idx: vec4u) -> u32 { return p.off.x + dot(idx, p.nb_d); }
fn at_0(idx: vec4u) -> u32 { return p.off.y + dot(idx, p.nb_0); }
fn at_1(idx: vec4u) -> u32 { return p.off.z + dot(idx, p.nb_1); }
fn at_2(idx: vec4u) -> u32 { return p.off.w + dot(idx, p.nb_2); }
fn at_3(idx: vec4u) -> u32 { return p.off3.x + dot(idx, p.nb_3); }

// The same bindings read as vec4s (for kernels that checked the alignment; no entry point
// may use both views of one binding).
@group(0) @binding(1) var<storage, read_write> dst_v4: array<vec4<TD>>;
@group(0) @binding(2) var<storage, read_write> src0_v4: array<vec4<T0>>;
@group(0) @binding(3) var<storage, read_write> src1_v4: array<vec4<T1>>;

// The lowest finite f32: the max of an empty set (WGSL has no -inf literal); anything below
// it is -inf.
const LOWEST: f32 = -3.40282347e+38;
