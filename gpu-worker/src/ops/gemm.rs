//! A bounds-checked, strided-matrix front end to the matrix products: our packed f32
//! product (`packed_gemm.rs`) where this machine runs it (see `packed_gemm::takes`), the
//! `gemm` crate elsewhere (f64, small products, the CPUs ours has not been measured on).
//!
//! A [`Mat`] is a slice plus (rows, cols, row stride, column stride), so a head of
//! the fused QKV activation or a transposed weight is a view, never a copy.
//! Note the crate's own argument order: `alpha` scales the existing destination and
//! `beta` scales the product; [`matmul`] hides that behind `accumulate` / `scale`.
//!
//! bf16 and fp16 matrices are multiplied as cuBLAS does with an f32 compute type: the
//! operands are widened to f32, the product is accumulated in f32, and the result is
//! rounded once as it is stored (here through dense f32 copies of the views).

use std::borrow::Cow;
use std::mem::MaybeUninit;

use rayon::prelude::*;

use crate::memory::{kernel_scratch, Receipt};
use crate::ops::float::{Float, Stored};
use crate::ops::packed_gemm;
use crate::ops::simd::simd_kernel;
pub use gemm::Parallelism;

/// A read-only strided matrix view.
#[derive(Clone, Copy)]
pub struct Mat<'a, F> {
    data: &'a [F],
    rows: usize,
    cols: usize,
    row_stride: usize,
    col_stride: usize,
}

/// A writable strided matrix view.
pub struct MatMut<'a, F> {
    data: &'a mut [F],
    rows: usize,
    cols: usize,
    row_stride: usize,
    col_stride: usize,
}

fn last_index(rows: usize, cols: usize, row_stride: usize, col_stride: usize) -> usize {
    (rows - 1) * row_stride + (cols - 1) * col_stride
}

impl<'a, F> Mat<'a, F> {
    /// Element (i, j) is `data[i * row_stride + j * col_stride]`.
    pub fn new(data: &'a [F], rows: usize, cols: usize, row_stride: usize, col_stride: usize) -> Self {
        if rows > 0 && cols > 0 {
            assert!(
                last_index(rows, cols, row_stride, col_stride) < data.len(),
                "matrix view {rows}x{cols} (strides {row_stride},{col_stride}) exceeds its {} elements",
                data.len()
            );
        }
        Self { data, rows, cols, row_stride, col_stride }
    }

    /// A dense row-major `rows x cols` matrix.
    pub fn row_major(data: &'a [F], rows: usize, cols: usize) -> Self {
        Self::new(data, rows, cols, cols, 1)
    }

    /// The transpose, as a view.
    pub fn t(self) -> Self {
        Self {
            data: self.data,
            rows: self.cols,
            cols: self.rows,
            row_stride: self.col_stride,
            col_stride: self.row_stride,
        }
    }
}

impl<'a, F> MatMut<'a, F> {
    pub fn new(data: &'a mut [F], rows: usize, cols: usize, row_stride: usize, col_stride: usize) -> Self {
        if rows > 0 && cols > 0 {
            assert!(
                last_index(rows, cols, row_stride, col_stride) < data.len(),
                "matrix view {rows}x{cols} (strides {row_stride},{col_stride}) exceeds its {} elements",
                data.len()
            );
        }
        Self { data, rows, cols, row_stride, col_stride }
    }

    pub fn row_major(data: &'a mut [F], rows: usize, cols: usize) -> Self {
        Self::new(data, rows, cols, cols, 1)
    }
}

/// Elements per task when widening or narrowing on several threads.
const CONVERT_CHUNK: usize = 1 << 15;

simd_kernel! {
    /// `dst[i] = src[i]` in the compute format (vectorised: a bf16 load is a shift, fp16
    /// has the CPU's own conversion).
    fn widen_into<F: Float, S: Stored<Acc = F>>(src: &[S], dst: &mut [MaybeUninit<F>]) {
        S::widen_uninit(src, dst)
    }
}

simd_kernel! {
    /// `dst[i] = src[i]` rounded once to the stored format.
    fn narrow_into<F: Float, S: Stored<Acc = F>>(src: &[F], dst: &mut [S]) {
        S::narrow_slice(src, dst)
    }
}

/// `src` widened, in chunks over the threads when `par` has several.
fn widened_slice<S: Stored>(src: &[S], par: Parallelism) -> Vec<S::Acc> {
    let mut out = Vec::with_capacity(src.len());
    let spare = &mut out.spare_capacity_mut()[..src.len()];
    match par {
        Parallelism::Rayon(n) if n > 1 && src.len() > CONVERT_CHUNK => {
            spare.par_chunks_mut(CONVERT_CHUNK).zip(src.par_chunks(CONVERT_CHUNK)).for_each(|(d, s)| widen_into(s, d))
        }
        _ => widen_into(src, spare),
    }
    // SAFETY: widen_into wrote every one of the first src.len() elements.
    unsafe { out.set_len(src.len()) };
    out
}

