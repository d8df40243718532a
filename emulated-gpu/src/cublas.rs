//! cuBLAS (libcublas) as the CUDA backend calls it: batched GEMMs with every operand in one
//! storage format (f32, bf16, f16) and fp32 compute, by a reference loop.
//!
//! `C = alpha * op(A) * op(B) + beta * C` for each matrix of the batch, column-major: element
//! (r, c) of a matrix with leading dimension ld is at `r + c * ld`; op(A) is A (`N`) or its
//! transpose (`T`), m x k; op(B) is k x n; C is m x n. Each dot product is summed in f32,
//! p = 0, 1, ..., k-1, and rounded once into C's format. With beta = 0, C is not read (so a
//! NaN left there does not leak in), as cuBLAS documents.

use std::ffi::{c_int, c_longlong, c_uint, c_void};

type Status = c_uint;
const SUCCESS: Status = 0;
const NOT_INITIALIZED: Status = 1;
const INVALID_VALUE: Status = 7;
const EXECUTION_FAILED: Status = 13;
const NOT_SUPPORTED: Status = 15;

const OP_N: c_uint = 0;
const OP_T: c_uint = 1;
const R_32F: c_uint = 0;
const R_16F: c_uint = 2;
const R_16BF: c_uint = 14;
const COMPUTE_32F: c_uint = 68;

#[derive(Clone, Copy, PartialEq, Eq)]
enum Format {
    F32,
    F16,
    Bf16,
}

impl Format {
    fn of(data_type: c_uint) -> Option<Format> {
        match data_type {
            R_32F => Some(Format::F32),
            R_16F => Some(Format::F16),
            R_16BF => Some(Format::Bf16),
            _ => None,
        }
    }

    /// Element `i` of the matrix at `base`, as f32.
    unsafe fn load(self, base: *const c_void, i: usize) -> f32 {
        match self {
            Format::F32 => (base as *const f32).add(i).read_unaligned(),
            Format::F16 => half::f16::from_bits((base as *const u16).add(i).read_unaligned()).to_f32(),
            Format::Bf16 => half::bf16::from_bits((base as *const u16).add(i).read_unaligned()).to_f32(),
        }
    }

    unsafe fn store(self, base: *mut c_void, i: usize, value: f32) {
        match self {
            Format::F32 => (base as *mut f32).add(i).write_unaligned(value),
            Format::F16 => (base as *mut u16).add(i).write_unaligned(half::f16::from_f32(value).to_bits()),
            Format::Bf16 => (base as *mut u16).add(i).write_unaligned(half::bf16::from_f32(value).to_bits()),
        }
    }
}

/// One GEMM's shape and operands' layout.
struct Gemm {
    trans_a: bool,
    trans_b: bool,
    m: usize,
    n: usize,
    k: usize,
    alpha: f32,
    beta: f32,
    lda: usize,
    ldb: usize,
    ldc: usize,
    format: Format,
}

impl Gemm {
    /// Checks the arguments as cuBLAS does.
    #[allow(clippy::too_many_arguments)]
    unsafe fn new(
        trans: (c_uint, c_uint),
        (m, n, k): (c_int, c_int, c_int),
        (alpha, beta): (*const c_void, *const c_void),
        (lda, ldb, ldc): (c_int, c_int, c_int),
        types: (c_uint, c_uint, c_uint),
        compute: c_uint,
    ) -> Result<Gemm, Status> {
        if compute != COMPUTE_32F || types.0 != types.1 || types.1 != types.2 {
            return Err(NOT_SUPPORTED);
        }
        let format = Format::of(types.0).ok_or(NOT_SUPPORTED)?;
        let op = |t: c_uint| match t {
            OP_N => Ok(false),
            OP_T => Ok(true),
            _ => Err(NOT_SUPPORTED),
        };
        let (trans_a, trans_b) = (op(trans.0)?, op(trans.1)?);
        if m < 0 || n < 0 || k < 0 || alpha.is_null() || beta.is_null() {
            return Err(INVALID_VALUE);
        }
        let rows_a = if trans_a { k } else { m };
        let rows_b = if trans_b { n } else { k };
        if lda < rows_a.max(1) || ldb < rows_b.max(1) || ldc < m.max(1) {
            return Err(INVALID_VALUE);
        }
        let u = |x: c_int| x as usize;
        Ok(Gemm {
            trans_a,
            trans_b,
            m: u(m),
            n: u(n),
            k: u(k),
            alpha: (alpha as *const f32).read(),
            beta: (beta as *const f32).read(),
            lda: u(lda),
            ldb: u(ldb),
            ldc: u(ldc),
            format,
        })
    }

    /// A product's arguments checked as cuBLAS does, its handle and the thread's context too.
    #[allow(clippy::too_many_arguments)]
    unsafe fn checked(
        handle: *mut c_void,
        trans: (c_uint, c_uint),
        mnk: (c_int, c_int, c_int),
        scalars: (*const c_void, *const c_void),
        lds: (c_int, c_int, c_int),
        types: (c_uint, c_uint, c_uint),
        compute: c_uint,
    ) -> Result<Gemm, Status> {
        if handle.is_null() {
            return Err(NOT_INITIALIZED);
        }
        if !crate::driver::context_bound() {
            eprintln!("distlab emulated GPU: a cuBLAS product on a thread with no CUDA context bound");
            return Err(EXECUTION_FAILED);
        }
        Gemm::new(trans, mnk, scalars, lds, types, compute)
    }

