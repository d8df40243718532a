//! What every op's CUDA launch computes with (cargo feature `cuda`), as `gemm.rs` and
//! `simd.rs` are for the CPU kernels: the storage formats the kernels and cuBLAS handle,
//! views of device memory, the `Launcher` (one GPU stream, its cuBLAS handle and the
//! compiled kernels) with the `launch!` macro, the launch shapes, the bounds checks, the
//! cuBLAS products and the column sums two ops share. Each op's launch is in its own file
//! (`layernorm.rs`'s `cuda` module beside `layernorm.cu`); the CUDA backend
//! (`backend/cuda/`) makes the launcher and calls them.
//!
//! Everything runs in order on one stream, so a kernel may read what the one before it
//! wrote. No kernel uses atomics, every sum over rows runs in a fixed order, and cuBLAS's
//! default algorithms are deterministic on one stream.

use std::collections::HashMap;
use std::ffi::c_void;
use std::marker::PhantomData;
use std::sync::Arc;

use cudarc::cublas::{result as blas, sys as blas_sys, CudaBlas};
use cudarc::driver::{CudaFunction, CudaSlice, CudaStream, DevicePtr, DeviceRepr, LaunchConfig, ValidAsZeroBits};

use crate::ops::float::Stored;

/// Threads per block of every kernel (`BLOCK` in `cuda_prelude.cu`).
pub(crate) const BLOCK: u32 = 256;
/// Rows per warp-per-row kernel block.
const ROWS_PER_BLOCK: u32 = BLOCK / 32;
/// Rows per block of the column sums (bias, LayerNorm parameter gradients), at least.
const COLUMN_ROWS: usize = 64;
/// The most blocks a grid's y dimension holds.
pub(crate) const MAX_GRID_Y: usize = 65_535;

/// A storage format the CUDA kernels and cuBLAS handle.
pub trait DeviceElem: Stored<Acc = f32> + DeviceRepr + ValidAsZeroBits {
    /// The macro the kernels' CUDA C is compiled with.
    const DEFINE: &'static str;
    /// cuBLAS's name for it.
    const DATA_TYPE: blas_sys::cudaDataType;
}

impl DeviceElem for f32 {
    const DEFINE: &'static str = "ELEM_F32";
    const DATA_TYPE: blas_sys::cudaDataType = blas_sys::cudaDataType::CUDA_R_32F;
}

impl DeviceElem for half::bf16 {
    const DEFINE: &'static str = "ELEM_BF16";
    const DATA_TYPE: blas_sys::cudaDataType = blas_sys::cudaDataType::CUDA_R_16BF;
}

impl DeviceElem for half::f16 {
    const DEFINE: &'static str = "ELEM_F16";
    const DATA_TYPE: blas_sys::cudaDataType = blas_sys::cudaDataType::CUDA_R_16F;
}

/// A read-only range of a device buffer: a device pointer with a length, borrowed from the
/// buffer like a slice.
#[derive(Clone, Copy, Debug)]
pub struct DeviceView<'a, S> {
    pub(crate) ptr: u64,
    pub(crate) len: usize,
    _borrow: PhantomData<&'a [S]>,
}

/// A writable range of a device buffer.
#[derive(Debug)]
pub struct DeviceViewMut<'a, S> {
    pub(crate) ptr: u64,
    pub(crate) len: usize,
    _borrow: PhantomData<&'a mut [S]>,
}

impl<S> DeviceView<'_, S> {
    pub(crate) fn new(ptr: u64, len: usize) -> Self {
        Self { ptr, len, _borrow: PhantomData }
    }
}

impl<S> DeviceViewMut<'_, S> {
    pub(crate) fn new(ptr: u64, len: usize) -> Self {
        Self { ptr, len, _borrow: PhantomData }
    }
}

/// Where the kernels of buffers of `S` launch: one stream of a GPU, the cuBLAS handle on it
/// and the kernels compiled for `S` (by name).
pub(crate) struct Launcher<S> {
    pub(crate) stream: Arc<CudaStream>,
    blas: Arc<CudaBlas>,
    kernels: Arc<HashMap<&'static str, CudaFunction>>,
    _format: PhantomData<S>,
}

