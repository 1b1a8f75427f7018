// k_mul_mat_subgroup: mul_mat (see matmul.wgsl) for CPU adapters such as Mesa's lavapipe.
// Its own file: subgroup builtins compile only on devices with the 'subgroup' feature.
//
// On a CPU device the invocations of a subgroup are the lanes of one SIMD register and every
// storage-buffer load is a loop over the lanes, one element at a time: loads, not
// multiply-adds, bound the speed, and shared memory does not help (its loads are the same
// loop, plus barriers). So each element is loaded once per subgroup and shared in registers:
// a workgroup is one subgroup of 8 invocations; invocation `lane` owns 4 rows of a
// (m0 .. m0 + 3) and loads rows n0 + lane and n0 + 8 + lane of b; subgroupBroadcast hands
// each invocation all 16 rows of b. The workgroup computes a 32 x 16 tile of dst: per vec4
// along K, 6 vec4 loads per invocation feed 256 multiply-adds. Named accumulators and
// unrolled broadcasts (their lane must be a constant) keep everything in registers.
// Needs subgroups of at least 8 invocations (lavapipe: the SIMD width, 8 or 16); the
// backend picks this kernel only there. Operands and epilogue as for k_mul_mat_tiled.
// #include product

fn times4(a: array<vec4f, 4>, b: vec4f) -> vec4f {
    return vec4f(dot(a[0], b), dot(a[1], b), dot(a[2], b), dot(a[3], b));
}

@compute @workgroup_size(8)
fn k_mul_mat_subgroup(@builtin(subgroup_invocation_id) lane: u32,
                      @builtin(workgroup_id) wid: vec3u, @builtin(num_workgroups) nwg: vec3u) {
    let g = flat_group(wid, nwg); if (g >= p.n) { return; }  // the whole workgroup
    let M = p.ne_d.x;
    let N = p.ne_d.y;
    let K4 = p.ne_0.x / 4u;
    let tile = product_tile(g, 32u, 16u);
    let m0 = tile.x + lane * 4u;
    let n0 = tile.y;
    let base = product_bases(tile.z);
    let a_base = base.y / 4u;
    let a_stride = p.nb_0.y / 4u;
    let a_row = vec4u(a_base + min(m0, M - 1u) * a_stride, a_base + min(m0 + 1u, M - 1u) * a_stride,
                      a_base + min(m0 + 2u, M - 1u) * a_stride, a_base + min(m0 + 3u, M - 1u) * a_stride);
    let b_row0 = base.z / 4u + min(n0 + lane, N - 1u) * (p.nb_1.y / 4u);
    let b_row1 = base.z / 4u + min(n0 + 8u + lane, N - 1u) * (p.nb_1.y / 4u);
    // acc<j>: dst[n0 + j, m0 .. m0 + 3]
    var acc0 = vec4f(); var acc1 = vec4f(); var acc2 = vec4f(); var acc3 = vec4f();
    var acc4 = vec4f(); var acc5 = vec4f(); var acc6 = vec4f(); var acc7 = vec4f();
    var acc8 = vec4f(); var acc9 = vec4f(); var acc10 = vec4f(); var acc11 = vec4f();
    var acc12 = vec4f(); var acc13 = vec4f(); var acc14 = vec4f(); var acc15 = vec4f();
    for (var k = 0u; k < K4; k++) {
        let a = array<vec4f, 4>(vec4f(src0_v4[a_row.x + k]), vec4f(src0_v4[a_row.y + k]),
                                vec4f(src0_v4[a_row.z + k]), vec4f(src0_v4[a_row.w + k]));
        let b0 = vec4f(src1_v4[b_row0 + k]);
        let b1 = vec4f(src1_v4[b_row1 + k]);
        acc0 += times4(a, subgroupBroadcast(b0, 0u));
        acc1 += times4(a, subgroupBroadcast(b0, 1u));
        acc2 += times4(a, subgroupBroadcast(b0, 2u));
        acc3 += times4(a, subgroupBroadcast(b0, 3u));
        acc4 += times4(a, subgroupBroadcast(b0, 4u));
        acc5 += times4(a, subgroupBroadcast(b0, 5u));
        acc6 += times4(a, subgroupBroadcast(b0, 6u));
        acc7 += times4(a, subgroupBroadcast(b0, 7u));
        acc8 += times4(a, subgroupBroadcast(b1, 0u));
        acc9 += times4(a, subgroupBroadcast(b1, 1u));
        acc10 += times4(a, subgroupBroadcast(b1, 2u));
        acc11 += times4(a, subgroupBroadcast(b1, 3u));
        acc12 += times4(a, subgroupBroadcast(b1, 4u));
        acc13 += times4(a, subgroupBroadcast(b1, 5u));
        acc14 += times4(a, subgroupBroadcast(b1, 6u));
        acc15 += times4(a, subgroupBroadcast(b1, 7u));
    }
    let acc = array<vec4f, 16>(acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7,
                               acc8, acc9, acc10, acc11, acc12, acc13, acc14, acc15);
    let d = base.x;
    if (p.nb_d.x == 1u && p.nb_d.y % 4u == 0u && d % 4u == 0u && m0 + 4u <= M && n0 + 16u <= N) {
        for (var j = 0u; j < 16u; j++) {
            dst_v4[(d + (n0 + j) * p.nb_d.y + m0) / 4u] =
                to_TD4(product_epilogue(tile.z, n0 + j, m0, acc[j]));
        }
        return;
    }
    for (var j = 0u; j < 16u; j++) {
        if (n0 + j < N) {
            store_product4(d, n0 + j, m0, product_epilogue(tile.z, n0 + j, m0, acc[j]));
        }
    }
}