    /// One matrix product of the batch. op(A) is first read into rows of f32 (row i holds
    /// op(A)[i, 0..k]) and op(B) into rows over j (row p holds op(B)[p, 0..n]); then each
    /// row of C is summed p = 0, 1, ..., k-1 across all its columns at once, which keeps
    /// every element's order of summation and lets the compiler use vector lanes across j.
    unsafe fn run(&self, a: *const c_void, b: *const c_void, c: *mut c_void) {
        let (f, m, n, k) = (self.format, self.m, self.n, self.k);
        let op_a: Vec<f32> = (0..m * k)
            .map(|at| {
                let (i, p) = (at / k, at % k);
                if self.trans_a {
                    f.load(a, p + i * self.lda)
                } else {
                    f.load(a, i + p * self.lda)
                }
            })
            .collect();
        let op_b: Vec<f32> = (0..k * n)
            .map(|at| {
                let (p, j) = (at / n, at % n);
                if self.trans_b {
                    f.load(b, j + p * self.ldb)
                } else {
                    f.load(b, p + j * self.ldb)
                }
            })
            .collect();
        let mut row = vec![0.0f32; n];
        for i in 0..m {
            row.fill(0.0);
            for p in 0..k {
                let x = op_a[i * k + p];
                for (acc, &y) in row.iter_mut().zip(&op_b[p * n..(p + 1) * n]) {
                    *acc += x * y;
                }
            }
            for (j, &acc) in row.iter().enumerate() {
                let at = i + j * self.ldc;
                let value =
                    if self.beta == 0.0 { self.alpha * acc } else { self.alpha * acc + self.beta * f.load(c, at) };
                f.store(c, at, value);
            }
        }
    }

    fn bytes(&self) -> usize {
        if self.format == Format::F32 {
            4
        } else {
            2
        }
    }
}

#[no_mangle]
pub unsafe extern "C" fn cublasCreate_v2(handle: *mut *mut c_void) -> Status {
    if handle.is_null() {
        return INVALID_VALUE;
    }
    handle.write(Box::into_raw(Box::new(0u64)) as *mut c_void);
    SUCCESS
}

#[no_mangle]
pub unsafe extern "C" fn cublasDestroy_v2(handle: *mut c_void) -> Status {
    if handle.is_null() {
        return NOT_INITIALIZED;
    }
    drop(Box::from_raw(handle as *mut u64));
    SUCCESS
}

#[no_mangle]
pub extern "C" fn cublasSetStream_v2(handle: *mut c_void, _stream: *mut c_void) -> Status {
    if handle.is_null() {
        NOT_INITIALIZED
    } else {
        SUCCESS
    }
}

#[no_mangle]
pub extern "C" fn cublasSetMathMode(handle: *mut c_void, _mode: c_uint) -> Status {
    // Every mode computes here as the strictest does: fp32 sums, rounded once.
    cublasSetStream_v2(handle, std::ptr::null_mut())
}

#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn cublasGemmStridedBatchedEx(
    handle: *mut c_void,
    trans_a: c_uint,
    trans_b: c_uint,
    m: c_int,
    n: c_int,
    k: c_int,
    alpha: *const c_void,
    a: *const c_void,
    a_type: c_uint,
    lda: c_int,
    stride_a: c_longlong,
    b: *const c_void,
    b_type: c_uint,
    ldb: c_int,
    stride_b: c_longlong,
    beta: *const c_void,
    c: *mut c_void,
    c_type: c_uint,
    ldc: c_int,
    stride_c: c_longlong,
    batch: c_int,
    compute: c_uint,
    _algo: c_int,
) -> Status {
    let gemm = match Gemm::checked(
        handle,
        (trans_a, trans_b),
        (m, n, k),
        (alpha, beta),
        (lda, ldb, ldc),
        (a_type, b_type, c_type),
        compute,
    ) {
        Ok(g) => g,
        Err(status) => return status,
    };
    if batch < 0 {
        return INVALID_VALUE;
    }
    let e = gemm.bytes() as isize;
    for i in 0..batch as isize {
        let at = |base: *const c_void, stride: c_longlong| {
            (base as *const u8).offset(i * stride as isize * e) as *const c_void
        };
        gemm.run(at(a, stride_a), at(b, stride_b), at(c, stride_c) as *mut c_void);
    }
    SUCCESS
}

#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn cublasGemmBatchedEx(
    handle: *mut c_void,
    trans_a: c_uint,
    trans_b: c_uint,
    m: c_int,
    n: c_int,
    k: c_int,
    alpha: *const c_void,
    a: *const *const c_void,
    a_type: c_uint,
    lda: c_int,
    b: *const *const c_void,
    b_type: c_uint,
    ldb: c_int,
    beta: *const c_void,
    c: *const *mut c_void,
    c_type: c_uint,
    ldc: c_int,
    batch: c_int,
    compute: c_uint,
    _algo: c_int,
) -> Status {
    let gemm = match Gemm::checked(
        handle,
        (trans_a, trans_b),
        (m, n, k),
        (alpha, beta),
        (lda, ldb, ldc),
        (a_type, b_type, c_type),
        compute,
    ) {
        Ok(g) => g,
        Err(status) => return status,
    };
    if batch < 0 || (batch > 0 && (a.is_null() || b.is_null() || c.is_null())) {
        return INVALID_VALUE;
    }
    // The pointer arrays are in device memory, which is host memory here.
    for i in 0..batch as usize {
        gemm.run(a.add(i).read(), b.add(i).read(), c.add(i).read());
    }
    SUCCESS
}
