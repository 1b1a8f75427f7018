// The tiled product kernels' bodies, shared by matmul.wgsl (f32 and f16 operands) and
// quant_tiled.wgsl (a frozen weight in a block type), each of which defines how an operand's
// vec4 is loaded (load_operand4) and where a batch entry's operands start (operand_bases),
// and includes the entry points (wgsl.tile_entries: k_<product>_<kernel>, of
// <KERNEL>_THREADS invocations). p.u.y: the operands' layouts; p.f.x, p.u.x:
// product_epilogue's alpha and c.
// #include product

// mul_mat_tiled, for GPUs: a workgroup of 16 x 16 invocations computes a 64 x 64 tile of
// dst, each invocation a 4 x 4 block of it. Per step of 16 along K the workgroup stages
// 64 x 16 of a and of b in workgroup memory as [k][m / 4] (and [k][n / 4]) vec4s, one vec4
// load per invocation each, so that the inner loop reads 4 consecutive m (or n) as one vec4.
// Each operand is read as it lies, in either of two layouts (p.u.y: bit 0 for a, bit 1 for b;
// ops/matmul.py's tiled_layouts): 0, rows along K (contiguous along K, K % 4 == 0), each
// vec4 transposed into the tile; 1, stored K-outermost (contiguous along m or n: the
// transposed views of every backward product), each vec4 a tile entry as it is. Offsets and
// the other strides are multiples of 4. Rows past M or N are clamped on load, never stored.
// mul_mat_wide is the same with tiles of 128 x 128, 8 along K a step, each invocation an
// 8 x 8 block (twice the multiply-adds per workgroup-memory load), for large products;
// mul_mat_small with tiles of 32 x 32, 64 invocations, 8 along K, for products of few tiles.
// Each stages 4 values per invocation of a and of b per step: `rows` of the tile x
// 4 invocations / rows along K.
var<workgroup> tile_a: array<vec4f, 256>;          // [k][m / 4]: 1024 / rows x rows of a
var<workgroup> tile_b: array<vec4f, 256>;          // [k][n / 4]: the same of b

// Rows along K: the invocation (of `threads`) loads one vec4 along K of one row of a tile of
// `tile` rows (k from k0 + 4 (lid % (threads / tile))), and writes its 4 values into 4
// entries of the tile.
fn stage_along_k(lid: u32, k0: u32, K: u32, rows: u32, first: u32, base: u32, stride: u32,
                 is_b: bool, tile: u32, threads: u32) {
    let per_row = threads / tile;                       // vec4s along K of a row, a step
    let row = lid / per_row;
    let k = k0 + (lid % per_row) * 4u;
    let at = (base + min(first + row, rows - 1u) * stride) / 4u + min(k, K - 4u) / 4u;
    var v = vec4f();
    if (k < K) { v = load_operand4(at, is_b); }
    let width = tile / 4u;                              // vec4s of a row of the tile
    let t = (lid % per_row) * 4u * width + row / 4u;    // tile index of (k - k0, row)
    for (var i = 0u; i < 4u; i++) {
        if (is_b) { tile_b[t + i * width][row % 4u] = v[i]; } else { tile_a[t + i * width][row % 4u] = v[i]; }
    }
}

// Stored K-outermost: the invocation loads row k0 + lid / (tile / 4) along K, the 4 values
// from first + 4 (lid % (tile / 4)) on, which are one tile entry.
fn stage_along_rows(lid: u32, k0: u32, K: u32, rows: u32, first: u32, base: u32,
                    k_stride: u32, is_b: bool, tile: u32) {
    let width = tile / 4u;
    let k = k0 + lid / width;
    let at = (base + min(k, K - 1u) * k_stride + min(first + (lid % width) * 4u, (rows - 1u) & ~3u)) / 4u;
    var v = vec4f();
    if (k < K) { v = load_operand4(at, is_b); }
    if (is_b) { tile_b[lid] = v; } else { tile_a[lid] = v; }
}

// One step's staging of both operands (a tile of `tile` rows each, 4 threads / tile deep
// along K), as p.u.y's layouts say.
fn stage_step(lid: u32, k0: u32, tile: u32, threads: u32, m0: u32, n0: u32, base: vec3u) {
    let K = p.ne_0.x;
    if ((p.u.y & 1u) != 0u) {
        stage_along_rows(lid, k0, K, p.ne_d.x, m0, base.y, p.nb_0.x, false, tile);
    } else {
        stage_along_k(lid, k0, K, p.ne_d.x, m0, base.y, p.nb_0.y, false, tile, threads);
    }
    if ((p.u.y & 2u) != 0u) {
        stage_along_rows(lid, k0, K, p.ne_d.y, n0, base.z, p.nb_1.x, true, tile);
    } else {
        stage_along_k(lid, k0, K, p.ne_d.y, n0, base.z, p.nb_1.y, true, tile, threads);
    }
}

