// The tiled product kernels (tiles.wgsl) with src0 a frozen weight in a block type, for
// GPUs: mul_mat_q (a = w [.., M, K], rows along K) and mul_mat_q_back (a = w's transposed
// view [.., K, M], read K-outermost), b the f32 or f16 operand in either layout (p.u.y).
// Each staged vec4 of the weight is one quad (quant_blocks.wgsl), dequantized once per
// workgroup and step rather than once per invocation as quant.wgsl's kernels do. p.u.z is
// the type (TYPE_CODE); p.u.x = 0 and p.f.x = 1: the products have no epilogue.
// #include tiles
// #include quant_blocks

// The vec4 at `at` of b (is_b), or the quad of the weight's values 4 at .. 4 at + 3.
fn load_operand4(at: u32, is_b: bool) -> vec4f {
    if (is_b) { return vec4f(src1_v4[at]); }
    return quad(p.u.z, 4u * at);
}

// The weight's values count from its first block (quad adds where the blocks start).
fn operand_bases(batch: u32) -> vec3u {
    let o = batch_offsets(batch);
    return vec3u(p.off.x + o.x, o.y, p.off.z + o.z);
}

// k_mul_mat_q_tiled, _small, _wide
// #include mul_mat_q_tile_entries
