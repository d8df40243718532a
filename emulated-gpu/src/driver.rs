//! The CUDA driver API (libcuda) as cudarc calls it: devices, their primary contexts,
//! memory (`memory.rs`), copies, modules compiled by the stand-in NVRTC and kernel launches.
//! Every call completes before it returns, so streams and events only need handles.

use std::cell::Cell;
use std::ffi::{c_char, c_int, c_uint, c_void, CStr, CString};

use crate::{fault, memory, nvrtc, settings};

pub type CUresult = c_uint;
pub const SUCCESS: CUresult = 0;
const INVALID_VALUE: CUresult = 1;
const OUT_OF_MEMORY: CUresult = 2;
const NO_DEVICE: CUresult = 100;
const INVALID_DEVICE: CUresult = 101;
const INVALID_IMAGE: CUresult = 200;
const INVALID_CONTEXT: CUresult = 201;
const INVALID_HANDLE: CUresult = 400;
const NOT_FOUND: CUresult = 500;
const LAUNCH_FAILED: CUresult = 719;

const ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR: c_uint = 75;
const ATTRIBUTE_COMPUTE_CAPABILITY_MINOR: c_uint = 76;
const ATTRIBUTE_MEMORY_POOLS_SUPPORTED: c_uint = 115;
/// The compute capability the emulated devices report: an H100's.
const COMPUTE_CAPABILITY: (c_int, c_int) = (9, 0);

/// A device's primary context: its handle is the address of its entry here.
struct Context {
    device: c_int,
}
static CONTEXTS: [Context; 8] = [
    Context { device: 0 },
    Context { device: 1 },
    Context { device: 2 },
    Context { device: 3 },
    Context { device: 4 },
    Context { device: 5 },
    Context { device: 6 },
    Context { device: 7 },
];

thread_local! {
    static CURRENT: Cell<*mut c_void> = const { Cell::new(std::ptr::null_mut()) };
}

fn context_handle(device: c_int) -> *mut c_void {
    &CONTEXTS[device as usize] as *const Context as *mut c_void
}

fn device_of(context: *mut c_void) -> Option<c_int> {
    CONTEXTS.iter().find(|c| std::ptr::eq(*c as *const Context as *const c_void, context)).map(|c| c.device)
}

/// The device of the calling thread's current context (0 when none is bound).
pub(crate) fn current_device() -> c_int {
    device_of(CURRENT.with(Cell::get)).unwrap_or(0)
}

/// Whether the calling thread has a context bound. The driver's copies, allocations and
/// launches (and cuBLAS's products) need one, as on a real GPU (`CUDA_ERROR_INVALID_CONTEXT`);
/// a free does not (cudarc frees without binding).
pub fn context_bound() -> bool {
    !CURRENT.with(Cell::get).is_null()
}

fn valid_device(device: c_int) -> bool {
    (0..settings::devices()).contains(&device)
}

/// Stores `value` at `out`, unless `out` is null.
unsafe fn put<T>(out: *mut T, value: T) -> CUresult {
    if out.is_null() {
        return INVALID_VALUE;
    }
    out.write(value);
    SUCCESS
}

#[no_mangle]
pub extern "C" fn cuInit(_flags: c_uint) -> CUresult {
    if settings::devices() == 0 {
        return NO_DEVICE;
    }
    SUCCESS
}

#[no_mangle]
pub unsafe extern "C" fn cuDriverGetVersion(version: *mut c_int) -> CUresult {
    put(version, 13000)
}

#[no_mangle]
pub unsafe extern "C" fn cuDeviceGetCount(count: *mut c_int) -> CUresult {
    put(count, settings::devices())
}

#[no_mangle]
pub unsafe extern "C" fn cuDeviceGet(device: *mut c_int, ordinal: c_int) -> CUresult {
    if !valid_device(ordinal) {
        return INVALID_DEVICE;
    }
    put(device, ordinal)
}

#[no_mangle]
pub unsafe extern "C" fn cuDeviceGetAttribute(value: *mut c_int, attribute: c_uint, device: c_int) -> CUresult {
    if !valid_device(device) {
        return INVALID_DEVICE;
    }
    let v = match attribute {
        ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR => COMPUTE_CAPABILITY.0,
        ATTRIBUTE_COMPUTE_CAPABILITY_MINOR => COMPUTE_CAPABILITY.1,
        ATTRIBUTE_MEMORY_POOLS_SUPPORTED => 1,
        _ => 0,
    };
    put(value, v)
}

