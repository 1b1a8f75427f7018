// Row normalisations: one workgroup per row, p.n rows; p.f.x = eps.
// src0 x [.., n], src1 dy [.., n] (the *_back ops), dst [.., n]: one shape, any strides
// (row_start and workgroup_sum4 in row_kernels.wgsl). rms_norm_mul(_back) add a weight w that
// tiles x (ggml broadcasting).
// #include row_kernels

// 1 / sqrt(mean(x^2) + eps) of the row of src0 that starts at r.
fn rms_scale(lid: u32, r: vec4u) -> f32 {
    var ss = 0.0;
    for (var i = lid; i < p.ne_0.x; i += WG) {
        let x = f32(src0[at_0(vec4u(i, r.yzw))]);
        ss += x * x;
    }
    return 1.0 / sqrt(workgroup_sum(lid, ss) / f32(p.ne_0.x) + p.f.x);
}

// rms_norm: y = x / sqrt(mean(x^2) + eps).
@compute @workgroup_size(WG)
fn k_rms_norm(@builtin(local_invocation_id) lid: vec3u, @builtin(workgroup_id) wid: vec3u,
              @builtin(num_workgroups) nwg: vec3u) {
    let row = flat_group(wid, nwg);
    if (row >= p.n) { return; }  // uniform per workgroup: barriers stay in uniform control flow
    let r = row_start(row);
    let rs = rms_scale(lid.x, r);
    for (var i = lid.x; i < p.ne_0.x; i += WG) {
        let idx = vec4u(i, r.yzw);
        dst[at_d(idx)] = to_TD(f32(src0[at_0(idx)]) * rs);
    }
}

// rms_norm_mul: y = x / sqrt(mean(x^2) + eps) * w, src1 = w tiling x (ggml broadcasting):
// llama's weighted norm in one pass.
@compute @workgroup_size(WG)
fn k_rms_norm_mul(@builtin(local_invocation_id) lid: vec3u, @builtin(workgroup_id) wid: vec3u,
                  @builtin(num_workgroups) nwg: vec3u) {
    let row = flat_group(wid, nwg);
    if (row >= p.n) { return; }
    let r = row_start(row);
    let rs = rms_scale(lid.x, r);
    for (var i = lid.x; i < p.ne_0.x; i += WG) {
        let idx = vec4u(i, r.yzw);
        dst[at_d(idx)] = to_TD(f32(src0[at_0(idx)]) * rs * f32(src1[at_1(idx % p.ne_1)]));
    }
}

// dy at idx for rms_norm_back (src1), or dy * w for rms_norm_mul_back (src2 dy, src1 w
// tiling x).
fn rms_upstream(idx: vec4u, weighted: bool) -> f32 {
    if (weighted) { return f32(src2[at_2(idx)]) * f32(src1[at_1(idx % p.ne_1)]); }
    return f32(src1[at_1(idx)]);
}

// With r = 1 / sqrt(mean(x^2) + eps), y = x * r and g the upstream gradient (dy, or dy * w):
// dx = r * (g - y * mean(g * y)) = r * (g - x * r^2 * mean(g * x)).
fn rms_norm_back_row(lid: u32, row: u32, weighted: bool) {
    let r = row_start(row);
    let n = p.ne_0.x;
    var xx = 0.0;
    var gx = 0.0;
    for (var i = lid; i < n; i += WG) {
        let idx = vec4u(i, r.yzw);
        let x = f32(src0[at_0(idx)]);
        xx += x * x;
        gx += rms_upstream(idx, weighted) * x;
    }
    let sums = workgroup_sum4(lid, vec4f(xx, gx, 0.0, 0.0)) / f32(n);
    let rs = 1.0 / sqrt(sums.x + p.f.x);
    let k = rs * rs * sums.y;
    for (var i = lid; i < n; i += WG) {
        let idx = vec4u(i, r.yzw);
        dst[at_d(idx)] = to_TD(rs * (rms_upstream(idx, weighted) - f32(src0[at_0(idx)]) * k));
    }
}

// rms_norm_back: src0 x, src1 dy.
@compute @workgroup_size(WG)
fn k_rms_norm_back(@builtin(local_invocation_id) lid: vec3u, @builtin(workgroup_id) wid: vec3u,
                   @builtin(num_workgroups) nwg: vec3u) {
    let row = flat_group(wid, nwg);
    if (row >= p.n) { return; }
    rms_norm_back_row(lid.x, row, false);
}

// rms_norm_mul_back: rms_norm_back of dy * w; src0 x, src1 w (tiling x), src2 dy.
@compute @workgroup_size(WG)
fn k_rms_norm_mul_back(@builtin(local_invocation_id) lid: vec3u,
                       @builtin(workgroup_id) wid: vec3u, @builtin(num_workgroups) nwg: vec3u) {
    let row = flat_group(wid, nwg);
    if (row >= p.n) { return; }
    rms_norm_back_row(lid.x, row, true);
}

// The row mean of src0 (every invocation gets it).
fn row_mean(lid: u32, r: vec4u) -> f32 {
    var acc = 0.0;
    for (var i = lid; i < p.ne_0.x; i += WG) { acc += f32(src0[at_0(vec4u(i, r.yzw))]); }
    return workgroup_sum(lid, acc) / f32(p.ne_0.x);
}