impl<S> Clone for Launcher<S> {
    fn clone(&self) -> Self {
        Self {
            stream: self.stream.clone(),
            blas: self.blas.clone(),
            kernels: self.kernels.clone(),
            _format: PhantomData,
        }
    }
}

/// Launches kernel `$name` with `$cfg` and the arguments in order (each a device pointer
/// `u64`, or an `i32` / `i64` / `f32` value, as the kernel declares it).
macro_rules! launch {
    ($k:expr, $name:literal, $cfg:expr, $($arg:expr),+ $(,)?) => {{
        use cudarc::driver::PushKernelArg as _;
        let function = $k.kernel($name);
        let mut builder = $k.stream.launch_builder(function);
        $(
            let arg = $arg;
            builder.arg(&arg);
        )+
        // SAFETY: the arguments match the kernel's parameters in number, order and type
        // (kernel by kernel, checked against their `.cu` files); the pointers come from live
        // views, whose lengths and token ids the callers check (`check_shape`,
        // `check_tokens`) where the kernel would otherwise go out of bounds.
        unsafe { builder.launch($cfg) }.unwrap_or_else(|e| panic!("CUDA kernel {}: {e}", $name));
    }};
}
pub(crate) use launch;

pub(crate) fn blocks_for(n: usize, per_block: u32) -> u32 {
    u32::try_from(n.div_ceil(per_block as usize)).expect("a grid of fewer than 2^32 blocks").max(1)
}

/// The column sums' blocks over `rows` rows (the grid's y) and rows per block:
/// `COLUMN_ROWS` each, more where that would take more blocks than a grid's y holds.
pub(crate) fn column_blocks(rows: usize) -> (usize, usize) {
    let per_block = COLUMN_ROWS.max(rows.div_ceil(MAX_GRID_Y));
    (rows.div_ceil(per_block).max(1), per_block)
}

/// One thread per element.
pub(crate) fn elementwise(n: usize) -> LaunchConfig {
    LaunchConfig { grid_dim: (blocks_for(n, BLOCK), 1, 1), block_dim: (BLOCK, 1, 1), shared_mem_bytes: 0 }
}

/// One warp per row.
pub(crate) fn warp_per_row(rows: usize) -> LaunchConfig {
    LaunchConfig { grid_dim: (blocks_for(rows, ROWS_PER_BLOCK), 1, 1), block_dim: (BLOCK, 1, 1), shared_mem_bytes: 0 }
}

/// One block per row.
pub(crate) fn block_per_row(rows: usize) -> LaunchConfig {
    LaunchConfig { grid_dim: (blocks_for(rows, 1), 1, 1), block_dim: (BLOCK, 1, 1), shared_mem_bytes: 0 }
}

/// Kernels index tables by token id on the GPU, where nothing checks bounds: an id outside
/// the table is refused here, as a slice index would be on the CPU.
pub(crate) fn check_tokens(kernel: &str, ids: &[u32], table_rows: usize) {
    if let Some(bad) = ids.iter().find(|&&id| id as usize >= table_rows) {
        panic!("{kernel}: token id {bad} outside a table of {table_rows} rows");
    }
}

/// Buffer lengths a kernel relies on: (have, need) pairs, checked before the launch.
pub(crate) fn check_shape(kernel: &str, lengths: &[(usize, usize)]) {
    for (i, &(have, need)) in lengths.iter().enumerate() {
        assert!(have >= need, "{kernel}: buffer {i} holds {have} elements, the kernel needs {need}");
    }
}

pub(crate) fn int(x: usize) -> i32 {
    i32::try_from(x).expect("a size below 2^31")
}

fn op(transpose: bool) -> blas_sys::cublasOperation_t {
    if transpose {
        blas_sys::cublasOperation_t::CUBLAS_OP_T
    } else {
        blas_sys::cublasOperation_t::CUBLAS_OP_N
    }
}

