// Rotary position embedding, forward and backward, with or without per-pair frequency
// factors, YaRN included (ggml_rope_ext).
// #include common

// positions are i32: read through an int32 view of binding 3 (this file never uses src1).
@group(0) @binding(3) var<storage, read_write> src1_i32: array<i32>;

// theta reduced to [-pi, pi]: WGSL bounds the error of sin and cos only there, and
// positions make theta large (thousands of radians). 2 pi = TWO_PI_HI + TWO_PI_LO with
// TWO_PI_HI of 8 significant bits, so n * TWO_PI_HI is exact for n < 2^16 turns.
const TWO_PI_HI: f32 = 6.28125;
const TWO_PI_LO: f32 = 0.0019353071795864769;
const INV_TWO_PI: f32 = 0.15915494309189535;

fn reduce_angle(theta: f32) -> f32 {
    let n = round(theta * INV_TWO_PI);
    return (theta - n * TWO_PI_HI) - n * TWO_PI_LO;
}

// rope / rope_back (k_rope), rope_ff / rope_ff_back (k_rope_ff): src0 x [head_dim, n_head,
// n_tokens, batch] (ggml order), src1_i32 positions [n_tokens], src2 (rope_ff) factors
// [n_dims / 2]; dst like x. p.f = (freq_base, freq_scale, m: the factor of sin, its sign
// +1 forward, -1 backward, its magnitude cos's, ext_factor), p.u = (n_dims, mode: 0 normal,
// 2 neox, YaRN's ramp: first and last pair).
// One invocation per dst element: it reads its own element and its pair partner and
// writes its half of the rotation, so both halves of a pair see the same inputs.
fn rope_element(i: u32, with_factors: bool) {
    let idx = unravel(i, p.ne_d);                  // (dim, head, token, batch)
    let x = f32(src0[at_0(idx)]);
    let n_dims = p.u.x;
    if (idx.x >= n_dims) { dst[at_d(idx)] = to_TD(x); return; }   // pass-through dims

    var k: u32;            // pair index: its angle is theta_k
    var first: bool;       // x0 (true) or x1 (false) of the pair
    var partner: u32;
    if (p.u.y == 0u) {     // normal: pairs (2k, 2k + 1)
        k = idx.x / 2u;
        first = (idx.x & 1u) == 0u;
        partner = idx.x ^ 1u;
    } else {               // neox: pairs (k, k + n_dims / 2)
        let half = n_dims / 2u;
        first = idx.x < half;
        k = select(idx.x - half, idx.x, first);
        partner = select(idx.x - half, idx.x + half, first);
    }
    let pos = f32(src1_i32[at_1(vec4u(idx.z, 0u, 0u, 0u))]);
    var extrap = pos * pow(p.f.x, -2.0 * f32(k) / f32(n_dims));    // the unscaled angle
    if (with_factors) { extrap = extrap / f32(src2[at_2(vec4u(k, 0u, 0u, 0u))]); }
    var theta = extrap * p.f.y;
    if (p.f.w != 0.0) {    // YaRN: the fast pairs mixed back towards their unscaled angle
        let lo = f32(p.u.z);
        let y = (f32(k) - lo) / max(0.001, f32(p.u.w) - lo);
        let mix = (1.0 - clamp(y, 0.0, 1.0)) * p.f.w;
        theta = theta * (1.0 - mix) + extrap * mix;
    }
    theta = reduce_angle(theta);
    let c = cos(theta) * abs(p.f.z);
    let s = sin(theta) * p.f.z;
    let y = f32(src0[at_0(vec4u(partner, idx.yzw))]);
    // first: x0 c - x1 s (x = x0, y = x1); second: x0 s + x1 c (y = x0, x = x1)
    dst[at_d(idx)] = to_TD(select(y * s + x * c, x * c - y * s, first));
}

@compute @workgroup_size(WG)
fn k_rope(@builtin(global_invocation_id) gid: vec3u, @builtin(num_workgroups) nwg: vec3u) {
    let i = flat_id(gid, nwg); if (i >= p.n) { return; }
    rope_element(i, false);
}

@compute @workgroup_size(WG)
fn k_rope_ff(@builtin(global_invocation_id) gid: vec3u, @builtin(num_workgroups) nwg: vec3u) {
    let i = flat_id(gid, nwg); if (i >= p.n) { return; }
    rope_element(i, true);
}