// dst[n0 + 4 ty + j, m0 + 4 tx ..] = the epilogue of acc[j]: a 4 x 4 block of a tile.
fn store_block4(tile: vec3u, base: vec3u, tx: u32, ty: u32, acc: array<vec4f, 4>) {
    for (var j = 0u; j < 4u; j++) {
        let n = tile.y + ty * 4u + j;
        if (n < p.ne_d.y) {
            let m = tile.x + tx * 4u;
            store_product4(base.x, n, m, product_epilogue(tile.z, n, m, acc[j]));
        }
    }
}

// mul_mat_tiled (tiles of 64 x 64, 256 invocations) and mul_mat_small (32 x 32, 64
// invocations: four times the workgroups on products of few 64 x 64 tiles, as a small
// model's 576-wide products over 512 rows: 288 rather than 72): each invocation a 4 x 4
// block, 4 threads / size along K a step. The sizes are constants at each call.
fn mul_mat_blocks4(lid: u32, wid: vec3u, nwg: vec3u, size: u32, threads: u32) {
    let g = flat_group(wid, nwg); if (g >= p.n) { return; }  // the whole workgroup
    let tile = product_tile(g, size, size);
    let base = operand_bases(tile.z);
    // compute: 4 consecutive m at tx * 4, 4 consecutive n at ty * 4
    let side = size / 4u;
    let depth = 4u * threads / size;
    let tx = lid % side;
    let ty = lid / side;
    var acc: array<vec4f, 4>;  // acc[j]: dst[n0 + 4 ty + j, m0 + 4 tx ..]
    for (var k0 = 0u; k0 < p.ne_0.x; k0 += depth) {
        stage_step(lid, k0, size, threads, tile.x, tile.y, base);
        workgroupBarrier();
        for (var k = 0u; k < depth; k++) {
            let a = tile_a[k * side + tx];
            let b = tile_b[k * side + ty];
            acc[0] += a * b.x;
            acc[1] += a * b.y;
            acc[2] += a * b.z;
            acc[3] += a * b.w;
        }
        workgroupBarrier();
    }
    store_block4(tile, base, tx, ty, acc);
}

// Each kernel's invocations, the workgroup size of its entry points (wgsl.tile_entries).
const TILED_THREADS: u32 = 256u;
const SMALL_THREADS: u32 = 64u;
const WIDE_THREADS: u32 = 256u;

fn mul_mat_tiled(lid: u32, wid: vec3u, nwg: vec3u) {
    mul_mat_blocks4(lid, wid, nwg, 64u, TILED_THREADS);
}

fn mul_mat_small(lid: u32, wid: vec3u, nwg: vec3u) {
    mul_mat_blocks4(lid, wid, nwg, 32u, SMALL_THREADS);
}

// mul_mat_wide: invocation (tx, ty) computes m in 4 tx .. + 3 and 64 + 4 tx .. + 3, n in
// 4 ty .. + 3 and 64 + 4 ty .. + 3 of a 128 x 128 tile: per k, 4 vec4 loads of workgroup
// memory (consecutive invocations read consecutive vec4s) feed 64 multiply-adds.
fn mul_mat_wide(lid: u32, wid: vec3u, nwg: vec3u) {       // WIDE_THREADS: 16 x 16
    let g = flat_group(wid, nwg); if (g >= p.n) { return; }  // the whole workgroup
    let tile = product_tile(g, 128u, 128u);
    let base = operand_bases(tile.z);
    let tx = lid % 16u;
    let ty = lid / 16u;
    var lo: array<vec4f, 8>;   // lo[j]: dst[n_j, m0 + 4 tx ..], n_j the j-th of this one's n
    var hi: array<vec4f, 8>;   // hi[j]: dst[n_j, m0 + 64 + 4 tx ..]
    for (var k0 = 0u; k0 < p.ne_0.x; k0 += 8u) {
        stage_step(lid, k0, 128u, WIDE_THREADS, tile.x, tile.y, base);
        workgroupBarrier();
        for (var k = 0u; k < 8u; k++) {
            let a0 = tile_a[k * 32u + tx];
            let a1 = tile_a[k * 32u + 16u + tx];
            let b0 = tile_b[k * 32u + ty];
            let b1 = tile_b[k * 32u + 16u + ty];
            for (var j = 0u; j < 4u; j++) {
                lo[j] += a0 * b0[j];
                hi[j] += a1 * b0[j];
                lo[4u + j] += a0 * b1[j];
                hi[4u + j] += a1 * b1[j];
            }
        }
        workgroupBarrier();
    }
    for (var j = 0u; j < 8u; j++) {
        let n = tile.y + select(4u * ty + j, 64u + 4u * ty + j - 4u, j >= 4u);
        if (n < p.ne_d.y) {
            for (var part = 0u; part < 2u; part++) {
                let m = tile.x + 64u * part + 4u * tx;
                let v = select(lo[j], hi[j], part == 1u);
                store_product4(base.x, n, m, product_epilogue(tile.z, n, m, v));
            }
        }
    }
}

