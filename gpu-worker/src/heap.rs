//! What the process really holds, measured beside the memory ledger: a counting global
//! allocator (heap bytes now and at their peak) and the kernel's peak resident set. The
//! ledger books the engine's buffers by category where they are allocated; this counts
//! every allocation, so the memory page can show how much of the process the ledger
//! explains ("untracked" = measured minus booked).
//!
//! The `distlab-worker` binary installs [`CountingAllocator`] as its global allocator; a
//! program that does not (a library test, a benchmark) reports no heap figures.

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};

use distlab_common::memory::ProcessMemory;

/// The system allocator, counting the bytes it hands out and takes back.
pub struct CountingAllocator;

static CURRENT: AtomicU64 = AtomicU64::new(0);
static PEAK: AtomicU64 = AtomicU64::new(0);
static INSTALLED: AtomicBool = AtomicBool::new(false);

fn grew(bytes: usize) {
    let now = CURRENT.fetch_add(bytes as u64, Relaxed) + bytes as u64;
    PEAK.fetch_max(now, Relaxed);
}

fn shrank(bytes: usize) {
    CURRENT.fetch_sub(bytes as u64, Relaxed);
}

/// Counts a fresh allocation of `bytes` at `ptr` (none when it failed) and hands it on.
fn counted(ptr: *mut u8, bytes: usize) -> *mut u8 {
    if !ptr.is_null() {
        INSTALLED.store(true, Relaxed);
        grew(bytes);
    }
    ptr
}

// SAFETY: every call is forwarded to `System` unchanged; the counters only observe sizes.
unsafe impl GlobalAlloc for CountingAllocator {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        counted(unsafe { System.alloc(layout) }, layout.size())
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        counted(unsafe { System.alloc_zeroed(layout) }, layout.size())
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        unsafe { System.dealloc(ptr, layout) };
        shrank(layout.size());
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        let new = unsafe { System.realloc(ptr, layout, new_size) };
        if !new.is_null() {
            shrank(layout.size());
            grew(new_size);
        }
        new
    }
}

/// Heap bytes live now, when this process counts them.
pub fn heap_now() -> Option<u64> {
    INSTALLED.load(Relaxed).then(|| CURRENT.load(Relaxed))
}

/// The process's measurements so far: heap now and at its peak (counting allocator), and
/// the peak resident set (`VmHWM`: heap, stacks, shared-memory pipes, code) from the kernel.
pub fn measure() -> ProcessMemory {
    ProcessMemory {
        heap_current: heap_now(),
        heap_peak: INSTALLED.load(Relaxed).then(|| PEAK.load(Relaxed)),
        peak_resident: peak_resident_bytes(),
        device_used: None,
        start_up: None,
    }
}

/// `VmHWM` of /proc/self/status in bytes (None where there is no procfs).
fn peak_resident_bytes() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_counters_follow_allocations_and_keep_the_peak() {
        // The test harness does not install the allocator: drive the counters directly.
        let before = CURRENT.load(Relaxed);
        grew(1 << 20);
        assert!(PEAK.load(Relaxed) >= before + (1 << 20));
        shrank(1 << 20);
        assert_eq!(CURRENT.load(Relaxed), before);
    }

    #[test]
    fn the_kernel_reports_a_peak_resident_set() {
        let rss = peak_resident_bytes().expect("/proc/self/status has VmHWM");
        assert!(rss > 1 << 20, "a test process holds more than 1 MiB: {rss}");
    }
}