#[no_mangle]
pub unsafe extern "C" fn cuDeviceGetName(name: *mut c_char, len: c_int, device: c_int) -> CUresult {
    if !valid_device(device) {
        return INVALID_DEVICE;
    }
    if name.is_null() || len <= 0 {
        return INVALID_VALUE;
    }
    let text = format!("distlab emulated GPU {device}");
    let n = text.len().min(len as usize - 1);
    std::ptr::copy_nonoverlapping(text.as_ptr() as *const c_char, name, n);
    name.add(n).write(0);
    SUCCESS
}

#[no_mangle]
pub unsafe extern "C" fn cuDeviceTotalMem_v2(bytes: *mut usize, device: c_int) -> CUresult {
    if !valid_device(device) {
        return INVALID_DEVICE;
    }
    put(bytes, settings::memory_bytes())
}

#[no_mangle]
pub unsafe extern "C" fn cuDevicePrimaryCtxRetain(context: *mut *mut c_void, device: c_int) -> CUresult {
    if !valid_device(device) {
        return INVALID_DEVICE;
    }
    put(context, context_handle(device))
}

#[no_mangle]
pub extern "C" fn cuDevicePrimaryCtxRelease_v2(device: c_int) -> CUresult {
    if valid_device(device) {
        SUCCESS
    } else {
        INVALID_DEVICE
    }
}

#[no_mangle]
pub unsafe extern "C" fn cuCtxGetCurrent(context: *mut *mut c_void) -> CUresult {
    put(context, CURRENT.with(Cell::get))
}

#[no_mangle]
pub extern "C" fn cuCtxSetCurrent(context: *mut c_void) -> CUresult {
    if !context.is_null() && device_of(context).is_none() {
        return INVALID_CONTEXT;
    }
    CURRENT.with(|c| c.set(context));
    SUCCESS
}

#[no_mangle]
pub extern "C" fn cuCtxSynchronize() -> CUresult {
    SUCCESS
}

#[no_mangle]
pub unsafe extern "C" fn cuMemGetInfo_v2(free: *mut usize, total: *mut usize) -> CUresult {
    let total_bytes = settings::memory_bytes();
    let used = memory::used(current_device());
    put(free, total_bytes.saturating_sub(used));
    put(total, total_bytes)
}

#[no_mangle]
pub unsafe extern "C" fn cuMemAlloc_v2(ptr: *mut u64, bytes: usize) -> CUresult {
    if !context_bound() {
        return INVALID_CONTEXT;
    }
    match memory::alloc(bytes, current_device()) {
        Some(p) => put(ptr, p),
        None => OUT_OF_MEMORY,
    }
}

#[no_mangle]
pub unsafe extern "C" fn cuMemAllocAsync(ptr: *mut u64, bytes: usize, _stream: *mut c_void) -> CUresult {
    cuMemAlloc_v2(ptr, bytes)
}

#[no_mangle]
pub extern "C" fn cuMemFree_v2(ptr: u64) -> CUresult {
    if memory::free(ptr) {
        SUCCESS
    } else {
        INVALID_VALUE
    }
}

#[no_mangle]
pub extern "C" fn cuMemFreeAsync(ptr: u64, _stream: *mut c_void) -> CUresult {
    cuMemFree_v2(ptr)
}

#[no_mangle]
pub unsafe extern "C" fn cuMemsetD8_v2(ptr: u64, value: u8, n: usize) -> CUresult {
    if !context_bound() {
        return INVALID_CONTEXT;
    }
    if n > 0 {
        std::ptr::write_bytes(ptr as *mut u8, value, n);
    }
    SUCCESS
}

#[no_mangle]
pub unsafe extern "C" fn cuMemsetD8Async(ptr: u64, value: u8, n: usize, _stream: *mut c_void) -> CUresult {
    cuMemsetD8_v2(ptr, value, n)
}

