// Fused attention (flash_attn, flash_attn_ext) and their backward (flash_attn_back,
// flash_attn_ext_back), one invocation per query row (or key row), an online softmax over
// the keys, no score matrix in memory. One body for both: flash_attn is flash_attn_ext with
// the causal rule instead of a mask.
// Bindings of every entry point (ggml order, x = innermost):
//   src0 mask (n_kv', n_q', n_head', batch'), tiled: element (j, i, h, b) reads
//        (j % n_kv', i % n_q', ..); unread without a mask (p.u.z = 0; k is bound there)
//   src1 k, src2 v (d, n_kv, n_head_kv, batch_kv)
//   src3 q (d, n_q, n_head, batch), or the backward's scratch whose rows start with q
// query head h reads kv head h / (n_head / n_head_kv), batch likewise.
// p.f.x = scale; p.u.x = causal: query i sees key j only if j <= i + n_kv - n_q;
// p.u.z = 1: add the mask to the scores, and hide the keys where it is -inf.
// A query row that sees no key gives 0 (ggml's flash_attn_ext) and takes no gradient.
// Any strides for q, k, v, mask, dout (views); rows are read through nb.
// #include common

const MAX_D: u32 = 256u;  // head dim bound (checked by the shape rule)

// Per-invocation rows of d floats.
var<private> row_a: array<f32, MAX_D>;
var<private> row_b: array<f32, MAX_D>;
var<private> acc_a: array<f32, MAX_D>;
var<private> acc_b: array<f32, MAX_D>;

fn head_dim() -> u32 { return p.ne_1.x; }

// A query row r (flat over n_q, n_head, batch) and the kv head / batch it reads.
struct QRow { i: u32, h: u32, b: u32, hk: u32, bk: u32 }

fn query_row(r: u32) -> QRow {
    let i = r % p.ne_3.y;
    let h = (r / p.ne_3.y) % p.ne_3.z;
    let b = r / (p.ne_3.y * p.ne_3.z);
    return QRow(i, h, b, h / (p.ne_3.z / p.ne_1.z), b / (p.ne_3.w / p.ne_1.w));
}

// Keys query i may see: [0, kv_end(i)) (the causal rule; a mask hides more).
fn kv_end(i: u32) -> u32 {
    if (p.u.x != 0u) { return min(p.ne_1.y, i + 1u + p.ne_1.y - p.ne_3.y); }
    return p.ne_1.y;
}

// The additive mask of query (i, h, b) and key j; 0 without one.
fn mask_at(i: u32, j: u32, h: u32, b: u32) -> f32 {
    if (p.u.z == 0u) { return 0.0; }
    return f32(src0[at_0(vec4u(j % p.ne_0.x, i % p.ne_0.y, h % p.ne_0.z, b % p.ne_0.w))]);
}

fn hidden(m: f32) -> bool { return m < LOWEST; }  // -inf

// q row (i, h, b), element c: from q itself or from the scratch rows that start with it.
fn q_at(i: u32, h: u32, b: u32, c: u32) -> f32 { return f32(src3[at_3(vec4u(c, i, h, b))]); }

fn dot_k(a: ptr<private, array<f32, MAX_D>>, kb: u32) -> f32 {
    var s = 0.0;
    for (var c = 0u; c < head_dim(); c++) { s += (*a)[c] * f32(src1[kb + c * p.nb_1.x]); }
    return s;
}

fn dot_v(a: ptr<private, array<f32, MAX_D>>, vb: u32) -> f32 {
    var s = 0.0;
    for (var c = 0u; c < head_dim(); c++) { s += (*a)[c] * f32(src2[vb + c * p.nb_2.x]); }
    return s;
}

