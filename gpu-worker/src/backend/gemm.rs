//! A bounds-checked, strided-matrix front end to the `gemm` crate.
//!
//! A [`Mat`] is a slice plus (rows, cols, row stride, column stride), so a head of
//! the fused QKV activation or a transposed weight is a view, never a copy.
//! Note the crate's own argument order: `alpha` scales the existing destination and
//! `beta` scales the product; [`matmul`] hides that behind `accumulate` / `scale`.

use crate::backend::Float;
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

/// `dst = (accumulate ? dst : 0) + scale * lhs · rhs`.
pub fn matmul<F: Float>(
    dst: MatMut<'_, F>,
    accumulate: bool,
    lhs: Mat<'_, F>,
    rhs: Mat<'_, F>,
    scale: F,
    par: Parallelism,
) {
    assert_eq!(lhs.cols, rhs.rows, "inner dimensions differ");
    assert_eq!(dst.rows, lhs.rows, "output rows differ");
    assert_eq!(dst.cols, rhs.cols, "output columns differ");
    if dst.rows == 0 || dst.cols == 0 {
        return;
    }
    if lhs.cols == 0 {
        // An empty product: only the (kept or cleared) destination remains.
        if !accumulate {
            for i in 0..dst.rows {
                for j in 0..dst.cols {
                    dst.data[i * dst.row_stride + j * dst.col_stride] = F::ZERO;
                }
            }
        }
        return;
    }
    // SAFETY: the constructors checked that every index the strides reach is inside
    // its slice; `dst` is borrowed mutably, so it cannot alias `lhs` or `rhs`; F is
    // f32 or f64, which the gemm crate dispatches on.
    unsafe {
        gemm::gemm(
            dst.rows,
            dst.cols,
            lhs.cols,
            dst.data.as_mut_ptr(),
            dst.col_stride as isize,
            dst.row_stride as isize,
            accumulate,
            lhs.data.as_ptr(),
            lhs.col_stride as isize,
            lhs.row_stride as isize,
            rhs.data.as_ptr(),
            rhs.col_stride as isize,
            rhs.row_stride as isize,
            F::ONE,
            scale,
            false,
            false,
            false,
            par,
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn naive(a: &[f64], b: &[f64], m: usize, k: usize, n: usize) -> Vec<f64> {
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
    #[should_panic(expected = "exceeds")]
    fn out_of_bounds_view_panics() {
        let a = [0.0f32; 6];
        let _ = Mat::row_major(&a, 3, 3);
    }
}
