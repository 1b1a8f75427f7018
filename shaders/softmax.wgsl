// Softmax family. Row kernels (row_kernels.wgsl): one workgroup per row of src0, p.n rows; every
// tensor of a row kernel has src0's shape (a mask tiles it), any strides.
// #include row_kernels

// Online softmax statistics: x = running max m, y = sum of exp(v - m); z, w plain sums.
// Adding v rescales the sum whenever the max grows, so one pass over the row suffices.
fn ms_add(a: vec4f, v: f32) -> vec4f {
    let m = max(a.x, v);
    return vec4f(m, a.y * exp(a.x - m) + exp(v - m), a.z, a.w);
}

fn ms_merge(a: vec4f, b: vec4f) -> vec4f {
    let m = max(a.x, b.x);
    return vec4f(m, a.y * exp(a.x - m) + b.y * exp(b.x - m), a.z + b.z, a.w + b.w);
}

// ms_merge over the workgroup: a tree in row_kernels.wgsl's partial4, as workgroup_sum4 adds;
// uniform control flow.
fn workgroup_ms(lid: u32, v: vec4f) -> vec4f {
    partial4[lid] = v;
    workgroupBarrier();
    for (var s = WG / 2u; s > 0u; s = s / 2u) {
        if (lid < s) { partial4[lid] = ms_merge(partial4[lid], partial4[lid + s]); }
        workgroupBarrier();
    }
    let total = partial4[0];
    workgroupBarrier();  // partial4 may be reused right after
    return total;
}

// soft_max / soft_max_ext: the logit x * scale (+ mask when p.u.x = 1), p.f.x = scale.
fn logit(idx: vec4u) -> f32 {
    var v = f32(src0[at_0(idx)]) * p.f.x;
    if (p.u.x != 0u) { v += f32(src1[at_1(idx % p.ne_1)]); }  // the mask tiles x
    return v;
}

// soft_max: y = exp(v - max) / sum(exp(v - max)) per row (-inf logits give 0).
@compute @workgroup_size(WG)
fn k_soft_max(@builtin(local_invocation_id) lid: vec3u, @builtin(workgroup_id) wid: vec3u,
              @builtin(num_workgroups) nwg: vec3u) {
    let row = flat_group(wid, nwg);
    if (row >= p.n) { return; }  // uniform per workgroup: barriers stay in uniform control flow
    let r = row_start(row);
    var acc = vec4f(LOWEST, 0.0, 0.0, 0.0);
    for (var i = lid.x; i < p.ne_0.x; i += WG) { acc = ms_add(acc, logit(vec4u(i, r.yzw))); }
    let ms = workgroup_ms(lid.x, acc);
    let inv = 1.0 / ms.y;
    for (var i = lid.x; i < p.ne_0.x; i += WG) {
        let idx = vec4u(i, r.yzw);
        dst[at_d(idx)] = to_TD(exp(logit(idx) - ms.x) * inv);
    }
}

