// mul_mat_q and mul_mat_q_back (see quant.wgsl) for CPU adapters such as Mesa's lavapipe,
// whose subgroups are the lanes of one SIMD register. Its own file: subgroup builtins compile
// only on devices with the 'subgroup' feature. The same reasoning as matmul_subgroup.wgsl:
// every storage-buffer load is a loop over the lanes, so each f32 operand is loaded once per
// subgroup and handed to the other lanes by subgroupBroadcast, and each block of a weight row
// is read word by word, each word once (q4_0: 5 words for 32 values, q8_0: 9, f16: 16),
// rather than 4 values at a time with their scale. A workgroup is one subgroup of 8.
// That streaming is written out for the types of the models at hand (f16, bf16, q8_0, q4_0,
// q4_1); the others read their 4 rows through coef() and codes() (quant_blocks.wgsl), each
// row's scale once per 16 values, still sharing x.
// #include product

// #include quant_blocks

// The 4 bytes from byte 2 of the pair of words (w, next) on, or `next` itself when the
// block starts at byte 2 of w (s = 16): q8_0 and q4_0 blocks are only 2-byte aligned, and
// their values start 2 bytes into the block, after d.
fn after_d(w: u32, next: u32, s: u32) -> u32 {
    return ((w >> 16u) >> s) | (next << (16u - s));
}

fn bytes_i8(q: u32) -> vec4f {
    let v = bitcast<i32>(q);
    return vec4f(vec4i(extractBits(v, 0u, 8u), extractBits(v, 8u, 8u), extractBits(v, 16u, 8u),
                       extractBits(v, 24u, 8u)));
}

// The nibbles of q at bit `at` (0: low, 4: high) of each byte.
fn nibbles(q: u32, at: u32) -> vec4f {
    return bytes4((q >> at) & 0x0F0F0F0Fu);
}

// The 4 rows' values d * n + m of the nibbles at bit `at` of their words q.
fn rows_q4(q: vec4u, at: u32, d: vec4f, m: vec4f) -> array<vec4f, 4> {
    return array<vec4f, 4>(d.x * nibbles(q.x, at) + m.x, d.y * nibbles(q.y, at) + m.y,
                           d.z * nibbles(q.z, at) + m.z, d.w * nibbles(q.w, at) + m.w);
}

// 4 values from the 2 words (lo, hi) of an f16 or bf16 row.
fn halves4(t: u32, lo: u32, hi: u32) -> vec4f {
    if (t == F16) { return vec4f(unpack2x16float(lo), unpack2x16float(hi)); }
    return bitcast<vec4f>(vec4u(lo << 16u, lo & 0xFFFF0000u, hi << 16u, hi & 0xFFFF0000u));
}

// (dot(w[0], x), .., dot(w[3], x)): x against 4 weight rows.
fn rows4(w: array<vec4f, 4>, x: vec4f) -> vec4f {
    return vec4f(dot(w[0], x), dot(w[1], x), dot(w[2], x), dot(w[3], x));
}

// acc[j] += rows4(w, x of token j), the 16 tokens' x spread over the lanes as x0 (tokens
// 0..7) and x1 (8..15). Broadcast lanes must be constants, so this is unrolled by hand.
fn mac16(acc: ptr<function, array<vec4f, 16>>, w: array<vec4f, 4>, x0: vec4f, x1: vec4f) {
    (*acc)[0] += rows4(w, subgroupBroadcast(x0, 0u));
    (*acc)[1] += rows4(w, subgroupBroadcast(x0, 1u));
    (*acc)[2] += rows4(w, subgroupBroadcast(x0, 2u));
    (*acc)[3] += rows4(w, subgroupBroadcast(x0, 3u));
    (*acc)[4] += rows4(w, subgroupBroadcast(x0, 4u));
    (*acc)[5] += rows4(w, subgroupBroadcast(x0, 5u));
    (*acc)[6] += rows4(w, subgroupBroadcast(x0, 6u));
    (*acc)[7] += rows4(w, subgroupBroadcast(x0, 7u));
    (*acc)[8] += rows4(w, subgroupBroadcast(x1, 0u));
    (*acc)[9] += rows4(w, subgroupBroadcast(x1, 1u));
    (*acc)[10] += rows4(w, subgroupBroadcast(x1, 2u));
    (*acc)[11] += rows4(w, subgroupBroadcast(x1, 3u));
    (*acc)[12] += rows4(w, subgroupBroadcast(x1, 4u));
    (*acc)[13] += rows4(w, subgroupBroadcast(x1, 5u));
    (*acc)[14] += rows4(w, subgroupBroadcast(x1, 6u));
    (*acc)[15] += rows4(w, subgroupBroadcast(x1, 7u));
}

