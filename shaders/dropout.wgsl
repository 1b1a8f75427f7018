// Dropout (ops/elementwise.py's dropout): a mask drawn from a hash of each element's index,
// so that the forward, its backward and every backend draw the same one, with no state.
// #include common

// The control, i32 [seed, on], in binding 3.
@group(0) @binding(3) var<storage, read_write> src1_i32: array<i32>;

// lowbias32, a 32-bit integer hash (ops/elementwise.py's dropout_mix).
fn dropout_mix(v: u32) -> u32 {
    var x = v ^ (v >> 16u);
    x *= 0x7feb352du;
    x ^= x >> 15u;
    x *= 0x846ca68bu;
    return x ^ (x >> 16u);
}

// dropout: dst = src0 * p.f.x (1 / (1 - rate)) where element i's draw is at least p.u.y (the
// threshold), else 0; with on (ctl[1]) 0, dst = src0. The draw: the top 24 bits of
// mix(mix(i ^ key) + key), key = mix(seed + mix(stream)), i dst's row-major index, p.u.x
// the stream (ops/elementwise.py's dropout_keep).
@compute @workgroup_size(WG)
fn k_dropout(@builtin(global_invocation_id) gid: vec3u, @builtin(num_workgroups) nwg: vec3u) {
    let i = flat_id(gid, nwg); if (i >= p.n) { return; }
    let idx = unravel(i, p.ne_d);
    var y = f32(src0[at_0(idx)]);
    if (src1_i32[p.off.z + p.nb_1.x] != 0) {
        let key = dropout_mix(bitcast<u32>(src1_i32[p.off.z]) + dropout_mix(p.u.x));
        let draw = dropout_mix(dropout_mix(i ^ key) + key) >> 8u;
        y = select(0.0, y * p.f.x, draw >= p.u.y);
    }
    dst[at_d(idx)] = to_TD(y);
}
