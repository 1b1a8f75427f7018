// Copies between layouts.
// #include common

// cpy / cont: element i of dst (in its own shape) gets element i of src0 (in src0's shape);
// both walk their elements in row-major order, so the shapes may differ.
@compute @workgroup_size(WG)
fn k_cpy(@builtin(global_invocation_id) gid: vec3u, @builtin(num_workgroups) nwg: vec3u) {
    let i = flat_id(gid, nwg); if (i >= p.n) { return; }
    dst[at_d(unravel(i, p.ne_d))] = to_TD(f32(src0[at_0(unravel(i, p.ne_0))]));
}

// acc, second step: dst is the view (of a fresh copy of a) that src0 is added into.
// Views are non-overlapping, so each invocation owns its dst element.
@compute @workgroup_size(WG)
fn k_acc(@builtin(global_invocation_id) gid: vec3u, @builtin(num_workgroups) nwg: vec3u) {
    let i = flat_id(gid, nwg); if (i >= p.n) { return; }
    let idx = unravel(i, p.ne_d);
    dst[at_d(idx)] = to_TD(f32(dst[at_d(idx)]) + (f32(src0[at_0(idx)])));
}

// diag: dst [.., n, n] from the row src0 [.., 1, n]: dst[.., i, j] = (i == j) ? src0[.., 0, j] : 0.
@compute @workgroup_size(WG)
fn k_diag(@builtin(global_invocation_id) gid: vec3u, @builtin(num_workgroups) nwg: vec3u) {
    let i = flat_id(gid, nwg); if (i >= p.n) { return; }
    let idx = unravel(i, p.ne_d);
    var v = 0.0;
    if (idx.x == idx.y) { v = f32(src0[at_0(vec4u(idx.x, 0u, idx.z, idx.w))]); }
    dst[at_d(idx)] = to_TD(v);
}
