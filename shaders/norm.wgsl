// Row normalisations, p.n rows; p.f.x = eps. Each op's pass over a row is one function
// <entry>_row (row_kernels.wgsl); the family is compiled once per kernel variant
// (norm_workgroup, norm_rowwise: ggwgpu/kernels.py), whose entry points wgsl.py adds.
// src0 x, src1 dy (the *_back ops), dst [.., n]: one shape, any strides. rms_norm_mul(_back)
// add a weight w (src1) that tiles x (ggml broadcasting).
// #include row_kernels

// 1 / sqrt(mean(x^2) + eps) of the row of src0.
fn rms_scale(w: Row) -> f32 {
    var ss = 0.0;
    for (var i = w.lane; i < p.ne_0.x; i += ROW_STEP) {
        let x = row_src0(w, i);
        ss += x * x;
    }
    return 1.0 / sqrt(row_sum(w, ss) / f32(p.ne_0.x) + p.f.x);
}

// rms_norm: y = x / sqrt(mean(x^2) + eps).
fn rms_norm_row(w: Row) {
    let rs = rms_scale(w);
    for (var i = w.lane; i < p.ne_0.x; i += ROW_STEP) { row_store(w, i, row_src0(w, i) * rs); }
}

// rms_norm_mul: y = x / sqrt(mean(x^2) + eps) * w: llama's weighted norm in one pass.
fn rms_norm_mul_row(w: Row) {
    let rs = rms_scale(w);
    let m = p.ne_1.x;
    let dj = ROW_STEP % m;
    var j = w.lane % m;   // w's column (tile_wrap)
    for (var i = w.lane; i < p.ne_0.x; i += ROW_STEP) {
        row_store(w, i, row_src0(w, i) * rs * row_src1(w, j));
        j = tile_wrap(j + dj, m);
    }
}

// The upstream gradient at element i: dy (src1) for rms_norm_back, or dy * w for
// rms_norm_mul_back (src2 dy, src1 w at column j).
fn rms_upstream(w: Row, i: u32, j: u32, weighted: bool) -> f32 {
    if (weighted) { return row_src2(w, i) * row_src1(w, j); }
    return row_src1(w, i);
}

// With r = 1 / sqrt(mean(x^2) + eps), y = x * r and g the upstream gradient (dy, or dy * w):
// dx = r * (g - y * mean(g * y)) = r * (g - x * r^2 * mean(g * x)).
fn rms_norm_back_pass(w: Row, weighted: bool) {
    let n = p.ne_0.x;
    let m = p.ne_1.x;
    let dj = ROW_STEP % m;
    var sums = vec4f(0.0);   // sum(x^2), sum(g * x)
    var j = w.lane % m;
    for (var i = w.lane; i < n; i += ROW_STEP) {
        let x = row_src0(w, i);
        sums += vec4f(x * x, rms_upstream(w, i, j, weighted) * x, 0.0, 0.0);
        j = tile_wrap(j + dj, m);
    }
    sums = row_sum4(w, sums) / f32(n);
    let rs = 1.0 / sqrt(sums.x + p.f.x);
    let k = rs * rs * sums.y;
    j = w.lane % m;
    for (var i = w.lane; i < n; i += ROW_STEP) {
        row_store(w, i, rs * (rms_upstream(w, i, j, weighted) - row_src0(w, i) * k));
        j = tile_wrap(j + dj, m);
    }
}

// rms_norm_back: src0 x, src1 dy.
fn rms_norm_back_row(w: Row) { rms_norm_back_pass(w, false); }

// rms_norm_mul_back: rms_norm_back of dy * w; src0 x, src1 w (tiling x), src2 dy.
fn rms_norm_mul_back_row(w: Row) { rms_norm_back_pass(w, true); }

// The row mean of src0.
fn row_mean(w: Row) -> f32 {
    var acc = 0.0;
    for (var i = w.lane; i < p.ne_0.x; i += ROW_STEP) { acc += row_src0(w, i); }
    return row_sum(w, acc) / f32(p.ne_0.x);
}

// norm: y = (x - mean) / sqrt(var + eps); var from a second pass (no cancellation).
fn norm_row(w: Row) {
    let n = p.ne_0.x;
    let mu = row_mean(w);
    var cc = 0.0;
    for (var i = w.lane; i < n; i += ROW_STEP) {
        let c = row_src0(w, i) - mu;
        cc += c * c;
    }
    let s = 1.0 / sqrt(row_sum(w, cc) / f32(n) + p.f.x);
    for (var i = w.lane; i < n; i += ROW_STEP) { row_store(w, i, (row_src0(w, i) - mu) * s); }
}

// norm_back: with c = x - mean, s = 1 / sqrt(var + eps), y = c * s,
// dx = s * (dy - mean(dy) - y * mean(dy * y)) = s * (dy - mean(dy) - c * s^2 * mean(dy * c)).
fn norm_back_row(w: Row) {
    let n = p.ne_0.x;
    let mu = row_mean(w);
    var sums = vec4f(0.0);   // sum(c^2), sum(dy), sum(dy * c)
    for (var i = w.lane; i < n; i += ROW_STEP) {
        let c = row_src0(w, i) - mu;
        let d = row_src1(w, i);
        sums += vec4f(c * c, d, d * c, 0.0);
    }
    sums = row_sum4(w, sums) / f32(n);
    let s = 1.0 / sqrt(sums.x + p.f.x);
    let k = s * s * sums.z;
    for (var i = w.lane; i < n; i += ROW_STEP) {
        row_store(w, i, s * (row_src1(w, i) - sums.y - (row_src0(w, i) - mu) * k));
    }
}
