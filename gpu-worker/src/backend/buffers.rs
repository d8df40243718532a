//! [`Buffers`]: where a backend's buffers live and how they are made, viewed, filled,
//! copied and read from the host; the family every other backend trait builds on.

use std::ops::Range;

use crate::ops::float::Stored;

/// A backend's memory: its number format, its buffers and their views, and what moves
/// data in and out of them.
pub trait Buffers: Send + Sync + 'static {
    /// Number format of every buffer: f32 for training, bf16 or fp16 for mixed precision
    /// (kernels compute in f32 and round on the store), f64 on the CPU for checks.
    type Elem: Stored;
    /// An owned buffer of `Elem`s on the device.
    type Buf: Send + Sync;
    /// A read-only range of a buffer.
    type View<'a>: Copy + Send + Sync;
    /// A writable range of a buffer.
    type ViewMut<'a>: Send;

    /// Short name for logs ("cpu").
    fn name(&self) -> &'static str;
    /// Waits until every kernel queued so far has finished, so that a clock read after it
    /// times them (a GPU queues kernels and returns at once; the CPU runs them in the call).
    fn synchronize(&self) {}
    /// Device memory this backend's run uses now, measured by the driver (free when the
    /// backend was made minus free now), for a backend whose buffers are not on the host
    /// heap; None for the CPU backend, whose buffers the heap measurement counts.
    fn device_memory_used(&self) -> Option<u64> {
        None
    }
    /// Whether the buffers are host memory (the CPU backend), so that what the host holds
    /// for the run is device memory too (an offloaded optimizer's piece).
    fn buffers_on_host(&self) -> bool {
        true
    }
    /// Threads the kernels use.
    fn threads(&self) -> usize;

    // ---- memory -------------------------------------------------------------

    /// A zero-filled buffer of `len` elements.
    fn alloc(&self, len: usize) -> Self::Buf;
    fn buf_len(&self, buf: &Self::Buf) -> usize;
    /// Copies host data into the start of `dst`.
    fn upload(&self, dst: &mut Self::Buf, src: &[Self::Elem]);
    /// Copies the start of `src` to the host.
    fn download(&self, src: &Self::Buf, dst: &mut [Self::Elem]);
    /// The buffer's elements in host memory, the buffer given up (activation offload):
    /// copied down and freed; the CPU backend's buffer is host memory already, moved.
    fn move_to_host(&self, buf: Self::Buf) -> Vec<Self::Elem> {
        let mut host = vec![Self::Elem::default(); self.buf_len(&buf)];
        self.download(&buf, &mut host);
        host
    }
    /// A buffer holding `host`'s elements: a new one filled from the host; on the CPU
    /// backend `host` itself.
    fn move_from_host(&self, host: Vec<Self::Elem>) -> Self::Buf {
        let mut buf = self.alloc(host.len());
        self.upload(&mut buf, &host);
        buf
    }
    fn view<'a>(&self, buf: &'a Self::Buf, range: Range<usize>) -> Self::View<'a>;
    fn view_mut<'a>(&self, buf: &'a mut Self::Buf, range: Range<usize>) -> Self::ViewMut<'a>;
    /// Part `range` of a read-only view (one expert's weights inside a tensor of them).
    fn subview<'a>(&self, view: Self::View<'a>, range: Range<usize>) -> Self::View<'a>;
    /// Splits a writable view at `mid` (so that several parameter gradients can be
    /// written at once).
    fn split_mut<'a>(&self, view: Self::ViewMut<'a>, mid: usize) -> (Self::ViewMut<'a>, Self::ViewMut<'a>);
    /// A shorter-lived copy of a writable view, so the view can be handed to a kernel
    /// and still be used afterwards.
    fn reborrow<'b>(&self, view: &'b mut Self::ViewMut<'_>) -> Self::ViewMut<'b>;
    /// Gives up writing: the same range read-only, for as long as the view lived
    /// (how backward hands finished gradients to data parallelism while it goes on).
    fn freeze<'a>(&self, view: Self::ViewMut<'a>) -> Self::View<'a>;
    /// The whole buffer, read-only.
    fn all<'a>(&self, buf: &'a Self::Buf) -> Self::View<'a> {
        self.view(buf, 0..self.buf_len(buf))
    }
    /// The whole buffer, writable.
    fn all_mut<'a>(&self, buf: &'a mut Self::Buf) -> Self::ViewMut<'a> {
        let len = self.buf_len(buf);
        self.view_mut(buf, 0..len)
    }
    fn fill(&self, out: Self::ViewMut<'_>, value: f64);
    /// `dst = src` (the same length).
    fn copy(&self, dst: Self::ViewMut<'_>, src: Self::View<'_>);
    /// `dst += src` (the same length), in f32, rounded once.
    fn add(&self, dst: Self::ViewMut<'_>, src: Self::View<'_>);

    // ---- host access (collectives over host channels, the optimizer, checkpoints) ----

    /// Runs `f` on the elements of `view` in host memory, and keeps what it writes: the
    /// CPU backend's buffers are host memory already; a GPU backend stages the range
    /// through the host (copied down, then back up).
    fn on_host<R>(&self, view: Self::ViewMut<'_>, f: impl FnOnce(&mut [Self::Elem]) -> R) -> R;
    /// Runs `f` on the elements of `view` read in host memory.
    fn read_host<R>(&self, view: Self::View<'_>, f: impl FnOnce(&[Self::Elem]) -> R) -> R;
}