// k_mul_mat_q_subgroup_<type>: operands and result as k_mul_mat_q. The workgroup computes 32
// weight rows x 16 tokens: lane `lane` owns rows m0 .. m0 + 3 and loads the x of tokens
// n0 + lane and n0 + 8 + lane. Per block of 32 values a lane reads 4 x 9 (q8_0) or 4 x 5
// (q4_0, q4_1) words of weight and 2 x 32 floats of x, for 2048 multiply-adds.
// One entry point per type, so that the type is a constant the compiler folds away
// (measured on lavapipe: a quarter faster than branching on p.u.x); ops/quant.py generates
// them from the type codes, here and for k_mul_mat_q_back_subgroup_<type>.
// #include mul_mat_q_subgroup_entries

fn mul_mat_q_subgroup(t: u32, lane: u32, g: u32) {
    if (g >= p.n) { return; }  // the whole workgroup
    let M = p.ne_d.x;
    let N = p.ne_d.y;
    let K = p.ne_0.x;
    let tile = product_tile(g, 32u, 16u);
    let m0 = tile.x + lane * 4u;
    let n0 = tile.y;
    let offsets = batch_offsets(tile.z);
    let w_base = offsets.y;
    let x_base = p.off.z + offsets.z;
    // rows in values; x rows in vec4s
    let row = vec4u(w_base + min(m0, M - 1u) * K, w_base + min(m0 + 1u, M - 1u) * K,
                    w_base + min(m0 + 2u, M - 1u) * K, w_base + min(m0 + 3u, M - 1u) * K);
    let x0 = (x_base + min(n0 + lane, N - 1u) * p.nb_1.y) / 4u;
    let x1 = (x_base + min(n0 + 8u + lane, N - 1u) * p.nb_1.y) / 4u;
    let bytes = p.off.y * 4u;
    var acc: array<vec4f, 16>;  // acc[j]: dst[n0 + j, m0 .. m0 + 3]
    if (t == F16 || t == BF16) {
        let w = bytes / 4u + row / 2u;                 // in words: 2 values per word
        for (var k = 0u; k < K / 4u; k++) {
            let wk = w + 2u * k;
            let wq = array<vec4f, 4>(halves4(t, src0_word(wk.x), src0_word(wk.x + 1u)),
                                     halves4(t, src0_word(wk.y), src0_word(wk.y + 1u)),
                                     halves4(t, src0_word(wk.z), src0_word(wk.z + 1u)),
                                     halves4(t, src0_word(wk.w), src0_word(wk.w + 1u)));
            mac16(&acc, wq, vec4f(src1_v4[x0 + k]), vec4f(src1_v4[x1 + k]));
        }
    } else if (t == Q8_0 || t == Q4_0 || t == Q4_1) {
        let size = select(select(18u, 20u, t == Q4_1), 34u, t == Q8_0);
        for (var k = 0u; k < K; k += 32u) {
            let b = bytes + ((row + k) / 32u) * size;  // each row's block
            let s = (b & vec4u(2u)) * 8u;              // 16 where a block starts mid-word
            var w = b / 4u;
            var prev = vec4u(src0_word(w.x), src0_word(w.y), src0_word(w.z), src0_word(w.w));
            let d = vec4f(unpack2x16float(prev.x >> s.x).x, unpack2x16float(prev.y >> s.y).x,
                          unpack2x16float(prev.z >> s.z).x, unpack2x16float(prev.w >> s.w).x);
            let xk = k / 4u;
            if (t == Q8_0) {
                for (var j = 0u; j < 8u; j++) {
                    w += 1u;
                    let next = vec4u(src0_word(w.x), src0_word(w.y), src0_word(w.z), src0_word(w.w));
                    let wq = array<vec4f, 4>(
                        d.x * bytes_i8(after_d(prev.x, next.x, s.x)),
                        d.y * bytes_i8(after_d(prev.y, next.y, s.y)),
                        d.z * bytes_i8(after_d(prev.z, next.z, s.z)),
                        d.w * bytes_i8(after_d(prev.w, next.w, s.w)));
                    prev = next;
                    mac16(&acc, wq, vec4f(src1_v4[x0 + xk + j]), vec4f(src1_v4[x1 + xk + j]));
                }
            } else {
                // q4_0: value d * (n - 8); q4_1 (20-byte blocks, word-aligned): d * n + m,
                // m the second half of the first word
                var m = vec4f(-8.0) * d;
                if (t == Q4_1) {
                    m = vec4f(unpack2x16float(prev.x).y, unpack2x16float(prev.y).y,
                              unpack2x16float(prev.z).y, unpack2x16float(prev.w).y);
                }
                // word j of the nibbles holds values 4j .. 4j + 3 (low) and 16 + 4j .. (high)
                for (var j = 0u; j < 4u; j++) {
                    w += 1u;
                    let next = vec4u(src0_word(w.x), src0_word(w.y), src0_word(w.z), src0_word(w.w));
                    var q = next;
                    if (t == Q4_0) {
                        q = vec4u(after_d(prev.x, next.x, s.x), after_d(prev.y, next.y, s.y),
                                  after_d(prev.z, next.z, s.z), after_d(prev.w, next.w, s.w));
                    }
                    prev = next;
                    mac16(&acc, rows_q4(q, 0u, d, m), vec4f(src1_v4[x0 + xk + j]), vec4f(src1_v4[x1 + xk + j]));
                    mac16(&acc, rows_q4(q, 4u, d, m), vec4f(src1_v4[x0 + xk + j + 4u]),
                          vec4f(src1_v4[x1 + xk + j + 4u]));
                }
            }
        }
    } else {
        // 16 values at a time (a sub-block or a part of one): each row's scale and offset
        // once, then 4 quads of codes
        for (var k = 0u; k < K; k += 16u) {
            let c = array<vec2f, 4>(coef(t, row.x + k), coef(t, row.y + k), coef(t, row.z + k),
                                    coef(t, row.w + k));
            for (var e = k; e < k + 16u; e += 4u) {
                let wq = array<vec4f, 4>(c[0].x * codes(t, row.x + e) + c[0].y,
                                         c[1].x * codes(t, row.y + e) + c[1].y,
                                         c[2].x * codes(t, row.z + e) + c[2].y,
                                         c[3].x * codes(t, row.w + e) + c[3].y);
                mac16(&acc, wq, vec4f(src1_v4[x0 + e / 4u]), vec4f(src1_v4[x1 + e / 4u]));
            }
        }
    }
    for (var j = 0u; j < 16u; j++) {
        if (n0 + j < N) { store_product4(p.off.x + offsets.x, n0 + j, m0, acc[j]); }
    }
}

