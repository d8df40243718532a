//! A kernel's invalid access (out of bounds into a guard page, a bad pointer) is a fault
//! on the CPU. While a launch runs, a handler for SIGSEGV and SIGBUS says where: the
//! kernel, block and thread, the address, and the allocation it is next to; then the
//! previous handler takes the fault (the process ends, as a GPU's context would be lost).

use std::cell::Cell;
use std::ffi::{c_char, c_int, c_void};
use std::sync::Once;

use crate::memory;
use crate::nvrtc::WhereFn;

thread_local! {
    static LAUNCH: Cell<Option<WhereFn>> = const { Cell::new(None) };
}

static mut PREVIOUS_SEGV: std::mem::MaybeUninit<libc::sigaction> = std::mem::MaybeUninit::zeroed();
static mut PREVIOUS_BUS: std::mem::MaybeUninit<libc::sigaction> = std::mem::MaybeUninit::zeroed();

extern "C" fn on_fault(signal: c_int, info: *mut libc::siginfo_t, _context: *mut c_void) {
    if let Some(where_) = LAUNCH.with(Cell::get) {
        let mut at = [0 as c_char; 512];
        // SAFETY: the module's locator writes a NUL-terminated string into the buffer.
        let place = unsafe {
            where_(at.as_mut_ptr(), at.len());
            std::ffi::CStr::from_ptr(at.as_ptr()).to_string_lossy().into_owned()
        };
        // SAFETY: the kernel's faulting address, as the kernel reports it.
        let address = unsafe { (*info).si_addr() } as u64;
        let next_to = match memory::near(address) {
            Some((start, bytes)) if address >= start + bytes as u64 => {
                format!(", {} bytes past the end of an allocation of {bytes} bytes", address - (start + bytes as u64))
            }
            Some((start, bytes)) if address < start => {
                format!(", {} bytes before an allocation of {bytes} bytes", start - address)
            }
            _ => String::new(),
        };
        let message = format!("distlab emulated GPU: invalid memory access at {address:#x}{next_to}, in {place}\n");
        // SAFETY: writing a buffer to standard error.
        unsafe { libc::write(2, message.as_ptr() as *const c_void, message.len()) };
    }
    // The fault happens again under the handler there was before, which ends the process.
    // SAFETY: restoring the sigaction saved when this one was installed.
    unsafe {
        let previous = if signal == libc::SIGBUS { &raw const PREVIOUS_BUS } else { &raw const PREVIOUS_SEGV };
        libc::sigaction(signal, previous.cast(), std::ptr::null_mut());
    }
}

fn install() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        // SAFETY: a handler with SA_SIGINFO's signature; the previous ones are saved first.
        unsafe {
            let mut action: libc::sigaction = std::mem::zeroed();
            action.sa_sigaction = on_fault as *const () as usize;
            action.sa_flags = libc::SA_SIGINFO | libc::SA_ONSTACK;
            libc::sigemptyset(&mut action.sa_mask);
            libc::sigaction(libc::SIGSEGV, &action, (&raw mut PREVIOUS_SEGV).cast());
            libc::sigaction(libc::SIGBUS, &action, (&raw mut PREVIOUS_BUS).cast());
        }
    });
    // The handler runs on an alternate stack (a fiber's stack may be what overflowed).
    // SAFETY: querying, and if there is none setting, this thread's alternate stack.
    unsafe {
        let mut current: libc::stack_t = std::mem::zeroed();
        libc::sigaltstack(std::ptr::null(), &mut current);
        if current.ss_flags & libc::SS_DISABLE != 0 {
            let size = 256 * 1024;
            let stack = Box::leak(vec![0u8; size].into_boxed_slice());
            let new = libc::stack_t { ss_sp: stack.as_mut_ptr() as *mut c_void, ss_flags: 0, ss_size: size };
            libc::sigaltstack(&new, std::ptr::null_mut());
        }
    }
}

/// Runs `launch` with faults reported as the module's `where_` locates them.
pub fn during_launch(where_: WhereFn, launch: impl FnOnce() -> c_int) -> c_int {
    install();
    LAUNCH.with(|l| l.set(Some(where_)));
    let result = launch();
    LAUNCH.with(|l| l.set(None));
    result
}