// soft_max_back: src0 y, src1 dy; dx = y * (dy - sum(y * dy)).
@compute @workgroup_size(WG)
fn k_soft_max_back(@builtin(local_invocation_id) lid: vec3u, @builtin(workgroup_id) wid: vec3u,
                   @builtin(num_workgroups) nwg: vec3u) {
    let row = flat_group(wid, nwg);
    if (row >= p.n) { return; }
    let r = row_start(row);
    var acc = 0.0;
    for (var i = lid.x; i < p.ne_0.x; i += WG) {
        let idx = vec4u(i, r.yzw);
        acc += f32(src0[at_0(idx)]) * f32(src1[at_1(idx)]);
    }
    let yd = workgroup_sum(lid.x, acc);
    for (var i = lid.x; i < p.ne_0.x; i += WG) {
        let idx = vec4u(i, r.yzw);
        dst[at_d(idx)] = to_TD(f32(src0[at_0(idx)]) * (f32(src1[at_1(idx)]) - yd));
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
fn ce_row_stats(lid: u32, r: vec4u) -> vec4f {
    var acc = vec4f(LOWEST, 0.0, 0.0, 0.0);
    for (var i = lid; i < p.ne_0.x; i += WG) {
        let idx = vec4u(i, r.yzw);
        acc = ms_add(acc, f32(src0[at_0(idx)]));
        acc.z += f32(src1[at_1(idx)]);
    }
    return workgroup_ms(lid, acc);
}

// cross_entropy_loss, step 1: src0 logits x, src1 targets p; dst [rows] gets each row's
// -sum(p * log_softmax(x)) * p.f.x (p.f.x = 1 / rows), with
// log_softmax(x) = x - m - log(sum(exp(x - m))), m = the row max.
@compute @workgroup_size(WG)
fn k_cross_entropy_loss(@builtin(local_invocation_id) lid: vec3u,
                        @builtin(workgroup_id) wid: vec3u, @builtin(num_workgroups) nwg: vec3u) {
    let row = flat_group(wid, nwg);
    if (row >= p.n) { return; }
    let r = row_start(row);
    let ms = ce_row_stats(lid.x, r);
    var px = 0.0;
    for (var i = lid.x; i < p.ne_0.x; i += WG) {
        let idx = vec4u(i, r.yzw);
        px += f32(src1[at_1(idx)]) * (f32(src0[at_0(idx)]) - ms.x);   // sum(p * (x - m))
    }
    let total = workgroup_sum(lid.x, px);
    if (lid.x == 0u) {
        dst[at_d(unravel(row, p.ne_d))] = to_TD((ms.z * log(ms.y) - total) * p.f.x);
    }
}

// cross_entropy_loss_back: src0 logits x, src1 targets p, src2 dloss (one element);
// dx = (softmax(x) * sum(p) - p) * dloss * p.f.x (p.f.x = 1 / rows).
@compute @workgroup_size(WG)
fn k_cross_entropy_loss_back(@builtin(local_invocation_id) lid: vec3u,
                             @builtin(workgroup_id) wid: vec3u,
                             @builtin(num_workgroups) nwg: vec3u) {
    let row = flat_group(wid, nwg);
    if (row >= p.n) { return; }
    let r = row_start(row);
    let ms = ce_row_stats(lid.x, r);
    let k = f32(src2[at_2(vec4u(0u))]) * p.f.x;
    let sk = ms.z / ms.y;  // sum(p) / sum(exp(x - m))
    for (var i = lid.x; i < p.ne_0.x; i += WG) {
        let idx = vec4u(i, r.yzw);
        dst[at_d(idx)] = to_TD((exp(f32(src0[at_0(idx)]) - ms.x) * sk - f32(src1[at_1(idx)])) * k);
    }
}

// -- the 'rowwise' variant (CPU adapters): one invocation per row (row_kernels.wgsl row_bases).
// A CPU device runs neighbouring invocations in its SIMD lanes, so rows go side by side;
// the workgroup kernels' barriers cost more there than a whole row of work.

// soft_max / soft_max_ext: the logit of element i (mask element j, when p.u.x = 1).
fn logit_row(b: vec4u, i: u32, j: u32) -> f32 {
    var v = f32(src0[b.y + i * p.nb_0.x]) * p.f.x;
    if (p.u.x != 0u) { v += f32(src1[b.z + j * p.nb_1.x]); }
    return v;
}

// Online softmax statistics of one invocation: (max m, sum of exp(v - m)) plus v, with one
// exp (ms_add's two): e = exp(-|v - m|) either scales the sum down to a new max or is the
// new term.
fn ms_add_row(a: vec2f, v: f32) -> vec2f {
    let e = exp(-abs(v - a.x));
    return vec2f(max(a.x, v), select(a.y + e, a.y * e + 1.0, v > a.x));
}

// soft_max: the max and the sum of exp(v - max) in one pass, then the output. The mask's
// row may be shorter than x's (it tiles x): j wraps over it.
@compute @workgroup_size(WG)
fn k_soft_max_rowwise(@builtin(global_invocation_id) gid: vec3u,
                      @builtin(num_workgroups) nwg: vec3u) {
    let row = flat_id(gid, nwg); if (row >= p.n) { return; }
    let b = row_bases(row_start(row));
    var ms = vec2f(LOWEST, 0.0);
    var j = 0u;
    for (var i = 0u; i < p.ne_0.x; i++) {
        ms = ms_add_row(ms, logit_row(b, i, j));
        j = select(j + 1u, 0u, j + 1u == p.ne_1.x);
    }
    let inv = 1.0 / ms.y;
    j = 0u;
    for (var i = 0u; i < p.ne_0.x; i++) {
        dst[b.x + i * p.nb_d.x] = to_TD(exp(logit_row(b, i, j) - ms.x) * inv);
        j = select(j + 1u, 0u, j + 1u == p.ne_1.x);
    }
}

// soft_max_back: src0 y, src1 dy; dx = y * (dy - sum(y * dy)).
@compute @workgroup_size(WG)
fn k_soft_max_back_rowwise(@builtin(global_invocation_id) gid: vec3u,
                           @builtin(num_workgroups) nwg: vec3u) {
    let row = flat_id(gid, nwg); if (row >= p.n) { return; }
    let b = row_bases(row_start(row));
    var yd = 0.0;
    for (var i = 0u; i < p.ne_0.x; i++) {
        yd += f32(src0[b.y + i * p.nb_0.x]) * f32(src1[b.z + i * p.nb_1.x]);
    }
    for (var i = 0u; i < p.ne_0.x; i++) {
        dst[b.x + i * p.nb_d.x] = to_TD(f32(src0[b.y + i * p.nb_0.x]) * (f32(src1[b.z + i * p.nb_1.x]) - yd));
    }
}

// The row max of logits src0, sum(exp(x - max)) and sum(p) of targets src1 (x, y, z).
fn ce_row_stats_rowwise(b: vec4u) -> vec3f {
    var ms = vec2f(LOWEST, 0.0);
    var sp = 0.0;
    for (var i = 0u; i < p.ne_0.x; i++) {
        ms = ms_add_row(ms, f32(src0[b.y + i * p.nb_0.x]));
        sp += f32(src1[b.z + i * p.nb_1.x]);
    }
    return vec3f(ms, sp);
}

// cross_entropy_loss, step 1: dst [rows] gets each row's -sum(p * log_softmax(x)) * p.f.x.
@compute @workgroup_size(WG)
fn k_cross_entropy_loss_rowwise(@builtin(global_invocation_id) gid: vec3u,
                                @builtin(num_workgroups) nwg: vec3u) {
    let row = flat_id(gid, nwg); if (row >= p.n) { return; }
    let b = row_bases(row_start(row));
    let ms = ce_row_stats_rowwise(b);
    var px = 0.0;
    for (var i = 0u; i < p.ne_0.x; i++) {
        px += f32(src1[b.z + i * p.nb_1.x]) * (f32(src0[b.y + i * p.nb_0.x]) - ms.x);
    }
    dst[at_d(unravel(row, p.ne_d))] = to_TD((ms.z * log(ms.y) - px) * p.f.x);
}

// cross_entropy_loss_back: dx = (softmax(x) * sum(p) - p) * dloss * p.f.x.
@compute @workgroup_size(WG)
fn k_cross_entropy_loss_back_rowwise(@builtin(global_invocation_id) gid: vec3u,
                                     @builtin(num_workgroups) nwg: vec3u) {
    let row = flat_id(gid, nwg); if (row >= p.n) { return; }
    let b = row_bases(row_start(row));
    let ms = ce_row_stats_rowwise(b);
    let k = f32(src2[at_2(vec4u(0u))]) * p.f.x;
    let sk = ms.z / ms.y;
    for (var i = 0u; i < p.ne_0.x; i++) {
        dst[b.x + i * p.nb_d.x] = to_TD((exp(f32(src0[b.y + i * p.nb_0.x]) - ms.x) * sk
                                   - f32(src1[b.z + i * p.nb_1.x])) * k);
    }
}

// -- cross_entropy_ids and its backward: src0 logits x; src1_i32 target ids and src2 row
// weights w, both shaped like x's rows (ids.xyz = x.yzw); a negative id ignores its row (0
// loss, 0 gradient, whatever its weight and logits). Ids >= the row length are clamped to
// the last column: the kernels never read outside the row. For counted rows the arithmetic
// is cross_entropy_loss's with a one-hot p, term by term.

// int32 view of binding 3: the ce_ids kernels read ids through it and never use src1.
@group(0) @binding(3) var<storage, read_write> src1_i32: array<i32>;

fn ce_id(r: vec4u) -> i32 { return src1_i32[at_1(vec4u(r.yzw, 0u))]; }
fn ce_weight(r: vec4u) -> f32 { return f32(src2[at_2(vec4u(r.yzw, 0u))]); }
fn ce_col(id: i32) -> u32 { return min(u32(id), p.ne_0.x - 1u); }

// The row max of logits src0 and sum(exp(x - max)) (in x, y).
fn ce_ids_stats(lid: u32, r: vec4u) -> vec4f {
    var acc = vec4f(LOWEST, 0.0, 0.0, 0.0);
    for (var i = lid; i < p.ne_0.x; i += WG) { acc = ms_add(acc, f32(src0[at_0(vec4u(i, r.yzw))])); }
    return workgroup_ms(lid, acc);
}

// cross_entropy_ids, step 1: dst [rows] gets each row's w * (log(sum(exp(x - m))) - (x[id] - m)).
@compute @workgroup_size(WG)
fn k_cross_entropy_ids(@builtin(local_invocation_id) lid: vec3u,
                       @builtin(workgroup_id) wid: vec3u, @builtin(num_workgroups) nwg: vec3u) {
    let row = flat_group(wid, nwg);
    if (row >= p.n) { return; }
    let r = row_start(row);
    let ms = ce_ids_stats(lid.x, r);
    if (lid.x == 0u) {
        let id = ce_id(r);
        var loss = 0.0;
        if (id >= 0) {
            loss = (log(ms.y) - (f32(src0[at_0(vec4u(ce_col(id), r.yzw))]) - ms.x)) * ce_weight(r);
        }
        dst[at_d(unravel(row, p.ne_d))] = to_TD(loss);
    }
}

// cross_entropy_ids_back: src3 dloss (one element); dx = (softmax(x) - onehot(id)) * w * dloss.
@compute @workgroup_size(WG)
fn k_cross_entropy_ids_back(@builtin(local_invocation_id) lid: vec3u,
                            @builtin(workgroup_id) wid: vec3u,
                            @builtin(num_workgroups) nwg: vec3u) {
    let row = flat_group(wid, nwg);
    if (row >= p.n) { return; }
    let r = row_start(row);
    let ms = ce_ids_stats(lid.x, r);
    let id = ce_id(r);
    let k = f32(src3[at_3(vec4u(0u))]) * ce_weight(r);
    let inv = 1.0 / ms.y;
    for (var i = lid.x; i < p.ne_0.x; i += WG) {
        let idx = vec4u(i, r.yzw);
        let d = (exp(f32(src0[at_0(idx)]) - ms.x) * inv - select(0.0, 1.0, i == ce_col(id))) * k;
        dst[at_d(idx)] = to_TD(select(0.0, d, id >= 0));
    }
}

// The rowwise variants: one invocation per row.
fn ce_ids_stats_rowwise(b0: u32) -> vec2f {
    var ms = vec2f(LOWEST, 0.0);
    for (var i = 0u; i < p.ne_0.x; i++) { ms = ms_add_row(ms, f32(src0[b0 + i * p.nb_0.x])); }
    return ms;
}

@compute @workgroup_size(WG)
fn k_cross_entropy_ids_rowwise(@builtin(global_invocation_id) gid: vec3u,
                               @builtin(num_workgroups) nwg: vec3u) {
    let row = flat_id(gid, nwg); if (row >= p.n) { return; }
    let r = row_start(row);
    let id = ce_id(r);
    var loss = 0.0;
    if (id >= 0) {
        let b0 = at_0(r);
        let ms = ce_ids_stats_rowwise(b0);
        loss = (log(ms.y) - (f32(src0[b0 + ce_col(id) * p.nb_0.x]) - ms.x)) * ce_weight(r);
    }
    dst[at_d(unravel(row, p.ne_d))] = to_TD(loss);
}

@compute @workgroup_size(WG)
fn k_cross_entropy_ids_back_rowwise(@builtin(global_invocation_id) gid: vec3u,
                                    @builtin(num_workgroups) nwg: vec3u) {
    let row = flat_id(gid, nwg); if (row >= p.n) { return; }
    let r = row_start(row);
    let bd = at_d(r);
    let id = ce_id(r);
    if (id < 0) {
        for (var i = 0u; i < p.ne_0.x; i++) { dst[bd + i * p.nb_d.x] = to_TD(0.0); }
        return;
    }
    let b0 = at_0(r);
    let ms = ce_ids_stats_rowwise(b0);
    let k = f32(src3[at_3(vec4u(0u))]) * ce_weight(r);
    let inv = 1.0 / ms.y;
    let col = ce_col(id);
    for (var i = 0u; i < p.ne_0.x; i++) {
        dst[bd + i * p.nb_d.x] = to_TD((exp(f32(src0[b0 + i * p.nb_0.x]) - ms.x) * inv
                                  - select(0.0, 1.0, i == col)) * k);
    }
}
