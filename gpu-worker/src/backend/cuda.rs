//! The CUDA backend (cargo feature `cuda`): buffers live in GPU memory, GEMMs go through
//! cuBLAS (fp32, or bf16/fp16 with fp32 accumulation), and every other kernel is CUDA C
//! (`cuda_prelude.cu`, `cuda_reductions.cu`, each op's `.cu` beside its CPU kernel in `ops/`,
//! `optim.cu`), compiled by NVRTC for the buffers' format when the backend
//! starts. cudarc loads libcuda, cuBLAS and NVRTC at run time, so this builds on a machine
//! without CUDA; there [`CudaBackend::new`] says what is missing instead of starting.
//!
//! Everything runs in order on one stream, so a kernel may read what the one before it
//! wrote; results come back to the host (`download`, `sum`, the loss) after a sync.
//! Views are device pointers with a length, borrowed from the buffer like slices.
//!
//! Like the CPU backend, results do not depend on timing: no kernel uses atomics, every
//! sum over rows runs in a fixed order, and cuBLAS's default algorithms are deterministic
//! on one stream.

use std::collections::HashMap;
use std::ffi::c_void;
use std::marker::PhantomData;
use std::ops::Range;
use std::sync::{Arc, Mutex};

use cudarc::cublas::{result as blas, sys as blas_sys, CudaBlas};
use cudarc::driver::{
    CudaContext, CudaFunction, CudaSlice, CudaStream, DevicePtr, DeviceRepr, LaunchConfig, PushKernelArg,
    ValidAsZeroBits,
};
use cudarc::nvrtc::{compile_ptx_with_opts, CompileOptions, Ptx};

use crate::backend::{Backend, Stored};
use crate::comm::{CommError, Communicator, InPlace};
use crate::optim::{OptimizerSlices, OptimizerState, Update};

/// The kernels' CUDA C: what they share, then every op's kernels from the file beside its
/// CPU kernel, as one source for NVRTC.
pub const KERNELS: &str = concat!(
    include_str!("cuda_prelude.cu"),
    include_str!("cuda_reductions.cu"),
    include_str!("../ops/embedding.cu"),
    include_str!("../ops/layernorm.cu"),
    include_str!("../ops/linear.cu"),
    include_str!("../ops/mlp.cu"),
    include_str!("../ops/attention.cu"),
    include_str!("../ops/flash_attention.cu"),
    include_str!("../ops/loss.cu"),
    include_str!("../optim.cu"),
);
/// Threads per block of every kernel (`BLOCK` in the .cu file).
const BLOCK: u32 = 256;
/// The widest head flash attention's kernels hold in registers (WARP * ROW_REGS).
const FLASH_MAX_HEAD: usize = distlab_common::backends::CUDA_FLASH_MAX_HEAD;
/// Rows per warp-per-row kernel block.
const ROWS_PER_BLOCK: u32 = BLOCK / 32;
/// Elements per block of `sum` / `sum_squares`.
const SUM_CHUNK: usize = 1 << 16;
/// Rows per block of the column sums (bias, LayerNorm parameter gradients), at least.
const COLUMN_ROWS: usize = 64;
/// The most blocks a grid's y dimension holds.
const MAX_GRID_Y: usize = 65_535;

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