/// Every copy, whichever way: device memory is host memory here.
unsafe fn copy_bytes(dst: *mut u8, src: *const u8, bytes: usize) -> CUresult {
    if !context_bound() {
        return INVALID_CONTEXT;
    }
    if bytes > 0 {
        std::ptr::copy(src, dst, bytes);
    }
    SUCCESS
}

#[no_mangle]
pub unsafe extern "C" fn cuMemcpyHtoD_v2(dst: u64, src: *const c_void, bytes: usize) -> CUresult {
    copy_bytes(dst as *mut u8, src as *const u8, bytes)
}

#[no_mangle]
pub unsafe extern "C" fn cuMemcpyHtoDAsync_v2(dst: u64, src: *const c_void, bytes: usize, _s: *mut c_void) -> CUresult {
    cuMemcpyHtoD_v2(dst, src, bytes)
}

#[no_mangle]
pub unsafe extern "C" fn cuMemcpyDtoH_v2(dst: *mut c_void, src: u64, bytes: usize) -> CUresult {
    copy_bytes(dst as *mut u8, src as *const u8, bytes)
}

#[no_mangle]
pub unsafe extern "C" fn cuMemcpyDtoHAsync_v2(dst: *mut c_void, src: u64, bytes: usize, _s: *mut c_void) -> CUresult {
    cuMemcpyDtoH_v2(dst, src, bytes)
}

#[no_mangle]
pub unsafe extern "C" fn cuMemcpyDtoD_v2(dst: u64, src: u64, bytes: usize) -> CUresult {
    copy_bytes(dst as *mut u8, src as *const u8, bytes)
}

#[no_mangle]
pub unsafe extern "C" fn cuMemcpyDtoDAsync_v2(dst: u64, src: u64, bytes: usize, _s: *mut c_void) -> CUresult {
    cuMemcpyDtoD_v2(dst, src, bytes)
}

/// A stream or an event: nothing to hold, a handle of its own.
fn new_handle() -> *mut c_void {
    Box::into_raw(Box::new(0u64)) as *mut c_void
}

unsafe fn drop_handle(handle: *mut c_void) -> CUresult {
    if handle.is_null() {
        return INVALID_HANDLE;
    }
    drop(Box::from_raw(handle as *mut u64));
    SUCCESS
}

#[no_mangle]
pub unsafe extern "C" fn cuStreamCreate(stream: *mut *mut c_void, _flags: c_uint) -> CUresult {
    put(stream, new_handle())
}

#[no_mangle]
pub unsafe extern "C" fn cuStreamDestroy_v2(stream: *mut c_void) -> CUresult {
    drop_handle(stream)
}

#[no_mangle]
pub extern "C" fn cuStreamSynchronize(_stream: *mut c_void) -> CUresult {
    SUCCESS
}

#[no_mangle]
pub extern "C" fn cuStreamWaitEvent(_stream: *mut c_void, _event: *mut c_void, _flags: c_uint) -> CUresult {
    SUCCESS
}

#[no_mangle]
pub unsafe extern "C" fn cuEventCreate(event: *mut *mut c_void, _flags: c_uint) -> CUresult {
    put(event, new_handle())
}

#[no_mangle]
pub extern "C" fn cuEventRecord(_event: *mut c_void, _stream: *mut c_void) -> CUresult {
    SUCCESS
}

#[no_mangle]
pub extern "C" fn cuEventSynchronize(_event: *mut c_void) -> CUresult {
    SUCCESS
}

#[no_mangle]
pub extern "C" fn cuEventQuery(_event: *mut c_void) -> CUresult {
    SUCCESS
}

#[no_mangle]
pub unsafe extern "C" fn cuEventDestroy_v2(event: *mut c_void) -> CUresult {
    drop_handle(event)
}

/// A loaded module: the shared object the stand-in NVRTC compiled.
struct Module {
    library: *mut c_void,
}

/// A kernel of a module: its entry point, whether it may wait at a barrier or shuffle, and
/// the module's launcher.
pub struct Function {
    name: CString,
    entry: *mut c_void,
    waits: bool,
    run: nvrtc::RunFn,
    where_: nvrtc::WhereFn,
}

#[no_mangle]
pub unsafe extern "C" fn cuModuleLoadData(module: *mut *mut c_void, image: *const c_void) -> CUresult {
    if image.is_null() {
        return INVALID_VALUE;
    }
    let text = CStr::from_ptr(image as *const c_char).to_string_lossy();
    let Some(library) = nvrtc::open_module(&text) else { return INVALID_IMAGE };
    put(module, Box::into_raw(Box::new(Module { library })) as *mut c_void)
}

