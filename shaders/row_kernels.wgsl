// Row kernels (norm, softmax, reduce): one workgroup, or one invocation ('rowwise'), per
// row of src0.
// #include common

// Element i of a row is vec4u(i, r.yzw), with r the row's start index.
fn row_start(row: u32) -> vec4u { return unravel(row * p.ne_0.x, p.ne_0); }

// -- the row ops' pass over a row, written once for both variants (ggwgpu/kernels.py): each op
// is a function `<entry>_row(w: Row)` (norm.wgsl, softmax.wgsl). Its loops visit elements
// w.lane, w.lane + ROW_STEP, ... and its reductions (row_sum, row_sum4, row_ms) give every
// invocation of the row the whole row's value. row_workgroup.wgsl or row_rowwise.wgsl
// defines ROW_STEP and the reductions; a family is compiled once with each.

// A row of src0 and this invocation's share of it. Element i of the row lies at
// b.x + i * p.nb_d.x in dst, b.y + i * p.nb_0.x in src0, and so on; src1 and src2 may tile
// src0 (ggml broadcasting), so their row is r modulo their shape.
struct Row {
    row: u32,    // the row's index, < p.n
    lane: u32,   // the first element this invocation visits
    r: vec4u,    // the row's start index
    b: vec4u,    // the row's first element in dst, src0, src1, src2
}

fn row_work(row: u32, lane: u32) -> Row {
    let r = row_start(row);
    return Row(row, lane, r, vec4u(at_d(r), at_0(r), at_1(r % p.ne_1), at_2(r % p.ne_2)));
}

fn row_src0(w: Row, i: u32) -> f32 { return f32(src0[w.b.y + i * p.nb_0.x]); }
fn row_src1(w: Row, i: u32) -> f32 { return f32(src1[w.b.z + i * p.nb_1.x]); }
fn row_src2(w: Row, i: u32) -> f32 { return f32(src2[w.b.w + i * p.nb_2.x]); }
fn row_store(w: Row, i: u32, v: f32) { dst[w.b.x + i * p.nb_d.x] = to_TD(v); }

// A source whose rows are m long and tile the row: element i reads its column i % m. A loop
// keeps that column beside i without a division per element: it starts at w.lane % m and
// steps by ROW_STEP % m, wrapping with tile_wrap.
fn tile_wrap(j: u32, m: u32) -> u32 { return select(j, j - m, j >= m); }

// Online softmax statistics: x = running max m, y = sum of exp(v - m); z, w plain sums.
// Adding v rescales the sum whenever the max grows, so one pass over the row suffices; one
// exp per value: e = exp(-|v - m|) either scales the sum down to a new max or is the new term.
const MS_EMPTY = vec4f(LOWEST, 0.0, 0.0, 0.0);

fn ms_add(a: vec4f, v: f32) -> vec4f {
    let e = exp(-abs(v - a.x));
    return vec4f(max(a.x, v), select(a.y + e, a.y * e + 1.0, v > a.x), a.z, a.w);
}

fn ms_merge(a: vec4f, b: vec4f) -> vec4f {
    let m = max(a.x, b.x);
    return vec4f(m, a.y * exp(a.x - m) + b.y * exp(b.x - m), a.z + b.z, a.w + b.w);
}

// -- reductions over a workgroup.
// Bound the work of one workgroup: lavapipe loses workgroup barriers after about 4M loads in
// one workgroup (measured: 64 x 65000 fine, 64 x 65534 wrong).
var<workgroup> partial4: array<vec4f, WG>;

// v combined across the workgroup by a tree (one set of barriers for up to four values:
// barriers dominate a short row's cost on CPU devices): summed, or merged as softmax
// statistics (ms_merge). Every invocation must call it (uniform control flow).
fn workgroup_tree(lid: u32, v: vec4f, softmax: bool) -> vec4f {
    partial4[lid] = v;
    workgroupBarrier();
    for (var s = WG / 2u; s > 0u; s = s / 2u) {
        if (lid < s) {
            if (softmax) {
                partial4[lid] = ms_merge(partial4[lid], partial4[lid + s]);
            } else {
                partial4[lid] += partial4[lid + s];
            }
        }
        workgroupBarrier();
    }
    let total = partial4[0];
    workgroupBarrier();  // partial4 may be reused right after
    return total;
}

// The tree of one value: a quarter of workgroup_tree's loads and stores (a short row's
// rms_norm or soft_max_back runs ~1.2x faster on lavapipe with it).
var<workgroup> partial: array<f32, WG>;

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
