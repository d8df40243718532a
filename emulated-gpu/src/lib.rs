//! An emulated CUDA device on the CPU: stand-ins for the CUDA driver (`driver.rs`), NVRTC
//! (`nvrtc.rs`), cuBLAS (`cublas.rs`) and NCCL (`nccl.rs`), exported with their C names
//! from one shared library. `cargo xtask emulated-gpu -- COMMAND` links it as `libcuda.so`,
//! `libnvrtc.so`, `libcublas.so` and `libnccl.so` in a folder it puts first on
//! `LD_LIBRARY_PATH`: cudarc, which loads those libraries by name at run time, finds these,
//! and the CUDA backend and NCCL communicator run unchanged (they cannot tell). The dynamic
//! loader loads one file once, whatever name it is asked for, so the four share this
//! library's state. NCCL's ranks are processes (one per rank, as the worker runs them);
//! they meet in shared memory (`shared_group.rs`).
//!
//! What it is: device memory is host memory between guard pages (`memory.rs`), so a kernel
//! that reads or writes out of bounds faults, and the fault is reported naming the kernel,
//! block and thread; "NVRTC" compiles the kernels' CUDA C as C++ with g++ against
//! `kernels/runtime.h`, which runs every CUDA thread as a fiber (barriers and warp shuffles
//! behave as on a GPU, a shuffle some lane never reaches is an error, and the threads can
//! run in reverse or shuffled order between barriers, `DISTLAB_EMULATED_GPU_ORDER`; a
//! kernel that never waits, as `waiting.rs` reads its source, runs without fibers);
//! "cuBLAS" is a reference column-major GEMM. Every call runs to completion before it
//! returns: streams are in order trivially, events have nothing to wait for.
//!
//! What it is not: a timing model (nothing here says how fast a GPU is), or concurrency
//! between streams.

// Every exported function is unsafe as its CUDA counterpart is: its pointers must be valid
// as that library's documentation requires (and device pointers ones this library made).
#![allow(clippy::missing_safety_doc)]

pub mod cublas;
pub mod driver;
pub mod fault;
pub mod memory;
pub mod nccl;
pub mod nvrtc;
mod shared_group;
mod waiting;

/// Settings, read from the environment once.
pub mod settings {
    use std::sync::OnceLock;

    /// Devices this process sees: the machine's (`DISTLAB_EMULATED_GPU_DEVICES`, 1 to 8; 1
    /// when unset), or as a real driver does with `CUDA_VISIBLE_DEVICES`, as many of them
    /// as that list names before its first entry that is not one (so "0" is one device).
    pub fn devices() -> i32 {
        static N: OnceLock<i32> = OnceLock::new();
        *N.get_or_init(|| {
            let machine: i32 = std::env::var("DISTLAB_EMULATED_GPU_DEVICES")
                .ok()
                .and_then(|v| v.parse().ok())
                .unwrap_or(1)
                .clamp(1, 8);
            match std::env::var("CUDA_VISIBLE_DEVICES") {
                Ok(list) => visible(&list, machine),
                Err(_) => machine,
            }
        })
    }

    /// How many devices `CUDA_VISIBLE_DEVICES=list` leaves of a machine's `machine`.
    pub fn visible(list: &str, machine: i32) -> i32 {
        list.split(',').map_while(|entry| entry.trim().parse::<i32>().ok().filter(|d| (0..machine).contains(d))).count()
            as i32
    }

    /// Bytes of memory each device has (`DISTLAB_EMULATED_GPU_MEMORY_MB`; 16 GiB when unset).
    pub fn memory_bytes() -> usize {
        static B: OnceLock<usize> = OnceLock::new();
        *B.get_or_init(|| {
            let mb: usize =
                std::env::var("DISTLAB_EMULATED_GPU_MEMORY_MB").ok().and_then(|v| v.parse().ok()).unwrap_or(16 * 1024);
            mb << 20
        })
    }

    /// The order a block's threads run in between two synchronisations
    /// (`DISTLAB_EMULATED_GPU_ORDER`: forward, reverse or shuffled) and the shuffle's seed
    /// (`DISTLAB_EMULATED_GPU_SEED`), unless this thread runs under [`with_thread_order`].
    pub fn thread_order() -> (i32, u64) {
        if let Some(order) = ORDER_HERE.with(std::cell::Cell::get) {
            return order;
        }
        static O: OnceLock<(i32, u64)> = OnceLock::new();
        *O.get_or_init(|| {
            let order = match std::env::var("DISTLAB_EMULATED_GPU_ORDER").as_deref() {
                Ok("reverse") => REVERSE,
                Ok("shuffled") => SHUFFLED,
                _ => FORWARD,
            };
            let seed = std::env::var("DISTLAB_EMULATED_GPU_SEED").ok().and_then(|v| v.parse().ok()).unwrap_or(1);
            (order, seed)
        })
    }

    pub const FORWARD: i32 = 0;
    pub const REVERSE: i32 = 1;
    pub const SHUFFLED: i32 = 2;

    thread_local! {
        static ORDER_HERE: std::cell::Cell<Option<(i32, u64)>> = const { std::cell::Cell::new(None) };
    }

    /// Runs `f` with the launches of this thread in `order` (a test's own setting).
    pub fn with_thread_order<R>(order: i32, seed: u64, f: impl FnOnce() -> R) -> R {
        ORDER_HERE.with(|o| o.set(Some((order, seed))));
        let result = f();
        ORDER_HERE.with(|o| o.set(None));
        result
    }
}
