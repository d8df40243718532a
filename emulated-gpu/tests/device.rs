//! The emulated device itself, through the C functions cudarc calls: kernels compiled by
//! the stand-in NVRTC and launched by the stand-in driver behave as CUDA threads do
//! (barriers, shared memory, warp shuffles), a missing barrier changes a result when the
//! threads run in another order, a shuffle not every lane reaches fails the launch, and an
//! access past the end of a buffer is reported with the kernel, block and thread.

use std::ffi::{c_char, c_void, CStr, CString};
use std::process::Command;

use distlab_emulated_gpu::driver::*;
use distlab_emulated_gpu::nvrtc::*;
use distlab_emulated_gpu::settings::{with_thread_order, FORWARD, REVERSE, SHUFFLED};

const KERNELS: &str = r#"
#define BLOCK 128
// The block's sum through shared memory, with the barriers it needs.
extern "C" __global__ void block_sum(const float* x, float* out) {
    __shared__ float part[BLOCK];
    part[threadIdx.x] = x[blockIdx.x * BLOCK + threadIdx.x];
    __syncthreads();
    for (int half = BLOCK / 2; half > 0; half /= 2) {
        if (threadIdx.x < half) part[threadIdx.x] += part[threadIdx.x + half];
        __syncthreads();
    }
    if (threadIdx.x == 0) out[blockIdx.x] = part[0];
}
// The same without the first barrier: thread 0 may add what the others have not written.
extern "C" __global__ void block_sum_racy(const float* x, float* out) {
    __shared__ float part[BLOCK];
    part[threadIdx.x] = x[blockIdx.x * BLOCK + threadIdx.x];
    if (threadIdx.x == 0) {
        float total = 0.0f;
        for (int i = 0; i < BLOCK; i++) total += part[i];
        out[blockIdx.x] = total;
    }
}
// A warp's sum by shuffles: every lane ends with it.
extern "C" __global__ void warp_sum(float* x) {
    float v = x[threadIdx.x];
    for (int o = 16; o > 0; o /= 2) v += __shfl_xor_sync(0xffffffffu, v, o);
    x[threadIdx.x] = v;
}
// Odd lanes leave before the shuffle.
extern "C" __global__ void warp_sum_divergent(float* x) {
    if (threadIdx.x % 2) return;
    float v = x[threadIdx.x];
    for (int o = 16; o > 0; o /= 2) v += __shfl_xor_sync(0xffffffffu, v, o);
    x[threadIdx.x] = v;
}
// Each thread writes its index (x + 10 y + 100 z) at its place in the block.
extern "C" __global__ void indices(float* x) {
    x[threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z)] = threadIdx.x + 10 * threadIdx.y + 100 * threadIdx.z;
}
// One element per thread, the grid one block too many.
extern "C" __global__ void scale(float* x, float by) {
    x[blockIdx.x * blockDim.x + threadIdx.x] *= by;
}
"#;

/// Binds device 0's context to the calling thread, as cudarc does before its calls.
fn bind() {
    unsafe {
        let mut context = std::ptr::null_mut();
        assert_eq!(cuDevicePrimaryCtxRetain(&mut context, 0), 0);
        assert_eq!(cuCtxSetCurrent(context), 0);
    }
}

/// The test kernels, compiled and loaded.
struct Module(*mut c_void);
// SAFETY: a module handle may be used from any thread, as CUDA's may.
unsafe impl Sync for Module {}

impl Module {
    fn load() -> Module {
        let ptx = ptx();
        unsafe {
            let mut module = std::ptr::null_mut();
            assert_eq!(cuModuleLoadData(&mut module, ptx.as_ptr() as *const c_void), 0);
            Module(module)
        }
    }

    /// Launches kernel `name` on `blocks` blocks of `threads`: the driver's result.
    fn launch(&self, name: &str, blocks: u32, threads: u32, args: &mut [*mut c_void]) -> u32 {
        self.launch_block(name, blocks, [threads, 1, 1], args)
    }

    /// Launches kernel `name` on `blocks` blocks of `block` (x, y, z): the driver's result.
    fn launch_block(&self, name: &str, blocks: u32, block: [u32; 3], args: &mut [*mut c_void]) -> u32 {
        unsafe {
            let mut function = std::ptr::null_mut();
            let name = CString::new(name).unwrap();
            assert_eq!(cuModuleGetFunction(&mut function, self.0, name.as_ptr()), 0);
            cuLaunchKernel(
                function,
                blocks,
                1,
                1,
                block[0],
                block[1],
                block[2],
                0,
                std::ptr::null_mut(),
                args.as_mut_ptr(),
                std::ptr::null_mut(),
            )
        }
    }
}