/// `src` rounded into `dst` (equal lengths), in chunks over the threads when `par` has several.
pub fn narrow_slice<S: Stored>(src: &[S::Acc], dst: &mut [S], par: Parallelism) {
    match par {
        Parallelism::Rayon(n) if n > 1 && src.len() > CONVERT_CHUNK => {
            dst.par_chunks_mut(CONVERT_CHUNK).zip(src.par_chunks(CONVERT_CHUNK)).for_each(|(d, s)| narrow_into(s, d))
        }
        _ => narrow_into(src, dst),
    }
}

impl<F: Stored> Mat<'_, F> {
    /// The view in the compute format, with its strides: a dense matrix (row- or
    /// column-major, as a weight and its transpose are) is widened as one slice and keeps
    /// its strides; a view whose rows (or columns) are contiguous but apart, as a head's
    /// columns of the fused QKV activation are, is widened row by row (column by column)
    /// into a dense one; any other view is gathered element by element.
    fn widened(&self, par: Parallelism) -> (Vec<F::Acc>, usize, usize) {
        let len = self.rows * self.cols;
        if len == 0 {
            // An empty view (an empty product's operand) has no lines to widen.
            return (Vec::new(), self.cols, 1);
        }
        let dense = (self.row_stride, self.col_stride) == (self.cols, 1)
            || (self.row_stride, self.col_stride) == (1, self.rows);
        if dense {
            return (widened_slice(&self.data[..len], par), self.row_stride, self.col_stride);
        }
        // Contiguous lines of `line` elements, `stride` apart (rows, or columns).
        let (line, stride, strides) = if self.col_stride == 1 {
            (self.cols, self.row_stride, (self.cols, 1))
        } else if self.row_stride == 1 {
            (self.rows, self.col_stride, (1, self.rows))
        } else {
            let out = (0..self.rows)
                .flat_map(|i| (0..self.cols).map(move |j| (i, j)))
                .map(|(i, j)| self.data[i * self.row_stride + j * self.col_stride].load())
                .collect();
            return (out, self.cols, 1);
        };
        let mut out = Vec::with_capacity(len);
        for (l, dst) in out.spare_capacity_mut()[..len].chunks_exact_mut(line).enumerate() {
            widen_into(&self.data[l * stride..l * stride + line], dst);
        }
        // SAFETY: the lines cover the first `len` elements and widen_into wrote each.
        unsafe { out.set_len(len) };
        (out, strides.0, strides.1)
    }
}

/// Checks the shapes of `dst = lhs · rhs`; true (with the work done) when there is nothing
/// to multiply: an empty output, or an empty product, which leaves the destination kept
/// (`accumulate`) or cleared.
fn trivial<A, B: Default>(dst: &mut MatMut<'_, B>, accumulate: bool, lhs: &Mat<'_, A>, rhs: &Mat<'_, A>) -> bool {
    assert_eq!(lhs.cols, rhs.rows, "inner dimensions differ");
    assert_eq!(dst.rows, lhs.rows, "output rows differ");
    assert_eq!(dst.cols, rhs.cols, "output columns differ");
    if dst.rows == 0 || dst.cols == 0 {
        return true;
    }
    if lhs.cols != 0 {
        return false;
    }
    if !accumulate {
        for i in 0..dst.rows {
            for j in 0..dst.cols {
                dst.data[i * dst.row_stride + j * dst.col_stride] = B::default();
            }
        }
    }
    true
}

/// `dst = (accumulate ? dst : 0) + scale * lhs · rhs`.
pub fn matmul<S: Stored>(
    dst: MatMut<'_, S>,
    accumulate: bool,
    lhs: Mat<'_, S>,
    rhs: Mat<'_, S>,
    scale: S::Acc,
    par: Parallelism,
) {
    let (lhs, rhs) = (lhs.widen(par), rhs.widen(par));
    matmul_wide(dst, accumulate, lhs.view(), rhs.view(), scale, par);
}

/// A matrix in the compute format: the stored view itself when it already is one (f32,
/// f64), else a widened copy, booked as kernel scratch while it lives. An operand used by
/// two products (a layer's output gradient, by its input and its weight gradients) is
/// widened once for both.
pub struct Wide<'a, F: Clone> {
    data: Cow<'a, [F]>,
    rows: usize,
    cols: usize,
    row_stride: usize,
    col_stride: usize,
    _booked: Option<Receipt>,
}

impl<F: Clone> Wide<'_, F> {
    /// The matrix, as a view to multiply (or to take sub-views of, through [`Self::data`]).
    pub fn view(&self) -> Mat<'_, F> {
        Mat {
            data: &self.data,
            rows: self.rows,
            cols: self.cols,
            row_stride: self.row_stride,
            col_stride: self.col_stride,
        }
    }

    /// Its elements, laid out by the view's strides: the stored slice's own layout when
    /// borrowed, dense (rows or columns as the view's contiguous side) when widened.
    pub fn data(&self) -> &[F] {
        &self.data
    }
}

