//! Device memory: host memory with a page that faults on each side of every allocation, its
//! end as close to the page after it as 16-byte alignment allows, so a kernel that reads or
//! writes past either end of a buffer faults at once (`fault.rs` names the kernel, block
//! and thread). A zero-byte allocation is a pointer at the page after it: any access faults.
//! Device pointers are these host addresses, so cuBLAS and the copies use them directly.

use std::collections::HashMap;
use std::sync::Mutex;

const PAGE: usize = 4096;
/// Alignment of every allocation (a kernel's wide loads may rely on it).
const ALIGN: usize = 16;

struct Region {
    mapping: usize,
    mapped: usize,
    bytes: usize,
    device: i32,
}

/// Every live allocation by its pointer, and the bytes allocated on each device.
#[derive(Default)]
struct Allocations {
    regions: HashMap<u64, Region>,
    used: [usize; 8],
}

static ALLOCATIONS: Mutex<Option<Allocations>> = Mutex::new(None);

fn with<R>(f: impl FnOnce(&mut Allocations) -> R) -> R {
    f(ALLOCATIONS.lock().unwrap_or_else(|e| e.into_inner()).get_or_insert_with(Allocations::default))
}

/// `bytes` of zeroed device memory of `device`, or None when the device has not that much
/// free (or the host none to map).
pub fn alloc(bytes: usize, device: i32) -> Option<u64> {
    if used(device).saturating_add(bytes) > crate::settings::memory_bytes() {
        return None;
    }
    let data_pages = bytes.div_ceil(PAGE).max(1);
    let mapped = (data_pages + 2) * PAGE;
    // SAFETY: a fresh private anonymous mapping; the guard pages are inside it.
    let mapping = unsafe {
        let p = libc::mmap(
            std::ptr::null_mut(),
            mapped,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
            -1,
            0,
        );
        if p == libc::MAP_FAILED {
            return None;
        }
        libc::mprotect(p, PAGE, libc::PROT_NONE);
        libc::mprotect((p as *mut u8).add(PAGE + data_pages * PAGE) as *mut libc::c_void, PAGE, libc::PROT_NONE);
        p as usize
    };
    let end = mapping + PAGE + data_pages * PAGE;
    let ptr = (end - bytes) / ALIGN * ALIGN;
    with(|a| {
        a.used[device as usize] += bytes;
        a.regions.insert(ptr as u64, Region { mapping, mapped, bytes, device });
    });
    Some(ptr as u64)
}

/// Frees an allocation; false when `ptr` is not one.
pub fn free(ptr: u64) -> bool {
    let Some(region) = with(|a| {
        let region = a.regions.remove(&ptr)?;
        a.used[region.device as usize] -= region.bytes;
        Some(region)
    }) else {
        return false;
    };
    // SAFETY: the mapping `alloc` made for this pointer, unmapped once.
    unsafe { libc::munmap(region.mapping as *mut libc::c_void, region.mapped) };
    true
}

/// Bytes allocated on `device` now.
pub fn used(device: i32) -> usize {
    with(|a| a.used[device as usize])
}

/// The device whose allocation holds all of `ptr..ptr + bytes`, if one does.
pub fn owner(ptr: u64, bytes: usize) -> Option<i32> {
    with(|a| {
        a.regions
            .iter()
            .find_map(|(&start, r)| (ptr >= start && ptr + bytes as u64 <= start + r.bytes as u64).then_some(r.device))
    })
}

/// The allocation `address` falls in or next to (within a page), as (start, bytes): what a
/// fault report says of the address.
pub fn near(address: u64) -> Option<(u64, usize)> {
    let guard = ALLOCATIONS.try_lock().ok()?;
    guard.as_ref()?.regions.iter().find_map(|(&start, r)| {
        let lo = (r.mapping + PAGE) as u64;
        let hi = (r.mapping + r.mapped) as u64;
        (address + PAGE as u64 >= lo && address < hi).then_some((start, r.bytes))
    })
}
