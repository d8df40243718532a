//! Our own f32 matrix product, `C = start + alpha · A·B`, laid out as BLIS lays out a GEMM
//! (Goto's five loops around a register-blocked micro-kernel):
//!
//! ```text
//! for jc in columns of C, NC at a time           B block: KC x NC, packed, lives in L3
//!   for pc in depth, KC at a time                (each element's sum is added up KC deep
//!     pack B[pc.., jc..] into NR-wide panels      at a time, in order: 1 and N threads alike)
//!     for ic in rows of C, MC at a time          A block: MC x KC, lives in L2
//!       pack A[ic.., pc..] into MR-tall panels   (row-major A is read in place instead)
//!       for jr in the block's NR-wide panels     B micro-panel: KC x NR, stays in L1
//!         for ir in the block's MR-tall panels   A micro-panel streams from L2
//!           micro-kernel: MR x NR of C in registers, KC rank-1 updates
//! ```
//!
//! Numbers for the machines here: AVX2 (Zen 3: 32 KiB L1d, 512 KiB L2 per core) takes a
//! 6 x 16 tile, 12 ymm accumulators (FMA latency 4 x 2 ports = 8 needed at least), 2 B
//! loads and 6 broadcasts per 12 FMAs; its B micro-panel is 256 x 16 x 4 B = 16 KiB (half
//! of L1), the A block 96 x 256 x 4 B = 96 KiB (a fifth of L2). AVX-512 takes 12 x 32 (24
//! zmm accumulators). KC = 256 is the engine's depth chunk (`gemm.rs`).
//!
//! The micro-kernel is plain Rust over fixed-size arrays; compiled inside a
//! `#[target_feature]` function, LLVM keeps the tile in registers and emits one vector FMA
//! per (row, vector of columns) (checked in the disassembly: `vfmadd231ps` x 12, 2 loads,
//! 6 `vbroadcastss` per depth step on AVX2). Each ISA's version is the same source.
//!
//! The epilogue: the first depth chunk writes `start + alpha · tile` (the start being zero,
//! the destination itself, or a bias row plus a residual matrix: the linear layer's forward
//! then writes its output once, with no separate pass for bias and residual); later chunks
//! add `alpha · tile` to what the first wrote.
//!
//! B's column sums can come with the product: the weight gradient `dW += Xᵀ·dY` packs dY as
//! its B, and the bias gradient `db += Σ_rows dY` is then added up from each panel just
//! packed (still in L1) instead of in a pass of its own over dY; in row order, as that pass
//! adds them.
//!
//! Pack buffers are per thread and kept between calls, as the gemm crate keeps its own.

use std::cell::RefCell;

/// Depth of a chunk: the B micro-panel (KC x NR) stays in L1.
pub const KC: usize = 256;
/// Rows of an A block (MC x KC stays in L2).
const MC: usize = 96;
/// Columns of a B block (KC x NC, in L3): wider than every product of the reference model.
const NC: usize = 1024;

/// What the output holds before the product is added to it.
#[derive(Clone, Copy)]
pub enum Start {
    /// Nothing: the output is overwritten (and never read).
    Zero,
    /// The output's own values (the product accumulates onto them).
    Kept,
    /// `bias[j]` (if any) plus `residual[i, j]` (if any; laid out with the output's strides).
    Rows { bias: *const f32, residual: *const f32 },
}

/// A product `C = start + alpha · A·B` on raw strided f32 matrices: (pointer, row stride,
/// column stride).
#[derive(Clone, Copy)]
pub struct Product {
    pub rows: usize,
    pub cols: usize,
    pub depth: usize,
    pub c: (*mut f32, usize, usize),
    pub a: (*const f32, usize, usize),
    pub b: (*const f32, usize, usize),
    pub start: Start,
    pub alpha: f32,
    /// Null, or `cols` sums: `b_col_sums[j] += Σ_p B[p, j]`, added up in order of `p`.
    pub b_col_sums: *mut f32,
}

/// Whether this machine runs the packed product where the gemm crate would otherwise:
/// AVX2 without AVX-512, on products of at least 4 M multiply-adds (measured on Zen 3,
/// paired with the crate on the reference model's products: 1.0-1.1x the crate's speed on
/// the big ones, 0.8-0.9x on attention's 128 x 64 x 128 tiles, whose packing does not pay).
/// AVX-512 keeps the crate until a machine with it measures ours against it.
pub fn takes(rows: usize, cols: usize, depth: usize) -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        use crate::ops::simd::x86;
        x86::level() == x86::V3 && rows * cols * depth >= 1 << 22
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = (rows, cols, depth);
        false
    }
}