impl<'a, S: Stored> Mat<'a, S> {
    /// The view in the compute format (see [`Wide`]).
    pub fn widen(self, par: Parallelism) -> Wide<'a, S::Acc> {
        let (rows, cols) = (self.rows, self.cols);
        if let Some(data) = S::as_acc(self.data) {
            let (row_stride, col_stride) = (self.row_stride, self.col_stride);
            return Wide { data: Cow::Borrowed(data), rows, cols, row_stride, col_stride, _booked: None };
        }
        let (data, row_stride, col_stride) = self.widened(par);
        let _booked = kernel_scratch::<S::Acc>(data.len());
        Wide { data: Cow::Owned(data), rows, cols, row_stride, col_stride, _booked }
    }
}

/// `dst = (accumulate ? dst : 0) + scale * lhs · rhs` with the operands already in the
/// compute format ([`Mat::widen`]); a 2-byte `dst` is computed in an f32 copy (of itself
/// when accumulating, uninitialised otherwise) and rounded once as it is stored.
pub fn matmul_wide<S: Stored>(
    mut dst: MatMut<'_, S>,
    accumulate: bool,
    lhs: Mat<'_, S::Acc>,
    rhs: Mat<'_, S::Acc>,
    scale: S::Acc,
    par: Parallelism,
) {
    if trivial(&mut dst, accumulate, &lhs, &rhs) {
        return;
    }
    let (rows, cols) = (dst.rows, dst.cols);
    let dst_strides = (dst.row_stride, dst.col_stride);
    if let Some(d) = S::as_acc_mut(dst.data) {
        let d = MatMut { data: d, rows, cols, row_stride: dst_strides.0, col_stride: dst_strides.1 };
        return gemm_in_place(d, accumulate, lhs, rhs, scale, par);
    }
    let (mut out, out_strides) = if accumulate {
        let dst_view = Mat { data: &*dst.data, rows, cols, row_stride: dst_strides.0, col_stride: dst_strides.1 };
        let (out, row_stride, col_stride) = dst_view.widened(par);
        (out, (row_stride, col_stride))
    } else {
        (Vec::with_capacity(rows * cols), (cols, 1))
    };
    let _booked = kernel_scratch::<S::Acc>(rows * cols);
    let product = RawProduct::new((out.as_mut_ptr(), rows, cols, out_strides), accumulate, lhs, rhs, scale);
    // SAFETY: `out` holds (or has the capacity for) the rows * cols elements its strides
    // reach, and nothing else sees it; the operands' views checked their indices. A product
    // that does not accumulate writes every element of its output and reads none (the test
    // `an_overwriting_product_reads_nothing_of_its_output`), so `out` is initialised after.
    unsafe {
        run_on_threads(product, par);
        out.set_len(rows * cols);
    }
    if dst_strides == out_strides {
        // Laid out alike (both dense): one slice onto the other.
        narrow_slice(&out, &mut dst.data[..rows * cols], par);
        return;
    }
    for (i, row) in out.chunks_exact(cols).enumerate() {
        let start = i * dst_strides.0;
        if dst_strides.1 == 1 {
            narrow_into(row, &mut dst.data[start..start + cols]);
        } else {
            for (j, &x) in row.iter().enumerate() {
                dst.data[start + j * dst_strides.1] = S::store(x);
            }
        }
    }
}

/// `dst = (accumulate ? dst : 0) + scale * lhs · rhs` on views of the compute format
/// itself (f32 or f64), with no copies: for kernels that widen their operands once and
/// multiply tiles of them many times (flash_attention.rs).
pub fn matmul_widened<F: Float>(
    mut dst: MatMut<'_, F>,
    accumulate: bool,
    lhs: Mat<'_, F>,
    rhs: Mat<'_, F>,
    scale: F,
    par: Parallelism,
) {
    if !trivial(&mut dst, accumulate, &lhs, &rhs) {
        gemm_in_place(dst, accumulate, lhs, rhs, scale, par);
    }
}

/// `dst = residual + bias + lhs · rhs` (the bias one value per column, the residual laid
/// out as `dst`) written in one pass over `dst`, where the packed product takes it (f32 on a
/// machine it runs on); false, with nothing done, where it does not.
pub fn matmul_onto_bias_residual<F: Float>(
    mut dst: MatMut<'_, F>,
    lhs: Mat<'_, F>,
    rhs: Mat<'_, F>,
    bias: Option<&[F]>,
    residual: Option<&[F]>,
    par: Parallelism,
) -> bool {
    let Some(mut product) = packed_accumulating(&mut dst, lhs, rhs) else { return false };
    if let Some(bias) = bias {
        assert!(bias.len() >= dst.cols, "a bias of {} for {} columns", bias.len(), dst.cols);
    }
    if let Some(residual) = residual {
        let last = last_index(dst.rows, dst.cols, dst.row_stride, dst.col_stride);
        assert!(
            last < residual.len(),
            "a residual of {} elements for a {}x{} output",
            residual.len(),
            dst.rows,
            dst.cols
        );
    }
    let pointer = |x: Option<&[F]>| x.map_or(std::ptr::null(), |x| x.as_ptr());
    product.start_rows = Some((pointer(bias), pointer(residual)));
    // SAFETY: the views' constructors and the asserts above checked every index the
    // strides reach; `dst` is borrowed mutably, so it aliases no input.
    unsafe { run_on_threads(product, par) };
    true
}

