// Optimizer steps change nothing where their finite flag (set by append_finite_flag from the
// loss and the gradients' sum of squares) is 0, read the gradient times their gradient factor
// (the last hyper-parameter: clipping and 1/loss scale), and leave a parameter element and its
// moments as they are where its own scaled gradient is not finite.
// #include common

// Finite from the exponent bits: WGSL lets compilers assume no NaN or infinity, so a float
// test such as g - g == 0.0 (or NaN arithmetic such as 0 * x) may be folded away.
fn is_finite(x: f32) -> bool { return (bitcast<u32>(x) & 0x7f800000u) != 0x7f800000u; }

// append_finite_flag, one invocation per element of dst (contiguous, 1-D): dst = src0 (the
// hyper-parameters, 1-D), then 1 when every element of src1 and src2 is finite, else 0, then
// src3 (the gradient factor, one element). The flag's invocation scans src1 and src2 alone:
// they are the loss and a sum of squares, one element each, in training.
@compute @workgroup_size(WG)
fn k_append_finite_flag(@builtin(global_invocation_id) gid: vec3u, @builtin(num_workgroups) nwg: vec3u) {
    let i = flat_id(gid, nwg); if (i >= p.n) { return; }
    if (i + 2u < p.n) {
        dst[p.off.x + i * p.nb_d.x] = to_TD(f32(src0[p.off.y + i * p.nb_0.x]));
        return;
    }
    if (i + 1u == p.n) {
        dst[p.off.x + i * p.nb_d.x] = to_TD(f32(src3[p.off3.x]));
        return;
    }
    var finite = true;
    let n1 = p.ne_1.x * p.ne_1.y * p.ne_1.z * p.ne_1.w;
    for (var j = 0u; j < n1; j++) { finite = finite && is_finite(f32(src1[at_1(unravel(j, p.ne_1))])); }
    let n2 = p.ne_2.x * p.ne_2.y * p.ne_2.z * p.ne_2.w;
    for (var j = 0u; j < n2; j++) { finite = finite && is_finite(f32(src2[at_2(unravel(j, p.ne_2))])); }
    dst[p.off.x + i * p.nb_d.x] = to_TD(select(0.0, 1.0, finite));
}

// opt_step_adamw, one invocation per parameter element, in place:
// dst = param (contiguous), src0 = grad (any strides), src1 = m, src2 = v (contiguous, same
// shape), src3 = hparams [alpha, beta1, beta2, eps, wd, beta1h, beta2h, finite,
// grad_factor]; p.u.x: decay or not.
@compute @workgroup_size(WG)
fn k_opt_step_adamw(@builtin(global_invocation_id) gid: vec3u, @builtin(num_workgroups) nwg: vec3u) {
    let i = flat_id(gid, nwg); if (i >= p.n) { return; }
    let idx = unravel(i, p.ne_d);
    let h = p.off3.x;
    if (f32(src3[h + 7u]) == 0.0) { return; }
    let alpha = f32(src3[h]);
    let beta1 = f32(src3[h + 1u]);
    let beta2 = f32(src3[h + 2u]);
    let eps = f32(src3[h + 3u]);
    let wd = select(0.0, f32(src3[h + 4u]), p.u.x != 0u);
    let g = f32(src0[at_0(idx)]) * f32(src3[h + 8u]);
    if (!is_finite(g)) { return; }
    let im = at_1(idx);
    let iv = at_2(idx);
    let m = f32(src1[im]) * beta1 + g * (1.0 - beta1);
    let v = f32(src2[iv]) * beta2 + g * g * (1.0 - beta2);
    src1[im] = to_T1(m);
    src2[iv] = to_T2(v);
    let d = at_d(idx);
    dst[d] = to_TD(f32(dst[d]) * (1.0 - alpha * wd) - alpha * (m * f32(src3[h + 5u])) / (sqrt(v * f32(src3[h + 6u])) + eps));
}

// opt_step_sgd, in place: dst = param (contiguous), src0 = grad, src1 = hparams [lr, wd, finite,
// grad_factor]; p.u.x: decay or not.
@compute @workgroup_size(WG)
fn k_opt_step_sgd(@builtin(global_invocation_id) gid: vec3u, @builtin(num_workgroups) nwg: vec3u) {
    let i = flat_id(gid, nwg); if (i >= p.n) { return; }
    if (f32(src1[p.off.z + 2u]) == 0.0) { return; }
    let idx = unravel(i, p.ne_d);
    let lr = f32(src1[p.off.z]);
    let wd = select(0.0, f32(src1[p.off.z + 1u]), p.u.x != 0u);
    let g = f32(src0[at_0(idx)]) * f32(src1[p.off.z + 3u]);
    if (!is_finite(g)) { return; }
    let d = at_d(idx);
    dst[d] = to_TD(f32(dst[d]) * (1.0 - lr * wd) - lr * g);
}