/// The test kernels compiled by the stand-in NVRTC: their "PTX" (NUL-terminated).
fn ptx() -> Vec<c_char> {
    bind();
    unsafe {
        let mut program = std::ptr::null_mut();
        let source = CString::new(KERNELS).unwrap();
        let options = [CString::new("-DTEST").unwrap()];
        let option_ptrs: Vec<_> = options.iter().map(|o| o.as_ptr()).collect();
        assert_eq!(
            nvrtcCreateProgram(&mut program, source.as_ptr(), std::ptr::null(), 0, std::ptr::null(), std::ptr::null()),
            0
        );
        let compiled = nvrtcCompileProgram(program, 1, option_ptrs.as_ptr());
        if compiled != 0 {
            let mut size = 0;
            nvrtcGetProgramLogSize(program, &mut size);
            let mut log = vec![0; size];
            nvrtcGetProgramLog(program, log.as_mut_ptr());
            panic!("the kernels do not compile: {}", CStr::from_ptr(log.as_ptr()).to_string_lossy());
        }
        let mut size = 0;
        assert_eq!(nvrtcGetPTXSize(program, &mut size), 0);
        let mut ptx = vec![0; size];
        assert_eq!(nvrtcGetPTX(program, ptx.as_mut_ptr()), 0);
        assert_eq!(nvrtcDestroyProgram(&mut program), 0);
        ptx
    }
}

/// `values` in device memory: its pointer.
fn device(values: &[f32]) -> u64 {
    unsafe {
        let mut ptr = 0u64;
        assert_eq!(cuMemAlloc_v2(&mut ptr, values.len() * 4), 0);
        cuMemcpyHtoD_v2(ptr, values.as_ptr() as *const c_void, values.len() * 4);
        ptr
    }
}

fn host(ptr: u64, len: usize) -> Vec<f32> {
    let mut out = vec![0.0f32; len];
    unsafe { cuMemcpyDtoH_v2(out.as_mut_ptr() as *mut c_void, ptr, len * 4) };
    out
}

/// The sums of `blocks` blocks of 128 values (k for value k of a block) by `kernel`.
fn sums(module: &Module, kernel: &str, blocks: usize) -> Vec<f32> {
    let x: Vec<f32> = (0..blocks * 128).map(|i| (i % 128) as f32).collect();
    let (mut xd, mut out) = (device(&x), device(&vec![0.0; blocks]));
    let mut args = [&mut xd as *mut u64 as *mut c_void, &mut out as *mut u64 as *mut c_void];
    assert_eq!(module.launch(kernel, blocks as u32, 128, &mut args), 0);
    host(out, blocks)
}

#[test]
fn barriers_make_a_block_sum_the_same_in_every_thread_order() {
    let module = Module::load();
    for order in [FORWARD, REVERSE, SHUFFLED] {
        let got = with_thread_order(order, 7, || sums(&module, "block_sum", 3));
        assert_eq!(got, vec![8128.0; 3], "order {order}");
    }
}

#[test]
fn every_thread_of_a_three_dimensional_block_gets_its_own_index() {
    let module = Module::load();
    let mut x = device(&[-1.0; 24]);
    let mut args = [&mut x as *mut u64 as *mut c_void];
    assert_eq!(module.launch_block("indices", 1, [4, 3, 2], &mut args), 0);
    let want: Vec<f32> =
        (0..2).flat_map(|z| (0..3).flat_map(move |y| (0..4).map(move |x| (x + 10 * y + 100 * z) as f32))).collect();
    assert_eq!(host(x, 24), want);
}