/// `dst += lhs · rhs` and `col_sums[j] += Σ_p rhs[p, j]` with one read of `rhs` (a weight
/// gradient and its bias's, `rhs` being the output gradient: the sums are added up as the
/// product packs it, each in row order as a pass of its own adds it), where the packed
/// product takes it (f32 on a machine it runs on); false, with nothing done, where it does not.
pub fn matmul_and_rhs_col_sums<F: Float>(
    mut dst: MatMut<'_, F>,
    lhs: Mat<'_, F>,
    rhs: Mat<'_, F>,
    col_sums: &mut [F],
    par: Parallelism,
) -> bool {
    let Some(mut product) = packed_accumulating(&mut dst, lhs, rhs) else { return false };
    assert_eq!(col_sums.len(), dst.cols, "column sums for {} columns", dst.cols);
    product.rhs_col_sums = col_sums.as_mut_ptr();
    // SAFETY: the views' constructors and the assert above checked every index; `dst` and
    // `col_sums` are borrowed mutably, so they alias no input.
    unsafe { run_on_threads(product, par) };
    true
}

/// `dst += lhs · rhs` as a product of the packed engine, for the epilogues only it has,
/// where it takes it (f32 on a machine it runs on), the shapes checked; None where not.
fn packed_accumulating<F: Float>(dst: &mut MatMut<'_, F>, lhs: Mat<'_, F>, rhs: Mat<'_, F>) -> Option<RawProduct<F>> {
    if !is_f32::<F>() || !packed_gemm::takes(dst.rows, dst.cols, lhs.cols) {
        return None;
    }
    // Checks the shapes (an empty product never gets here: `takes` wants some size).
    if trivial(dst, true, &lhs, &rhs) {
        return None;
    }
    let raw_dst = (dst.data.as_mut_ptr(), dst.rows, dst.cols, (dst.row_stride, dst.col_stride));
    Some(RawProduct::new(raw_dst, true, lhs, rhs, F::ONE))
}

fn is_f32<F: Float>() -> bool {
    std::any::TypeId::of::<F>() == std::any::TypeId::of::<f32>()
}

/// Output rows or columns per thread's block, at least: a block this long still takes the
/// gemm crate's cache-blocked path, whose depth chunks (which fix the order in which each
/// element's sum is added up) depend on the inner dimension alone.
const MIN_BLOCK: usize = 128;

/// Depth of the chunks a product much deeper than it is wide is summed in (a weight
/// gradient `Xᵀ dY`, whose inner dimension is the tokens): the gemm crate would sum it at
/// least 512 deep at a time, and its packed operands then outgrow the caches. Measured on the
/// reference model's weight gradients (2048 deep, 256 x 1024 and 1024 x 256 outputs, one
/// thread): 4 to 6 points of the FMA peak more than the crate's own depth, and 4 to 5
/// fewer on the wide products, which are therefore left to it.
const DEPTH_CHUNK: usize = 256;

/// The gemm crate's product on f32 or f64 views (shapes already checked).
///
/// On several threads the output is cut into one block of whole rows or whole columns
/// (its longer side) per thread, and each block is a single-threaded product: each
/// element is then computed exactly as on one thread, so results do not depend on the
/// thread count, and the threads meet once per product rather than once per depth chunk
/// as under the crate's own threading (which spends its time packing and waiting on the
/// weight gradients' long, thin products).
fn gemm_in_place<F: Float>(
    dst: MatMut<'_, F>,
    accumulate: bool,
    lhs: Mat<'_, F>,
    rhs: Mat<'_, F>,
    scale: F,
    par: Parallelism,
) {
    let raw_dst = (dst.data.as_mut_ptr(), dst.rows, dst.cols, (dst.row_stride, dst.col_stride));
    // SAFETY: the views' constructors checked every index the strides reach, `dst` is
    // borrowed mutably (so it aliases neither operand).
    unsafe { run_on_threads(RawProduct::new(raw_dst, accumulate, lhs, rhs, scale), par) }
}