// k_mul_mat_q_back_subgroup_<type>: operands and result as k_mul_mat_q_back. The workgroup computes
// 32 values of k (one block of the weight's rows, or an eighth of a k-quant's) x 16 tokens:
// lane `lane` owns k0 .. k0 + 3 and loads g of tokens n0 + lane and n0 + 8 + lane. Per weight
// row m a lane reads 2 words of the block (its 4 values; q4_0 and q8_0 take d from lane 0's
// first word); per 4 rows 2 vec4s of g, for 256 multiply-adds. Rows m in [p.u.y, p.u.z),
// added to dst when p.u.w = 1, as k_mul_mat_q_back.
// #include mul_mat_q_back_subgroup_entries

// The 4 values k0 .. k0 + 3 of the weight row starting at value e, block kb .. kb + 31 of
// it (each lane of the subgroup asks for its 4 values of the same block).
fn back_quad(t: u32, lane: u32, e: u32, kb: u32, k0: u32) -> vec4f {
    let bytes = p.off.y * 4u;
    if (t == F16 || t == BF16) {
        let w = bytes / 4u + (e + k0) / 2u;
        return halves4(t, src0_word(w), src0_word(w + 1u));
    }
    if (t == Q4_1) {   // word-aligned: d and m in word 0, the nibbles of lane % 4 in word 1 + ..
        let w = (bytes + ((e + kb) / 32u) * 20u) / 4u;
        let dm = unpack2x16float(src0_word(w));
        return dm.x * nibbles(src0_word(w + 1u + lane % 4u), 4u * (lane / 4u)) + dm.y;
    }
    if (t != Q8_0 && t != Q4_0) { return quad(t, e + k0); }
    let b = bytes + ((e + kb) / 32u) * select(18u, 34u, t == Q8_0);   // the block
    let s = (b & 2u) * 8u;
    // q8_0: values 4 lane .. from byte 2 + 4 lane of the block; q4_0: nibble word lane % 4,
    // low nibbles for lanes 0..3, high for 4..7
    let w = b / 4u + select(lane % 4u, lane, t == Q8_0);
    let first = src0_word(w);
    let q = after_d(first, src0_word(w + 1u), s);
    let d = unpack2x16float(subgroupBroadcast(first, 0u) >> s).x;      // lane 0: d's word
    if (t == Q8_0) { return d * bytes_i8(q); }
    return d * (nibbles(q, 4u * (lane / 4u)) - 8.0);
}

