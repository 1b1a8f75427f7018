// Row gather (get_rows) and its deterministic scatter-add backward (get_rows_back); the row
// write set_rows.
// #include common

// int32 views of the bindings: an entry point uses either the alias or the f32 name of a
// binding, never both (Naga accepts such aliases).
@group(0) @binding(1) var<storage, read_write> dst_i32: array<i32>;
@group(0) @binding(2) var<storage, read_write> src0_i32: array<i32>;
@group(0) @binding(3) var<storage, read_write> src1_i32: array<i32>;

// Ids outside [0, n_rows) are clamped: the shaders never read or write outside the table.
// (The NumPy reference raises IndexError on them; the graph must not feed them.)
fn clamp_id(id: i32, n_rows: u32) -> u32 {
    return u32(clamp(id, 0, i32(n_rows) - 1));
}

// get_rows: src0 table [n_cols, n_rows] (ggml order), src1_i32 ids [ne_1.xyz];
// dst [n_cols, ne_1.xyz]. One invocation per dst element.
@compute @workgroup_size(WG)
fn k_get_rows(@builtin(global_invocation_id) gid: vec3u, @builtin(num_workgroups) nwg: vec3u) {
    let i = flat_id(gid, nwg); if (i >= p.n) { return; }
    let idx = unravel(i, p.ne_d);                       // (col, id index)
    let row = clamp_id(src1_i32[at_1(vec4u(idx.yzw, 0u))], p.ne_0.y);
    dst[at_d(idx)] = to_TD(f32(src0[at_0(vec4u(idx.x, row, 0u, 0u))]));
}

// get_rows_back, pass 1: dst_i32 links = [head: n rows | next: one per id]; heads to -1.
@compute @workgroup_size(WG)
fn k_rows_clear(@builtin(global_invocation_id) gid: vec3u, @builtin(num_workgroups) nwg: vec3u) {
    let r = flat_id(gid, nwg); if (r >= p.n) { return; }
    dst_i32[p.off.x + r] = -1;
}

fn id_at(j: u32, n_rows: u32) -> u32 {
    return clamp_id(src0_i32[at_0(unravel(j, p.ne_0))], n_rows);
}

// pass 2, one invocation per id position j (src0_i32 ids, p.n of them; p.u.x = n_rows):
// next[j] = the next position with the same id (or -1); the first position of each id
// becomes its row's head. Each head has exactly one writer: no race, no atomics.
@compute @workgroup_size(WG)
fn k_rows_link(@builtin(global_invocation_id) gid: vec3u, @builtin(num_workgroups) nwg: vec3u) {
    let j = flat_id(gid, nwg); if (j >= p.n) { return; }
    let n_rows = p.u.x;
    let id = id_at(j, n_rows);
    var next = -1;
    for (var k = j + 1u; k < p.n; k++) {
        if (id_at(k, n_rows) == id) { next = i32(k); break; }
    }
    dst_i32[p.off.x + n_rows + j] = next;
    var first = true;
    for (var k = 0u; k < j; k++) {
        if (id_at(k, n_rows) == id) { first = false; break; }
    }
    if (first) { dst_i32[p.off.x + id] = i32(j); }
}

// pass 3: dst [n_cols, n_rows]; src0 g [n_cols, ids...]; src1_i32 links (p.u.x = n_rows).
// dst[c, r] = sum over row r's list, in id order (the reference's order).
@compute @workgroup_size(WG)
fn k_get_rows_back(@builtin(global_invocation_id) gid: vec3u, @builtin(num_workgroups) nwg: vec3u) {
    let i = flat_id(gid, nwg); if (i >= p.n) { return; }
    let idx = unravel(i, p.ne_d);                       // (col, row)
    var j = src1_i32[p.off.z + idx.y];
    var acc = 0.0;
    while (j >= 0) {
        let at = unravel(u32(j) * p.ne_0.x, p.ne_0);   // (0, id index)
        acc += f32(src0[at_0(vec4u(idx.x, at.yzw))]);
        j = src1_i32[p.off.z + p.u.x + u32(j)];
    }
    dst[at_d(idx)] = to_TD(acc);
}

// set_rows: dst [n_cols, n_rows] (a view of b: only the rows named are written), src0 a
// [n_cols, n], src1_i32 ids [n] (distinct). One invocation per element of a.
@compute @workgroup_size(WG)
fn k_set_rows(@builtin(global_invocation_id) gid: vec3u, @builtin(num_workgroups) nwg: vec3u) {
    let i = flat_id(gid, nwg); if (i >= p.n) { return; }
    let idx = unravel(i, p.ne_0);                       // (col, row of a)
    let row = clamp_id(src1_i32[at_1(vec4u(idx.y, 0u, 0u, 0u))], p.ne_d.y);
    dst[at_d(vec4u(idx.x, row, 0u, 0u))] = to_TD(f32(src0[at_0(idx)]));
}