/// Runs `product`, on several threads as blocks of whole output rows or columns (see
/// [`gemm_in_place`]).
///
/// # Safety
/// As [`RawProduct::run`].
unsafe fn run_on_threads<F: Float>(product: RawProduct<F>, par: Parallelism) {
    let threads = match par {
        Parallelism::None => 1,
        Parallelism::Rayon(0) => rayon::current_num_threads(),
        Parallelism::Rayon(n) => n,
    };
    let (rows, cols, (row_stride, col_stride)) = (product.rows, product.cols, (product.dst.1, product.dst.2));
    let by_rows = rows >= cols;
    let long = rows.max(cols);
    let blocks = threads.min(long / MIN_BLOCK);
    // Blocks are disjoint only where no two elements of the output share an address.
    let one_to_one = (col_stride == 1 && row_stride >= cols) || (row_stride == 1 && col_stride >= rows);
    if blocks < 2 || !one_to_one {
        // SAFETY: the caller's.
        return unsafe { product.run(par) };
    }
    let step = long.div_ceil(blocks).next_multiple_of(16);
    (0..long.div_ceil(step)).into_par_iter().for_each(|b| {
        let range = b * step..((b + 1) * step).min(long);
        let block = if by_rows { product.rows_of(range) } else { product.cols_of(range) };
        // SAFETY: the caller's; the blocks write disjoint elements (one-to-one strides).
        unsafe { block.run(Parallelism::None) }
    });
}

/// A product `dst = (accumulate ? dst : 0) + scale * lhs · rhs` as the gemm crate takes
/// it: pointers with (row stride, column stride).
#[derive(Clone, Copy)]
struct RawProduct<F> {
    rows: usize,
    cols: usize,
    inner: usize,
    /// The inner dimension is summed this deep at a time, in order (all of it at once
    /// unless the product is deep: [`DEPTH_CHUNK`]).
    depth_chunk: usize,
    dst: (*mut F, usize, usize),
    lhs: (*const F, usize, usize),
    rhs: (*const F, usize, usize),
    accumulate: bool,
    scale: F,
    /// Ours rather than the gemm crate's (decided on the whole product, as the depth chunk
    /// is, so that a thread's block is computed as the whole is).
    packed: bool,
    /// The output starts from (bias row, residual laid out as the output), either null,
    /// instead of zero or itself: packed products only.
    start_rows: Option<(*const F, *const F)>,
    /// Null, or one sum per output column that `rhs`'s column is added onto: packed
    /// products only.
    rhs_col_sums: *mut F,
}

// SAFETY: a product is shared among the pool's threads only as blocks that write
// disjoint parts of its output (`run_on_threads`).
unsafe impl<F: Send> Send for RawProduct<F> {}
unsafe impl<F: Sync> Sync for RawProduct<F> {}

impl<F: Float> RawProduct<F> {
    /// The product into `dst` = (pointer, rows, columns, (row stride, column stride)).
    fn new(
        dst: (*mut F, usize, usize, (usize, usize)),
        accumulate: bool,
        lhs: Mat<'_, F>,
        rhs: Mat<'_, F>,
        scale: F,
    ) -> Self {
        let (ptr, rows, cols, (row_stride, col_stride)) = dst;
        let inner = lhs.cols;
        // Decided on the whole product, so that each element's sum is added up the same way
        // whatever the thread count.
        let deep = inner > DEPTH_CHUNK && inner >= 2 * rows.max(cols);
        Self {
            rows,
            cols,
            inner,
            depth_chunk: if deep { DEPTH_CHUNK } else { inner },
            dst: (ptr, row_stride, col_stride),
            lhs: (lhs.data.as_ptr(), lhs.row_stride, lhs.col_stride),
            rhs: (rhs.data.as_ptr(), rhs.row_stride, rhs.col_stride),
            accumulate,
            scale,
            packed: is_f32::<F>() && packed_gemm::takes(rows, cols, inner),
            start_rows: None,
            rhs_col_sums: std::ptr::null_mut(),
        }
    }

    /// Output rows `range` (and the same rows of `lhs`).
    fn rows_of(self, range: std::ops::Range<usize>) -> Self {
        let (dst, lhs) = (self.dst, self.lhs);
        Self {
            rows: range.len(),
            start_rows: self.start_rows.map(|(bias, residual)| (bias, offset(residual, range.start * dst.1))),
            // Every block of rows reads all of rhs: the first alone adds up its columns.
            rhs_col_sums: if range.start == 0 { self.rhs_col_sums } else { std::ptr::null_mut() },
            dst: (dst.0.wrapping_add(range.start * dst.1), dst.1, dst.2),
            lhs: (lhs.0.wrapping_add(range.start * lhs.1), lhs.1, lhs.2),
            ..self
        }
    }

    /// Output columns `range` (and the same columns of `rhs`).
    fn cols_of(self, range: std::ops::Range<usize>) -> Self {
        let (dst, rhs) = (self.dst, self.rhs);
        Self {
            cols: range.len(),
            start_rows: self
                .start_rows
                .map(|(bias, residual)| (offset(bias, range.start), offset(residual, range.start * dst.2))),
            rhs_col_sums: offset(self.rhs_col_sums, range.start) as *mut F,
            dst: (dst.0.wrapping_add(range.start * dst.2), dst.1, dst.2),
            rhs: (rhs.0.wrapping_add(range.start * rhs.2), rhs.1, rhs.2),
            ..self
        }
    }