// norm: y = (x - mean) / sqrt(var + eps); var from a second pass (no cancellation).
@compute @workgroup_size(WG)
fn k_norm(@builtin(local_invocation_id) lid: vec3u, @builtin(workgroup_id) wid: vec3u,
          @builtin(num_workgroups) nwg: vec3u) {
    let row = flat_group(wid, nwg);
    if (row >= p.n) { return; }
    let r = row_start(row);
    let n = p.ne_0.x;
    let mu = row_mean(lid.x, r);
    var cc = 0.0;
    for (var i = lid.x; i < n; i += WG) {
        let c = f32(src0[at_0(vec4u(i, r.yzw))]) - mu;
        cc += c * c;
    }
    let s = 1.0 / sqrt(workgroup_sum(lid.x, cc) / f32(n) + p.f.x);
    for (var i = lid.x; i < n; i += WG) {
        let idx = vec4u(i, r.yzw);
        dst[at_d(idx)] = to_TD((f32(src0[at_0(idx)]) - mu) * s);
    }
}

// norm_back: with c = x - mean, s = 1 / sqrt(var + eps), y = c * s,
// dx = s * (dy - mean(dy) - y * mean(dy * y)) = s * (dy - mean(dy) - c * s^2 * mean(dy * c)).
@compute @workgroup_size(WG)
fn k_norm_back(@builtin(local_invocation_id) lid: vec3u, @builtin(workgroup_id) wid: vec3u,
               @builtin(num_workgroups) nwg: vec3u) {
    let row = flat_group(wid, nwg);
    if (row >= p.n) { return; }
    let r = row_start(row);
    let n = p.ne_0.x;
    let mu = row_mean(lid.x, r);
    var cc = 0.0;
    var dd = 0.0;
    var dc = 0.0;
    for (var i = lid.x; i < n; i += WG) {
        let idx = vec4u(i, r.yzw);
        let c = f32(src0[at_0(idx)]) - mu;
        let d = f32(src1[at_1(idx)]);
        cc += c * c;
        dd += d;
        dc += d * c;
    }
    let sums = workgroup_sum4(lid.x, vec4f(cc, dd, dc, 0.0)) / f32(n);
    let s = 1.0 / sqrt(sums.x + p.f.x);
    let mean_dy = sums.y;
    let k = s * s * sums.z;
    for (var i = lid.x; i < n; i += WG) {
        let idx = vec4u(i, r.yzw);
        dst[at_d(idx)] = to_TD(s * (f32(src1[at_1(idx)]) - mean_dy - (f32(src0[at_0(idx)]) - mu) * k));
    }
}

// -- the 'rowwise' variant (CPU adapters): one invocation per row (row_kernels.wgsl row_bases).
// A CPU device runs neighbouring invocations in its SIMD lanes, so rows go side by side;
// the workgroup kernels' barriers cost more there than a whole row of work.

// 1 / sqrt(mean(x^2) + eps) of the row of src0 at b.y.
fn rms_scale_row(b: vec4u) -> f32 {
    var ss = 0.0;
    for (var i = 0u; i < p.ne_0.x; i++) {
        let x = f32(src0[b.y + i * p.nb_0.x]);
        ss += x * x;
    }
    return 1.0 / sqrt(ss / f32(p.ne_0.x) + p.f.x);
}

// rms_norm_mul: y = x * r * w. w's row may be shorter than x's (it tiles x): j runs over it
// with a wrap instead of i % n (an integer division per element).
@compute @workgroup_size(WG)
fn k_rms_norm_mul_rowwise(@builtin(global_invocation_id) gid: vec3u,
                          @builtin(num_workgroups) nwg: vec3u) {
    let row = flat_id(gid, nwg); if (row >= p.n) { return; }
    let b = row_bases(row_start(row));
    let rs = rms_scale_row(b);
    var j = 0u;
    for (var i = 0u; i < p.ne_0.x; i++) {
        dst[b.x + i * p.nb_d.x] = to_TD(f32(src0[b.y + i * p.nb_0.x]) * rs * f32(src1[b.z + j * p.nb_1.x]));
        j = select(j + 1u, 0u, j + 1u == p.ne_1.x);
    }
}

// rms_norm_mul_back: src0 x, src1 w (tiling x), src2 dy;
// dx = r * (dy * w - x * r^2 * mean(dy * w * x)).
@compute @workgroup_size(WG)
fn k_rms_norm_mul_back_rowwise(@builtin(global_invocation_id) gid: vec3u,
                               @builtin(num_workgroups) nwg: vec3u) {
    let row = flat_id(gid, nwg); if (row >= p.n) { return; }
    let b = row_bases(row_start(row));
    let n = p.ne_0.x;
    var xx = 0.0;
    var dx = 0.0;
    var j = 0u;
    for (var i = 0u; i < n; i++) {
        let x = f32(src0[b.y + i * p.nb_0.x]);
        xx += x * x;
        dx += f32(src2[b.w + i * p.nb_2.x]) * f32(src1[b.z + j * p.nb_1.x]) * x;
        j = select(j + 1u, 0u, j + 1u == p.ne_1.x);
    }
    let rs = 1.0 / sqrt(xx / f32(n) + p.f.x);
    let k = rs * rs * dx / f32(n);
    j = 0u;
    for (var i = 0u; i < n; i++) {
        let dyw = f32(src2[b.w + i * p.nb_2.x]) * f32(src1[b.z + j * p.nb_1.x]);
        dst[b.x + i * p.nb_d.x] = to_TD(rs * (dyw - f32(src0[b.y + i * p.nb_0.x]) * k));
        j = select(j + 1u, 0u, j + 1u == p.ne_1.x);
    }
}