/// Why the CUDA backend cannot start here.
#[derive(Debug, thiserror::Error)]
pub enum CudaUnavailable {
    #[error("the CUDA driver library (libcuda.so) is not installed on this machine")]
    NoDriver,
    #[error("{0} is not installed on this machine")]
    NoLibrary(&'static str),
    #[error("no CUDA device {ordinal} (this machine has {count})")]
    NoDevice { ordinal: usize, count: i32 },
    #[error("the CUDA driver finds no usable GPU: {0}")]
    NoUsableDevice(cudarc::driver::DriverError),
    #[error("CUDA: {0}")]
    Driver(#[from] cudarc::driver::DriverError),
    #[error("cuBLAS: {0}")]
    Blas(#[from] blas::CublasError),
    #[error("NVRTC could not compile the kernels: {0}")]
    Compile(String),
}

impl CudaUnavailable {
    /// True when this machine simply has no GPU to offer (no driver, library or device),
    /// as opposed to a GPU that is there but failed.
    pub fn no_gpu_here(&self) -> bool {
        matches!(self, Self::NoDriver | Self::NoLibrary(_) | Self::NoDevice { .. } | Self::NoUsableDevice(_))
    }
}

/// [`KERNELS`] compiled by NVRTC into PTX for storage format `define` (a
/// [`DeviceElem::DEFINE`]) and compute capability `major`.`minor`: what every backend of
/// this process on such a GPU loads, compiled once (each rank, each op test, asks again).
pub fn compile_kernels(define: &str, major: i32, minor: i32) -> Result<Ptx, CudaUnavailable> {
    /// (format, major, minor): what a compile is for.
    type Target = (String, i32, i32);
    static COMPILED: Mutex<Vec<(Target, Ptx)>> = Mutex::new(Vec::new());
    let key = (define.to_string(), major, minor);
    let mut compiled = COMPILED.lock().unwrap_or_else(|e| e.into_inner());
    if let Some((_, ptx)) = compiled.iter().find(|(k, _)| *k == key) {
        return Ok(ptx.clone());
    }
    if !unsafe { cudarc::nvrtc::sys::is_culib_present() } {
        return Err(CudaUnavailable::NoLibrary("NVRTC (libnvrtc.so)"));
    }
    let options = CompileOptions {
        // No contraction of a * b + c into one rounding: the CPU's kernels round each step.
        options: vec![
            format!("-D{define}"),
            format!("--gpu-architecture=compute_{major}{minor}"),
            "--fmad=false".to_string(),
        ],
        ..Default::default()
    };
    let ptx = compile_ptx_with_opts(KERNELS, options).map_err(|e| CudaUnavailable::Compile(e.to_string()))?;
    compiled.push((key, ptx.clone()));
    Ok(ptx)
}

/// How many GPUs this machine has (without making a context on any).
pub fn device_count() -> Result<usize, CudaUnavailable> {
    if !unsafe { cudarc::driver::sys::is_culib_present() } {
        return Err(CudaUnavailable::NoDriver);
    }
    let count = CudaContext::device_count().map_err(CudaUnavailable::NoUsableDevice)?;
    Ok(count.max(0) as usize)
}

/// A GPU of this machine, as a worker reports it.
pub struct Gpu {
    /// e.g. "cuda:0 NVIDIA H100 80GB HBM3 (79 GiB)".
    pub label: String,
    pub memory_bytes: u64,
}

/// The GPUs this machine offers, or why it offers none.
pub fn devices() -> Result<Vec<Gpu>, CudaUnavailable> {
    // cudarc panics on first use of a library it cannot load: check first.
    if !unsafe { cudarc::driver::sys::is_culib_present() } {
        return Err(CudaUnavailable::NoDriver);
    }
    let count = CudaContext::device_count().map_err(CudaUnavailable::NoUsableDevice)?;
    (0..count.max(0) as usize)
        .map(|i| {
            let ctx = CudaContext::new(i)?;
            let memory_bytes = ctx.total_mem()? as u64;
            let gib = memory_bytes as f64 / (1u64 << 30) as f64;
            Ok(Gpu { label: format!("cuda:{i} {} ({gib:.0} GiB)", ctx.name()?), memory_bytes })
        })
        .collect()
}

/// A read-only range of a device buffer.
#[derive(Clone, Copy, Debug)]
pub struct DeviceView<'a, S> {
    ptr: u64,
    len: usize,
    _borrow: PhantomData<&'a [S]>,
}

/// A writable range of a device buffer.
#[derive(Debug)]
pub struct DeviceViewMut<'a, S> {
    ptr: u64,
    len: usize,
    _borrow: PhantomData<&'a mut [S]>,
}

/// CUDA kernels on buffers of `S` on one GPU.
pub struct CudaBackend<S: DeviceElem = f32> {
    stream: Arc<CudaStream>,
    blas: Arc<CudaBlas>,
    kernels: Arc<HashMap<&'static str, CudaFunction>>,
    device: String,
    /// Free device memory when the backend was made (what the run's use is measured from).
    free_at_start: usize,
    _format: PhantomData<S>,
}

impl<S: DeviceElem> Clone for CudaBackend<S> {
    fn clone(&self) -> Self {
        Self {
            stream: self.stream.clone(),
            blas: self.blas.clone(),
            kernels: self.kernels.clone(),
            device: self.device.clone(),
            free_at_start: self.free_at_start,
            _format: PhantomData,
        }
    }
}

/// Every kernel of [`KERNELS`] the backend calls.
pub const KERNEL_NAMES: [&str; 27] = [
    "fill",
    "add",
    "widen",
    "narrow",
    "partial_sums",
    "add_column_partials",
    "column_partials",
    "encoder_forward",
    "encoder_backward_wte",
    "encoder_backward_wpe",
    "layernorm_forward",
    "layernorm_backward_input",
    "layernorm_param_partials",
    "add_bias",
    "gelu_forward",
    "gelu_backward",
    "causal_softmax_forward",
    "causal_softmax_backward",
    "flash_attention_forward",
    "flash_attention_delta",
    "flash_attention_backward_query",
    "flash_attention_backward_key",
    "crossentropy_forward",
    "crossentropy_backward",
    "adamw",
    "head_pointers",
    "sgd",
];

/// Launches kernel `$name` with `$cfg` and the arguments in order (each a device pointer
/// `u64`, or an `i32` / `i64` / `f32` value, as the kernel declares it).
macro_rules! launch {
    ($be:expr, $name:literal, $cfg:expr, $($arg:expr),+ $(,)?) => {{
        let function = $be.kernel($name);
        let mut builder = $be.stream.launch_builder(function);
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

fn blocks_for(n: usize, per_block: u32) -> u32 {
    u32::try_from(n.div_ceil(per_block as usize)).expect("a grid of fewer than 2^32 blocks").max(1)
}

/// The column sums' blocks over `rows` rows (the grid's y) and rows per block:
/// `COLUMN_ROWS` each, more where that would take more blocks than a grid's y holds.
fn column_blocks(rows: usize) -> (usize, usize) {
    let per_block = COLUMN_ROWS.max(rows.div_ceil(MAX_GRID_Y));
    (rows.div_ceil(per_block).max(1), per_block)
}

/// One thread per element.
fn elementwise(n: usize) -> LaunchConfig {
    LaunchConfig { grid_dim: (blocks_for(n, BLOCK), 1, 1), block_dim: (BLOCK, 1, 1), shared_mem_bytes: 0 }
}

/// One warp per row.
fn warp_per_row(rows: usize) -> LaunchConfig {
    LaunchConfig { grid_dim: (blocks_for(rows, ROWS_PER_BLOCK), 1, 1), block_dim: (BLOCK, 1, 1), shared_mem_bytes: 0 }
}

/// One block per row.
fn block_per_row(rows: usize) -> LaunchConfig {
    LaunchConfig { grid_dim: (blocks_for(rows, 1), 1, 1), block_dim: (BLOCK, 1, 1), shared_mem_bytes: 0 }
}

/// Kernels index tables by token id on the GPU, where nothing checks bounds: an id outside
/// the table is refused here, as a slice index would be on the CPU.
fn check_tokens(kernel: &str, ids: &[u32], table_rows: usize) {
    if let Some(bad) = ids.iter().find(|&&id| id as usize >= table_rows) {
        panic!("{kernel}: token id {bad} outside a table of {table_rows} rows");
    }
}

/// Buffer lengths a kernel relies on: (have, need) pairs, checked before the launch.
fn check_shape(kernel: &str, lengths: &[(usize, usize)]) {
    for (i, &(have, need)) in lengths.iter().enumerate() {
        assert!(have >= need, "{kernel}: buffer {i} holds {have} elements, the kernel needs {need}");
    }
}

fn int(x: usize) -> i32 {
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
struct Operand {
    ptr: u64,
    ld: usize,
    stride: usize,
}

/// One operand of the per-(sequence, head) products of attention: the matrix of head h of
/// sequence b starts `b * seq + h * head` elements after `ptr`.
#[derive(Clone, Copy)]
struct HeadOperand {
    ptr: u64,
    ld: usize,
    seq: usize,
    head: usize,
}

impl<S: DeviceElem> CudaBackend<S> {
    /// A backend on GPU `ordinal`: a context, one stream, a cuBLAS handle and the kernels
    /// compiled for this GPU and format `S`.
    pub fn new(ordinal: usize) -> Result<Self, CudaUnavailable> {
        if !unsafe { cudarc::driver::sys::is_culib_present() } {
            return Err(CudaUnavailable::NoDriver);
        }
        if !unsafe { cudarc::cublas::sys::is_culib_present() } {
            return Err(CudaUnavailable::NoLibrary("cuBLAS (libcublas.so)"));
        }
        if !unsafe { cudarc::nvrtc::sys::is_culib_present() } {
            return Err(CudaUnavailable::NoLibrary("NVRTC (libnvrtc.so)"));
        }
        let count = CudaContext::device_count().map_err(CudaUnavailable::NoUsableDevice)?;
        if ordinal >= count.max(0) as usize {
            return Err(CudaUnavailable::NoDevice { ordinal, count });
        }
        let ctx = CudaContext::new(ordinal)?;
        // One stream: order is enough, cudarc's per-buffer events would only cost time.
        // SAFETY: called before any buffer or stream of this context exists.
        unsafe { ctx.disable_event_tracking() };
        let (major, minor) = ctx.compute_capability()?;
        let stream = ctx.default_stream();
        let module = ctx.load_module(compile_kernels(S::DEFINE, major, minor)?)?;
        let mut kernels = HashMap::new();
        for name in KERNEL_NAMES {
            kernels.insert(name, module.load_function(name)?);
        }
        let blas = CudaBlas::new(stream.clone())?;
        // Split-K partial sums stay fp32 in 2-byte GEMMs (cuBLAS's default may round them
        // to the format), as the CPU's sums do.
        // SAFETY: a live handle; the mode is one of cuBLAS's.
        unsafe {
            blas_sys::cublasSetMathMode(
                *blas.handle(),
                blas_sys::cublasMath_t::CUBLAS_MATH_DISALLOW_REDUCED_PRECISION_REDUCTION,
            )
        }
        .result()?;
        let gib = ctx.total_mem()? as f64 / (1u64 << 30) as f64;
        let free_at_start = ctx.mem_get_info()?.0;
        Ok(Self {
            device: format!("cuda:{ordinal} {} ({gib:.0} GiB, sm_{major}{minor})", ctx.name()?),
            free_at_start,
            stream,
            blas: Arc::new(blas),
            kernels: Arc::new(kernels),
            _format: PhantomData,
        })
    }

    /// Which GPU this is, for logs and reports.
    pub fn device(&self) -> &str {
        &self.device
    }

    /// Bytes of GPU memory free now.
    pub fn free_memory(&self) -> Result<usize, CudaUnavailable> {
        Ok(self.stream.context().mem_get_info()?.0)
    }

    fn kernel(&self, name: &str) -> &CudaFunction {
        &self.kernels[name]
    }

    /// Makes this backend's context the calling thread's, as the driver's and cuBLAS's raw
    /// calls need (cudarc's own stream methods do it themselves): a step may run on any
    /// thread of the pool, and not every call begins with a kernel launch.
    fn bind(&self) {
        self.stream.context().bind_to_thread().expect("CUDA: binding the context to this thread");
    }

    fn base(&self, buf: &CudaSlice<S>) -> u64 {
        let (ptr, _no_event) = buf.device_ptr(&self.stream);
        ptr
    }

    fn upload_u32(&self, host: &[u32]) -> CudaSlice<u32> {
        self.stream.clone_htod(host).expect("CUDA upload")
    }

    fn scratch<T: DeviceRepr + ValidAsZeroBits>(&self, len: usize) -> CudaSlice<T> {
        self.stream.alloc_zeros::<T>(len.max(1)).expect("CUDA scratch allocation")
    }

    fn ptr_of<T>(&self, buf: &CudaSlice<T>) -> u64 {
        let (ptr, _no_event) = buf.device_ptr(&self.stream);
        ptr
    }

    fn download_f64(&self, buf: &CudaSlice<f64>, len: usize) -> Vec<f64> {
        let mut host = vec![0.0; len];
        self.stream.memcpy_dtoh(&buf.slice(0..len), &mut host).expect("CUDA download");
        self.stream.synchronize().expect("CUDA stream synchronize");
        host
    }

    /// `c = alpha · op(a) · op(b) + beta · c` for `batch` column-major matrices (m x n),
    /// computed in fp32 whatever `S` is.
    #[allow(clippy::too_many_arguments)]
    fn gemm(
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
    fn head_gemm(
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
    fn add_column_sums(&self, dst: u64, x: u64, rows: usize, c: usize) {
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

    fn ordered_sum(&self, x: DeviceView<'_, S>, squares: bool) -> f64 {
        if x.len == 0 {
            return 0.0;
        }
        let blocks = x.len.div_ceil(SUM_CHUNK);
        let partial = self.scratch::<f64>(blocks);
        let cfg = LaunchConfig { grid_dim: (blocks as u32, 1, 1), block_dim: (BLOCK, 1, 1), shared_mem_bytes: 0 };
        launch!(
            self,
            "partial_sums",
            cfg,
            x.ptr,
            x.len as i64,
            SUM_CHUNK as i64,
            self.ptr_of(&partial),
            squares as i32
        );
        self.download_f64(&partial, blocks).iter().sum()
    }

    fn download_f32(&self, buf: &CudaSlice<f32>) -> Vec<f32> {
        let mut host = vec![0.0; buf.len()];
        if !host.is_empty() {
            self.stream.memcpy_dtoh(buf, &mut host).expect("CUDA download");
            self.stream.synchronize().expect("CUDA stream synchronize");
        }
        host
    }
}

/// The optimizer's state on the GPU (the CUDA backend's `OptimizerBuffers`).
pub struct DeviceOptimizerBuffers {
    /// Parameters it is for (a buffer is never empty on the GPU: at least one element).
    pub len: usize,
    /// AdamW's m and v (None for SGD).
    pub moments: Option<(CudaSlice<f32>, CudaSlice<f32>)>,
    /// fp32 master weights (bf16/fp16 models only).
    pub master: Option<CudaSlice<f32>>,
}

impl<S: DeviceElem> Backend for CudaBackend<S> {
    type Elem = S;
    type Buf = CudaSlice<S>;
    type View<'a> = DeviceView<'a, S>;
    type ViewMut<'a> = DeviceViewMut<'a, S>;

    fn name(&self) -> &'static str {
        "cuda"
    }

    fn threads(&self) -> usize {
        1
    }

    fn alloc(&self, len: usize) -> CudaSlice<S> {
        let buf = if len == 0 { self.stream.null() } else { self.stream.alloc_zeros::<S>(len) };
        buf.unwrap_or_else(|e| panic!("CUDA: allocating {len} elements: {e}"))
    }

    fn buf_len(&self, buf: &CudaSlice<S>) -> usize {
        buf.len()
    }

    fn upload(&self, dst: &mut CudaSlice<S>, src: &[S]) {
        if src.is_empty() {
            return;
        }
        self.stream.memcpy_htod(src, &mut dst.slice_mut(0..src.len())).expect("CUDA upload");
    }

    fn download(&self, src: &CudaSlice<S>, dst: &mut [S]) {
        if dst.is_empty() {
            return;
        }
        self.stream.memcpy_dtoh(&src.slice(0..dst.len()), dst).expect("CUDA download");
        self.stream.synchronize().expect("CUDA stream synchronize");
    }

    fn view<'a>(&self, buf: &'a CudaSlice<S>, range: Range<usize>) -> DeviceView<'a, S> {
        assert!(range.start <= range.end && range.end <= buf.len(), "view {range:?} of a buffer of {}", buf.len());
        let ptr = self.base(buf) + (range.start * size_of::<S>()) as u64;
        DeviceView { ptr, len: range.len(), _borrow: PhantomData }
    }

    fn view_mut<'a>(&self, buf: &'a mut CudaSlice<S>, range: Range<usize>) -> DeviceViewMut<'a, S> {
        assert!(range.start <= range.end && range.end <= buf.len(), "view {range:?} of a buffer of {}", buf.len());
        let ptr = self.base(buf) + (range.start * size_of::<S>()) as u64;
        DeviceViewMut { ptr, len: range.len(), _borrow: PhantomData }
    }

    fn subview<'a>(&self, view: Self::View<'a>, range: Range<usize>) -> Self::View<'a> {
        assert!(range.start <= range.end && range.end <= view.len, "subview {range:?} of a view of {}", view.len);
        let ptr = view.ptr + (range.start * size_of::<S>()) as u64;
        DeviceView { ptr, len: range.len(), _borrow: PhantomData }
    }

    fn split_mut<'a>(&self, view: Self::ViewMut<'a>, mid: usize) -> (Self::ViewMut<'a>, Self::ViewMut<'a>) {
        assert!(mid <= view.len, "split at {mid} of a view of {}", view.len);
        let tail = view.ptr + (mid * size_of::<S>()) as u64;
        (
            DeviceViewMut { ptr: view.ptr, len: mid, _borrow: PhantomData },
            DeviceViewMut { ptr: tail, len: view.len - mid, _borrow: PhantomData },
        )
    }