    /// # Safety
    /// Every index the strides reach is inside its allocation, and `dst` aliases neither
    /// operand nor memory another thread touches meanwhile.
    unsafe fn run(self, par: Parallelism) {
        let (dst, lhs, rhs) = (self.dst, self.lhs, self.rhs);
        if self.packed {
            let f32_view = |(ptr, rs, cs): (*const F, usize, usize)| (ptr as *const f32, rs, cs);
            let start = match self.start_rows {
                Some((bias, residual)) => {
                    packed_gemm::Start::Rows { bias: bias as *const f32, residual: residual as *const f32 }
                }
                None if self.accumulate => packed_gemm::Start::Kept,
                None => packed_gemm::Start::Zero,
            };
            let product = packed_gemm::Product {
                rows: self.rows,
                cols: self.cols,
                depth: self.inner,
                c: (dst.0 as *mut f32, dst.1, dst.2),
                a: f32_view(lhs),
                b: f32_view(rhs),
                start,
                alpha: self.scale.to_f64() as f32,
                b_col_sums: self.rhs_col_sums as *mut f32,
            };
            // SAFETY: the caller's; F is f32 (`packed` is only set then).
            let ran = unsafe { packed_gemm::run(&product) };
            assert!(ran, "the packed product runs wherever `packed_gemm::takes` chose it");
            return;
        }
        assert!(self.rhs_col_sums.is_null(), "column sums come with packed products only");
        // dst = (accumulate ? dst : 0) + scale * lhs[:, chunk] · rhs[chunk, :], chunk by chunk.
        for start in (0..self.inner).step_by(self.depth_chunk) {
            let depth = self.depth_chunk.min(self.inner - start);
            // SAFETY: the caller's (a chunk's columns of lhs and rows of rhs lie inside
            // theirs); F is f32 or f64, which the gemm crate dispatches on.
            unsafe {
                gemm::gemm(
                    self.rows,
                    self.cols,
                    depth,
                    dst.0,
                    dst.2 as isize,
                    dst.1 as isize,
                    self.accumulate || start > 0,
                    lhs.0.wrapping_add(start * lhs.2),
                    lhs.2 as isize,
                    lhs.1 as isize,
                    rhs.0.wrapping_add(start * rhs.1),
                    rhs.2 as isize,
                    rhs.1 as isize,
                    F::ONE,
                    self.scale,
                    false,
                    false,
                    false,
                    par,
                );
            }
        }
    }
}

