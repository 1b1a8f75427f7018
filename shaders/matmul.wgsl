// mul_mat (ggml semantics): src0 a [.., M, K], src1 b [.., N, K] -> dst [.., N, M],
// dst[n, m] = sum_k a[m, k] * b[n, k]. In ggml order: ne_0 = (K, M, a2, a3),
// ne_1 = (K, N, b2, b3), ne_d = (M, N, b2, b3); a is broadcast over b's batch entries
// (product_bases in product.wgsl). Out-of-range rows are clamped on load, skipped on store.
// Three kernels: k_mul_mat reads any strides; k_mul_mat_tiled (here) and
// k_mul_mat_subgroup (matmul_subgroup.wgsl) read vec4s along K, which ops/matmul.py
// arranges, and are chosen per adapter. Each applies product_epilogue (product.wgsl) to
// what it stores: alpha, and mul_mat_acc's c; or k_mul_mat_splits does, after adding up
// the sums of K's chunks that the tiled kernel computed side by side (ops/matmul.py).
// #include tiles

// k_mul_mat: any strides (out_prod's transposed views, K % 4 != 0). Each invocation
// computes a 4x4 tile of dst in registers.
@compute @workgroup_size(WG)
fn k_mul_mat(@builtin(global_invocation_id) gid: vec3u, @builtin(num_workgroups) nwg: vec3u) {
    let t = flat_id(gid, nwg); if (t >= p.n) { return; }
    let M = p.ne_d.x;
    let N = p.ne_d.y;
    let K = p.ne_0.x;
    let tile = product_tile(t, 4u, 4u);
    let m0 = tile.x;
    let n0 = tile.y;
    let base = product_bases(tile.z);
    var a_row: vec4u;
    var b_row: vec4u;
    for (var r = 0u; r < 4u; r++) {
        a_row[r] = base.y + min(m0 + r, M - 1u) * p.nb_0.y;
        b_row[r] = base.z + min(n0 + r, N - 1u) * p.nb_1.y;
    }
    var acc: array<vec4f, 4>;  // acc[n][m]
    for (var k = 0u; k < K; k++) {
        let ka = k * p.nb_0.x;
        let kb = k * p.nb_1.x;
        let av = vec4f(f32(src0[a_row.x + ka]), f32(src0[a_row.y + ka]), f32(src0[a_row.z + ka]), f32(src0[a_row.w + ka]));
        acc[0] += av * f32(src1[b_row.x + kb]);
        acc[1] += av * f32(src1[b_row.y + kb]);
        acc[2] += av * f32(src1[b_row.z + kb]);
        acc[3] += av * f32(src1[b_row.w + kb]);
    }
    for (var j = 0u; j < 4u; j++) {
        if (n0 + j < N) {
            store_product4(base.x, n0 + j, m0, product_epilogue(tile.z, n0 + j, m0, acc[j]));
        }
    }
}

// The vec4 at `at` of b (is_b) or a; is_b is a constant at each call, so one load remains.
fn load_operand4(at: u32, is_b: bool) -> vec4f {
    if (is_b) { return vec4f(src1_v4[at]); }
    return vec4f(src0_v4[at]);
}

fn operand_bases(batch: u32) -> vec3u { return product_bases(batch); }

// The tiled kernels (tiles.wgsl), for GPUs: k_mul_mat_tiled, _small, _wide.
// #include mul_mat_tile_entries

// k_mul_mat_splits: dst[n, m] = the epilogue of the sum over s of src0[s, n, m], the sums of
// p.u.y chunks of K (src0 contiguous [chunks, N, M], unscaled); one invocation per 4
// consecutive m of a row, in chunk order. src2: mul_mat_acc's c where p.u.x = 1.
@compute @workgroup_size(WG)
fn k_mul_mat_splits(@builtin(global_invocation_id) gid: vec3u, @builtin(num_workgroups) nwg: vec3u) {
    let t = flat_id(gid, nwg); if (t >= p.n) { return; }
    let M = p.ne_d.x;
    let m4 = (M + 3u) / 4u;
    let n = t / m4;
    let m = (t % m4) * 4u;
    let plane = M * p.ne_d.y;
    var v = vec4f();
    for (var s = 0u; s < p.u.y; s++) {
        let row = p.off.y + s * plane + n * M;
        for (var r = 0u; r < 4u; r++) { v[r] += f32(src0[row + min(m + r, M - 1u)]); }
    }
    store_product4(p.off.x, n, m, product_epilogue(0u, n, m, v));
}
