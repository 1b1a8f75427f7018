// Ops that draw random numbers while training (ops/draws.py): element i's draw is the top 24
// bits of mix(mix(i ^ key) + key), key = mix(seed + mix(stream)), i the element's row-major
// index in dst, the seed from the control src1 (i32 [seed, on]), p.u.x the stream. With on
// 0 an op writes src0 as it is.
// #include common

@group(0) @binding(3) var<storage, read_write> src1_i32: array<i32>;

// lowbias32, a 32-bit integer hash (ops/draws.py's mix).
fn mix(v: u32) -> u32 {
    var x = v ^ (v >> 16u);
    x *= 0x7feb352du;
    x ^= x >> 15u;
    x *= 0x846ca68bu;
    return x ^ (x >> 16u);
}

fn draws_on() -> bool { return src1_i32[p.off.z + p.nb_1.x] != 0; }

fn draw(i: u32) -> u32 {
    let key = mix(bitcast<u32>(src1_i32[p.off.z]) + mix(p.u.x));
    return mix(mix(i ^ key) + key) >> 8u;
}

// dropout: dst = src0 * p.f.x (1 / (1 - rate)) where the draw is at least p.u.y (the
// threshold), else 0.
@compute @workgroup_size(WG)
fn k_dropout(@builtin(global_invocation_id) gid: vec3u, @builtin(num_workgroups) nwg: vec3u) {
    let i = flat_id(gid, nwg); if (i >= p.n) { return; }
    let idx = unravel(i, p.ne_d);
    var y = f32(src0[at_0(idx)]);
    if (draws_on()) {
        y = select(0.0, y * p.f.x, draw(i) >= p.u.y);
    }
    dst[at_d(idx)] = to_TD(y);
}

// noise: dst = src0 + p.f.x (the magnitude) * (draw / 2^23 - 1), uniform in [-1, 1).
@compute @workgroup_size(WG)
fn k_noise(@builtin(global_invocation_id) gid: vec3u, @builtin(num_workgroups) nwg: vec3u) {
    let i = flat_id(gid, nwg); if (i >= p.n) { return; }
    let idx = unravel(i, p.ne_d);
    var y = f32(src0[at_0(idx)]);
    if (draws_on()) {
        y += p.f.x * (f32(draw(i)) * (1.0 / 8388608.0) - 1.0);
    }
    dst[at_d(idx)] = to_TD(y);
}