// k_mul_mat_subgroup_t: the same product with both operands stored K-outermost (out_prod's,
// read as they lie rather than copied): a[m, k] at k * nb_0.x + m, b[n, k] at k * nb_1.x + n,
// read as vec4s along m and n (nb_0.y == nb_1.y == 1; offsets and other strides multiples
// of 4); K needs no alignment. Two steps of k at a time: lanes 0..3 load b[k, n0 .. n0 + 15]
// as 4 vec4s, lanes 4..7 b[k + 1, ..]; 8 broadcasts hand every lane all 32 values, which
// meet the lane's own a[k, m0 .. m0 + 3] and a[k + 1, ..]: per lane 3 vec4 loads for 128
// multiply-adds, as k_mul_mat_subgroup.
@compute @workgroup_size(8)
fn k_mul_mat_subgroup_t(@builtin(subgroup_invocation_id) lane: u32,
                        @builtin(workgroup_id) wid: vec3u, @builtin(num_workgroups) nwg: vec3u) {
    let g = flat_group(wid, nwg); if (g >= p.n) { return; }  // the whole workgroup
    let M = p.ne_d.x;
    let N = p.ne_d.y;
    let K = p.ne_0.x;
    let tile = product_tile(g, 32u, 16u);
    let m0 = tile.x + lane * 4u;
    let n0 = tile.y;
    let base = product_bases(tile.z);
    // columns past M or N are clamped on load, never stored
    let a_col = (base.y + min(m0, (M - 1u) & ~3u)) / 4u;
    let b_col = (base.z + min(n0 + (lane % 4u) * 4u, (N - 1u) & ~3u)) / 4u;
    let a_k = p.nb_0.x / 4u;
    let b_k = p.nb_1.x / 4u;
    let b_step = lane / 4u;
    var acc0 = vec4f(); var acc1 = vec4f(); var acc2 = vec4f(); var acc3 = vec4f();
    var acc4 = vec4f(); var acc5 = vec4f(); var acc6 = vec4f(); var acc7 = vec4f();
    var acc8 = vec4f(); var acc9 = vec4f(); var acc10 = vec4f(); var acc11 = vec4f();
    var acc12 = vec4f(); var acc13 = vec4f(); var acc14 = vec4f(); var acc15 = vec4f();
    for (var k = 0u; k < K; k += 2u) {
        let a0 = vec4f(src0_v4[a_col + k * a_k]);
        // an odd K's last step: a row of zeros stands in for k + 1
        let a1 = select(vec4f(), vec4f(src0_v4[a_col + min(k + 1u, K - 1u) * a_k]), k + 1u < K);
        let bv = vec4f(src1_v4[b_col + min(k + b_step, K - 1u) * b_k]);
        let c0 = subgroupBroadcast(bv, 0u);   // b[k, n0 + 0 .. 3]
        let c1 = subgroupBroadcast(bv, 1u);
        let c2 = subgroupBroadcast(bv, 2u);
        let c3 = subgroupBroadcast(bv, 3u);
        let d0 = subgroupBroadcast(bv, 4u);   // b[k + 1, n0 + 0 .. 3]
        let d1 = subgroupBroadcast(bv, 5u);
        let d2 = subgroupBroadcast(bv, 6u);
        let d3 = subgroupBroadcast(bv, 7u);
        acc0 += a0 * c0.x + a1 * d0.x;
        acc1 += a0 * c0.y + a1 * d0.y;
        acc2 += a0 * c0.z + a1 * d0.z;
        acc3 += a0 * c0.w + a1 * d0.w;
        acc4 += a0 * c1.x + a1 * d1.x;
        acc5 += a0 * c1.y + a1 * d1.y;
        acc6 += a0 * c1.z + a1 * d1.z;
        acc7 += a0 * c1.w + a1 * d1.w;
        acc8 += a0 * c2.x + a1 * d2.x;
        acc9 += a0 * c2.y + a1 * d2.y;
        acc10 += a0 * c2.z + a1 * d2.z;
        acc11 += a0 * c2.w + a1 * d2.w;
        acc12 += a0 * c3.x + a1 * d3.x;
        acc13 += a0 * c3.y + a1 * d3.y;
        acc14 += a0 * c3.z + a1 * d3.z;
        acc15 += a0 * c3.w + a1 * d3.w;
    }
    let acc = array<vec4f, 16>(acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7,
                               acc8, acc9, acc10, acc11, acc12, acc13, acc14, acc15);
    for (var j = 0u; j < 16u; j++) {
        if (n0 + j < N) {
            store_product4(base.x, n0 + j, m0, product_epilogue(tile.z, n0 + j, m0, acc[j]));
        }
    }
}