/// A kernel that never waits runs without fibers, and one run so that waits anyway fails its
/// launch saying why (the guard behind the stand-in NVRTC's reading of the source).
#[test]
fn a_kernel_run_without_fibers_that_waits_fails_its_launch() {
    let ptx = ptx();
    let text = unsafe { CStr::from_ptr(ptx.as_ptr()) }.to_string_lossy();
    let library = open_module(&text).expect("the module opens");
    let waits = |name: &CStr| unsafe { kernel(library, name) }.expect("a kernel of the module").1;
    assert!(waits(c"block_sum") && waits(c"warp_sum") && waits(c"warp_sum_divergent"));
    assert!(!waits(c"block_sum_racy") && !waits(c"scale"));

    let (entry, _, run, _) = unsafe { kernel(library, c"block_sum") }.unwrap();
    let x: Vec<f32> = (0..128).map(|i| i as f32).collect();
    let (mut xd, mut out) = (device(&x), device(&[0.0]));
    let mut args = [&mut xd as *mut u64 as *mut c_void, &mut out as *mut u64 as *mut c_void];
    let (grid, block) = ([1u32, 1, 1], [128u32, 1, 1]);
    let mut error = [0 as c_char; 1024];
    let mut run_with = |waits: i32, error: &mut [c_char; 1024]| unsafe {
        run(
            c"block_sum".as_ptr(),
            entry,
            args.as_mut_ptr(),
            grid.as_ptr(),
            block.as_ptr(),
            FORWARD,
            1,
            waits,
            error.as_mut_ptr(),
            1024,
        )
    };
    assert_eq!(run_with(0, &mut error), 1, "a barrier without fibers must fail the launch");
    let why = unsafe { CStr::from_ptr(error.as_ptr()) }.to_string_lossy().into_owned();
    assert!(why.contains("kernel block_sum") && why.contains("run without fibers"), "{why}");
    // The same launch with fibers, after it: the sum.
    assert_eq!(run_with(1, &mut error), 0);
    assert_eq!(host(out, 1), [8128.0]);
}

#[test]
fn a_missing_barrier_changes_the_sum_when_the_threads_run_in_another_order() {
    let module = Module::load();
    // (One block: a block after it would find the first one's values in shared memory.)
    let forward = with_thread_order(FORWARD, 1, || sums(&module, "block_sum_racy", 1));
    let reverse = with_thread_order(REVERSE, 1, || sums(&module, "block_sum_racy", 1));
    // Forward, thread 0 adds before anyone else has written; reversed, after everyone.
    assert_eq!((forward, reverse), (vec![0.0], vec![8128.0]));
}

#[test]
fn a_warp_sums_by_shuffles_and_a_shuffle_some_lanes_never_reach_fails_the_launch() {
    let module = Module::load();
    let mut x = device(&(0..32).map(|i| i as f32).collect::<Vec<_>>());
    let mut args = [&mut x as *mut u64 as *mut c_void];
    assert_eq!(module.launch("warp_sum", 1, 32, &mut args), 0);
    assert_eq!(host(x, 32), vec![496.0; 32]);
    assert_eq!(module.launch("warp_sum_divergent", 1, 32, &mut args), 719, "CUDA_ERROR_LAUNCH_FAILED");
}

#[test]
fn a_copy_or_a_launch_needs_a_context_bound_to_the_thread() {
    let module = Module::load();
    let x = device(&[1.0; 4]);
    let mut out = [0.0f32; 4];
    std::thread::scope(|s| {
        s.spawn(|| unsafe {
            // A new thread has no context (CUDA_ERROR_INVALID_CONTEXT), until it binds one.
            assert_eq!(cuMemcpyDtoH_v2(out.as_mut_ptr() as *mut c_void, x, 16), 201);
            let (mut xd, mut by) = (x, 2.0f32);
            let mut args = [&mut xd as *mut u64 as *mut c_void, &mut by as *mut f32 as *mut c_void];
            assert_eq!(module.launch("scale", 1, 4, &mut args), 201);
            bind();
            assert_eq!(cuMemcpyDtoH_v2(out.as_mut_ptr() as *mut c_void, x, 16), 0);
        });
    });
    assert_eq!(out, [1.0; 4]);
}

/// In a child process (the fault ends it): a kernel writing one block past a buffer.
#[test]
fn an_access_past_the_end_of_a_buffer_names_the_kernel_block_and_thread() {
    if std::env::var_os("DISTLAB_EMULATED_GPU_TEST_FAULT").is_some() {
        let module = Module::load();
        let mut x = device(&[1.0; 64]);
        let mut by = 2.0f32;
        let mut args = [&mut x as *mut u64 as *mut c_void, &mut by as *mut f32 as *mut c_void];
        module.launch("scale", 3, 32, &mut args);
        unreachable!("the write past the end faults");
    }
    let out = Command::new(std::env::current_exe().unwrap())
        .args(["an_access_past_the_end_of_a_buffer_names_the_kernel_block_and_thread", "--exact", "--nocapture"])
        .env("DISTLAB_EMULATED_GPU_TEST_FAULT", "1")
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "the fault ends the process");
    assert!(
        stderr.contains(
            "0 bytes past the end of an allocation of 256 bytes, in kernel scale, block (2, 0, 0), thread (0, 0, 0)"
        ),
        "{stderr}"
    );
}
