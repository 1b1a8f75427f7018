// Prepended to every shader file: the parameter block, the bindings, index helpers.
// Sizes (ne) and strides (nb) are in ggml order (x = innermost dim) and counted in elements;
// off holds the element offsets of dst, src0, src1, src2 in their buffers, off3.x src3's.
// This struct is the layout's one description: the backend reads it (wgpu_backend.py,
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
@group(0) @binding(1) var<storage, read_write> dst: array<f32>;
@group(0) @binding(2) var<storage, read_write> src0: array<f32>;
@group(0) @binding(3) var<storage, read_write> src1: array<f32>;
@group(0) @binding(4) var<storage, read_write> src2: array<f32>;
@group(0) @binding(5) var<storage, read_write> src3: array<f32>;

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

// Matrix products (matmul.wgsl, matmul_subgroup.wgsl): element offsets of batch entry
// `batch` of dst, src0 (a, broadcast over b as ggml does: b's entry j reads a's j / ratio)
// and src1 (b).
fn product_bases(batch: u32) -> vec3u {
    let i2 = batch % p.ne_d.z;
    let i3 = batch / p.ne_d.z;
    return vec3u(p.off.x + i2 * p.nb_d.z + i3 * p.nb_d.w,
                 p.off.y + (i2 / (p.ne_d.z / p.ne_0.z)) * p.nb_0.z
                         + (i3 / (p.ne_d.w / p.ne_0.w)) * p.nb_0.w,
                 p.off.z + i2 * p.nb_1.z + i3 * p.nb_1.w);
}

// The same bindings read as vec4s (for kernels that checked the alignment; no entry point
// may use both views of one binding).
@group(0) @binding(1) var<storage, read_write> dst_v4: array<vec4f>;
@group(0) @binding(2) var<storage, read_write> src0_v4: array<vec4f>;
@group(0) @binding(3) var<storage, read_write> src1_v4: array<vec4f>;

// Writes dst[n, m .. m + 3] of a product (dst base offset d) through dst_v4: one vec4 store
// where dst rows allow it, else element by element; columns >= M are skipped.
fn store_product4(d: u32, n: u32, m: u32, v: vec4f) {
    let M = p.ne_d.x;
    if (p.nb_d.x == 1u && p.nb_d.y % 4u == 0u && d % 4u == 0u && m + 4u <= M) {
        dst_v4[(d + n * p.nb_d.y + m) / 4u] = v;
        return;
    }
    for (var r = 0u; r < 4u; r++) {
        if (m + r < M) {
            let i = d + n * p.nb_d.y + (m + r) * p.nb_d.x;
            dst_v4[i / 4u][i % 4u] = v[r];
        }
    }
}

// Row kernels: one workgroup per row of src0. Element i of a row is vec4u(i, r.yzw), with r
// the row's start index.
fn row_start(row: u32) -> vec4u { return unravel(row * p.ne_0.x, p.ne_0); }

// Rowwise row kernels (the 'rowwise' variant, for CPU adapters): one invocation per row,
// no workgroup memory, no barriers. Element i of the row that starts at r lies at
// base.x + i * p.nb_d.x in dst, base.y + i * p.nb_0.x in src0, and so on; src1 and src2
// may tile src0 (ggml broadcasting), so their row is r modulo their shape.
fn row_bases(r: vec4u) -> vec4u {
    return vec4u(at_d(r), at_0(r), at_1(r % p.ne_1), at_2(r % p.ne_2));
}

// Row reductions: one workgroup per row, then a tree over the workgroup.
// Bound the work of one workgroup: lavapipe loses workgroup barriers after about 4M loads in
// one workgroup (measured: 64 x 65000 fine, 64 x 65534 wrong).
var<workgroup> partial: array<f32, WG>;

// Tree-sum of v across the workgroup; every invocation must call it (uniform control flow).
fn workgroup_sum(lid: u32, v: f32) -> f32 {
    partial[lid] = v;
    workgroupBarrier();
    for (var s = WG / 2u; s > 0u; s = s / 2u) {
        if (lid < s) { partial[lid] += partial[lid + s]; }
        workgroupBarrier();
    }
    let total = partial[0];
    workgroupBarrier();  // partial may be reused right after
    return total;
}

// Tree-max of v across the workgroup, as workgroup_sum.
fn workgroup_max(lid: u32, v: f32) -> f32 {
    partial[lid] = v;
    workgroupBarrier();
    for (var s = WG / 2u; s > 0u; s = s / 2u) {
        if (lid < s) { partial[lid] = max(partial[lid], partial[lid + s]); }
        workgroupBarrier();
    }
    let total = partial[0];
    workgroupBarrier();
    return total;
}

// workgroup_sum of up to four values at once: one tree, one set of barriers (barriers
// dominate a short row's cost on CPU devices).
var<workgroup> partial4: array<vec4f, WG>;

fn workgroup_sum4(lid: u32, v: vec4f) -> vec4f {
    partial4[lid] = v;
    workgroupBarrier();
    for (var s = WG / 2u; s > 0u; s = s / 2u) {
        if (lid < s) { partial4[lid] += partial4[lid + s]; }
        workgroupBarrier();
    }
    let total = partial4[0];
    workgroupBarrier();
    return total;
}
