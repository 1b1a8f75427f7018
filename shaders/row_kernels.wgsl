// Row kernels (norm, softmax, reduce): one workgroup, or one invocation ('rowwise'), per
// row of src0.
// #include common

// Element i of a row is vec4u(i, r.yzw), with r the row's start index.
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