thread_local! {
    static PACKS: RefCell<(Vec<f32>, Vec<f32>)> = const { RefCell::new((Vec::new(), Vec::new())) };
}

/// Runs `p` with the widest micro-kernel this CPU has (AVX-512 or AVX2); false (nothing
/// done) on a CPU with neither.
///
/// # Safety
/// Every element the strides reach is inside its allocation; `c` aliases neither operand,
/// the bias nor the residual, nor memory another thread touches meanwhile.
pub unsafe fn run(p: &Product) -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        // SAFETY: the caller's; each level is reported only when the CPU has its features.
        unsafe { run_at(crate::ops::simd::x86::level(), p) }
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = p;
        false
    }
}

/// [`run`] at SIMD level `level` (or below it): for the tests, which run every level the
/// CPU has.
///
/// # Safety
/// As [`run`], and the CPU has the level's features.
#[cfg(target_arch = "x86_64")]
unsafe fn run_at(level: u8, p: &Product) -> bool {
    use crate::ops::simd::x86;
    if p.rows == 0 || p.cols == 0 {
        return true;
    }
    PACKS.with_borrow_mut(|(pack_a, pack_b)| {
        // SAFETY: the caller's.
        unsafe {
            match level {
                x86::V4 => avx512(p, pack_a, pack_b),
                x86::V3 => avx2(p, pack_a, pack_b),
                _ => return false,
            }
        }
        true
    })
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512cd,avx512dq,avx512vl,avx2,fma")]
unsafe fn avx512(p: &Product, pack_a: &mut Vec<f32>, pack_b: &mut Vec<f32>) {
    // SAFETY: the caller's.
    unsafe { blocked::<12, 32>(p, pack_a, pack_b) }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn avx2(p: &Product, pack_a: &mut Vec<f32>, pack_b: &mut Vec<f32>) {
    // SAFETY: the caller's.
    unsafe { blocked::<6, 16>(p, pack_a, pack_b) }
}

/// The five loops (module comment).
#[inline(always)]
unsafe fn blocked<const MR: usize, const NR: usize>(p: &Product, pack_a: &mut Vec<f32>, pack_b: &mut Vec<f32>) {
    pack_a.resize(MC.next_multiple_of(MR) * KC, 0.0);
    pack_b.resize(NC.next_multiple_of(NR) * KC, 0.0);
    let (a, a_rs, a_cs) = p.a;
    let (b, b_rs, b_cs) = p.b;
    // A row-major A is read in place: its rows are the micro-kernel's MR streams.
    let a_in_place = a_cs == 1;
    for jc in (0..p.cols).step_by(NC) {
        let nc = NC.min(p.cols - jc);
        for pc in (0..p.depth).step_by(KC) {
            let kc = KC.min(p.depth - pc);
            // SAFETY (all the pointer arithmetic below): inside the matrices, by the caller's.
            unsafe {
                let sums = if p.b_col_sums.is_null() { None } else { Some(p.b_col_sums.add(jc)) };
                pack_b_block::<NR>(pack_b, (b.add(pc * b_rs + jc * b_cs), b_rs, b_cs), kc, nc, sums);
                for ic in (0..p.rows).step_by(MC) {
                    let mc = MC.min(p.rows - ic);
                    let a_block = (a.add(ic * a_rs + pc * a_cs), a_rs, a_cs);
                    // The panels packed: all of them, or only the last, short one.
                    let packed_from = if a_in_place { mc / MR * MR } else { 0 };
                    if packed_from < mc {
                        let rest = (a_block.0.add(packed_from * a_rs), a_rs, a_cs);
                        pack_a_block::<MR>(&mut pack_a[packed_from * kc..], rest, mc - packed_from, kc);
                    }
                    for jr in (0..nc).step_by(NR) {
                        let nr = NR.min(nc - jr);
                        let b_panel = pack_b.as_ptr().add(jr * kc);
                        for ir in (0..mc).step_by(MR) {
                            let mr = MR.min(mc - ir);
                            let (i0, j0) = (ic + ir, jc + jr);
                            prefetch_tile(p.c, i0, j0, mr, nr);
                            let tile = if ir < packed_from {
                                micro_kernel_rows::<MR, NR>(kc, a_block.0.add(ir * a_rs), a_rs, b_panel)
                            } else {
                                micro_kernel::<MR, NR>(kc, pack_a.as_ptr().add(ir * kc), b_panel)
                            };
                            store_tile(p, pc == 0, &tile, (i0, j0), (mr, nr));
                        }
                    }
                }
            }
        }
    }
}

/// `MR x NR` of C: `Σ_p a[p][i] · b[p][j]` over a packed A micro-panel (`a[p * MR + i]`)
/// and a packed B micro-panel (`b[p * NR + j]`), the tile in registers.
#[inline(always)]
unsafe fn micro_kernel<const MR: usize, const NR: usize>(
    depth: usize,
    a: *const f32,
    b: *const f32,
) -> [[f32; NR]; MR] {
    let mut tile = [[0.0f32; NR]; MR];
    for p in 0..depth {
        // SAFETY: the panels hold `depth` steps of MR and NR elements.
        let (a_p, b_p) = unsafe { (*(a.add(p * MR) as *const [f32; MR]), *(b.add(p * NR) as *const [f32; NR])) };
        for i in 0..MR {
            for j in 0..NR {
                tile[i][j] = a_p[i].mul_add(b_p[j], tile[i][j]);
            }
        }
    }
    tile
}

/// As [`micro_kernel`], with A's MR rows read in place (`a[i * row_stride + p]`).
#[inline(always)]
unsafe fn micro_kernel_rows<const MR: usize, const NR: usize>(
    depth: usize,
    a: *const f32,
    row_stride: usize,
    b: *const f32,
) -> [[f32; NR]; MR] {
    let mut tile = [[0.0f32; NR]; MR];
    let rows: [*const f32; MR] = std::array::from_fn(|i| a.wrapping_add(i * row_stride));
    for p in 0..depth {
        // SAFETY: the MR rows hold `depth` elements each; the B panel `depth` steps of NR.
        let b_p = unsafe { *(b.add(p * NR) as *const [f32; NR]) };
        for i in 0..MR {
            let a_ip = unsafe { *rows[i].add(p) };
            for j in 0..NR {
                tile[i][j] = a_ip.mul_add(b_p[j], tile[i][j]);
            }
        }
    }
    tile
}

/// The tile's rows of C into L1 while the micro-kernel runs (its stores would otherwise
/// wait on them at its end).
#[inline(always)]
fn prefetch_tile(c: (*mut f32, usize, usize), i0: usize, j0: usize, mr: usize, nr: usize) {
    #[cfg(target_arch = "x86_64")]
    for i in 0..mr {
        use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
        let first = c.0.wrapping_add((i0 + i) * c.1 + j0 * c.2);
        // SAFETY: a prefetch never faults.
        unsafe {
            _mm_prefetch::<_MM_HINT_T0>(first as *const i8);
            _mm_prefetch::<_MM_HINT_T0>(first.wrapping_add((nr - 1) * c.2) as *const i8);
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = (c, i0, j0, mr, nr);
}

/// The epilogue: the live `mr x nr` part of the tile into C at (i0, j0); the first depth
/// chunk writes `start + alpha · tile`, the others add `alpha · tile`. Row by row, on
/// slices where C's rows are contiguous (so that it is vectorised), else element by element.
#[inline(always)]
unsafe fn store_tile<const MR: usize, const NR: usize>(
    p: &Product,
    first_chunk: bool,
    tile: &[[f32; NR]; MR],
    (i0, j0): (usize, usize),
    (mr, nr): (usize, usize),
) {
    let (c, rs, cs) = p.c;
    let start = if first_chunk { p.start } else { Start::Kept };
    let alpha = p.alpha;
    for (i, tile_row) in tile.iter().enumerate().take(mr) {
        let tile_row = &tile_row[..nr];
        let row_start = (i0 + i) * rs + j0 * cs;
        // SAFETY: (i0 + i, j0..j0 + nr) is inside C, and inside the residual (laid out
        // alike) and the bias row.
        unsafe {
            if let Start::Zero = start {
                // Written through the pointer: the output may be uninitialised (gemm.rs).
                let out = c.add(row_start);
                if cs == 1 {
                    tile_row.iter().enumerate().for_each(|(j, t)| out.add(j).write(alpha * t));
                } else {
                    tile_row.iter().enumerate().for_each(|(j, t)| out.add(j * cs).write(alpha * t));
                }
                continue;
            }
            if cs == 1 {
                let out = std::slice::from_raw_parts_mut(c.add(row_start), nr);
                match start {
                    Start::Zero => unreachable!("written above"),
                    Start::Kept => out.iter_mut().zip(tile_row).for_each(|(y, t)| *y += alpha * t),
                    Start::Rows { bias, residual } => {
                        let line = |x: *const f32, at: usize| {
                            (!x.is_null()).then(|| std::slice::from_raw_parts(x.add(at), nr))
                        };
                        match (line(bias, j0), line(residual, row_start)) {
                            (Some(b), Some(r)) => {
                                for (((y, t), b), r) in out.iter_mut().zip(tile_row).zip(b).zip(r) {
                                    *y = r + b + alpha * t;
                                }
                            }
                            (Some(b), None) => {
                                out.iter_mut().zip(tile_row).zip(b).for_each(|((y, t), b)| *y = b + alpha * t)
                            }
                            (None, Some(r)) => {
                                out.iter_mut().zip(tile_row).zip(r).for_each(|((y, t), r)| *y = r + alpha * t)
                            }
                            (None, None) => out.iter_mut().zip(tile_row).for_each(|(y, t)| *y = alpha * t),
                        }
                    }
                }
                continue;
            }
            for (j, t) in tile_row.iter().enumerate() {
                let y = c.add(row_start + j * cs);
                *y = match start {
                    Start::Zero => unreachable!("written above"),
                    Start::Kept => *y + alpha * t,
                    Start::Rows { bias, residual } => {
                        let r = if residual.is_null() { 0.0 } else { *residual.add(row_start + j * cs) };
                        let b = if bias.is_null() { 0.0 } else { *bias.add(j0 + j) };
                        r + b + alpha * t
                    }
                };
            }
        }
    }
}

/// A's `rows x depth` block (element (i, p) at `a[i * rs + p * cs]`) as MR-tall panels,
/// each `depth` steps of MR (`dst[panel][p * MR + i]`), the last panel padded with zeros.
#[inline(always)]
unsafe fn pack_a_block<const MR: usize>(dst: &mut [f32], a: (*const f32, usize, usize), rows: usize, depth: usize) {
    let (a, rs, cs) = a;
    for (panel, out) in dst.chunks_exact_mut(MR * depth).take(rows.div_ceil(MR)).enumerate() {
        let i0 = panel * MR;
        let live = MR.min(rows - i0);
        if rs == 1 && live == MR {
            // Columns of A are contiguous (a transposed activation): MR at a time.
            for (p, out_p) in out.chunks_exact_mut(MR).enumerate() {
                // SAFETY: column p's rows i0..i0 + MR are inside A.
                out_p.copy_from_slice(unsafe { std::slice::from_raw_parts(a.add(i0 + p * cs), MR) });
            }
            continue;
        }
        for p in 0..depth {
            for i in 0..MR {
                // SAFETY: (i0 + i, p) is inside A for the live rows.
                out[p * MR + i] = if i < live { unsafe { *a.add((i0 + i) * rs + p * cs) } } else { 0.0 };
            }
        }
    }
}

/// B's `depth x cols` block (element (p, j) at `b[p * rs + j * cs]`) as NR-wide panels,
/// each `depth` steps of NR (`dst[panel][p * NR + j]`), the last panel padded with zeros;
/// and, given `col_sums`, `col_sums[j] += Σ_p B[p, j]` from each panel as it is packed.
#[inline(always)]
unsafe fn pack_b_block<const NR: usize>(
    dst: &mut [f32],
    b: (*const f32, usize, usize),
    depth: usize,
    cols: usize,
    col_sums: Option<*mut f32>,
) {
    let (b, rs, cs) = b;
    for (panel, out) in dst.chunks_exact_mut(NR * depth).take(cols.div_ceil(NR)).enumerate() {
        let j0 = panel * NR;
        let live = NR.min(cols - j0);
        if cs == 1 && live == NR {
            // Rows of B are contiguous: NR at a time.
            for (p, out_p) in out.chunks_exact_mut(NR).enumerate() {
                // SAFETY: row p's columns j0..j0 + NR are inside B.
                out_p.copy_from_slice(unsafe { std::slice::from_raw_parts(b.add(p * rs + j0), NR) });
            }
        } else if rs == 1 && live == NR {
            // Columns of B are contiguous (a transposed weight): one column at a time.
            for j in 0..NR {
                // SAFETY: column j0 + j's `depth` rows are inside B.
                let column = unsafe { std::slice::from_raw_parts(b.add((j0 + j) * cs), depth) };
                for (p, &x) in column.iter().enumerate() {
                    out[p * NR + j] = x;
                }
            }
        } else {
            for p in 0..depth {
                for j in 0..NR {
                    // SAFETY: (p, j0 + j) is inside B for the live columns.
                    out[p * NR + j] = if j < live { unsafe { *b.add(p * rs + (j0 + j) * cs) } } else { 0.0 };
                }
            }
        }
        if let Some(col_sums) = col_sums {
            // SAFETY: the caller's `cols` sums, of which this panel's live columns.
            let sums = unsafe { std::slice::from_raw_parts_mut(col_sums.add(j0), live) };
            for step in out.chunks_exact(NR) {
                sums.iter_mut().zip(step).for_each(|(sum, x)| *sum += x);
            }
        }
    }
}

#[cfg(all(test, target_arch = "x86_64"))]
mod tests {
    use super::*;
    use crate::ops::simd::x86;

    /// A row-major f64 matrix and a strided f32 view of the same values.
    struct Operand {
        exact: Vec<f64>,
        stored: Vec<f32>,
        strides: (usize, usize),
    }

    /// `rows x cols`, stored row-major, transposed or every other column (stride 2).
    fn operand(rows: usize, cols: usize, layout: usize, seed: f64) -> Operand {
        let values: Vec<f32> = (0..rows * cols).map(|i| ((i as f64 + seed) * 0.37).sin() as f32).collect();
        let exact = values.iter().map(|&x| x as f64).collect();
        let (stored, strides) = match layout {
            0 => (values, (cols, 1)),
            1 => ((0..rows * cols).map(|i| values[(i % rows) * cols + i / rows]).collect(), (1, rows)),
            _ => {
                let mut wide = vec![f32::NAN; rows * cols * 2];
                for (i, &x) in values.iter().enumerate() {
                    wide[(i / cols) * cols * 2 + (i % cols) * 2] = x;
                }
                (wide, (cols * 2, 2))
            }
        };
        Operand { exact, stored, strides }
    }

    fn levels() -> Vec<u8> {
        [x86::V3, x86::V4].into_iter().filter(|&l| x86::level() >= l).collect()
    }

    /// Every start, accumulating or not, on shapes that are and are not multiples of the
    /// tiles (and of KC: 600 deep is three chunks, the last short), against the f64 sum.
    #[test]
    fn products_match_the_f64_reference_on_every_level_start_and_layout() {
        let shapes =
            [(1, 1, 1), (6, 256, 16), (12, 512, 32), (7, 257, 17), (13, 600, 35), (100, 300, 70), (97, 40, 130)];
        for level in levels() {
            for (m, k, n) in shapes {
                for (layout_a, layout_b) in [(0, 0), (1, 1), (0, 1), (2, 2)] {
                    let (a, b) = (operand(m, k, layout_a, 1.0), operand(k, n, layout_b, 2.0));
                    let bias: Vec<f32> = (0..n).map(|j| (j as f32 * 0.3).cos()).collect();
                    let residual: Vec<f32> = (0..m * n).map(|i| (i as f32 * 0.7).sin()).collect();
                    let kept: Vec<f32> = (0..m * n).map(|i| (i as f32 * 0.11).cos()).collect();
                    let starts = [
                        ("zero", Start::Zero, vec![0.0; m * n]),
                        ("kept", Start::Kept, kept.iter().map(|&x| x as f64).collect()),
                        ("bias", Start::Rows { bias: bias.as_ptr(), residual: std::ptr::null() }, {
                            (0..m * n).map(|i| bias[i % n] as f64).collect()
                        }),
                        ("residual", Start::Rows { bias: std::ptr::null(), residual: residual.as_ptr() }, {
                            residual.iter().map(|&x| x as f64).collect()
                        }),
                        ("both", Start::Rows { bias: bias.as_ptr(), residual: residual.as_ptr() }, {
                            (0..m * n).map(|i| bias[i % n] as f64 + residual[i] as f64).collect()
                        }),
                    ];
                    for (name, start, base) in starts {
                        // An overwritten output starts as NaN: any element read would show.
                        let mut c = if matches!(start, Start::Kept) { kept.clone() } else { vec![f32::NAN; m * n] };
                        let product = Product {
                            rows: m,
                            cols: n,
                            depth: k,
                            c: (c.as_mut_ptr(), n, 1),
                            a: (a.stored.as_ptr(), a.strides.0, a.strides.1),
                            b: (b.stored.as_ptr(), b.strides.0, b.strides.1),
                            start,
                            alpha: 0.5,
                            b_col_sums: std::ptr::null_mut(),
                        };
                        // SAFETY: the views fit their vectors; the level is the CPU's.
                        assert!(unsafe { run_at(level, &product) });
                        for i in 0..m {
                            for j in 0..n {
                                let sum: f64 = (0..k).map(|p| a.exact[i * k + p] * b.exact[p * n + j]).sum();
                                let want = base[i * n + j] + 0.5 * sum;
                                let got = c[i * n + j] as f64;
                                assert!(
                                    (got - want).abs() < 1e-5 * (k as f64).sqrt() * (1.0 + want.abs()),
                                    "level {level} {m}x{k}x{n} layouts {layout_a},{layout_b} start {name} ({i}, {j}): {got} vs {want}"
                                );
                            }
                        }
                    }
                }
            }
        }
    }

    /// A block of C computed alone gives the bits the whole product gives there: each
    /// element's sum does not depend on which rows or columns a thread was given.
    #[test]
    fn a_block_alone_gives_the_whole_products_bits() {
        let (m, k, n) = (70, 700, 90);
        let (a, b) = (operand(m, k, 0, 1.0), operand(k, n, 1, 2.0));
        for level in levels() {
            let run = |rows: std::ops::Range<usize>, cols: std::ops::Range<usize>, c: &mut [f32]| {
                let product = Product {
                    rows: rows.len(),
                    cols: cols.len(),
                    depth: k,
                    c: (c.as_mut_ptr().wrapping_add(rows.start * n + cols.start), n, 1),
                    a: (a.stored.as_ptr().wrapping_add(rows.start * k), k, 1),
                    b: (b.stored.as_ptr().wrapping_add(cols.start * k), 1, k),
                    start: Start::Zero,
                    alpha: 1.0,
                    b_col_sums: std::ptr::null_mut(),
                };
                // SAFETY: the blocks lie inside the matrices; the level is the CPU's.
                unsafe { run_at(level, &product) };
            };
            let mut whole = vec![0.0; m * n];
            run(0..m, 0..n, &mut whole);
            let mut blocks = vec![0.0; m * n];
            run(0..29, 0..n, &mut blocks);
            run(29..m, 0..41, &mut blocks);
            run(29..m, 41..n, &mut blocks);
            assert!(whole.iter().zip(&blocks).all(|(x, y)| x.to_bits() == y.to_bits()), "level {level}");
        }
    }

    /// B's column sums, asked with the product, are each column's f32 sum in row order
    /// onto where they started (the bits a pass of its own gives), across depth chunks (600
    /// deep), column blocks (1,030 wide: two of NC) and short panels, in every layout of B.
    #[test]
    fn column_sums_of_b_are_added_up_in_row_order() {
        for level in levels() {
            for (m, k, n) in [(7, 600, 1030), (13, 257, 35), (1, 1, 1)] {
                let a = operand(m, k, 0, 1.0);
                for layout_b in [0, 1, 2] {
                    let b = operand(k, n, layout_b, 2.0);
                    let start: Vec<f32> = (0..n).map(|j| (j as f32 * 0.9).sin()).collect();
                    let (mut c, mut sums) = (vec![0.0; m * n], start.clone());
                    let product = Product {
                        rows: m,
                        cols: n,
                        depth: k,
                        c: (c.as_mut_ptr(), n, 1),
                        a: (a.stored.as_ptr(), a.strides.0, a.strides.1),
                        b: (b.stored.as_ptr(), b.strides.0, b.strides.1),
                        start: Start::Zero,
                        alpha: 1.0,
                        b_col_sums: sums.as_mut_ptr(),
                    };
                    // SAFETY: the views fit their vectors; the level is the CPU's.
                    assert!(unsafe { run_at(level, &product) });
                    for j in 0..n {
                        let want = (0..k).fold(start[j], |sum, p| sum + b.exact[p * n + j] as f32);
                        assert_eq!(
                            sums[j].to_bits(),
                            want.to_bits(),
                            "level {level} {m}x{k}x{n} B layout {layout_b} column {j}"
                        );
                    }
                }
            }
        }
    }
}
