// Matrix products (matmul, matmul_subgroup, quant, quant_subgroup): dst [.., N, M] from
// src0 [.., M, K] broadcast over src1's batch entries, in ggml order ne_d = (M, N, b2, b3).
// #include common

// Element offsets of batch entry `batch` of dst, src0 (a, broadcast over b as ggml does:
// b's entry j reads a's j / ratio) and src1 (b), from the start of each tensor.
fn batch_offsets(batch: u32) -> vec3u {
    let i2 = batch % p.ne_d.z;
    let i3 = batch / p.ne_d.z;
    return vec3u(i2 * p.nb_d.z + i3 * p.nb_d.w,
                 (i2 / (p.ne_d.z / p.ne_0.z)) * p.nb_0.z + (i3 / (p.ne_d.w / p.ne_0.w)) * p.nb_0.w,
                 i2 * p.nb_1.z + i3 * p.nb_1.w);
}

// The same offsets in the buffers (the tensors' offsets added).
fn product_bases(batch: u32) -> vec3u { return p.off.xyz + batch_offsets(batch); }

// Tile t of dst cut in tiles of tm columns (m) x tn rows (n), numbered along m first, then n,
// then the batch entries: (first m, first n, batch entry).
fn product_tile(t: u32, tm: u32, tn: u32) -> vec3u {
    let bm = (p.ne_d.x + tm - 1u) / tm;
    let bn = (p.ne_d.y + tn - 1u) / tn;
    return vec3u((t % bm) * tm, ((t / bm) % bn) * tn, t / (bm * bn));
}

// The products' epilogue (ops/matmul.py), on dst[n, m .. m + 3] of batch entry `batch`
// before it is stored: times alpha (p.f.x), plus c (src2: the result's shape, its own
// strides) where p.u.x is 1, as one fma (one rounding). Columns >= M read c's last one.
fn product_epilogue(batch: u32, n: u32, m: u32, v: vec4f) -> vec4f {
    if (p.u.x == 0u) { return p.f.x * v; }
    let last = p.ne_d.x - 1u;
    let row = p.off.w + (batch % p.ne_d.z) * p.nb_2.z + (batch / p.ne_d.z) * p.nb_2.w
              + n * p.nb_2.y;
    let c = vec4f(f32(src2[row + min(m, last) * p.nb_2.x]),
                  f32(src2[row + min(m + 1u, last) * p.nb_2.x]),
                  f32(src2[row + min(m + 2u, last) * p.nb_2.x]),
                  f32(src2[row + min(m + 3u, last) * p.nb_2.x]));
    return fma(vec4f(p.f.x), v, c);
}

// dst[n, m .. m + 3] of a product (dst base offset d), as store_product4 writes them (0 for
// columns >= M): what a dispatch that adds to an earlier one's sums starts from.
fn load_product4(d: u32, n: u32, m: u32) -> vec4f {
    var v = vec4f();
    for (var r = 0u; r < 4u; r++) {
        let i = d + n * p.nb_d.y + (m + r) * p.nb_d.x;
        if (m + r < p.ne_d.x) { v[r] = f32(dst_v4[i / 4u][i % 4u]); }
    }
    return v;
}

// Writes dst[n, m .. m + 3] of a product (dst base offset d) through dst_v4: one vec4 store
// where dst rows allow it, else element by element; columns >= M are skipped.
fn store_product4(d: u32, n: u32, m: u32, v: vec4f) {
    let M = p.ne_d.x;
    if (p.nb_d.x == 1u && p.nb_d.y % 4u == 0u && d % 4u == 0u && m + 4u <= M) {
        dst_v4[(d + n * p.nb_d.y + m) / 4u] = to_TD4(v);
        return;
    }
    for (var r = 0u; r < 4u; r++) {
        if (m + r < M) {
            let i = d + n * p.nb_d.y + (m + r) * p.nb_d.x;
            dst_v4[i / 4u][i % 4u] = to_TD(v[r]);
        }
    }
}
