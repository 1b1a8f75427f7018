// The causal depthwise convolution of a short-convolution block and its backward ops
// (ops/conv.py). ggml order: x, g and dst of ssm_conv / ssm_conv_back_x [C, T, b2, b3]; w
// [L, C]; pos [T] (p.u.x = 1: shared by every row of tokens) or [T, b2, b3]. Tap j of token
// t reaches d = L - 1 - j tokens back, where t >= d and pos[t] >= d.
// #include common

// pos is i32: read through an int32 view of binding 4 (this file never uses src2 else).
@group(0) @binding(4) var<storage, read_write> src2_i32: array<i32>;

fn pos_at(t: u32, b2: u32, b3: u32) -> i32 {
    if (p.u.x == 1u) { return src2_i32[at_2(vec4u(t, 0u, 0u, 0u))]; }
    return src2_i32[at_2(vec4u(t, b2, b3, 0u))];
}

fn reaches(t: u32, d: u32, b2: u32, b3: u32) -> bool {
    return t >= d && pos_at(t, b2, b3) >= i32(d);
}

// ssm_conv: src0 x, src1 w, src2 pos. One invocation per element of dst.
@compute @workgroup_size(WG)
fn k_ssm_conv(@builtin(global_invocation_id) gid: vec3u, @builtin(num_workgroups) nwg: vec3u) {
    let i = flat_id(gid, nwg); if (i >= p.n) { return; }
    let idx = unravel(i, p.ne_d);                  // (c, t, b2, b3)
    let L = p.ne_1.x;
    var acc = 0.0;
    for (var j = 0u; j < L; j++) {
        let d = L - 1u - j;
        if (reaches(idx.y, d, idx.z, idx.w)) {
            acc += f32(src1[at_1(vec4u(j, idx.x, 0u, 0u))]) *
                   f32(src0[at_0(vec4u(idx.x, idx.y - d, idx.z, idx.w))]);
        }
    }
    dst[at_d(idx)] = to_TD(acc);
}

// ssm_conv_back_x: src0 g, src1 w, src2 pos. dx[c, s] sums w[c, j] g[c, s + d] over the taps
// that reach s from s + d.
@compute @workgroup_size(WG)
fn k_ssm_conv_back_x(@builtin(global_invocation_id) gid: vec3u,
                     @builtin(num_workgroups) nwg: vec3u) {
    let i = flat_id(gid, nwg); if (i >= p.n) { return; }
    let idx = unravel(i, p.ne_d);                  // (c, s, b2, b3)
    let L = p.ne_1.x;
    let T = p.ne_d.y;
    var acc = 0.0;
    for (var j = 0u; j < L; j++) {
        let t = idx.y + L - 1u - j;
        if (t < T && reaches(t, L - 1u - j, idx.z, idx.w)) {
            acc += f32(src1[at_1(vec4u(j, idx.x, 0u, 0u))]) *
                   f32(src0[at_0(vec4u(idx.x, t, idx.z, idx.w))]);
        }
    }
    dst[at_d(idx)] = to_TD(acc);
}

// ssm_conv_back_w: src0 x, src1 g, src2 pos; dst [L, C]. One invocation per (j, c), summing
// the tokens (rows of every b2, b3) in [p.u.y, p.u.z), added to dst when p.u.w = 1.
@compute @workgroup_size(WG)
fn k_ssm_conv_back_w(@builtin(global_invocation_id) gid: vec3u,
                     @builtin(num_workgroups) nwg: vec3u) {
    let i = flat_id(gid, nwg); if (i >= p.n) { return; }
    let idx = unravel(i, p.ne_d);                  // (j, c)
    let d = p.ne_d.x - 1u - idx.x;
    let T = p.ne_0.y;
    var acc = 0.0;
    for (var r = p.u.y; r < p.u.z; r++) {
        let t = r % T;
        let b = r / T;
        let b2 = b % p.ne_0.z;
        let b3 = b / p.ne_0.z;
        if (reaches(t, d, b2, b3)) {
            acc += f32(src1[at_1(vec4u(idx.y, t, b2, b3))]) *
                   f32(src0[at_0(vec4u(idx.y, t - d, b2, b3))]);
        }
    }
    if (p.u.w == 1u) { acc += f32(dst[at_d(idx)]); }
    dst[at_d(idx)] = to_TD(acc);
}