    fn reborrow<'b>(&self, view: &'b mut DeviceViewMut<'_, S>) -> DeviceViewMut<'b, S> {
        DeviceViewMut { ptr: view.ptr, len: view.len, _borrow: PhantomData }
    }

    fn freeze<'a>(&self, view: Self::ViewMut<'a>) -> Self::View<'a> {
        DeviceView { ptr: view.ptr, len: view.len, _borrow: PhantomData }
    }

    fn on_host<R>(&self, view: DeviceViewMut<'_, S>, f: impl FnOnce(&mut [S]) -> R) -> R {
        if view.len == 0 {
            return f(&mut []);
        }
        let mut host = vec![S::default(); view.len];
        self.bind();
        // SAFETY: `view` is a live range of `len` elements of a device buffer, and `host`
        // is as long; the stream is synchronised before `host` is read or dropped.
        unsafe {
            cudarc::driver::result::memcpy_dtoh_async(&mut host, view.ptr, self.stream.cu_stream())
                .expect("CUDA download");
        }
        self.stream.synchronize().expect("CUDA stream synchronize");
        let result = f(&mut host);
        // SAFETY: as above; synchronised before `host` is dropped.
        unsafe {
            cudarc::driver::result::memcpy_htod_async(view.ptr, &host, self.stream.cu_stream()).expect("CUDA upload");
        }
        self.stream.synchronize().expect("CUDA stream synchronize");
        result
    }

    fn synchronize(&self) {
        self.stream.synchronize().expect("CUDA stream synchronize");
    }

    /// NCCL on this backend's GPU moves its buffers itself.
    fn reaches(&self, comm: &mut dyn Communicator) -> bool {
        comm.nccl().is_some_and(|nccl| nccl.ordinal() == self.stream.context().ordinal())
    }

    /// The collective through NCCL on the buffer itself (fp32), or on an f32 copy widened
    /// and narrowed on the GPU (bf16/fp16): no byte passes through the host.
    fn device_collective(
        &self,
        comm: &mut dyn Communicator,
        view: DeviceViewMut<'_, S>,
        op: InPlace,
    ) -> Result<(), CommError> {
        let ordinal = self.stream.context().ordinal();
        let nccl = comm.nccl().filter(|nccl| nccl.ordinal() == ordinal).ok_or_else(|| CommError::BadBuffer {
            collective: format!("{op:?}"),
            detail: "this communicator does not reach the GPU's memory (not NCCL on this GPU)".into(),
        })?;
        if view.len == 0 {
            return Ok(());
        }
        if size_of::<S>() == 4 {
            // SAFETY: `view` is a live range of `len` f32 of this GPU's memory, borrowed
            // mutably for the call; the backend's stream waits for the collective.
            return unsafe { nccl.in_place(&self.stream, view.ptr, view.len, op) };
        }
        let wide = self.scratch::<f32>(view.len);
        let wide_ptr = self.ptr_of(&wide);
        launch!(self, "widen", elementwise(view.len), wide_ptr, view.ptr, view.len as i64);
        // SAFETY: `wide` holds `len` f32 on this GPU and lives until the stream has used it
        // (cudarc frees it in stream order).
        unsafe { nccl.in_place(&self.stream, wide_ptr, view.len, op) }?;
        launch!(self, "narrow", elementwise(view.len), view.ptr, wide_ptr, view.len as i64);
        Ok(())
    }

    fn device_memory_used(&self) -> Option<u64> {
        let free = self.free_memory().ok()?;
        Some(self.free_at_start.saturating_sub(free) as u64)
    }

    fn buffers_on_host(&self) -> bool {
        false
    }

    type OptimizerBuffers = DeviceOptimizerBuffers;

    /// The optimizer's state in GPU memory for `len` parameters: AdamW's moments (with
    /// `moments`), and the master weights of a bf16/fp16 model, starting from `initial`, the
    /// parameters' fp32 values (as the CPU optimizer does).
    fn optimizer_buffers(
        &self,
        len: usize,
        moments: bool,
        initial: impl FnOnce() -> Vec<f32>,
    ) -> DeviceOptimizerBuffers {
        let master = crate::optim::needs_master::<S>().then(|| {
            let values = initial();
            assert_eq!(values.len(), len, "master weights for every parameter");
            self.stream.clone_htod(&values).expect("CUDA upload")
        });
        let moments = moments.then(|| (self.scratch::<f32>(len), self.scratch::<f32>(len)));
        DeviceOptimizerBuffers { len, moments, master }
    }

    /// One AdamW or SGD update on the GPU (the math of `optim::adamw_update` and
    /// `optim::sgd_update`): the fp32 weights are the master copy at `range` (mixed
    /// precision, rounded into `params` after) or `params` themselves (fp32).
    fn optimizer_update(
        &self,
        params: DeviceViewMut<'_, S>,
        grads: DeviceView<'_, S>,
        state: &mut DeviceOptimizerBuffers,
        range: Range<usize>,
        update: &Update,
    ) {
        assert!(params.len == grads.len && params.len == range.len(), "a gradient and a state slot per parameter");
        let n = range.len();
        if n == 0 {
            return;
        }
        let (weights, model) = match &state.master {
            Some(master) => (self.ptr_of(master) + (range.start * 4) as u64, params.ptr),
            None => (params.ptr, 0),
        };
        match update {
            Update::Sgd { lr, weight_decay, grad_scale } => {
                let (lr_g, decay) = ((lr * grad_scale) as f32, (1.0 - lr * weight_decay) as f32);
                launch!(self, "sgd", elementwise(n), weights, model, grads.ptr, n as i64, lr_g, decay);
            }
            Update::AdamW(hp) => {
                let Some((m, v)) = &state.moments else { panic!("AdamW needs its moments (state made without them)") };
                let at = |ptr: u64| ptr + (range.start * 4) as u64;
                let m_correction = (1.0 / (1.0 - hp.beta1.powf(hp.step as f64))) as f32;
                let v_correction = (1.0 / (1.0 - hp.beta2.powf(hp.step as f64))) as f32;
                let decay = (1.0 - hp.lr * hp.weight_decay) as f32;
                launch!(
                    self,
                    "adamw",
                    elementwise(n),
                    weights,
                    model,
                    grads.ptr,
                    at(self.ptr_of(m)),
                    at(self.ptr_of(v)),
                    n as i64,
                    hp.lr as f32,
                    hp.beta1 as f32,
                    hp.beta2 as f32,
                    (1.0 - hp.beta1) as f32,
                    (1.0 - hp.beta2) as f32,
                    hp.eps as f32,
                    decay,
                    m_correction,
                    v_correction,
                    hp.grad_scale as f32,
                );
            }
        }
    }

    fn read_optimizer_buffers<R>(
        &self,
        buffers: &DeviceOptimizerBuffers,
        f: impl FnOnce(OptimizerSlices<'_>) -> R,
    ) -> R {
        let len = buffers.len;
        let (m, v) = match &buffers.moments {
            Some((m, v)) => (self.download_f32(m), self.download_f32(v)),
            None => (Vec::new(), Vec::new()),
        };
        let master = buffers.master.as_ref().map(|w| self.download_f32(w));
        let (m, v) = (&m[..m.len().min(len)], &v[..v.len().min(len)]);
        f(OptimizerSlices { m, v, master: master.as_deref() })
    }

    fn load_optimizer_buffers(
        &self,
        buffers: &mut DeviceOptimizerBuffers,
        saved: &OptimizerState,
    ) -> Result<(), String> {
        let len = buffers.len;
        let moments = if buffers.moments.is_some() { len } else { 0 };
        let master = if buffers.master.is_some() { len } else { 0 };
        saved.check_lengths(moments, master)?;
        let saved_master = saved.master.as_deref().unwrap_or_default();
        let put = |buf: &mut CudaSlice<f32>, values: &[f32]| {
            if !values.is_empty() {
                self.stream.memcpy_htod(values, &mut buf.slice_mut(0..values.len())).expect("CUDA upload");
            }
        };
        if let Some((m, v)) = &mut buffers.moments {
            put(m, &saved.m);
            put(v, &saved.v);
        }
        if let Some(w) = &mut buffers.master {
            put(w, saved_master);
        }
        self.stream.synchronize().expect("CUDA stream synchronize");
        Ok(())
    }

    fn read_host<R>(&self, view: DeviceView<'_, S>, f: impl FnOnce(&[S]) -> R) -> R {
        if view.len == 0 {
            return f(&[]);
        }
        let mut host = vec![S::default(); view.len];
        self.bind();
        // SAFETY: `view` is a live range of `len` elements of a device buffer, and `host`
        // is as long; the stream is synchronised before `host` is read.
        unsafe {
            cudarc::driver::result::memcpy_dtoh_async(&mut host, view.ptr, self.stream.cu_stream())
                .expect("CUDA download");
        }
        self.stream.synchronize().expect("CUDA stream synchronize");
        f(&host)
    }

    fn fill(&self, out: DeviceViewMut<'_, S>, value: f64) {
        if out.len > 0 {
            launch!(self, "fill", elementwise(out.len), out.ptr, out.len as i64, value as f32);
        }
    }

    fn copy(&self, dst: DeviceViewMut<'_, S>, src: DeviceView<'_, S>) {
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

    fn add(&self, dst: DeviceViewMut<'_, S>, src: DeviceView<'_, S>) {
        assert_eq!(dst.len, src.len, "add between views of different lengths");
        if dst.len > 0 {
            launch!(self, "add", elementwise(dst.len), dst.ptr, src.ptr, dst.len as i64);
        }
    }

    fn sum(&self, x: DeviceView<'_, S>) -> f64 {
        self.ordered_sum(x, false)
    }

    fn sum_squares(&self, x: DeviceView<'_, S>) -> f64 {
        self.ordered_sum(x, true)
    }

    fn encoder_forward(
        &self,
        out: DeviceViewMut<'_, S>,
        tokens: &[u32],
        wte: DeviceView<'_, S>,
        wpe: DeviceView<'_, S>,
        seq_len: usize,
        c: usize,
    ) {
        let rows = out.len / c;
        check_tokens("encoder_forward", &tokens[..rows], wte.len / c);
        assert!(wpe.len >= seq_len.min(rows) * c, "encoder_forward: fewer positions than the sequence");
        let tokens = self.upload_u32(&tokens[..rows]);
        launch!(
            self,
            "encoder_forward",
            elementwise(rows * c),
            out.ptr,
            self.ptr_of(&tokens),
            wte.ptr,
            wpe.ptr,
            int(rows),
            int(seq_len),
            int(c)
        );
    }

    fn encoder_backward(
        &self,
        dwte: DeviceViewMut<'_, S>,
        dwpe: DeviceViewMut<'_, S>,
        dout: DeviceView<'_, S>,
        tokens: &[u32],
        seq_len: usize,
        c: usize,
    ) {
        let rows = dout.len / c;
        check_tokens("encoder_backward", &tokens[..rows], dwte.len / c);
        // Group the rows by token on the host (the ids are here anyway), so that one
        // thread adds every row of a token for one column, in row order.
        let mut rows_of: Vec<u32> = (0..rows as u32).collect();
        rows_of.sort_by_key(|&r| tokens[r as usize]);
        let mut distinct = Vec::new();
        let mut starts = Vec::new();
        for (k, &r) in rows_of.iter().enumerate() {
            let token = tokens[r as usize];
            if distinct.last() != Some(&token) {
                distinct.push(token);
                starts.push(k as u32);
            }
        }
        starts.push(rows as u32);
        if !distinct.is_empty() {
            let (distinct_d, starts_d, rows_d) =
                (self.upload_u32(&distinct), self.upload_u32(&starts), self.upload_u32(&rows_of));
            // Distinct tokens on x (up to 2^31 blocks), column blocks on y (at most 65535).
            assert!(c.div_ceil(BLOCK as usize) <= MAX_GRID_Y, "encoder_backward_wte: rows of {c} columns are too wide");
            let cfg = LaunchConfig {
                grid_dim: (u32::try_from(distinct.len()).expect("fewer tokens than 2^32"), blocks_for(c, BLOCK), 1),
                block_dim: (BLOCK, 1, 1),
                shared_mem_bytes: 0,
            };
            launch!(
                self,
                "encoder_backward_wte",
                cfg,
                dwte.ptr,
                dout.ptr,
                self.ptr_of(&distinct_d),
                self.ptr_of(&starts_d),
                self.ptr_of(&rows_d),
                int(c)
            );
        }
        let sequences = rows / seq_len;
        launch!(
            self,
            "encoder_backward_wpe",
            elementwise(seq_len * c),
            dwpe.ptr,
            dout.ptr,
            int(sequences),
            int(seq_len),
            int(c)
        );
    }

    fn layernorm_forward(
        &self,
        out: DeviceViewMut<'_, S>,
        mean: DeviceViewMut<'_, S>,
        rstd: DeviceViewMut<'_, S>,
        inp: DeviceView<'_, S>,
        gamma: DeviceView<'_, S>,
        beta: DeviceView<'_, S>,
        c: usize,
    ) {
        let rows = inp.len / c;
        launch!(
            self,
            "layernorm_forward",
            warp_per_row(rows),
            out.ptr,
            mean.ptr,
            rstd.ptr,
            inp.ptr,
            gamma.ptr,
            beta.ptr,
            int(rows),
            int(c)
        );
    }

    fn layernorm_backward(
        &self,
        dinp: DeviceViewMut<'_, S>,
        dgamma: DeviceViewMut<'_, S>,
        dbeta: DeviceViewMut<'_, S>,
        dout: DeviceView<'_, S>,
        inp: DeviceView<'_, S>,
        gamma: DeviceView<'_, S>,
        mean: DeviceView<'_, S>,
        rstd: DeviceView<'_, S>,
        c: usize,
    ) {
        let rows = inp.len / c;
        launch!(
            self,
            "layernorm_backward_input",
            warp_per_row(rows),
            dinp.ptr,
            dout.ptr,
            inp.ptr,
            gamma.ptr,
            mean.ptr,
            rstd.ptr,
            int(rows),
            int(c)
        );
        let (blocks, per_block) = column_blocks(rows);
        let partial = self.scratch::<f32>(2 * blocks * c);
        let p = self.ptr_of(&partial);
        let cfg = LaunchConfig {
            grid_dim: (blocks_for(c, BLOCK), blocks as u32, 1),
            block_dim: (BLOCK, 1, 1),
            shared_mem_bytes: 0,
        };
        launch!(
            self,
            "layernorm_param_partials",
            cfg,
            p,
            dout.ptr,
            inp.ptr,
            mean.ptr,
            rstd.ptr,
            int(rows),
            int(c),
            int(per_block)
        );
        launch!(self, "add_column_partials", elementwise(c), dgamma.ptr, p, int(blocks), int(c));
        let dbeta_partial = p + (blocks * c * 4) as u64;
        launch!(self, "add_column_partials", elementwise(c), dbeta.ptr, dbeta_partial, int(blocks), int(c));
    }

    fn matmul_forward(
        &self,
        out: DeviceViewMut<'_, S>,
        inp: DeviceView<'_, S>,
        weight: DeviceView<'_, S>,
        bias: Option<DeviceView<'_, S>>,
        residual: Option<DeviceView<'_, S>>,
        c_in: usize,
        c_out: usize,
    ) {
        let rows = inp.len / c_in;
        check_shape("matmul_forward", &[(inp.len, rows * c_in), (weight.len, c_in * c_out), (out.len, rows * c_out)]);
        let beta = match residual {
            Some(residual) => {
                self.copy(DeviceViewMut { ptr: out.ptr, len: out.len, _borrow: PhantomData }, residual);
                1.0
            }
            None => 0.0,
        };
        // Row-major out (rows x c_out) = inp · W is column-major outᵀ = Wᵀ · inpᵀ.
        self.gemm(
            (false, false),
            (c_out, rows, c_in),
            1.0,
            Operand { ptr: weight.ptr, ld: c_out, stride: 0 },
            Operand { ptr: inp.ptr, ld: c_in, stride: 0 },
            beta,
            Operand { ptr: out.ptr, ld: c_out, stride: 0 },
            1,
        );
        if let Some(bias) = bias {
            launch!(self, "add_bias", elementwise(rows * c_out), out.ptr, bias.ptr, int(rows), int(c_out));
        }
    }

    fn matmul_backward_input(
        &self,
        dinp: DeviceViewMut<'_, S>,
        dout: DeviceView<'_, S>,
        weight: DeviceView<'_, S>,
        c_in: usize,
        c_out: usize,
    ) {
        let rows = dinp.len / c_in;
        check_shape(
            "matmul_backward_input",
            &[(dinp.len, rows * c_in), (weight.len, c_in * c_out), (dout.len, rows * c_out)],
        );
        // dinp = dout · Wᵀ: column-major dinpᵀ (c_in x rows) = W · doutᵀ.
        self.gemm(
            (true, false),
            (c_in, rows, c_out),
            1.0,
            Operand { ptr: weight.ptr, ld: c_out, stride: 0 },
            Operand { ptr: dout.ptr, ld: c_out, stride: 0 },
            0.0,
            Operand { ptr: dinp.ptr, ld: c_in, stride: 0 },
            1,
        );
    }

    fn matmul_backward_weights(
        &self,
        dweight: DeviceViewMut<'_, S>,
        dbias: Option<DeviceViewMut<'_, S>>,
        dout: DeviceView<'_, S>,
        inp: DeviceView<'_, S>,
        c_in: usize,
        c_out: usize,
    ) {
        let rows = inp.len / c_in;
        check_shape(
            "matmul_backward_weights",
            &[(inp.len, rows * c_in), (dweight.len, c_in * c_out), (dout.len, rows * c_out)],
        );
        // dW += inpᵀ · dout: column-major dWᵀ (c_out x c_in) += doutᵀ · inp.
        self.gemm(
            (false, true),
            (c_out, c_in, rows),
            1.0,
            Operand { ptr: dout.ptr, ld: c_out, stride: 0 },
            Operand { ptr: inp.ptr, ld: c_in, stride: 0 },
            1.0,
            Operand { ptr: dweight.ptr, ld: c_out, stride: 0 },
            1,
        );
        if let Some(dbias) = dbias {
            self.add_column_sums(dbias.ptr, dout.ptr, rows, c_out);
        }
    }

    fn attention_forward(
        &self,
        out: DeviceViewMut<'_, S>,
        att: DeviceViewMut<'_, S>,
        qkv: DeviceView<'_, S>,
        seq_len: usize,
        c: usize,
        heads: usize,
    ) {
        let (t, hs) = (seq_len, c / heads);
        let batch = qkv.len / (t * 3 * c);
        check_shape("attention_forward", &[(out.len, batch * t * c), (att.len, batch * heads * t * t)]);
        let scale = 1.0 / (hs as f32).sqrt();
        let e = size_of::<S>() as u64;
        let qkv_part =
            |part: usize| HeadOperand { ptr: qkv.ptr + (part * c) as u64 * e, ld: 3 * c, seq: t * 3 * c, head: hs };
        let scores = |ptr: u64| HeadOperand { ptr, ld: t, seq: heads * t * t, head: t * t };
        let shape = (batch, heads);
        // S = Q Kᵀ * scale: column-major Sᵀ (keys x queries) = K · Qᵀ.
        self.head_gemm((true, false), (t, t, hs), scale, qkv_part(1), qkv_part(0), 0.0, scores(att.ptr), shape);
        launch!(
            self,
            "causal_softmax_forward",
            warp_per_row(batch * heads * t),
            att.ptr,
            (batch * heads * t) as i64,
            int(t)
        );
        // Y = P V: column-major Yᵀ (hs x T) = Vᵀ · Pᵀ.
        let y = HeadOperand { ptr: out.ptr, ld: c, seq: t * c, head: hs };
        self.head_gemm((false, false), (hs, t, t), 1.0, qkv_part(2), scores(att.ptr), 0.0, y, shape);
    }

    fn attention_backward(
        &self,
        dqkv: DeviceViewMut<'_, S>,
        datt: DeviceViewMut<'_, S>,
        dout: DeviceView<'_, S>,
        qkv: DeviceView<'_, S>,
        att: DeviceView<'_, S>,
        seq_len: usize,
        c: usize,
        heads: usize,
    ) {
        let (t, hs) = (seq_len, c / heads);
        let batch = qkv.len / (t * 3 * c);
        check_shape(
            "attention_backward",
            &[(dqkv.len, qkv.len), (dout.len, batch * t * c), (att.len, batch * heads * t * t), (datt.len, att.len)],
        );
        let scale = 1.0 / (hs as f32).sqrt();
        let e = size_of::<S>() as u64;
        let part = |ptr: u64, part: usize| HeadOperand {
            ptr: ptr + (part * c) as u64 * e,
            ld: 3 * c,
            seq: t * 3 * c,
            head: hs,
        };
        let scores = |ptr: u64| HeadOperand { ptr, ld: t, seq: heads * t * t, head: t * t };
        let dy = HeadOperand { ptr: dout.ptr, ld: c, seq: t * c, head: hs };
        let shape = (batch, heads);
        // dP = dY Vᵀ: column-major dPᵀ = V · dYᵀ.
        self.head_gemm((true, false), (t, t, hs), 1.0, part(qkv.ptr, 2), dy, 0.0, scores(datt.ptr), shape);
        // dV = Pᵀ dY: column-major dVᵀ (hs x T) = dYᵀ · P.
        self.head_gemm((false, true), (hs, t, t), 1.0, dy, scores(att.ptr), 0.0, part(dqkv.ptr, 2), shape);
        let rows = batch * heads * t;
        launch!(self, "causal_softmax_backward", warp_per_row(rows), datt.ptr, att.ptr, rows as i64, int(t), scale);
        // dQ = dS K: column-major dQᵀ (hs x T) = Kᵀ · dSᵀ.
        self.head_gemm(
            (false, false),
            (hs, t, t),
            1.0,
            part(qkv.ptr, 1),
            scores(datt.ptr),
            0.0,
            part(dqkv.ptr, 0),
            shape,
        );
        // dK = dSᵀ Q: column-major dKᵀ (hs x T) = Qᵀ · dS.
        self.head_gemm(
            (false, true),
            (hs, t, t),
            1.0,
            part(qkv.ptr, 0),
            scores(datt.ptr),
            0.0,
            part(dqkv.ptr, 1),
            shape,
        );
    }

    fn flash_attention_forward(
        &self,
        out: DeviceViewMut<'_, S>,
        lse: DeviceViewMut<'_, S>,
        qkv: DeviceView<'_, S>,
        seq_len: usize,
        c: usize,
        heads: usize,
    ) {
        let (t, hs) = (seq_len, c / heads);
        assert!(hs <= FLASH_MAX_HEAD, "flash attention: head size {hs} above {FLASH_MAX_HEAD} (checked by the spec)");
        let batch = qkv.len / (t * 3 * c);
        let rows = batch * heads * t;
        check_shape("flash_attention_forward", &[(out.len, batch * t * c), (lse.len, rows * 2)]);
        let scale = 1.0 / (hs as f32).sqrt();
        launch!(
            self,
            "flash_attention_forward",
            warp_per_row(rows),
            out.ptr,
            lse.ptr,
            qkv.ptr,
            rows as i64,
            int(t),
            int(c),
            int(heads),
            scale
        );
    }

    fn flash_attention_backward(
        &self,
        dqkv: DeviceViewMut<'_, S>,
        delta: DeviceViewMut<'_, S>,
        dout: DeviceView<'_, S>,
        qkv: DeviceView<'_, S>,
        out: DeviceView<'_, S>,
        lse: DeviceView<'_, S>,
        seq_len: usize,
        c: usize,
        heads: usize,
    ) {
        let (t, hs) = (seq_len, c / heads);
        assert!(hs <= FLASH_MAX_HEAD, "flash attention: head size {hs} above {FLASH_MAX_HEAD} (checked by the spec)");
        let batch = qkv.len / (t * 3 * c);
        let rows = batch * heads * t;
        check_shape(
            "flash_attention_backward",
            &[
                (dqkv.len, qkv.len),
                (dout.len, batch * t * c),
                (out.len, batch * t * c),
                (lse.len, rows * 2),
                (delta.len, rows * 2),
            ],
        );
        let scale = 1.0 / (hs as f32).sqrt();
        let (n, t, c, heads) = (rows as i64, int(t), int(c), int(heads));
        launch!(self, "flash_attention_delta", warp_per_row(rows), delta.ptr, dout.ptr, out.ptr, n, t, c, heads);
        let (dqkv, dout, qkv, lse, delta) = (dqkv.ptr, dout.ptr, qkv.ptr, lse.ptr, delta.ptr);
        // dQ by query row, then dK and dV by key row: disjoint columns of dqkv.
        launch!(
            self,
            "flash_attention_backward_query",
            warp_per_row(rows),
            dqkv,
            dout,
            qkv,
            lse,
            delta,
            n,
            t,
            c,
            heads,
            scale
        );
        launch!(
            self,
            "flash_attention_backward_key",
            warp_per_row(rows),
            dqkv,
            dout,
            qkv,
            lse,
            delta,
            n,
            t,
            c,
            heads,
            scale
        );
    }

    fn gelu_forward(&self, out: DeviceViewMut<'_, S>, inp: DeviceView<'_, S>) {
        launch!(self, "gelu_forward", elementwise(inp.len), out.ptr, inp.ptr, inp.len as i64);
    }

    fn gelu_backward(&self, dinout: DeviceViewMut<'_, S>, inp: DeviceView<'_, S>) {
        launch!(self, "gelu_backward", elementwise(inp.len), dinout.ptr, inp.ptr, inp.len as i64);
    }

    fn crossentropy_forward(
        &self,
        logits: DeviceViewMut<'_, S>,
        losses: DeviceViewMut<'_, S>,
        targets: &[u32],
        vocab: usize,
    ) -> f64 {
        let rows = logits.len / vocab;
        if rows == 0 {
            return 0.0;
        }
        check_tokens("crossentropy_forward", &targets[..rows], vocab);
        assert!(losses.len >= rows, "crossentropy_forward: {} losses for {rows} rows", losses.len);
        let targets = self.upload_u32(&targets[..rows]);
        let row_loss = self.scratch::<f64>(rows);
        launch!(
            self,
            "crossentropy_forward",
            block_per_row(rows),
            logits.ptr,
            losses.ptr,
            self.ptr_of(&row_loss),
            self.ptr_of(&targets),
            int(vocab)
        );
        self.download_f64(&row_loss, rows).iter().sum()
    }

    fn crossentropy_backward(&self, probs: DeviceViewMut<'_, S>, targets: &[u32], vocab: usize, dloss: f64) {
        let rows = probs.len / vocab;
        if rows == 0 {
            return;
        }
        check_tokens("crossentropy_backward", &targets[..rows], vocab);
        let targets = self.upload_u32(&targets[..rows]);
        launch!(
            self,
            "crossentropy_backward",
            block_per_row(rows),
            probs.ptr,
            self.ptr_of(&targets),
            int(vocab),
            dloss as f32
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_kernel_named_here_is_in_the_source() {
        for name in KERNEL_NAMES {
            let declaration = format!("extern \"C\" __global__ void {name}(");
            assert!(KERNELS.contains(&declaration), "{name} is not a kernel of the .cu files");
        }
    }
}