// Online softmax of query row q over its visible keys: acc_a = sum_j exp(s_j - m) v_j,
// returns (m, l = sum_j exp(s_j - m)); l = 0 when no key is visible. row_a holds the query.
fn attend(q: QRow) -> vec2f {
    let d = head_dim();
    for (var c = 0u; c < d; c++) { row_a[c] = q_at(q.i, q.h, q.b, c); acc_a[c] = 0.0; }
    var m = LOWEST;
    var l = 0.0;
    for (var j = 0u; j < kv_end(q.i); j++) {
        let mv = mask_at(q.i, j, q.h, q.b);
        if (hidden(mv)) { continue; }
        let s = p.f.x * dot_k(&row_a, at_1(vec4u(0u, j, q.hk, q.bk))) + mv;
        if (s > m) {  // new max: rescale what was summed so far
            let r = exp(m - s);
            l *= r;
            for (var c = 0u; c < d; c++) { acc_a[c] *= r; }
            m = s;
        }
        let e = exp(s - m);
        l += e;
        let vb = at_2(vec4u(0u, j, q.hk, q.bk));
        for (var c = 0u; c < d; c++) { acc_a[c] += e * f32(src2[vb + c * p.nb_2.x]); }
    }
    return vec2f(m, l);
}

// 1 / l, or 0 for a row that sees no key.
fn inv_sum(l: f32) -> f32 { return select(1.0 / l, 0.0, l == 0.0); }

// flash_attn, flash_attn_ext: dst (d, n_q, n_head, batch); p.n query rows.
@compute @workgroup_size(WG)
fn k_flash_attn(@builtin(global_invocation_id) gid: vec3u, @builtin(num_workgroups) nwg: vec3u) {
    let r = flat_id(gid, nwg); if (r >= p.n) { return; }
    let q = query_row(r);
    let inv = inv_sum(attend(q).y);
    for (var c = 0u; c < head_dim(); c++) {
        dst[at_d(vec4u(c, q.i, q.h, q.b))] = to_TD(acc_a[c] * inv);
    }
}

// The backward keeps, per query row, a scratch row [q (d) | dout (d) | lse | D]
// (dst here, src3 in the later passes); dout is copied in before this pass (a dispatch
// binds at most four sources).
// Pass 1: copy q in, lse = m + log(l) and D = dout . out; both 0 for a row that sees no key.
@compute @workgroup_size(WG)
fn k_flash_attn_back_stats(@builtin(global_invocation_id) gid: vec3u,
                           @builtin(num_workgroups) nwg: vec3u) {
    let r = flat_id(gid, nwg); if (r >= p.n) { return; }
    let q = query_row(r);
    let ml = attend(q);
    let d = head_dim();
    let sb = at_d(vec4u(0u, q.i, q.h, q.b));
    var delta = 0.0;
    for (var c = 0u; c < d; c++) {
        dst[sb + c * p.nb_d.x] = to_TD(row_a[c]);
        delta += f32(dst[sb + (d + c) * p.nb_d.x]) * acc_a[c];
    }
    let seen = ml.y > 0.0;
    dst[sb + 2u * d * p.nb_d.x] = to_TD(select(0.0, ml.x + log(ml.y), seen));
    dst[sb + (2u * d + 1u) * p.nb_d.x] = to_TD(delta * inv_sum(ml.y));
}

// Pass 2: dQ_i = scale * sum_j P_ij (dout_i . v_j - D_i) k_j.
// dst: dQ (d, n_q, n_head, batch); src3: the scratch.
@compute @workgroup_size(WG)
fn k_flash_attn_back_q(@builtin(global_invocation_id) gid: vec3u,
                       @builtin(num_workgroups) nwg: vec3u) {
    let r = flat_id(gid, nwg); if (r >= p.n) { return; }
    let q = query_row(r);
    let d = head_dim();
    let sb = at_3(vec4u(0u, q.i, q.h, q.b));
    for (var c = 0u; c < d; c++) {
        row_a[c] = f32(src3[sb + c * p.nb_3.x]);
        row_b[c] = f32(src3[sb + (d + c) * p.nb_3.x]);
        acc_a[c] = 0.0;
    }
    let lse = f32(src3[sb + 2u * d * p.nb_3.x]);
    let delta = f32(src3[sb + (2u * d + 1u) * p.nb_3.x]);
    for (var j = 0u; j < kv_end(q.i); j++) {
        let mv = mask_at(q.i, j, q.h, q.b);
        if (hidden(mv)) { continue; }
        let kb = at_1(vec4u(0u, j, q.hk, q.bk));
        let pr = exp(p.f.x * dot_k(&row_a, kb) + mv - lse);
        let ds = pr * (dot_v(&row_b, at_2(vec4u(0u, j, q.hk, q.bk))) - delta);
        for (var c = 0u; c < d; c++) { acc_a[c] += ds * f32(src1[kb + c * p.nb_1.x]); }
    }
    for (var c = 0u; c < d; c++) {
        dst[at_d(vec4u(c, q.i, q.h, q.b))] = to_TD(p.f.x * acc_a[c]);
    }
}

