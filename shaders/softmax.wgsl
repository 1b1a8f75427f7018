// Softmax family. The row ops, p.n rows of src0: each op's pass over a row is one function
// <entry>_row (row_kernels.wgsl); the family is compiled once per kernel variant
// (softmax_workgroup, softmax_rowwise: ggwgpu/kernels.py), whose entry points wgsl.py adds.
// Every tensor of a row op has src0's shape (a mask tiles it), any strides.
// #include row_kernels

// soft_max / soft_max_ext: the logit x * scale (+ the mask at its column j when p.u.x = 1),
// p.f.x = scale.
fn logit(w: Row, i: u32, j: u32) -> f32 {
    var v = row_src0(w, i) * p.f.x;
    if (p.u.x != 0u) { v += row_src1(w, j); }
    return v;
}

// soft_max: y = exp(v - max) / sum(exp(v - max)) per row (-inf logits give 0): the max and
// the sum in one pass, then the output. The mask's row may be shorter than x's (it tiles
// x): j is its column (tile_wrap). Causal (p.u.y = 1, n_past = p.u.z): only the row's
// columns up to n_past + its row in the matrix count, the rest are 0 (no infinities).
fn soft_max_row(w: Row) {
    let m = p.ne_1.x;
    let dj = ROW_STEP % m;
    var end = p.ne_0.x;
    if (p.u.y != 0u) { end = min(end, p.u.z + w.r.y + 1u); }
    var ms = MS_EMPTY;
    var j = w.lane % m;
    for (var i = w.lane; i < end; i += ROW_STEP) {
        ms = ms_add(ms, logit(w, i, j));
        j = tile_wrap(j + dj, m);
    }
    ms = row_ms(w, ms);
    let inv = 1.0 / ms.y;
    j = w.lane % m;
    for (var i = w.lane; i < p.ne_0.x; i += ROW_STEP) {
        var y = 0.0;
        if (i < end) { y = exp(logit(w, i, j) - ms.x) * inv; }
        row_store(w, i, y);
        j = tile_wrap(j + dj, m);
    }
}

// soft_max_back: src0 y, src1 dy; dx = y * (dy - sum(y * dy)).
fn soft_max_back_row(w: Row) {
    var yd = 0.0;
    for (var i = w.lane; i < p.ne_0.x; i += ROW_STEP) { yd += row_src0(w, i) * row_src1(w, i); }
    yd = row_sum(w, yd);
    for (var i = w.lane; i < p.ne_0.x; i += ROW_STEP) {
        row_store(w, i, row_src0(w, i) * (row_src1(w, i) - yd));
    }
}

// diag_mask_inf / diag_mask_zero: one invocation per element; (row i, col j) of every matrix
// becomes p.f.x (-inf or 0) where j > n_past + i, n_past = p.u.x.
@compute @workgroup_size(WG)
fn k_diag_mask(@builtin(global_invocation_id) gid: vec3u, @builtin(num_workgroups) nwg: vec3u) {
    let i = flat_id(gid, nwg); if (i >= p.n) { return; }
    let idx = unravel(i, p.ne_d);
    dst[at_d(idx)] = to_TD(select(f32(src0[at_0(idx)]), p.f.x, idx.x > p.u.x + idx.y));
}

// The row max of logits src0, sum(exp(x - max)) and sum(p) of targets src1 (in x, y, z).
fn ce_row_stats(w: Row) -> vec4f {
    var acc = MS_EMPTY;
    for (var i = w.lane; i < p.ne_0.x; i += ROW_STEP) {
        acc = ms_add(acc, row_src0(w, i));
        acc.z += row_src1(w, i);
    }
    return row_ms(w, acc);
}

