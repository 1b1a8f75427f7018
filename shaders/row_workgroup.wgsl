// The row ops' 'workgroup' variant (GPUs; ggwgpu/kernels.py): one workgroup per row, whose
// WG invocations take every WG-th element of it; the reductions are trees over the
// workgroup, so every invocation of the row must reach them: the kernels call them in
// uniform control flow (the row bound check is uniform per workgroup, and loops over the
// row end before them). The same functions as row_rowwise.wgsl.
// #include row_kernels

const ROW_STEP: u32 = WG;

fn row_index(wid: vec3u, gid: vec3u, nwg: vec3u) -> u32 { return flat_group(wid, nwg); }
fn row_lane(lid: vec3u) -> u32 { return lid.x; }

fn row_sum(w: Row, v: f32) -> f32 { return workgroup_sum(w.lane, v); }
fn row_sum4(w: Row, v: vec4f) -> vec4f { return workgroup_tree(w.lane, v, false); }
fn row_ms(w: Row, v: vec4f) -> vec4f { return workgroup_tree(w.lane, v, true); }
