// The block types of frozen weights (ggwgpu/quant.py's table TYPES), dequantized 4 values at
// a time. Included by quant.wgsl and quant_subgroup.wgsl. src0 holds the weight's raw blocks,
// bound as u32 words: p.off.y is where they start, in words. Blocks of 18, 22, 34, 110 and
// 210 bytes are only 2-byte aligned (mxfp4's 17 not even that), so bytes come out of words
// by shifts, and f16 scales through unpack2x16float: no shader-f16 feature needed.
// #include common

@group(0) @binding(2) var<storage, read_write> src0_u32: array<u32>;

// A weight larger than one storage binding is bound as up to 4 ranges of SRC0_PART_WORDS
// words each (WgpuPlan): src0_u32 holds the first, the three below the rest. The backend
// sets SRC0_PART_WORDS only in the pipelines of such weights; 0 is one binding.
override SRC0_PART_WORDS: u32 = 0u;
@group(0) @binding(6) var<storage, read_write> src0_part1: array<u32>;
@group(0) @binding(7) var<storage, read_write> src0_part2: array<u32>;
@group(0) @binding(8) var<storage, read_write> src0_part3: array<u32>;

// Word i of src0's blocks, from whichever binding holds it: the only read of src0.
fn src0_word(i: u32) -> u32 {
    if (SRC0_PART_WORDS == 0u) { return src0_u32[i]; }
    let j = i % SRC0_PART_WORDS;
    switch (i / SRC0_PART_WORDS) {
        case 0u: { return src0_u32[j]; }
        case 1u: { return src0_part1[j]; }
        case 2u: { return src0_part2[j]; }
        default: { return src0_part3[j]; }
    }
}

// Type codes (const F16: u32 = 0u; ...): generated from ggwgpu/kernels.py's TYPE_CODE.
// #include quant_type_codes

// The 4 bytes of src0 from byte b on, little-endian.
fn word_at(b: u32) -> u32 {
    let w = src0_word(b / 4u);
    let shift = (b & 3u) * 8u;
    if (shift == 0u) { return w; }
    return (w >> shift) | (src0_word(b / 4u + 1u) << (32u - shift));
}

// The f16 at byte b (b even) of src0.
fn half_at(b: u32) -> f32 {
    return unpack2x16float(src0_word(b / 4u) >> ((b & 2u) * 8u)).x;
}

fn byte_at(b: u32) -> u32 {
    return (src0_word(b / 4u) >> ((b & 3u) * 8u)) & 0xFFu;
}

// The 4 bytes of q as floats (byte 0 first).
fn bytes4(q: u32) -> vec4f {
    return vec4f(vec4u(q & 0xFFu, (q >> 8u) & 0xFFu, (q >> 16u) & 0xFFu, q >> 24u));
}

// Bits i .. i + 3 of h, one to a byte, at bit 4 of each: the high bits of 4 q5 codes.
fn bits4(h: u32, i: u32) -> u32 {
    let b = (h >> i) & 0xFu;
    return ((b & 1u) | ((b & 2u) << 7u) | ((b & 4u) << 14u) | ((b & 8u) << 21u)) << 4u;
}

// The 6-bit scale (x) and min (y) of sub-block j of a q4_k / q5_k block whose 12 scale
// bytes start at byte s: j < 4 in the low 6 bits of bytes j and j + 4, j >= 4 in the nibbles
// of byte j + 4 with their top 2 bits in the top bits of bytes j - 4 and j.
fn scale_min_k4(s: u32, j: u32) -> vec2f {
    if (j < 4u) { return vec2f(f32(byte_at(s + j) & 63u), f32(byte_at(s + j + 4u) & 63u)); }
    let c = byte_at(s + j + 4u);
    return vec2f(f32((c & 0xFu) | ((byte_at(s + j - 4u) >> 6u) << 4u)),
                 f32((c >> 4u) | ((byte_at(s + j) >> 6u) << 4u)));
}

// Values e .. e + 3 of src0 (e: flat value index, a multiple of 4), dequantized. The 4
// values of a quad always share their sub-block's scale and offset (coef) and sit in 4
// consecutive bytes at one shift (codes): value = a * code + c, with (a, c) = coef.
fn quad(t: u32, e: u32) -> vec4f {
    if (t == F16 || t == BF16) {
        let b = p.off.y * 4u + e * 2u;
        let lo = word_at(b);
        let hi = word_at(b + 4u);
        if (t == F16) { return vec4f(unpack2x16float(lo), unpack2x16float(hi)); }
        return bitcast<vec4f>(vec4u(lo << 16u, lo & 0xFFFF0000u, hi << 16u, hi & 0xFFFF0000u));
    }
    let c = coef(t, e);
    return c.x * codes(t, e) + c.y;
}

// The byte where value e's block starts.
fn block_at(t: u32, e: u32) -> u32 {
    let sizes = array<u32, 13>(2u, 2u, 18u, 20u, 22u, 24u, 34u, 17u, 84u, 110u, 144u, 176u,
                               210u);
    return p.off.y * 4u + (e / select(32u, 256u, t >= Q2_K)) * sizes[t];
}