/// One operand of a (batched) column-major GEMM: a device pointer, its leading dimension
/// and the distance between consecutive matrices of the batch (all in elements).
#[derive(Clone, Copy)]
pub(crate) struct Operand {
    pub(crate) ptr: u64,
    pub(crate) ld: usize,
    pub(crate) stride: usize,
}

/// One operand of the per-(sequence, head) products of attention: the matrix of head h of
/// sequence b starts `b * seq + h * head` elements after `ptr`.
#[derive(Clone, Copy)]
pub(crate) struct HeadOperand {
    pub(crate) ptr: u64,
    pub(crate) ld: usize,
    pub(crate) seq: usize,
    pub(crate) head: usize,
}

impl<S: DeviceElem> Launcher<S> {
    pub(crate) fn new(
        stream: Arc<CudaStream>,
        blas: Arc<CudaBlas>,
        kernels: Arc<HashMap<&'static str, CudaFunction>>,
    ) -> Self {
        Self { stream, blas, kernels, _format: PhantomData }
    }

    pub(crate) fn kernel(&self, name: &str) -> &CudaFunction {
        &self.kernels[name]
    }

    /// Makes this stream's context the calling thread's, as the driver's and cuBLAS's raw
    /// calls need (cudarc's own stream methods do it themselves): a step may run on any
    /// thread of the pool, and not every call begins with a kernel launch.
    pub(crate) fn bind(&self) {
        self.stream.context().bind_to_thread().expect("CUDA: binding the context to this thread");
    }

    /// A host slice (token ids, a table) copied into a new device buffer.
    pub(crate) fn upload<T: DeviceRepr>(&self, host: &[T]) -> CudaSlice<T> {
        self.stream.clone_htod(host).expect("CUDA upload")
    }

    pub(crate) fn scratch<T: DeviceRepr + ValidAsZeroBits>(&self, len: usize) -> CudaSlice<T> {
        self.stream.alloc_zeros::<T>(len.max(1)).expect("CUDA scratch allocation")
    }

    pub(crate) fn ptr_of<T>(&self, buf: &CudaSlice<T>) -> u64 {
        let (ptr, _no_event) = buf.device_ptr(&self.stream);
        ptr
    }

    pub(crate) fn download_f64(&self, buf: &CudaSlice<f64>, len: usize) -> Vec<f64> {
        let mut host = vec![0.0; len];
        self.stream.memcpy_dtoh(&buf.slice(0..len), &mut host).expect("CUDA download");
        self.stream.synchronize().expect("CUDA stream synchronize");
        host
    }

    /// `dst = src` (the same length).
    pub(crate) fn copy(&self, dst: DeviceViewMut<'_, S>, src: DeviceView<'_, S>) {
        assert_eq!(dst.len, src.len, "copy between views of different lengths");
        if dst.len > 0 {
            self.bind();
            // SAFETY: both views are live ranges of `len` elements of device buffers.
            unsafe {
                cudarc::driver::result::memcpy_dtod_async(
                    dst.ptr,
                    src.ptr,
                    dst.len * size_of::<S>(),
                    self.stream.cu_stream(),
                )
            }
            .expect("CUDA copy");
        }
    }

