// The block types of frozen weights (ggwgpu/quant.py's table TYPES), dequantized 4 values at
// a time. Included by quant.wgsl and quant_subgroup.wgsl. src0 holds the weight's raw blocks,
// bound as u32 words: p.off.y is where they start, in words. Blocks of 18, 22, 110 and 210
// bytes are only 2-byte aligned, so bytes come out of words by shifts, and f16 scales
// through unpack2x16float: no shader-f16 feature needed.

@group(0) @binding(2) var<storage, read_write> src0_u32: array<u32>;

// Type codes: the order of TYPES (tests/test_quant.py checks them).
const F16: u32 = 0u;
const BF16: u32 = 1u;
const Q4_0: u32 = 2u;
const Q4_1: u32 = 3u;
const Q5_0: u32 = 4u;
const Q5_1: u32 = 5u;
const Q8_0: u32 = 6u;
const Q2_K: u32 = 7u;
const Q3_K: u32 = 8u;
const Q4_K: u32 = 9u;
const Q5_K: u32 = 10u;
const Q6_K: u32 = 11u;

// The 4 bytes of src0 from byte b on (b even), little-endian.
fn word_at(b: u32) -> u32 {
    let w = src0_u32[b / 4u];
    if ((b & 2u) == 0u) { return w; }
    return (w >> 16u) | (src0_u32[b / 4u + 1u] << 16u);
}

// The f16 at byte b (b even) of src0.
fn half_at(b: u32) -> f32 {
    return unpack2x16float(src0_u32[b / 4u] >> ((b & 2u) * 8u)).x;
}

fn byte_at(b: u32) -> u32 {
    return (src0_u32[b / 4u] >> ((b & 3u) * 8u)) & 0xFFu;
}

// The 4 bytes of q as floats (byte 0 first).
fn bytes4(q: u32) -> vec4f {
    return vec4f(vec4u(q & 0xFFu, (q >> 8u) & 0xFFu, (q >> 16u) & 0xFFu, q >> 24u));
}

