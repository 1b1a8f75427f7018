// Reductions and tiling.
// #include row_kernels

// sum, sum_sqr, add_sum_sqr: workgroup g adds elements [g * p.u.x, (g + 1) * p.u.x) of src0's
// p.n (squared where p.u.y = 1) into dst[g] (dst contiguous), plus src1's one element where
// p.u.z = 1 (add_sum_sqr's accumulator). Sums longer than one span run twice: partial sums,
// then their sum (a workgroup's work is bounded, see row_kernels.wgsl). Each invocation adds
// every 64th element, then a tree adds the 64: as exact as a pairwise sum of depth 6 over
// runs of up to 1024; an inf or NaN (or a square that overflows) stays one.
@compute @workgroup_size(WG)
fn k_sum(@builtin(local_invocation_id) lid: vec3u, @builtin(workgroup_id) wid: vec3u,
         @builtin(num_workgroups) nwg: vec3u) {
    let g = flat_group(wid, nwg);
    let end = min(p.n, (g + 1u) * p.u.x);
    let square = p.u.y == 1u;
    var acc = 0.0;
    for (var i = g * p.u.x + lid.x; i < end; i += WG) {
        let v = f32(src0[at_0(unravel(i, p.ne_0))]);
        acc += select(v, v * v, square);
    }
    let total = workgroup_sum(lid.x, acc);
    if (lid.x == 0u) {
        var out = total;
        if (p.u.z == 1u) { out = f32(src1[p.off.z]) + total; }
        dst[p.off.x + g] = to_TD(out);
    }
}

// sum_sqr3 (add_sum_sqr3): dst[0] = src3's one element + the sums of the squares of every
// element of src0, src1 and src2 (each at most SUM_SPAN elements): one workgroup, as k_sum
// adds one span, so that a chain of small tensors' squares (the clip's sum over a LoRA's
// pairs) takes a dispatch per three of them.
fn sum_sqr_of(lid: u32, n: u32, which: u32) -> f32 {
    var acc = 0.0;
    for (var i = lid; i < n; i += WG) {
        var v: f32;
        switch which {
            case 0u: { v = f32(src0[at_0(unravel(i, p.ne_0))]); }
            case 1u: { v = f32(src1[at_1(unravel(i, p.ne_1))]); }
            default: { v = f32(src2[at_2(unravel(i, p.ne_2))]); }
        }
        acc += v * v;
    }
    return acc;
}

@compute @workgroup_size(WG)
fn k_sum_sqr3(@builtin(local_invocation_id) lid: vec3u) {
    let count = vec3u(p.ne_0.x * p.ne_0.y * p.ne_0.z * p.ne_0.w,
                      p.ne_1.x * p.ne_1.y * p.ne_1.z * p.ne_1.w,
                      p.ne_2.x * p.ne_2.y * p.ne_2.z * p.ne_2.w);
    let mine = sum_sqr_of(lid.x, count.x, 0u) + sum_sqr_of(lid.x, count.y, 1u)
               + sum_sqr_of(lid.x, count.z, 2u);
    let total = workgroup_sum(lid.x, mine);
    if (lid.x == 0u) { dst[p.off.x] = to_TD(f32(src3[p.off3.x]) + total); }
}

// sum_rows (mean with p.f.x = 1/ne0): one workgroup per row of src0; p.n rows.
@compute @workgroup_size(WG)
fn k_sum_rows(@builtin(local_invocation_id) lid: vec3u, @builtin(workgroup_id) wid: vec3u,
              @builtin(num_workgroups) nwg: vec3u) {
    let row = flat_group(wid, nwg);
    if (row >= p.n) { return; }  // uniform per workgroup: barriers stay in uniform control flow
    let r = row_start(row);
    var acc = 0.0;
    for (var i = lid.x; i < p.ne_0.x; i += WG) {
        acc += f32(src0[at_0(vec4u(i, r.yzw))]);
    }
    let total = workgroup_sum(lid.x, acc);
    if (lid.x == 0u) { dst[at_d(unravel(row, p.ne_d))] = to_TD(total * p.f.x); }
}

// repeat: dst element idx reads src0[idx % ne_0].
@compute @workgroup_size(WG)
fn k_repeat(@builtin(global_invocation_id) gid: vec3u, @builtin(num_workgroups) nwg: vec3u) {
    let i = flat_id(gid, nwg); if (i >= p.n) { return; }
    let idx = unravel(i, p.ne_d);
    dst[at_d(idx)] = to_TD(f32(src0[at_0(idx % p.ne_0)]));
}

// repeat_back: dst element idx sums src0 over every tile: idx + t * ne_d.
@compute @workgroup_size(WG)
fn k_repeat_back(@builtin(global_invocation_id) gid: vec3u, @builtin(num_workgroups) nwg: vec3u) {
    let i = flat_id(gid, nwg); if (i >= p.n) { return; }
    let idx = unravel(i, p.ne_d);
    let tiles = p.ne_0 / p.ne_d;
    var acc = 0.0;
    for (var t3 = 0u; t3 < tiles.w; t3++) {
        for (var t2 = 0u; t2 < tiles.z; t2++) {
            for (var t1 = 0u; t1 < tiles.y; t1++) {
                for (var t0 = 0u; t0 < tiles.x; t0++) {
                    acc += f32(src0[at_0(idx + vec4u(t0, t1, t2, t3) * p.ne_d)]);
                }
            }
        }
    }
    dst[at_d(idx)] = to_TD(acc);
}