// acc[j] += w0 * g_j.x + w1 * g_j.y + w2 * g_j.z + w3 * g_j.w, the 16 tokens' g spread over
// the lanes as ga (tokens 0..7) and gb (8..15).
fn mac4x16(acc: ptr<function, array<vec4f, 16>>, w0: vec4f, w1: vec4f, w2: vec4f, w3: vec4f,
           ga: vec4f, gb: vec4f) {
    let w = mat4x4f(w0, w1, w2, w3);
    (*acc)[0] += w * subgroupBroadcast(ga, 0u);
    (*acc)[1] += w * subgroupBroadcast(ga, 1u);
    (*acc)[2] += w * subgroupBroadcast(ga, 2u);
    (*acc)[3] += w * subgroupBroadcast(ga, 3u);
    (*acc)[4] += w * subgroupBroadcast(ga, 4u);
    (*acc)[5] += w * subgroupBroadcast(ga, 5u);
    (*acc)[6] += w * subgroupBroadcast(ga, 6u);
    (*acc)[7] += w * subgroupBroadcast(ga, 7u);
    (*acc)[8] += w * subgroupBroadcast(gb, 0u);
    (*acc)[9] += w * subgroupBroadcast(gb, 1u);
    (*acc)[10] += w * subgroupBroadcast(gb, 2u);
    (*acc)[11] += w * subgroupBroadcast(gb, 3u);
    (*acc)[12] += w * subgroupBroadcast(gb, 4u);
    (*acc)[13] += w * subgroupBroadcast(gb, 5u);
    (*acc)[14] += w * subgroupBroadcast(gb, 6u);
    (*acc)[15] += w * subgroupBroadcast(gb, 7u);
}
fn mul_mat_q_back_subgroup(t: u32, lane: u32, g: u32) {
    if (g >= p.n) { return; }  // the whole workgroup
    let K = p.ne_d.x;
    let N = p.ne_d.y;
    let M = p.ne_0.y;
    let tile = product_tile(g, 32u, 16u);                 // dst is [.., N, K]: k along x
    let kb = tile.x;                                      // the block's first k
    let k0 = min(kb + lane * 4u, K - 4u);                 // f16 rows may end mid-block
    let n0 = tile.y;
    let offsets = batch_offsets(tile.z);
    let w_base = offsets.y;
    let g_base = p.off.z + offsets.z;
    let g0 = g_base + min(n0 + lane, N - 1u) * p.nb_1.y;
    let g1 = g_base + min(n0 + 8u + lane, N - 1u) * p.nb_1.y;
    var acc: array<vec4f, 16>;  // acc[j]: dst[n0 + j, k0 .. k0 + 3]
    // 4 rows at a time, g read as vec4s along m where its layout allows (p.u.x == 1), then
    // the rows left one at a time. (One loop for both, rows past M against a g of 0, compiled
    // up to twice as fast on lavapipe but ran 7 % slower.)
    let m_end = min(M, p.u.z);
    let m4 = p.u.y + select(0u, (m_end - p.u.y) / 4u, p.u.x == 1u) * 4u;
    for (var m = p.u.y; m < m4; m += 4u) {
        let w0 = back_quad(t, lane, w_base + m * K, kb, k0);
        let w1 = back_quad(t, lane, w_base + (m + 1u) * K, kb, k0);
        let w2 = back_quad(t, lane, w_base + (m + 2u) * K, kb, k0);
        let w3 = back_quad(t, lane, w_base + (m + 3u) * K, kb, k0);
        let ga = vec4f(src1_v4[(g0 + m) / 4u]);
        let gb = vec4f(src1_v4[(g1 + m) / 4u]);
        mac4x16(&acc, w0, w1, w2, w3, ga, gb);
    }
    for (var m = m4; m < m_end; m++) {
        let wq = back_quad(t, lane, w_base + m * K, kb, k0);
        let ia = g0 + m * p.nb_1.x;
        let ib = g1 + m * p.nb_1.x;
        let z = vec4f();
        mac4x16(&acc, wq, z, z, z, vec4f(f32(src1_v4[ia / 4u][ia % 4u]), 0.0, 0.0, 0.0),
                vec4f(f32(src1_v4[ib / 4u][ib % 4u]), 0.0, 0.0, 0.0));
    }
    if (kb + lane * 4u >= K) { return; }                 // past the end of an f16 row
    let d = p.off.x + offsets.x;
    for (var j = 0u; j < 16u; j++) {
        if (n0 + j < N) {
            if (p.u.w == 1u) { acc[j] += load_product4(d, n0 + j, k0); }
            store_product4(d, n0 + j, k0, acc[j]);
        }
    }
}
