// Mixture-of-experts routing (ops/experts.py): top_k, one_hot, mul_mat_id, out_prod_id.
// out_prod_id's expert lists come from rows.wgsl's k_rows_clear and k_rows_link.
// #include common

// int32 views of the bindings (an entry point uses either the alias or the f32 name of a
// binding, never both).
@group(0) @binding(1) var<storage, read_write> dst_i32: array<i32>;
@group(0) @binding(2) var<storage, read_write> src0_i32: array<i32>;
@group(0) @binding(4) var<storage, read_write> src2_i32: array<i32>;

// Ids outside [0, n) are clamped: the shaders never read outside the experts.
fn clamp_expert(id: i32, n: u32) -> u32 {
    return u32(clamp(id, 0, i32(n) - 1));
}

fn is_nan(v: f32) -> bool {     // by its bits: compilers may assume v == v
    return (bitcast<u32>(v) & 0x7fffffffu) > 0x7f800000u;
}

// Whether value v at column i sorts before w at column j: larger first, equal ones in column
// order, NaN after every number (a total order: each rank has one column).
fn sorts_before(v: f32, i: u32, w: f32, j: u32) -> bool {
    let nan_v = is_nan(v);
    if (nan_v != is_nan(w)) { return !nan_v; }
    if (!nan_v && v != w) { return v > w; }
    return i < j;
}

// top_k: src0 x [n, rows...]; dst_i32 [k, rows...] (p.u.x = k). One invocation per element
// of x: its rank in its row; the k first write their column at their rank.
@compute @workgroup_size(WG)
fn k_top_k(@builtin(global_invocation_id) gid: vec3u, @builtin(num_workgroups) nwg: vec3u) {
    let i = flat_id(gid, nwg); if (i >= p.n) { return; }
    let idx = unravel(i, p.ne_0);
    let v = f32(src0[at_0(idx)]);
    var rank = 0u;
    for (var c = 0u; c < p.ne_0.x; c++) {
        if (c != idx.x && sorts_before(f32(src0[at_0(vec4u(c, idx.yzw))]), c, v, idx.x)) {
            rank++;
        }
    }
    if (rank < p.u.x) { dst_i32[at_d(vec4u(rank, idx.yzw))] = i32(idx.x); }
}

// one_hot: src0_i32 ids [S]; dst [n, S]. One invocation per element of dst.
@compute @workgroup_size(WG)
fn k_one_hot(@builtin(global_invocation_id) gid: vec3u, @builtin(num_workgroups) nwg: vec3u) {
    let i = flat_id(gid, nwg); if (i >= p.n) { return; }
    let idx = unravel(i, p.ne_d);
    let id = src0_i32[at_0(vec4u(idx.yzw, 0u))];
    dst[at_d(idx)] = to_TD(select(0.0, 1.0, id == i32(idx.x)));
}

// mul_mat_id: src0 a [K, M, E], src1 b [K, nb, T], src2_i32 ids [k, T]; dst [M, k, T].
// One invocation per 4 consecutive m of one slot (p.n of them): the slot's row of b is read
// once for the 4 rows of its expert, each a dot product of length K.
@compute @workgroup_size(WG)
fn k_mul_mat_id(@builtin(global_invocation_id) gid: vec3u, @builtin(num_workgroups) nwg: vec3u) {
    let i = flat_id(gid, nwg); if (i >= p.n) { return; }
    let M = p.ne_d.x;
    let quads = (M + 3u) / 4u;
    let m0 = (i % quads) * 4u;
    let slot = unravel((i / quads) * M, p.ne_d);        // (0, slot j, token t)
    let e = clamp_expert(src2_i32[at_2(vec4u(slot.y, slot.z, 0u, 0u))], p.ne_0.z);
    let b0 = at_1(vec4u(0u, slot.y % p.ne_1.y, slot.z, 0u));
    var a0: vec4u;
    for (var r = 0u; r < 4u; r++) { a0[r] = at_0(vec4u(0u, min(m0 + r, M - 1u), e, 0u)); }
    var acc = vec4f(0.0);
    for (var c = 0u; c < p.ne_0.x; c++) {
        let bv = f32(src1[b0 + c * p.nb_1.x]);
        let at = a0 + vec4u(c * p.nb_0.x);
        acc = fma(vec4f(f32(src0[at.x]), f32(src0[at.y]), f32(src0[at.z]), f32(src0[at.w])),
                  vec4f(bv), acc);
    }
    for (var r = 0u; r < min(4u, M - m0); r++) {
        dst[at_d(vec4u(m0 + r, slot.y, slot.z, 0u))] = to_TD(acc[r]);
    }
}

// out_prod_id: src0 b [K, nb, T], src1 g [M, k, T], src2_i32 links (p.u.x = E experts: the
// head of each expert's slots, then the next slot of each slot t * k + j); dst [K, M, E].
// One invocation per 4 consecutive c of one (m, expert) (p.n of them): the sum over its
// expert's slots, in slot order, each slot's g read once for the 4.
@compute @workgroup_size(WG)
fn k_out_prod_id(@builtin(global_invocation_id) gid: vec3u, @builtin(num_workgroups) nwg: vec3u) {
    let i = flat_id(gid, nwg); if (i >= p.n) { return; }
    let K = p.ne_d.x;
    let quads = (K + 3u) / 4u;
    let c0 = (i % quads) * 4u;
    let me = unravel((i / quads) * K, p.ne_d);          // (0, m, expert)
    let k = p.ne_1.y;
    var cs: vec4u;
    for (var r = 0u; r < 4u; r++) { cs[r] = min(c0 + r, K - 1u) * p.nb_0.x; }
    var s = src2_i32[p.off.w + me.z];
    var acc = vec4f(0.0);
    while (s >= 0) {
        let j = u32(s) % k;
        let t = u32(s) / k;
        let gv = f32(src1[at_1(vec4u(me.y, j, t, 0u))]);
        let at = vec4u(at_0(vec4u(0u, j % p.ne_0.y, t, 0u))) + cs;
        acc = fma(vec4f(f32(src0[at.x]), f32(src0[at.y]), f32(src0[at.z]), f32(src0[at.w])),
                  vec4f(gv), acc);
        s = src2_i32[p.off.w + p.u.x + u32(s)];
    }
    for (var r = 0u; r < min(4u, K - c0); r++) {
        dst[at_d(vec4u(c0 + r, me.y, me.z, 0u))] = to_TD(acc[r]);
    }
}
