//! The CUDA backend's buffers: `CudaSlice`s in GPU memory, views as device pointers with a
//! length, copies through the stream, and host access staged through host memory.

use std::ops::Range;

use cudarc::driver::CudaSlice;

use super::CudaBackend;
use crate::backend::Buffers;
use crate::ops::cuda::{elementwise, launch, DeviceElem, DeviceView, DeviceViewMut};

impl<S: DeviceElem> Buffers for CudaBackend<S> {
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

    fn synchronize(&self) {
        self.launcher.stream.synchronize().expect("CUDA stream synchronize");
    }

    fn device_memory_used(&self) -> Option<u64> {
        let free = self.free_memory().ok()?;
        Some(self.free_at_start.saturating_sub(free) as u64)
    }

    fn buffers_on_host(&self) -> bool {
        false
    }

    fn alloc(&self, len: usize) -> CudaSlice<S> {
        let buf = if len == 0 { self.launcher.stream.null() } else { self.launcher.stream.alloc_zeros::<S>(len) };
        buf.unwrap_or_else(|e| panic!("CUDA: allocating {len} elements: {e}"))
    }

    fn buf_len(&self, buf: &CudaSlice<S>) -> usize {
        buf.len()
    }

    fn upload(&self, dst: &mut CudaSlice<S>, src: &[S]) {
        if src.is_empty() {
            return;
        }
        self.launcher.stream.memcpy_htod(src, &mut dst.slice_mut(0..src.len())).expect("CUDA upload");
    }

    fn download(&self, src: &CudaSlice<S>, dst: &mut [S]) {
        if dst.is_empty() {
            return;
        }
        self.launcher.stream.memcpy_dtoh(&src.slice(0..dst.len()), dst).expect("CUDA download");
        self.launcher.stream.synchronize().expect("CUDA stream synchronize");
    }

    fn view<'a>(&self, buf: &'a CudaSlice<S>, range: Range<usize>) -> DeviceView<'a, S> {
        assert!(range.start <= range.end && range.end <= buf.len(), "view {range:?} of a buffer of {}", buf.len());
        let ptr = self.launcher.ptr_of(buf) + (range.start * size_of::<S>()) as u64;
        DeviceView::new(ptr, range.len())
    }

    fn view_mut<'a>(&self, buf: &'a mut CudaSlice<S>, range: Range<usize>) -> DeviceViewMut<'a, S> {
        assert!(range.start <= range.end && range.end <= buf.len(), "view {range:?} of a buffer of {}", buf.len());
        let ptr = self.launcher.ptr_of(buf) + (range.start * size_of::<S>()) as u64;
        DeviceViewMut::new(ptr, range.len())
    }

    fn subview<'a>(&self, view: Self::View<'a>, range: Range<usize>) -> Self::View<'a> {
        assert!(range.start <= range.end && range.end <= view.len, "subview {range:?} of a view of {}", view.len);
        let ptr = view.ptr + (range.start * size_of::<S>()) as u64;
        DeviceView::new(ptr, range.len())
    }

    fn split_mut<'a>(&self, view: Self::ViewMut<'a>, mid: usize) -> (Self::ViewMut<'a>, Self::ViewMut<'a>) {
        assert!(mid <= view.len, "split at {mid} of a view of {}", view.len);
        let tail = view.ptr + (mid * size_of::<S>()) as u64;
        (DeviceViewMut::new(view.ptr, mid), DeviceViewMut::new(tail, view.len - mid))
    }

    fn reborrow<'b>(&self, view: &'b mut DeviceViewMut<'_, S>) -> DeviceViewMut<'b, S> {
        DeviceViewMut::new(view.ptr, view.len)
    }

    fn freeze<'a>(&self, view: Self::ViewMut<'a>) -> Self::View<'a> {
        DeviceView::new(view.ptr, view.len)
    }

    fn fill(&self, out: DeviceViewMut<'_, S>, value: f64) {
        if out.len > 0 {
            launch!(self.launcher, "fill", elementwise(out.len), out.ptr, out.len as i64, value as f32);
        }
    }

    fn copy(&self, dst: DeviceViewMut<'_, S>, src: DeviceView<'_, S>) {
        self.launcher.copy(dst, src);
    }

    fn add(&self, dst: DeviceViewMut<'_, S>, src: DeviceView<'_, S>) {
        assert_eq!(dst.len, src.len, "add between views of different lengths");
        if dst.len > 0 {
            launch!(self.launcher, "add", elementwise(dst.len), dst.ptr, src.ptr, dst.len as i64);
        }
    }

    fn on_host<R>(&self, view: DeviceViewMut<'_, S>, f: impl FnOnce(&mut [S]) -> R) -> R {
        if view.len == 0 {
            return f(&mut []);
        }
        let mut host = vec![S::default(); view.len];
        self.launcher.bind();
        // SAFETY: `view` is a live range of `len` elements of a device buffer, and `host`
        // is as long; the stream is synchronised before `host` is read or dropped.
        unsafe {
            cudarc::driver::result::memcpy_dtoh_async(&mut host, view.ptr, self.launcher.stream.cu_stream())
                .expect("CUDA download");
        }
        self.launcher.stream.synchronize().expect("CUDA stream synchronize");
        let result = f(&mut host);
        // SAFETY: as above; synchronised before `host` is dropped.
        unsafe {
            cudarc::driver::result::memcpy_htod_async(view.ptr, &host, self.launcher.stream.cu_stream())
                .expect("CUDA upload");
        }
        self.launcher.stream.synchronize().expect("CUDA stream synchronize");
        result
    }

    fn read_host<R>(&self, view: DeviceView<'_, S>, f: impl FnOnce(&[S]) -> R) -> R {
        if view.len == 0 {
            return f(&[]);
        }
        let mut host = vec![S::default(); view.len];
        self.launcher.bind();
        // SAFETY: `view` is a live range of `len` elements of a device buffer, and `host`
        // is as long; the stream is synchronised before `host` is read.
        unsafe {
            cudarc::driver::result::memcpy_dtoh_async(&mut host, view.ptr, self.launcher.stream.cu_stream())
                .expect("CUDA download");
        }
        self.launcher.stream.synchronize().expect("CUDA stream synchronize");
        f(&host)
    }
}