#[no_mangle]
pub unsafe extern "C" fn cuModuleGetFunction(
    function: *mut *mut c_void,
    module: *mut c_void,
    name: *const c_char,
) -> CUresult {
    if module.is_null() || name.is_null() {
        return INVALID_VALUE;
    }
    let library = (*(module as *const Module)).library;
    let name = CStr::from_ptr(name).to_owned();
    let Some((entry, waits, run, where_)) = nvrtc::kernel(library, &name) else { return NOT_FOUND };
    put(function, Box::into_raw(Box::new(Function { name, entry, waits, run, where_ })) as *mut c_void)
}

#[no_mangle]
pub unsafe extern "C" fn cuModuleUnload(module: *mut c_void) -> CUresult {
    if module.is_null() {
        return INVALID_HANDLE;
    }
    // The shared object stays loaded: its kernels' functions may outlive the module handle.
    drop(Box::from_raw(module as *mut Module));
    SUCCESS
}

#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn cuLaunchKernel(
    function: *mut c_void,
    grid_x: c_uint,
    grid_y: c_uint,
    grid_z: c_uint,
    block_x: c_uint,
    block_y: c_uint,
    block_z: c_uint,
    _shared_bytes: c_uint,
    _stream: *mut c_void,
    params: *mut *mut c_void,
    _extra: *mut *mut c_void,
) -> CUresult {
    if !context_bound() {
        return INVALID_CONTEXT;
    }
    if function.is_null() {
        return INVALID_HANDLE;
    }
    let f = &*(function as *const Function);
    let (order, seed) = settings::thread_order();
    let mut error = [0 as c_char; 1024];
    let grid = [grid_x, grid_y, grid_z];
    let block = [block_x, block_y, block_z];
    let failed = fault::during_launch(f.where_, || {
        let waits = c_int::from(f.waits);
        (f.run)(
            f.name.as_ptr(),
            f.entry,
            params,
            grid.as_ptr(),
            block.as_ptr(),
            order,
            seed,
            waits,
            error.as_mut_ptr(),
            1024,
        )
    });
    if failed != 0 {
        let why = CStr::from_ptr(error.as_ptr()).to_string_lossy();
        eprintln!("distlab emulated GPU: the launch failed: {why}");
        return LAUNCH_FAILED;
    }
    SUCCESS
}

/// The driver's name and description of each error this stand-in returns.
fn describe(error: CUresult) -> (&'static CStr, &'static CStr) {
    match error {
        SUCCESS => (c"CUDA_SUCCESS", c"no error"),
        INVALID_VALUE => (c"CUDA_ERROR_INVALID_VALUE", c"invalid argument"),
        OUT_OF_MEMORY => (c"CUDA_ERROR_OUT_OF_MEMORY", c"out of memory"),
        INVALID_DEVICE => (c"CUDA_ERROR_INVALID_DEVICE", c"invalid device ordinal"),
        INVALID_IMAGE => (c"CUDA_ERROR_INVALID_IMAGE", c"device kernel image is invalid"),
        INVALID_CONTEXT => (c"CUDA_ERROR_INVALID_CONTEXT", c"invalid device context"),
        INVALID_HANDLE => (c"CUDA_ERROR_INVALID_HANDLE", c"invalid resource handle"),
        NOT_FOUND => (c"CUDA_ERROR_NOT_FOUND", c"named symbol not found"),
        LAUNCH_FAILED => (c"CUDA_ERROR_LAUNCH_FAILED", c"unspecified launch failure (the emulator printed why)"),
        _ => (c"CUDA_ERROR_UNKNOWN", c"unknown error"),
    }
}

#[no_mangle]
pub unsafe extern "C" fn cuGetErrorString(error: CUresult, text: *mut *const c_char) -> CUresult {
    put(text, describe(error).1.as_ptr())
}

#[no_mangle]
pub unsafe extern "C" fn cuGetErrorName(error: CUresult, text: *mut *const c_char) -> CUresult {
    put(text, describe(error).0.as_ptr())
}
