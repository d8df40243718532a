//! Memory accounting: every buffer the engine allocates for a run is registered here, with
//! its category, when it is allocated, and deregistered when it is freed (a `Receipt`
//! dropped with the buffer). Per rank this gives the bytes held now, each category's peak,
//! and a timeline sampled at op boundaries of the first steps, where FSDP's gather/free
//! sawtooth shows. Beside the bookings, each report and sample carries what the process
//! measured of itself (`heap.rs`), so a buffer the ledger misses shows as "untracked".

use std::cell::RefCell;
use std::sync::{Arc, Mutex};

use distlab_common::memory::{MemorySample, ProcessMemory, RankMemoryReport, StartUpMemory};
use distlab_common::planner::RankMemory;

use crate::trace::now_us;

/// What a buffer holds (the planner's categories).
pub use distlab_common::memory::MemoryCategory as Category;

#[derive(Default)]
struct Ledger {
    current: RankMemory,
    peak: RankMemory,
    /// Step being sampled into the timeline, if any.
    sampling: Option<u64>,
    timeline: Vec<MemorySample>,
    /// The heap's and the ledger's peaks when the model and its state were built.
    start_up: Option<StartUpMemory>,
    /// Booked bytes that live in shared memory (mapped by several ranks), not on the heap.
    shared: u64,
    shared_peak: u64,
    /// The most the ledger had booked on the heap at once (total less shared memory).
    heap_peak: u64,
    /// Shared-memory pipes to the other ranks this process maps (not booked).
    pipe_bytes: u64,
}

/// One rank's ledger of live buffers. Shared (Arc) by everything that allocates.
#[derive(Default)]
pub struct MemoryTracker {
    ledger: Mutex<Ledger>,
}

/// Proof that `bytes` of `category` are held; dropping it records their release.
#[must_use = "the bytes are released when the receipt drops"]
pub struct Receipt {
    tracker: Arc<MemoryTracker>,
    category: Category,
    bytes: u64,
    /// In shared memory rather than on the heap.
    shared: bool,
}

impl std::fmt::Debug for Receipt {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} bytes of {}", self.bytes, self.category.name())
    }
}

impl Drop for Receipt {
    fn drop(&mut self) {
        self.tracker.change(self.category, self.bytes, false, self.shared);
    }
}

impl MemoryTracker {
    pub fn new() -> Arc<Self> {
        Arc::new(Self::default())
    }

    /// Records that a buffer of `floats` f32s of `category` now exists.
    pub fn alloc(self: &Arc<Self>, category: Category, floats: usize) -> Receipt {
        self.alloc_of::<f32>(category, floats)
    }

    /// `len` elements of `T` (2 bytes each for bf16/fp16).
    pub fn alloc_of<T>(self: &Arc<Self>, category: Category, len: usize) -> Receipt {
        self.book::<T>(category, len, false)
    }

    /// `floats` f32s in shared memory (`Communicator::alloc_shared`): booked like any other
    /// buffer, but not on the heap, so the heap measurement is set against the rest.
    pub fn alloc_shared(self: &Arc<Self>, category: Category, floats: usize) -> Receipt {
        self.book::<f32>(category, floats, true)
    }

    fn book<T>(self: &Arc<Self>, category: Category, len: usize, shared: bool) -> Receipt {
        let bytes = (len * std::mem::size_of::<T>()) as u64;
        self.change(category, bytes, true, shared);
        Receipt { tracker: self.clone(), category, bytes, shared }
    }

    fn change(&self, category: Category, bytes: u64, grow: bool, shared: bool) {
        let mut ledger = self.ledger.lock().unwrap_or_else(|e| e.into_inner());
        let now = category.field(&mut ledger.current);
        *now = if grow { *now + bytes } else { now.saturating_sub(bytes) };
        let value = *now;
        let total = Category::ALL.iter().map(|c| c.of(&ledger.current)).sum();
        ledger.current.total = total;
        let peak = category.field(&mut ledger.peak);
        *peak = (*peak).max(value);
        ledger.peak.total = ledger.peak.total.max(total);
        if shared {
            ledger.shared = if grow { ledger.shared + bytes } else { ledger.shared.saturating_sub(bytes) };
            ledger.shared_peak = ledger.shared_peak.max(ledger.shared);
        }
        ledger.heap_peak = ledger.heap_peak.max(total.saturating_sub(ledger.shared));
    }

    /// Samples of the timeline are taken during step `step` (None: stop sampling).
    pub fn sample_step(&self, step: Option<u64>) {
        self.ledger.lock().unwrap_or_else(|e| e.into_inner()).sampling = step;
    }

    /// Adds a timeline point after `event` (named lazily: most calls are not sampled).
    pub fn sample(&self, event: impl FnOnce() -> String) {
        let mut ledger = self.ledger.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(step) = ledger.sampling {
            let bytes = ledger.current.clone();
            let (heap, shared) = (crate::heap::heap_now(), ledger.shared);
            ledger.timeline.push(MemorySample { t_us: now_us(), step, event: event(), bytes, heap, shared });
        }
    }

    /// The model and its state are built, training starts: what the process and the
    /// ledger peaked at so far is the start-up peak (the initialisation's copies live here).
    pub fn mark_start_up(&self) {
        let mut ledger = self.ledger.lock().unwrap_or_else(|e| e.into_inner());
        let ledger_peak = ledger.heap_peak;
        ledger.start_up = crate::heap::measure().heap_peak.map(|heap_peak| StartUpMemory { heap_peak, ledger_peak });
    }