// (a, c) of value e of a block type: value = a * code + c. The same for the 32 values of a
// q4_0 .. q8_0 block, the 16 or 32 of a k-quant's sub-block. With c = -offset * a (q4_0,
// q5_0, q8_0) the products are exact, as gguf.quants' d * (code - offset).
fn coef(t: u32, e: u32) -> vec2f {
    let b = block_at(t, e);
    switch t {
        case Q4_0, Q5_0, Q8_0: {                      // d, codes offset by 8, 16, 128
            let d = half_at(b);
            return vec2f(d, select(select(-8.0, -16.0, t == Q5_0), -128.0, t == Q8_0) * d);
        }
        case Q4_1, Q5_1: { return unpack2x16float(src0_word(b / 4u)); }   // d, m
        case MXFP4: {       // e: 2^(e - 128), as ggml's e8m0 "half" (subnormal below e = 2)
            let e8 = byte_at(b);
            return vec2f(bitcast<f32>(select(0x00200000u << e8, (e8 - 1u) << 23u, e8 >= 2u)), 0.0);
        }
        case Q2_K: {        // scales[16] at 0 (scale low nibble, min high), d and dmin at 80
            let sc = byte_at(b + (e % 256u) / 16u);
            let dm = unpack2x16float(src0_word((b + 80u) / 4u));
            return vec2f(dm.x * f32(sc & 0xFu), -dm.y * f32(sc >> 4u));
        }
        case Q3_K: {        // 16 6-bit scales at 96: low nibbles in bytes 0..7, high 2 bits
            let i = (e % 256u) / 16u;                  // in 8..11; d at 108; codes - 4
            let sc = ((byte_at(b + 96u + i % 8u) >> ((i / 8u) * 4u)) & 0xFu)
                     | (((byte_at(b + 104u + i % 4u) >> ((i / 4u) * 2u)) & 3u) << 4u);
            let a = half_at(b + 108u) * f32(i32(sc) - 32);
            return vec2f(a, -4.0 * a);
        }
        case Q4_K, Q5_K: {  // d, dmin, then 12 bytes of 6-bit scales and mins
            let dm = unpack2x16float(src0_word(b / 4u));
            let sm = scale_min_k4(b + 4u, (e % 256u) / 32u);
            return vec2f(dm.x * sm.x, -dm.y * sm.y);
        }
        default: {          // Q6_K: int8 scales[16] at 192, d at 208; codes - 32
            let sc = extractBits(bitcast<i32>(byte_at(b + 192u + (e % 256u) / 16u)), 0u, 8u);
            let a = half_at(b + 208u) * f32(sc);
            return vec2f(a, -32.0 * a);
        }
    }
}

// The codes (small unsigned ints) of values e .. e + 3 of a block type, as floats.
fn codes(t: u32, e: u32) -> vec4f {
    let b = block_at(t, e);
    if (t == MXFP4) {       // q4_0's nibbles from byte 1, each an index into E2M1 doubled
        let j = e % 32u;
        let n = (word_at(b + 1u + j % 16u) >> ((j / 16u) * 4u)) & 0x0F0F0F0Fu;
        let e2m1 = array<f32, 16>(0.0, 1.0, 2.0, 3.0, 4.0, 6.0, 8.0, 12.0,
                                  0.0, -1.0, -2.0, -3.0, -4.0, -6.0, -8.0, -12.0);
        return vec4f(e2m1[n & 0xFu], e2m1[(n >> 8u) & 0xFu], e2m1[(n >> 16u) & 0xFu],
                     e2m1[n >> 24u]);
    }
    if (t <= Q8_0) {                                   // 32-value blocks
        let j = e % 32u;                               // place in the block
        if (t == Q8_0) { return bytes4(word_at(b + 2u + j) ^ 0x80808080u); }   // int8 + 128
        // values j < 16: low nibbles of bytes j.., values j >= 16: high nibbles of bytes j - 16..
        let at = b + select(select(2u, 4u, t == Q4_1), select(6u, 8u, t == Q5_1), t >= Q5_0);
        var q = (word_at(at + j % 16u) >> ((j / 16u) * 4u)) & 0x0F0F0F0Fu;
        if (t == Q5_0 || t == Q5_1) { q |= bits4(word_at(at - 4u), j); }  // qh before qs
        return bytes4(q);
    }
    // k-quants: 256-value superblocks. v: place in the block; h, pos: its 128-value half
    // and place in it; l: place among 32
    let v = e % 256u;
    let h = v / 128u;
    let pos = v % 128u;
    let l = v % 32u;
    switch t {
        case Q2_K: {        // qs[64] at 16: 2 bits at 2 * (pos / 32)
            return bytes4((word_at(b + 16u + h * 32u + l) >> ((pos / 32u) * 2u)) & 0x03030303u);
        }
        case Q3_K: {        // hmask[32] at 0 (bit v / 32: the high bit), qs[64] at 32 as q2_k
            let lo = (word_at(b + 32u + h * 32u + l) >> ((pos / 32u) * 2u)) & 0x03030303u;
            let hi = (word_at(b + l) >> (v / 32u)) & 0x01010101u;
            return bytes4(lo | (hi << 2u));
        }
        case Q4_K, Q5_K: {  // qs[128] at 16 (q5_k: 48): 64 values per 32 bytes, low nibbles
            // first; q5_k's qh[32] at 16: bit v / 32 is bit 4 of the code
            var q = (word_at(b + select(16u, 48u, t == Q5_K) + (v / 64u) * 32u + l)
                     >> (((v / 32u) % 2u) * 4u)) & 0x0F0F0F0Fu;
            if (t == Q5_K) { q |= ((word_at(b + 16u + l) >> (v / 32u)) & 0x01010101u) << 4u; }
            return bytes4(q);
        }
        default: {          // Q6_K: ql[128] at 0 (64 values per 64 bytes, low nibbles first),
            // qh[64] at 128 (2 bits at 2 * (pos / 32)): code = low | high << 4
            let lo = (word_at(b + h * 64u + pos % 64u) >> ((pos / 64u) * 4u)) & 0x0F0F0F0Fu;
            let hi = (word_at(b + 128u + h * 32u + l) >> ((pos / 32u) * 2u)) & 0x03030303u;
            return bytes4(lo | (hi << 4u));
        }
    }
}