/// `ptr + by` elements, or null for null.
fn offset<F>(ptr: *const F, by: usize) -> *const F {
    if ptr.is_null() {
        ptr
    } else {
        ptr.wrapping_add(by)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    pub(super) fn naive(a: &[f64], b: &[f64], m: usize, k: usize, n: usize) -> Vec<f64> {
        let mut c = vec![0.0; m * n];
        for i in 0..m {
            for j in 0..n {
                c[i * n + j] = (0..k).map(|p| a[i * k + p] * b[p * n + j]).sum();
            }
        }
        c
    }

    #[test]
    fn matches_naive_with_transposes_and_accumulate() {
        let (m, k, n) = (5, 7, 3);
        let a: Vec<f64> = (0..m * k).map(|i| (i as f64 * 0.37).sin()).collect();
        let b: Vec<f64> = (0..k * n).map(|i| (i as f64 * 0.91).cos()).collect();
        let want = naive(&a, &b, m, k, n);

        let mut c = vec![1.0; m * n];
        matmul(
            MatMut::row_major(&mut c, m, n),
            false,
            Mat::row_major(&a, m, k),
            Mat::row_major(&b, k, n),
            1.0,
            Parallelism::None,
        );
        for (x, y) in c.iter().zip(&want) {
            assert!((x - y).abs() < 1e-12);
        }
        // accumulate, with scale 2: c = want + 2 want
        matmul(
            MatMut::row_major(&mut c, m, n),
            true,
            Mat::row_major(&a, m, k),
            Mat::row_major(&b, k, n),
            2.0,
            Parallelism::None,
        );
        for (x, y) in c.iter().zip(&want) {
            assert!((x - 3.0 * y).abs() < 1e-12);
        }
        // (bᵀ aᵀ)ᵀ = a b, with transposed views of the stored matrices.
        let mut ct = vec![0.0; n * m];
        matmul(
            MatMut::row_major(&mut ct, n, m),
            false,
            Mat::row_major(&b, k, n).t(),
            Mat::row_major(&a, m, k).t(),
            1.0,
            Parallelism::None,
        );
        for i in 0..m {
            for j in 0..n {
                assert!((ct[j * m + i] - want[i * n + j]).abs() < 1e-12);
            }
        }
    }

    #[test]
    fn bf16_and_fp16_products_accumulate_in_f32_and_round_once() {
        use half::{bf16, f16};
        let (m, k, n) = (4, 300, 5);
        let a: Vec<f64> = (0..m * k).map(|i| (i as f64 * 0.37).sin()).collect();
        let b: Vec<f64> = (0..k * n).map(|i| (i as f64 * 0.91).cos()).collect();
        fn product<S: Stored<Acc = f32>>(a: &[f64], b: &[f64], m: usize, k: usize, n: usize) -> (Vec<f64>, Vec<f64>) {
            let a: Vec<S> = a.iter().map(|&x| S::from_f64(x)).collect();
            let b: Vec<S> = b.iter().map(|&x| S::from_f64(x)).collect();
            // The exact product of the rounded operands, to compare with.
            let wide = |v: &[S]| v.iter().map(|x| x.to_f64()).collect::<Vec<_>>();
            let want = super::tests::naive(&wide(&a), &wide(&b), m, k, n);
            let mut c = vec![S::default(); m * n];
            // Stored transposed: the strided path.
            matmul(
                MatMut::new(&mut c, m, n, 1, m),
                false,
                Mat::row_major(&a, m, k),
                Mat::row_major(&b, k, n),
                1.0,
                Parallelism::None,
            );
            let got: Vec<f64> = (0..m * n).map(|i| c[(i % n) * m + i / n].to_f64()).collect();
            (got, want)
        }
        let (got, want) = product::<bf16>(&a, &b, m, k, n);
        for (g, w) in got.iter().zip(&want) {
            // One rounding to bf16 (2^-9 relative), not one per addition.
            assert!((g - w).abs() <= w.abs() * 2f64.powi(-8) + 1e-6, "{g} vs {w}");
        }
        let (got, want) = product::<f16>(&a, &b, m, k, n);
        for (g, w) in got.iter().zip(&want) {
            assert!((g - w).abs() <= w.abs() * 2f64.powi(-10) + 1e-4, "{g} vs {w}");
        }
        // An fp16 product beyond 65504 is inf, as on a GPU.
        let big = vec![f16::from_f32(300.0); 4];
        let mut out = [f16::ZERO];
        matmul(
            MatMut::row_major(&mut out, 1, 1),
            false,
            Mat::row_major(&big, 1, 4),
            Mat::row_major(&big, 4, 1),
            1.0,
            Parallelism::None,
        );
        assert!(out[0].is_infinite());
    }

    /// A 2-byte product that does not accumulate computes into uninitialised memory: that
    /// is sound only because the product then writes every element and reads none, on
    /// each of its paths (the gemm crate's vector-matrix, small, packed, depth-chunked; our
    /// packed product where this machine takes it; thread blocks). A
    /// destination full of NaN would poison any element read.
    #[test]
    fn an_overwriting_product_reads_nothing_of_its_output() {
        let pool = rayon::ThreadPoolBuilder::new().num_threads(2).build().expect("a pool");
        for (m, k, n) in
            [(1, 9, 7), (7, 9, 1), (300, 9, 1), (5, 2, 6), (4, 8, 4), (70, 33, 90), (130, 1100, 520), (300, 64, 300)]
        {
            let a: Vec<f64> = (0..m * k).map(|i| (i as f64 * 0.37).sin()).collect();
            let b: Vec<f64> = (0..k * n).map(|i| (i as f64 * 0.91).cos()).collect();
            let want = naive(&a, &b, m, k, n);
            let (a32, b32): (Vec<f32>, Vec<f32>) =
                (a.iter().map(|&x| x as f32).collect(), b.iter().map(|&x| x as f32).collect());
            for par in [Parallelism::None, Parallelism::Rayon(2)] {
                let mut c = vec![f32::NAN; m * n];
                pool.install(|| {
                    matmul(
                        MatMut::row_major(&mut c, m, n),
                        false,
                        Mat::row_major(&a32, m, k),
                        Mat::row_major(&b32, k, n),
                        1.0,
                        par,
                    )
                });
                for (got, want) in c.iter().zip(&want) {
                    assert!((*got as f64 - want).abs() < 1e-3 * (1.0 + want.abs()), "{m}x{k}x{n}: {got} vs {want}");
                }
            }
        }
    }

    #[test]
    #[should_panic(expected = "exceeds")]
    fn out_of_bounds_view_panics() {
        let a = [0.0f32; 6];
        let _ = Mat::row_major(&a, 3, 3);
    }

    /// A 2-byte product on views inside a bigger matrix (rows contiguous but apart, columns
    /// contiguous but apart, neither) gives the f32 product of the same values, rounded once.
    #[test]
    fn strided_2_byte_views_widen_to_their_own_values() {
        use half::bf16;
        // A 9 x 12 parent; the views are 4 x 5 blocks of it starting at (2, 3).
        let parent: Vec<bf16> = (0..9 * 12).map(|i| bf16::from_f64((i as f64 * 0.29).sin())).collect();
        let wide: Vec<f32> = parent.iter().map(|x| x.to_f32()).collect();
        let rhs: Vec<bf16> = (0..5 * 3).map(|i| bf16::from_f64((i as f64 * 0.71).cos())).collect();
        let rhs_wide: Vec<f32> = rhs.iter().map(|x| x.to_f32()).collect();
        // (row stride, column stride) of a 4 x 5 view at offset 2 * 12 + 3.
        for (row_stride, col_stride) in [(12, 1), (1, 12), (24, 2)] {
            let at = 2 * 12 + 3;
            let mut got = vec![bf16::ZERO; 4 * 3];
            matmul(
                MatMut::row_major(&mut got, 4, 3),
                false,
                Mat::new(&parent[at..], 4, 5, row_stride, col_stride),
                Mat::row_major(&rhs, 5, 3),
                1.0,
                Parallelism::None,
            );
            let mut want = vec![0f32; 4 * 3];
            matmul(
                MatMut::row_major(&mut want, 4, 3),
                false,
                Mat::new(&wide[at..], 4, 5, row_stride, col_stride),
                Mat::row_major(&rhs_wide, 5, 3),
                1.0,
                Parallelism::None,
            );
            let want: Vec<bf16> = want.iter().map(|&x| bf16::from_f32(x)).collect();
            assert_eq!(got, want, "strides ({row_stride}, {col_stride})");
        }
    }

    /// Blocks per thread compute every element as one thread does: the same bits on 1, 2
    /// and 3 threads, split by rows or by columns, on transposed views, accumulating or
    /// not, and summed in depth chunks (the second and third shapes are deep).
    #[test]
    fn thread_blocks_give_the_single_threaded_bits() {
        thread_blocks_match_one_thread::<f32>(1e-3);
        // f64 takes the gemm crate's path (blocks and depth chunks) on every machine.
        thread_blocks_match_one_thread::<f64>(1e-9);
        // 2-byte products: widened, multiplied on the same blocks, rounded once.
        thread_blocks_match_one_thread::<half::bf16>(2e-2);
        thread_blocks_match_one_thread::<half::f16>(2e-3);
    }

    fn thread_blocks_match_one_thread<S: Stored>(tolerance: f64) {
        let pool = rayon::ThreadPoolBuilder::new().num_threads(3).build().expect("a pool");
        // (rows, inner, cols): split by rows, by columns, deep by columns and by rows, too
        // small to split.
        for (m, k, n) in [(700, 600, 130), (130, 1100, 520), (520, 1100, 130), (100, 40, 100)] {
            let a: Vec<S> = (0..m * k).map(|i| S::from_f64(((i as f64) * 0.37).sin())).collect();
            let b: Vec<S> = (0..k * n).map(|i| S::from_f64(((i as f64) * 0.91).cos())).collect();
            let start: Vec<S> = (0..m * n).map(|i| S::from_f64(((i as f64) * 0.13).sin())).collect();
            // dst = start + aᵀᵀ·b with `a` read through a transposed view of its transpose,
            // and the same into a column-major destination.
            let at: Vec<S> = (0..k * m).map(|i| a[(i % m) * k + i / m]).collect();
            let product = |par: Parallelism, column_major: bool, accumulate: bool| {
                let mut c = start.clone();
                let dst = if column_major { MatMut::new(&mut c, m, n, 1, m) } else { MatMut::row_major(&mut c, m, n) };
                matmul(
                    dst,
                    accumulate,
                    Mat::row_major(&at, k, m).t(),
                    Mat::row_major(&b, k, n),
                    S::Acc::from_f64(0.5),
                    par,
                );
                c
            };
            for (column_major, accumulate) in [(false, true), (true, true), (false, false)] {
                let one = product(Parallelism::None, column_major, accumulate);
                for threads in [2, 3] {
                    let many = pool.install(|| product(Parallelism::Rayon(threads), column_major, accumulate));
                    let bits = |x: &[S]| x.iter().map(|v| v.to_f64().to_bits()).collect::<Vec<_>>();
                    assert!(
                        bits(&one) == bits(&many),
                        "{} {m}x{k}x{n} on {threads} threads (column-major {column_major})",
                        S::NAME
                    );
                }
                let wide = |x: &[S]| x.iter().map(|v| v.to_f64()).collect::<Vec<_>>();
                let want = naive(&wide(&a), &wide(&b), m, k, n);
                for (i, &w) in want.iter().enumerate() {
                    let (r, c) = (i / n, i % n);
                    let at = if column_major { c * m + r } else { i };
                    let kept = if accumulate { start[at].to_f64() } else { 0.0 };
                    let (got, expect) = (one[at].to_f64(), kept + 0.5 * w);
                    assert!((got - expect).abs() < tolerance * (1.0 + expect.abs()), "{} {got} vs {expect}", S::NAME);
                }
            }
        }
    }
}
