// Frozen weights in ggml block types (ggwgpu/quant.py), dequantized inside the kernels by
// quad() of quant_blocks.wgsl. ne_0 and nb_0 count values. p.u.x is the type (TYPE_CODE in
// ggwgpu/ops/quant.py): one kernel branches on it for every type.
// #include product
// #include quant_blocks

// The int32 view of src1 (src1_v4 is common.wgsl's): an entry point uses either the alias or
// the f32 name of a binding, never both.
@group(0) @binding(3) var<storage, read_write> src1_i32: array<i32>;

// mul_mat_q: src0 w [.., M, K] frozen, src1_v4 x [.., N, K] f32 -> dst [.., N, M],
// dst[n, m] = sum_k w[m, k] x[n, k]. ggml order: ne_0 = (K, M, w2, w3), ne_d = (M, N, x2, x3);
// x's batch entry j reads w's j / (x / w), as mul_mat. x is read as vec4s: contiguous along
// K, offset and strides multiples of 4 (ops/quant.py copies it so when it is not). Each
// invocation computes 4 weight rows x 8 tokens: a quad of each of the 4 rows, dequantized
// once, feeds 8 tokens. Out-of-range rows are clamped on load and skipped on store.
@compute @workgroup_size(WG)
fn k_mul_mat_q(@builtin(global_invocation_id) gid: vec3u, @builtin(num_workgroups) nwg: vec3u) {
    let t = flat_id(gid, nwg); if (t >= p.n) { return; }
    let M = p.ne_d.x;
    let N = p.ne_d.y;
    let K = p.ne_0.x;
    let tile = product_tile(t, 4u, 8u);
    let m0 = tile.x;
    let n0 = tile.y;
    let offsets = batch_offsets(tile.z);
    let w_base = offsets.y;
    let x_base = p.off.z + offsets.z;
    var w_row: vec4u;
    for (var r = 0u; r < 4u; r++) { w_row[r] = w_base + min(m0 + r, M - 1u) * K; }
    var x_row: array<u32, 8>;      // in vec4s
    for (var j = 0u; j < 8u; j++) { x_row[j] = (x_base + min(n0 + j, N - 1u) * p.nb_1.y) / 4u; }
    var acc: array<vec4f, 8>;  // acc[n][m]
    for (var k = 0u; k < K; k += 4u) {
        let w0 = quad(p.u.x, w_row.x + k);
        let w1 = quad(p.u.x, w_row.y + k);
        let w2 = quad(p.u.x, w_row.z + k);
        let w3 = quad(p.u.x, w_row.w + k);
        for (var j = 0u; j < 8u; j++) {
            let xv = vec4f(src1_v4[x_row[j] + k / 4u]);
            acc[j] += vec4f(dot(w0, xv), dot(w1, xv), dot(w2, xv), dot(w3, xv));
        }
    }
    for (var j = 0u; j < 8u; j++) {
        if (n0 + j < N) { store_product4(p.off.x + offsets.x, n0 + j, m0, acc[j]); }
    }
}

// mul_mat_q_back: src0 w [.., M, K] frozen, src1 g [.., N, M] f32, any strides -> dst
// [.., N, K], dst[n, k] = sum_m g[n, m] w[m, k] (the gradient of mul_mat_q w.r.t. x).
// ggml order: ne_0 = (K, M, w2, w3), ne_1 = (M, N, g2, g3), ne_d = (K, N, g2, g3). Each
// invocation computes one quad of k x 8 tokens: per weight row, one dequantized quad feeds 8
// tokens. A dispatch sums the rows m in [p.u.y, p.u.z), and with p.u.w = 1 adds to dst (the
// sum of the rows before): long sums are cut into dispatches (ops/quant.py).
@compute @workgroup_size(WG)
fn k_mul_mat_q_back(@builtin(global_invocation_id) gid: vec3u, @builtin(num_workgroups) nwg: vec3u) {
    let t = flat_id(gid, nwg); if (t >= p.n) { return; }
    let K = p.ne_d.x;
    let N = p.ne_d.y;
    let M = p.ne_0.y;
    let tile = product_tile(t, 4u, 8u);                // dst is [.., N, K]: k along x
    let k0 = tile.x;
    let n0 = tile.y;
    let offsets = batch_offsets(tile.z);
    let w_base = offsets.y + k0;
    let g_base = p.off.z + offsets.z;
    var g_row: array<u32, 8>;
    for (var j = 0u; j < 8u; j++) { g_row[j] = g_base + min(n0 + j, N - 1u) * p.nb_1.y; }
    var acc: array<vec4f, 8>;  // acc[n][k0 ..]
    for (var m = p.u.y; m < min(M, p.u.z); m++) {
        let wv = quad(p.u.x, w_base + m * K);
        let gm = m * p.nb_1.x;
        for (var j = 0u; j < 8u; j++) { acc[j] += f32(src1[g_row[j] + gm]) * wv; }
    }
    let d = p.off.x + offsets.x;
    for (var j = 0u; j < 8u; j++) {
        if (n0 + j < N) {
            if (p.u.w == 1u) { acc[j] += load_product4(d, n0 + j, k0); }
            store_product4(d, n0 + j, k0, acc[j]);
        }
    }
}