// cross_entropy_loss, step 1: src0 logits x, src1 targets p; dst [rows] gets each row's
// -sum(p * log_softmax(x)) * p.f.x (p.f.x = 1 / rows), with
// log_softmax(x) = x - m - log(sum(exp(x - m))), m = the row max.
fn cross_entropy_loss_row(w: Row) {
    let ms = ce_row_stats(w);
    var px = 0.0;   // sum(p * (x - m))
    for (var i = w.lane; i < p.ne_0.x; i += ROW_STEP) {
        px += row_src1(w, i) * (row_src0(w, i) - ms.x);
    }
    let total = row_sum(w, px);
    if (w.lane == 0u) {
        dst[at_d(unravel(w.row, p.ne_d))] = to_TD((ms.z * log(ms.y) - total) * p.f.x);
    }
}

// cross_entropy_loss_back: src0 logits x, src1 targets p, src2 dloss (one element);
// dx = (softmax(x) * sum(p) - p) * dloss * p.f.x (p.f.x = 1 / rows).
fn cross_entropy_loss_back_row(w: Row) {
    let ms = ce_row_stats(w);
    let k = f32(src2[at_2(vec4u(0u))]) * p.f.x;
    let sk = ms.z / ms.y;  // sum(p) / sum(exp(x - m))
    for (var i = w.lane; i < p.ne_0.x; i += ROW_STEP) {
        row_store(w, i, (exp(row_src0(w, i) - ms.x) * sk - row_src1(w, i)) * k);
    }
}

// -- cross_entropy_ids and its backward: src0 logits x; src1_i32 target ids and src2 row
// weights w, both shaped like x's rows (ids.xyz = x.yzw); a negative id ignores its row (0
// loss, 0 gradient, whatever its weight and logits). Ids >= the row length are clamped to
// the last column: the kernels never read outside the row. For counted rows the arithmetic
// is cross_entropy_loss's with a one-hot p, term by term.

// int32 view of binding 3: the ce_ids kernels read ids through it and never use src1.
@group(0) @binding(3) var<storage, read_write> src1_i32: array<i32>;

fn ce_id(w: Row) -> i32 { return src1_i32[at_1(vec4u(w.r.yzw, 0u))]; }
fn ce_weight(w: Row) -> f32 { return f32(src2[at_2(vec4u(w.r.yzw, 0u))]); }
fn ce_col(id: i32) -> u32 { return min(u32(id), p.ne_0.x - 1u); }

// The row max of logits src0 and sum(exp(x - max)) (in x, y). An ignored row skips the pass
// (its loop ends at once; the reduction after it is still reached by every invocation).
fn ce_ids_stats(w: Row, id: i32) -> vec4f {
    let n = select(0u, p.ne_0.x, id >= 0);
    var acc = MS_EMPTY;
    for (var i = w.lane; i < n; i += ROW_STEP) { acc = ms_add(acc, row_src0(w, i)); }
    return row_ms(w, acc);
}

// cross_entropy_ids, step 1: dst [rows] gets each row's w * (log(sum(exp(x - m))) - (x[id] - m)).
fn cross_entropy_ids_row(w: Row) {
    let id = ce_id(w);
    let ms = ce_ids_stats(w, id);
    if (w.lane == 0u) {
        var loss = 0.0;
        if (id >= 0) { loss = (log(ms.y) - (row_src0(w, ce_col(id)) - ms.x)) * ce_weight(w); }
        dst[at_d(unravel(w.row, p.ne_d))] = to_TD(loss);
    }
}

// cross_entropy_ids_back: src3 dloss (one element); dx = (softmax(x) - onehot(id)) * w * dloss,
// 0 on an ignored row.
fn cross_entropy_ids_back_row(w: Row) {
    let id = ce_id(w);
    let ms = ce_ids_stats(w, id);
    if (id < 0) {
        for (var i = w.lane; i < p.ne_0.x; i += ROW_STEP) { row_store(w, i, 0.0); }
        return;
    }
    let k = f32(src3[at_3(vec4u(0u))]) * ce_weight(w);
    let inv = 1.0 / ms.y;
    let col = ce_col(id);
    for (var i = w.lane; i < p.ne_0.x; i += ROW_STEP) {
        row_store(w, i, (exp(row_src0(w, i) - ms.x) * inv - select(0.0, 1.0, i == col)) * k);
    }
}
