// Optimizer steps leave a parameter element and its moments as they are where its gradient
// is not finite (the trainer makes every gradient of a non-finite step NaN, so the whole
// update is skipped).

// Finite from the exponent bits: WGSL lets compilers assume no NaN or infinity, so a float
// test such as g - g == 0.0 may be folded away.
fn is_finite(x: f32) -> bool { return (bitcast<u32>(x) & 0x7f800000u) != 0x7f800000u; }

// opt_step_adamw, one invocation per parameter element, in place:
// dst = param (contiguous), src0 = grad (any strides), src1 = m, src2 = v (contiguous, same
// shape), src3 = hparams [alpha, beta1, beta2, eps, wd, beta1h, beta2h]; p.u.x: decay or not.
@compute @workgroup_size(WG)
fn k_opt_step_adamw(@builtin(global_invocation_id) gid: vec3u, @builtin(num_workgroups) nwg: vec3u) {
    let i = flat_id(gid, nwg); if (i >= p.n) { return; }
    let idx = unravel(i, p.ne_d);
    let h = p.off3.x;
    let alpha = src3[h];
    let beta1 = src3[h + 1u];
    let beta2 = src3[h + 2u];
    let eps = src3[h + 3u];
    let wd = select(0.0, src3[h + 4u], p.u.x != 0u);
    let g = src0[at_0(idx)];
    if (!is_finite(g)) { return; }
    let im = at_1(idx);
    let iv = at_2(idx);
    let m = src1[im] * beta1 + g * (1.0 - beta1);
    let v = src2[iv] * beta2 + g * g * (1.0 - beta2);
    src1[im] = m;
    src2[iv] = v;
    let d = at_d(idx);
    dst[d] = dst[d] * (1.0 - alpha * wd) - alpha * (m * src3[h + 5u]) / (sqrt(v * src3[h + 6u]) + eps);
}

// opt_step_sgd, in place: dst = param (contiguous), src0 = grad, src1 = hparams [lr, wd];
// p.u.x: decay or not.
@compute @workgroup_size(WG)
fn k_opt_step_sgd(@builtin(global_invocation_id) gid: vec3u, @builtin(num_workgroups) nwg: vec3u) {
    let i = flat_id(gid, nwg); if (i >= p.n) { return; }
    let idx = unravel(i, p.ne_d);
    let lr = src1[p.off.z];
    let wd = select(0.0, src1[p.off.z + 1u], p.u.x != 0u);
    let g = src0[at_0(idx)];
    if (!is_finite(g)) { return; }
    let d = at_d(idx);
    dst[d] = dst[d] * (1.0 - lr * wd) - lr * g;
}