// get_rows_q: src0 table [n_cols, n_rows] (ggml order) frozen, src1_i32 ids [ne_1.xyz];
// dst [n_cols, ne_1.xyz] f32. One invocation per dst element; ids are clamped to the table.
@compute @workgroup_size(WG)
fn k_get_rows_q(@builtin(global_invocation_id) gid: vec3u, @builtin(num_workgroups) nwg: vec3u) {
    let i = flat_id(gid, nwg); if (i >= p.n) { return; }
    let idx = unravel(i, p.ne_d);                       // (col, id index)
    let row = u32(clamp(src1_i32[at_1(vec4u(idx.yzw, 0u))], 0, i32(p.ne_0.y) - 1));
    let e = row * p.ne_0.x + idx.x;
    var v = quad(p.u.x, e - e % 4u);
    dst[at_d(idx)] = to_TD(v[e % 4u]);
}

// The int32 view of src2: mul_mat_id_q's ids.
@group(0) @binding(4) var<storage, read_write> src2_i32: array<i32>;

// The expert of slot (j, t) of ids [k, T] (src2_i32), clamped to the E experts.
fn expert_of(j: u32, t: u32, n_expert: u32) -> u32 {
    return u32(clamp(src2_i32[at_2(vec4u(j, t, 0u, 0u))], 0, i32(n_expert) - 1));
}

// mul_mat_id_q: src0 w [K, M, E] frozen, src1 x [K, nb, T] (any strides), src2_i32 ids
// [k, T] -> dst [M, k, T], dst[m, j, t] = w[:, m, ids[j, t]] . x[:, j % nb, t]. One
// invocation per element of dst, a quad of its weight row dequantized at a time.
@compute @workgroup_size(WG)
fn k_mul_mat_id_q(@builtin(global_invocation_id) gid: vec3u, @builtin(num_workgroups) nwg: vec3u) {
    let i = flat_id(gid, nwg); if (i >= p.n) { return; }
    let idx = unravel(i, p.ne_d);                       // (m, slot j, token t)
    let K = p.ne_0.x;
    let row = (expert_of(idx.y, idx.z, p.ne_0.z) * p.ne_0.y + idx.x) * K;
    let x = vec4u(0u, idx.y % p.ne_1.y, idx.z, 0u);
    var acc = 0.0;
    for (var k = 0u; k < K; k += 4u) {
        let xv = vec4f(f32(src1[at_1(x + vec4u(k, 0u, 0u, 0u))]),
                       f32(src1[at_1(x + vec4u(k + 1u, 0u, 0u, 0u))]),
                       f32(src1[at_1(x + vec4u(k + 2u, 0u, 0u, 0u))]),
                       f32(src1[at_1(x + vec4u(k + 3u, 0u, 0u, 0u))]));
        acc += dot(quad(p.u.x, row + k), xv);
    }
    dst[at_d(idx)] = to_TD(acc);
}

// mul_mat_id_q_back: src0 w [K, M, E] frozen, src1 g [M, k, T] (any strides), src2_i32 ids
// [k, T] -> dst [K, k, T], dst[:, j, t] = sum_m g[m, j, t] w[:, m, ids[j, t]]. One
// invocation per quad of dst along K (K is a multiple of 4: check_frozen).
@compute @workgroup_size(WG)
fn k_mul_mat_id_q_back(@builtin(global_invocation_id) gid: vec3u, @builtin(num_workgroups) nwg: vec3u) {
    let i = flat_id(gid, nwg); if (i >= p.n) { return; }
    let idx = unravel(i * 4u, p.ne_d);                  // (k0, slot j, token t)
    let K = p.ne_0.x;
    let M = p.ne_0.y;
    let base = expert_of(idx.y, idx.z, p.ne_0.z) * M * K + idx.x;
    var acc = vec4f(0.0);
    for (var m = 0u; m < M; m++) {
        acc += f32(src1[at_1(vec4u(m, idx.y, idx.z, 0u))]) * quad(p.u.x, base + m * K);
    }
    for (var c = 0u; c < 4u; c++) { dst[at_d(idx + vec4u(c, 0u, 0u, 0u))] = to_TD(acc[c]); }
}