// Pass 3: per key row j of kv head hk, over the queries of every head (and batch) that
// reads it:  dK_j = scale * sum_i P_ij (dout_i . v_j - D_i) q_i,  dV_j = sum_i P_ij dout_i.
// dst: dK (d, n_kv, n_head_kv, batch_kv); dV at dK + p.u.y. src3: the scratch (its shape
// gives n_q, n_head, batch); p.n key rows.
@compute @workgroup_size(WG)
fn k_flash_attn_back_kv(@builtin(global_invocation_id) gid: vec3u,
                        @builtin(num_workgroups) nwg: vec3u) {
    let r = flat_id(gid, nwg); if (r >= p.n) { return; }
    let d = head_dim();
    let n_q = p.ne_3.y;
    let j = r % p.ne_1.y;
    let hk = (r / p.ne_1.y) % p.ne_1.z;
    let bk = r / (p.ne_1.y * p.ne_1.z);
    let kb = at_1(vec4u(0u, j, hk, bk));
    let vb = at_2(vec4u(0u, j, hk, bk));
    for (var c = 0u; c < d; c++) {
        row_a[c] = f32(src1[kb + c * p.nb_1.x]);
        row_b[c] = f32(src2[vb + c * p.nb_2.x]);
        acc_a[c] = 0.0;
        acc_b[c] = 0.0;
    }
    // causal: query i sees key j when i >= j - n_past (n_past = n_kv - n_q >= 0)
    var i0 = 0u;
    if (p.u.x != 0u) {
        let n_past = p.ne_1.y - n_q;
        if (j > n_past) { i0 = j - n_past; }
    }
    let rh = p.ne_3.z / p.ne_1.z;
    let rb = p.ne_3.w / p.ne_1.w;
    for (var b = bk * rb; b < (bk + 1u) * rb; b++) {
        for (var h = hk * rh; h < (hk + 1u) * rh; h++) {
            for (var i = i0; i < n_q; i++) {
                let mv = mask_at(i, j, h, b);
                if (hidden(mv)) { continue; }
                let sb = at_3(vec4u(0u, i, h, b));
                var s = 0.0;
                var dp = 0.0;
                for (var c = 0u; c < d; c++) {
                    s += f32(src3[sb + c * p.nb_3.x]) * row_a[c];
                    dp += f32(src3[sb + (d + c) * p.nb_3.x]) * row_b[c];
                }
                let pr = exp(p.f.x * s + mv - f32(src3[sb + 2u * d * p.nb_3.x]));
                let ds = pr * (dp - f32(src3[sb + (2u * d + 1u) * p.nb_3.x]));
                for (var c = 0u; c < d; c++) {
                    acc_a[c] += ds * f32(src3[sb + c * p.nb_3.x]);
                    acc_b[c] += pr * f32(src3[sb + (d + c) * p.nb_3.x]);
                }
            }
        }
    }
    for (var c = 0u; c < d; c++) {
        let at = at_d(vec4u(c, j, hk, bk));
        dst[at] = to_TD(p.f.x * acc_a[c]);
        dst[at + p.u.y] = to_TD(acc_b[c]);
    }
}
