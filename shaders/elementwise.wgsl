// Elementwise ops: one invocation per element of dst; src1 tiles dst (ggml broadcasting).

// dst index, src0 index and (tiled) src1 index of element i.
fn ix(i: u32) -> vec3u {
    let idx = unravel(i, p.ne_d);
    return vec3u(at_d(idx), at_0(idx), at_1(idx % p.ne_1));
}

@compute @workgroup_size(WG)
fn k_add(@builtin(global_invocation_id) gid: vec3u, @builtin(num_workgroups) nwg: vec3u) {
    let i = flat_id(gid, nwg); if (i >= p.n) { return; }
    let j = ix(i); dst[j.x] = src0[j.y] + src1[j.z];
}

@compute @workgroup_size(WG)
fn k_sub(@builtin(global_invocation_id) gid: vec3u, @builtin(num_workgroups) nwg: vec3u) {
    let i = flat_id(gid, nwg); if (i >= p.n) { return; }
    let j = ix(i); dst[j.x] = src0[j.y] - src1[j.z];
}

@compute @workgroup_size(WG)
fn k_mul(@builtin(global_invocation_id) gid: vec3u, @builtin(num_workgroups) nwg: vec3u) {
    let i = flat_id(gid, nwg); if (i >= p.n) { return; }
    let j = ix(i); dst[j.x] = src0[j.y] * src1[j.z];
}

@compute @workgroup_size(WG)
fn k_div(@builtin(global_invocation_id) gid: vec3u, @builtin(num_workgroups) nwg: vec3u) {
    let i = flat_id(gid, nwg); if (i >= p.n) { return; }
    let j = ix(i); dst[j.x] = src0[j.y] / src1[j.z];
}

// add1: src1 holds one element.
@compute @workgroup_size(WG)
fn k_add1(@builtin(global_invocation_id) gid: vec3u, @builtin(num_workgroups) nwg: vec3u) {
    let i = flat_id(gid, nwg); if (i >= p.n) { return; }
    let j = ix(i); dst[j.x] = src0[j.y] + src1[p.off.z];
}

// silu_back / gelu_back: src0 = x, src1 = dy (same shape).
@compute @workgroup_size(WG)
fn k_silu_back(@builtin(global_invocation_id) gid: vec3u, @builtin(num_workgroups) nwg: vec3u) {
    let i = flat_id(gid, nwg); if (i >= p.n) { return; }
    let j = ix(i);
    dst[j.x] = silu_grad(src0[j.y], src1[j.z]);
}

// silu'(x) * dy.
fn silu_grad(x: f32, dy: f32) -> f32 {
    let s = 1.0 / (1.0 + exp(-x));
    return dy * s * (1.0 + x * (1.0 - s));
}

// swiglu: dst = silu(a) * b; src0 = a, src1 = b (same shape).
@compute @workgroup_size(WG)
fn k_swiglu(@builtin(global_invocation_id) gid: vec3u, @builtin(num_workgroups) nwg: vec3u) {
    let i = flat_id(gid, nwg); if (i >= p.n) { return; }
    let j = ix(i);
    let a = src0[j.y];
    dst[j.x] = a / (1.0 + exp(-a)) * src1[j.z];
}

// swiglu_back: dst = silu'(a) * dy * b; src0 = a, src1 = b, src2 = dy (same shape).
@compute @workgroup_size(WG)
fn k_swiglu_back(@builtin(global_invocation_id) gid: vec3u, @builtin(num_workgroups) nwg: vec3u) {
    let i = flat_id(gid, nwg); if (i >= p.n) { return; }
    let idx = unravel(i, p.ne_d);
    dst[at_d(idx)] = silu_grad(src0[at_0(idx)], src2[at_2(idx)] * src1[at_1(idx)]);
}

const GELU_A: f32 = 0.044715;
const SQRT_2_OVER_PI: f32 = 0.7978845608028654;

// tanh of the gelu argument; clamped because tanh(u) overflows exp for large |u| on some
// drivers, and |u| > 10 is +-1 in f32 anyway.
fn gelu_tanh(x: f32) -> f32 {
    return tanh(clamp(SQRT_2_OVER_PI * x * (1.0 + GELU_A * x * x), -10.0, 10.0));
}

@compute @workgroup_size(WG)
fn k_gelu_back(@builtin(global_invocation_id) gid: vec3u, @builtin(num_workgroups) nwg: vec3u) {
    let i = flat_id(gid, nwg); if (i >= p.n) { return; }
    let j = ix(i);
    let x = src0[j.y];
    let t = gelu_tanh(x);
    let d = 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * SQRT_2_OVER_PI * (1.0 + 3.0 * GELU_A * x * x);
    dst[j.x] = src1[j.z] * d;
}