    /// The shared-memory pipes to the other rank processes: mapped, mostly never touched, so
    /// reported beside the ledger rather than booked in it.
    pub fn set_pipe_bytes(&self, bytes: u64) {
        self.ledger.lock().unwrap_or_else(|e| e.into_inner()).pipe_bytes = bytes;
    }

    /// Bytes held now, by category.
    pub fn current(&self) -> RankMemory {
        self.ledger.lock().unwrap_or_else(|e| e.into_inner()).current.clone()
    }

    pub fn report(&self, rank: usize) -> RankMemoryReport {
        let ledger = self.ledger.lock().unwrap_or_else(|e| e.into_inner());
        RankMemoryReport {
            rank: rank as u32,
            peak: ledger.peak.clone(),
            current: ledger.current.clone(),
            timeline: ledger.timeline.clone(),
            shared_peak: ledger.shared_peak,
            pipe_bytes: ledger.pipe_bytes,
            booked_heap_peak: Some(ledger.heap_peak),
            process: Some(ProcessMemory { start_up: ledger.start_up.clone(), ..crate::heap::measure() }),
        }
    }
}

thread_local! {
    /// The ledger of the kernel this thread is running (see `with_kernel_ledger`).
    static KERNEL_LEDGER: RefCell<Option<Arc<MemoryTracker>>> = const { RefCell::new(None) };
}

/// Runs `kernel` with `ledger` as the place its per-call scratch is booked: a kernel has
/// no handle on the trainer's ledger, so the backend that calls it (on this thread) lends
/// it for the call. Without a ledger (kernels driven alone, in tests) nothing is booked.
pub fn with_kernel_ledger<R>(ledger: Option<&Arc<MemoryTracker>>, kernel: impl FnOnce() -> R) -> R {
    let Some(ledger) = ledger else { return kernel() };
    let outer = KERNEL_LEDGER.with(|l| l.replace(Some(ledger.clone())));
    // Put back on the way out, even when the kernel panics.
    struct Restore(Option<Option<Arc<MemoryTracker>>>);
    impl Drop for Restore {
        fn drop(&mut self) {
            let outer = self.0.take().flatten();
            KERNEL_LEDGER.with(|l| *l.borrow_mut() = outer);
        }
    }
    let _restore = Restore(Some(outer));
    kernel()
}

/// Books `len` elements of `T` of kernel scratch (f32 copies of 2-byte operands) as
/// transient in the ledger of the kernel running on this thread, if any.
pub fn kernel_scratch<T>(len: usize) -> Option<Receipt> {
    KERNEL_LEDGER.with(|l| l.borrow().as_ref().map(|ledger| ledger.alloc_of::<T>(Category::Transient, len)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn receipts_count_up_and_down_and_peaks_stay() {
        let tracker = MemoryTracker::new();
        let params = tracker.alloc(Category::Parameters, 100);
        tracker.sample_step(Some(0));
        {
            let _gathered = tracker.alloc(Category::GatheredParameters, 50);
            tracker.sample(|| "gather".into());
            assert_eq!(tracker.current().total, 600);
        }
        tracker.sample(|| "free".into());
        let report = tracker.report(3);
        assert_eq!(report.current.total, 400);
        assert_eq!(report.current.gathered_parameters, 0);
        assert_eq!(report.peak.gathered_parameters, 200);
        assert_eq!(report.peak.total, 600);
        assert_eq!(report.timeline.iter().map(|s| s.bytes.total).collect::<Vec<_>>(), vec![600, 400]);
        drop(params);
        assert_eq!(tracker.current().total, 0);
    }

    /// A bf16 matrix product works on f32 copies of both operands and the output, booked
    /// as transient for the call; an f32 product runs in place and books nothing.
    #[test]
    fn a_two_byte_product_books_its_f32_copies_for_the_call() {
        use crate::backend::{Buffers, CpuBackend};
        use crate::ops::linear::LinearKernels;
        let (rows, c_in, c_out) = (8, 4, 6);
        let bf16 = MemoryTracker::new();
        let be = CpuBackend::<half::bf16>::new(1).booking_scratch_in(&bf16);
        let (mut out, inp, w) = (be.alloc(rows * c_out), be.alloc(rows * c_in), be.alloc(c_in * c_out));
        be.matmul_forward(&mut out, &inp, &w, None, None, c_in, c_out);
        let mut dinp = be.alloc(rows * c_in);
        let mut dw = be.alloc(c_in * c_out);
        be.matmul_backward(Some(&mut dinp), &mut dw, None, &out, &inp, &w, c_in, c_out);
        let report = bf16.report(0);
        assert_eq!(report.peak.transient, 4 * (rows * c_in + c_in * c_out + rows * c_out) as u64);
        assert_eq!(report.current.transient, 0, "released after the call");

        let f32 = MemoryTracker::new();
        let be = CpuBackend::<f32>::new(1).booking_scratch_in(&f32);
        let (mut out, inp, w) = (be.alloc(rows * c_out), be.alloc(rows * c_in), be.alloc(c_in * c_out));
        be.matmul_forward(&mut out, &inp, &w, None, None, c_in, c_out);
        assert_eq!(f32.report(0).peak.transient, 0);
        // Outside a backend's call nothing is booked anywhere.
        assert!(kernel_scratch::<f32>(10).is_none());
    }
}