// Bits i .. i + 3 of h, one to a byte, at bit `to` of each: the high bits of 4 q5 values.
fn bits4(h: u32, i: u32, to: u32) -> u32 {
    let b = (h >> i) & 0xFu;
    return ((b & 1u) | ((b & 2u) << 7u) | ((b & 4u) << 14u) | ((b & 8u) << 21u)) << to;
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
// values of a quad always share their block's scales and sit in 4 consecutive bytes (at one
// shift), so each type is one or two word reads, a mask and a scale.
fn quad(t: u32, e: u32) -> vec4f {
    let base = p.off.y * 4u;
    if (t == F16 || t == BF16) {
        let b = base + e * 2u;
        let lo = word_at(b);
        let hi = word_at(b + 4u);
        if (t == F16) { return vec4f(unpack2x16float(lo), unpack2x16float(hi)); }
        return bitcast<vec4f>(vec4u(lo << 16u, lo & 0xFFFF0000u, hi << 16u, hi & 0xFFFF0000u));
    }
    if (t <= Q8_0) {                                   // 32-value blocks
        let j = e % 32u;                               // place in the block
        let n = e / 32u;
        if (t == Q8_0) {
            let b = base + n * 34u;
            // int8 as unsigned: the bytes xor 0x80 are q + 128
            return half_at(b) * (bytes4(word_at(b + 2u + j) ^ 0x80808080u) - 128.0);
        }
        // values j < 16: low nibbles of bytes j.., values j >= 16: high nibbles of bytes j - 16..
        let shift = (j / 16u) * 4u;
        if (t == Q4_0) {
            let b = base + n * 18u;
            return half_at(b) * (bytes4((word_at(b + 2u + j % 16u) >> shift) & 0x0F0F0F0Fu) - 8.0);
        }
        if (t == Q4_1) {
            let b = base + n * 20u;                    // 4-byte aligned
            let dm = unpack2x16float(src0_u32[b / 4u]);
            return dm.x * bytes4((src0_u32[b / 4u + 1u + (j % 16u) / 4u] >> shift) & 0x0F0F0F0Fu)
                   + dm.y;
        }
        if (t == Q5_0) {
            let b = base + n * 22u;
            let q = ((word_at(b + 6u + j % 16u) >> shift) & 0x0F0F0F0Fu) | bits4(word_at(b + 2u), j, 4u);
            return half_at(b) * (bytes4(q) - 16.0);
        }
        let b = base + n * 24u;                        // Q5_1, 4-byte aligned
        let w = b / 4u;
        let dm = unpack2x16float(src0_u32[w]);
        let q = ((src0_u32[w + 2u + (j % 16u) / 4u] >> shift) & 0x0F0F0F0Fu) | bits4(src0_u32[w + 1u], j, 4u);
        return dm.x * bytes4(q) + dm.y;
    }
    // k-quants: 256-value superblocks. v: place in the block; half, pos: its 128-value half
    // and place in it; l: place among 32
    let v = e % 256u;
    let n = e / 256u;
    let half = v / 128u;
    let pos = v % 128u;
    let l = v % 32u;
    if (t == Q2_K) {
        // scales[16] (scale low nibble, min high), qs[64]: 2 bits at 2 * (pos / 32), d, dmin
        let b = base + n * 84u;                        // 4-byte aligned
        let q = (word_at(b + 16u + half * 32u + l) >> ((pos / 32u) * 2u)) & 0x03030303u;
        let sc = byte_at(b + v / 16u);
        let dm = unpack2x16float(src0_u32[(b + 80u) / 4u]);
        return dm.x * f32(sc & 0xFu) * bytes4(q) - dm.y * f32(sc >> 4u);
    }
    if (t == Q3_K) {
        // hmask[32] (bit v / 32: the high bit, set for q >= 0), qs[64] as q2_k, scales[12]
        // (16 6-bit: low nibbles in bytes 0..7, high 2 bits in 8..11), d; q = low | high << 2 - 4
        let b = base + n * 110u;
        let lo = (word_at(b + 32u + half * 32u + l) >> ((pos / 32u) * 2u)) & 0x03030303u;
        let hi = (word_at(b + l) >> (v / 32u)) & 0x01010101u;
        let i = v / 16u;
        let sc = ((byte_at(b + 96u + i % 8u) >> ((i / 8u) * 4u)) & 0xFu)
                 | (((byte_at(b + 104u + i % 4u) >> ((i / 4u) * 2u)) & 3u) << 4u);
        return half_at(b + 108u) * f32(i32(sc) - 32) * (bytes4(lo | (hi << 2u)) - 4.0);
    }
    if (t == Q4_K || t == Q5_K) {
        // d, dmin, scales[12] (scale_min_k4), [q5_k: qh[32], bit v / 32 is bit 4 of q],
        // qs[128]: 64 values per 32 bytes, low nibbles first
        let size = select(144u, 176u, t == Q5_K);      // both 4-byte aligned
        let b = base + n * size;
        let dm = unpack2x16float(src0_u32[b / 4u]);
        let sm = scale_min_k4(b + 4u, v / 32u);
        let at = b + select(16u, 48u, t == Q5_K) + (v / 64u) * 32u + l;
        var q = (src0_u32[at / 4u] >> (((v / 32u) % 2u) * 4u)) & 0x0F0F0F0Fu;
        if (t == Q5_K) { q |= ((src0_u32[(b + 16u + l) / 4u] >> (v / 32u)) & 0x01010101u) << 4u; }
        return dm.x * sm.x * bytes4(q) - dm.y * sm.y;
    }
    // Q6_K: ql[128] (64 values per 64 bytes, low nibbles first), qh[64] (2 bits at
    // 2 * (pos / 32)), int8 scales[16], d; q = low | high << 4 - 32
    let b = base + n * 210u;
    let lo = (word_at(b + half * 64u + pos % 64u) >> ((pos / 64u) * 4u)) & 0x0F0F0F0Fu;
    let hi = (word_at(b + 128u + half * 32u + l) >> ((pos / 32u) * 2u)) & 0x03030303u;
    let sc = extractBits(bitcast<i32>(byte_at(b + 192u + v / 16u)), 0u, 8u);
    return half_at(b + 208u) * f32(sc) * (bytes4(lo | (hi << 4u)) - 32.0);
}