// Unary maps, dst = f(src0): dst index and src0 index of element i.
fn ix1(i: u32) -> vec2u {
    let idx = unravel(i, p.ne_d);
    return vec2u(at_d(idx), at_0(idx));
}

@compute @workgroup_size(WG)
fn k_scale(@builtin(global_invocation_id) gid: vec3u, @builtin(num_workgroups) nwg: vec3u) {
    let i = flat_id(gid, nwg); if (i >= p.n) { return; }
    let j = ix1(i);
    dst[j.x] = src0[j.y] * p.f.x;
}

@compute @workgroup_size(WG)
fn k_neg(@builtin(global_invocation_id) gid: vec3u, @builtin(num_workgroups) nwg: vec3u) {
    let i = flat_id(gid, nwg); if (i >= p.n) { return; }
    let j = ix1(i);
    dst[j.x] = -src0[j.y];
}

@compute @workgroup_size(WG)
fn k_abs(@builtin(global_invocation_id) gid: vec3u, @builtin(num_workgroups) nwg: vec3u) {
    let i = flat_id(gid, nwg); if (i >= p.n) { return; }
    let j = ix1(i);
    dst[j.x] = abs(src0[j.y]);
}

@compute @workgroup_size(WG)
fn k_sgn(@builtin(global_invocation_id) gid: vec3u, @builtin(num_workgroups) nwg: vec3u) {
    let i = flat_id(gid, nwg); if (i >= p.n) { return; }
    let j = ix1(i);
    dst[j.x] = sign(src0[j.y]);
}

@compute @workgroup_size(WG)
fn k_step(@builtin(global_invocation_id) gid: vec3u, @builtin(num_workgroups) nwg: vec3u) {
    let i = flat_id(gid, nwg); if (i >= p.n) { return; }
    let j = ix1(i);
    dst[j.x] = select(0.0, 1.0, src0[j.y] > 0.0);
}

@compute @workgroup_size(WG)
fn k_relu(@builtin(global_invocation_id) gid: vec3u, @builtin(num_workgroups) nwg: vec3u) {
    let i = flat_id(gid, nwg); if (i >= p.n) { return; }
    let j = ix1(i);
    dst[j.x] = max(src0[j.y], 0.0);
}

@compute @workgroup_size(WG)
fn k_sqr(@builtin(global_invocation_id) gid: vec3u, @builtin(num_workgroups) nwg: vec3u) {
    let i = flat_id(gid, nwg); if (i >= p.n) { return; }
    let j = ix1(i);
    let x = src0[j.y]; dst[j.x] = x * x;
}

@compute @workgroup_size(WG)
fn k_sqrt(@builtin(global_invocation_id) gid: vec3u, @builtin(num_workgroups) nwg: vec3u) {
    let i = flat_id(gid, nwg); if (i >= p.n) { return; }
    let j = ix1(i);
    dst[j.x] = sqrt(src0[j.y]);
}

@compute @workgroup_size(WG)
fn k_log(@builtin(global_invocation_id) gid: vec3u, @builtin(num_workgroups) nwg: vec3u) {
    let i = flat_id(gid, nwg); if (i >= p.n) { return; }
    let j = ix1(i);
    dst[j.x] = log(src0[j.y]);
}

@compute @workgroup_size(WG)
fn k_exp(@builtin(global_invocation_id) gid: vec3u, @builtin(num_workgroups) nwg: vec3u) {
    let i = flat_id(gid, nwg); if (i >= p.n) { return; }
    let j = ix1(i);
    dst[j.x] = exp(src0[j.y]);
}

@compute @workgroup_size(WG)
fn k_silu(@builtin(global_invocation_id) gid: vec3u, @builtin(num_workgroups) nwg: vec3u) {
    let i = flat_id(gid, nwg); if (i >= p.n) { return; }
    let j = ix1(i);
    let x = src0[j.y]; dst[j.x] = x / (1.0 + exp(-x));
}

@compute @workgroup_size(WG)
fn k_gelu(@builtin(global_invocation_id) gid: vec3u, @builtin(num_workgroups) nwg: vec3u) {
    let i = flat_id(gid, nwg); if (i >= p.n) { return; }
    let j = ix1(i);
    let x = src0[j.y]; dst[j.x] = 0.5 * x * (1.0 + gelu_tanh(x));
}
