// mul_mat (ggml semantics): src0 a [.., M, K], src1 b [.., N, K] -> dst [.., N, M],
// dst[n, m] = sum_k a[m, k] * b[n, k]. In ggml order: ne_0 = (K, M, a2, a3),
// ne_1 = (K, N, b2, b3), ne_d = (M, N, b2, b3); a is broadcast over b's batch entries
// (product_bases in product.wgsl). Out-of-range rows are clamped on load, skipped on store.
// Three kernels: k_mul_mat reads any strides; k_mul_mat_tiled (here) and
// k_mul_mat_subgroup (matmul_subgroup.wgsl) read vec4s along K, which ops/matmul.py
// arranges, and are chosen per adapter. Each applies product_epilogue (product.wgsl) to
// what it stores: alpha, and mul_mat_acc's c.
// #include product

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

// k_mul_mat_tiled, for GPUs: a workgroup of 16 x 16 invocations computes a 64 x 64 tile of
// dst, each invocation a 4 x 4 block of it. Per step of 16 along K the workgroup stages
// 64 x 16 of a and of b in workgroup memory (one vec4 load per invocation each), transposed
// so that the inner loop reads 4 consecutive m (or n) as one vec4. Operands: contiguous
// along K, K % 4 == 0, offsets and row strides multiples of 4 (ops/matmul.py).
const TILE = 64u;
const TILE_K4 = 4u;                                // 16 along K, in vec4s
var<workgroup> tile_a: array<vec4f, 256>;          // [k][m / 4]: 16 x 64 of a
var<workgroup> tile_b: array<vec4f, 256>;          // [k][n / 4]: 16 x 64 of b

@compute @workgroup_size(256)
fn k_mul_mat_tiled(@builtin(local_invocation_index) lid: u32,
                   @builtin(workgroup_id) wid: vec3u, @builtin(num_workgroups) nwg: vec3u) {
    let g = flat_group(wid, nwg); if (g >= p.n) { return; }  // the whole workgroup
    let M = p.ne_d.x;
    let N = p.ne_d.y;
    let K4 = p.ne_0.x / 4u;
    let tile = product_tile(g, TILE, TILE);
    let m0 = tile.x;
    let n0 = tile.y;
    let base = product_bases(tile.z);
    // staging: this invocation loads row `row` of the tile, vec4 number `kq` of the step
    let row = lid / TILE_K4;
    let kq = lid % TILE_K4;
    let a_row = base.y / 4u + min(m0 + row, M - 1u) * (p.nb_0.y / 4u);
    let b_row = base.z / 4u + min(n0 + row, N - 1u) * (p.nb_1.y / 4u);
    let at = kq * 4u * 16u + row / 4u;                 // tile index of (k = 4 kq, row)
    // compute: 4 consecutive m at tx * 4, 4 consecutive n at ty * 4
    let tx = lid % 16u;
    let ty = lid / 16u;
    var acc: array<vec4f, 4>;  // acc[j]: dst[n0 + 4 ty + j, m0 + 4 tx ..]
    for (var k0 = 0u; k0 < K4; k0 += TILE_K4) {
        let inside = k0 + kq < K4;
        let av = select(vec4f(), vec4f(src0_v4[a_row + min(k0 + kq, K4 - 1u)]), inside);
        let bv = select(vec4f(), vec4f(src1_v4[b_row + min(k0 + kq, K4 - 1u)]), inside);
        for (var i = 0u; i < 4u; i++) {
            tile_a[at + i * 16u][row % 4u] = av[i];
            tile_b[at + i * 16u][row % 4u] = bv[i];
        }
        workgroupBarrier();
        for (var k = 0u; k < 16u; k++) {
            let a = tile_a[k * 16u + tx];
            let b = tile_b[k * 16u + ty];
            acc[0] += a * b.x;
            acc[1] += a * b.y;
            acc[2] += a * b.z;
            acc[3] += a * b.w;
        }
        workgroupBarrier();
    }
    for (var j = 0u; j < 4u; j++) {
        let n = n0 + ty * 4u + j;
        if (n < N) {
            let m = m0 + tx * 4u;
            store_product4(base.x, n, m, product_epilogue(tile.z, n, m, acc[j]));
        }
    }
}