    /// `c = alpha · op(a) · op(b) + beta · c` for `batch` column-major matrices (m x n),
    /// computed in fp32 whatever `S` is.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn gemm(
        &self,
        (ta, tb): (bool, bool),
        (m, n, k): (usize, usize, usize),
        alpha: f32,
        a: Operand,
        b: Operand,
        beta: f32,
        c: Operand,
        batch: usize,
    ) {
        self.bind();
        // SAFETY: the operands point into live device buffers that hold the matrices
        // described by the dimensions, leading dimensions and strides; alpha and beta
        // are host floats (cuBLAS's default pointer mode), as COMPUTE_32F expects.
        unsafe {
            blas::gemm_strided_batched_ex(
                *self.blas.handle(),
                op(ta),
                op(tb),
                int(m),
                int(n),
                int(k),
                &alpha as *const f32 as *const c_void,
                a.ptr as *const c_void,
                S::DATA_TYPE,
                int(a.ld),
                a.stride as i64,
                b.ptr as *const c_void,
                S::DATA_TYPE,
                int(b.ld),
                b.stride as i64,
                &beta as *const f32 as *const c_void,
                c.ptr as *mut c_void,
                S::DATA_TYPE,
                int(c.ld),
                c.stride as i64,
                int(batch),
                blas_sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                blas_sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
            )
        }
        .unwrap_or_else(|e| panic!("cuBLAS GEMM: {e}"));
    }

    /// The attention product `c = alpha · op(a) · op(b) + beta · c` for every (sequence,
    /// head) of `(batch, heads)`, in one cuBLAS call: strided over the heads of one
    /// sequence, or through arrays of matrix pointers (built on the GPU) for several.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn head_gemm(
        &self,
        trans: (bool, bool),
        mnk: (usize, usize, usize),
        alpha: f32,
        a: HeadOperand,
        b: HeadOperand,
        beta: f32,
        c: HeadOperand,
        (batch, heads): (usize, usize),
    ) {
        if batch == 1 {
            let strided = |o: HeadOperand| Operand { ptr: o.ptr, ld: o.ld, stride: o.head };
            self.gemm(trans, mnk, alpha, strided(a), strided(b), beta, strided(c), heads);
            return;
        }
        let count = batch * heads;
        let pointers = self.scratch::<u64>(3 * count);
        let p = self.ptr_of(&pointers);
        let e = size_of::<S>() as i64;
        let bytes = |o: HeadOperand| (o.seq as i64 * e, o.head as i64 * e);
        let ((a_seq, a_head), (b_seq, b_head), (c_seq, c_head)) = (bytes(a), bytes(b), bytes(c));
        launch!(
            self,
            "head_pointers",
            elementwise(count),
            p,
            a.ptr,
            b.ptr,
            c.ptr,
            a_seq,
            a_head,
            b_seq,
            b_head,
            c_seq,
            c_head,
            int(heads),
            int(count)
        );
        let (m, n, k) = mnk;
        let array = |i: usize| (p + (i * count * 8) as u64) as *const *const c_void;
        // SAFETY: `head_pointers` filled the three arrays (queued before this call on the
        // same stream) with `count` pointers each into live buffers holding the matrices
        // the dimensions and leading dimensions describe.
        unsafe {
            blas_sys::cublasGemmBatchedEx(
                *self.blas.handle(),
                op(trans.0),
                op(trans.1),
                int(m),
                int(n),
                int(k),
                &alpha as *const f32 as *const c_void,
                array(0),
                S::DATA_TYPE,
                int(a.ld),
                array(1),
                S::DATA_TYPE,
                int(b.ld),
                &beta as *const f32 as *const c_void,
                array(2) as *const *mut c_void,
                S::DATA_TYPE,
                int(c.ld),
                int(count),
                blas_sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                blas_sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
            )
        }
        .result()
        .unwrap_or_else(|e| panic!("cuBLAS batched GEMM: {e}"));
    }

    /// `dst[j] += sum over rows of x[r, j]` (x is `rows x c`), in row order.
    pub(crate) fn add_column_sums(&self, dst: u64, x: u64, rows: usize, c: usize) {
        let (blocks, per_block) = column_blocks(rows);
        let partial = self.scratch::<f32>(blocks * c);
        let p = self.ptr_of(&partial);
        let cfg = LaunchConfig {
            grid_dim: (blocks_for(c, BLOCK), blocks as u32, 1),
            block_dim: (BLOCK, 1, 1),
            shared_mem_bytes: 0,
        };
        launch!(self, "column_partials", cfg, p, x, int(rows), int(c), int(per_block));
        launch!(self, "add_column_partials", elementwise(c), dst, p, int(blocks), int(c));
    }
}
