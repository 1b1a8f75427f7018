// The row ops' 'rowwise' variant (CPU adapters; ggwgpu/kernels.py): one invocation per row,
// no workgroup memory, no barriers. A CPU device runs neighbouring invocations in its SIMD
// lanes, so rows go side by side; the workgroup variant's barriers cost more there than a
// whole row of work. Each invocation holds its whole row, so the reductions are the
// identity. The same functions as row_workgroup.wgsl.
// #include row_kernels

const ROW_STEP: u32 = 1u;

fn row_index(wid: vec3u, gid: vec3u, nwg: vec3u) -> u32 { return flat_id(gid, nwg); }
fn row_lane(lid: vec3u) -> u32 { return 0u; }

fn row_sum(w: Row, v: f32) -> f32 { return v; }
fn row_sum4(w: Row, v: vec4f) -> vec4f { return v; }
fn row_ms(w: Row, v: vec4f) -> vec4f { return v; }
