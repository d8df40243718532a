//! The CUDA backend's collectives on its own memory: NCCL on this GPU's buffers, with an
//! f32 copy widened and narrowed on the GPU for 2-byte formats.

use super::CudaBackend;
use crate::backend::DeviceCollectives;
use crate::comm::{CommError, Communicator, InPlace};
use crate::ops::cuda::{elementwise, launch, DeviceElem, DeviceViewMut};

impl<S: DeviceElem> DeviceCollectives for CudaBackend<S> {
    /// NCCL on this backend's GPU moves its buffers itself.
    fn reaches(&self, comm: &mut dyn Communicator) -> bool {
        comm.nccl().is_some_and(|nccl| nccl.ordinal() == self.launcher.stream.context().ordinal())
    }

    /// The collective through NCCL on the buffer itself (fp32), or on an f32 copy widened
    /// and narrowed on the GPU (bf16/fp16): no byte passes through the host.
    fn device_collective(
        &self,
        comm: &mut dyn Communicator,
        view: DeviceViewMut<'_, S>,
        op: InPlace,
    ) -> Result<(), CommError> {
        let ordinal = self.launcher.stream.context().ordinal();
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
            return unsafe { nccl.in_place(&self.launcher.stream, view.ptr, view.len, op) };
        }
        let wide = self.launcher.scratch::<f32>(view.len);
        let wide_ptr = self.launcher.ptr_of(&wide);
        launch!(self.launcher, "widen", elementwise(view.len), wide_ptr, view.ptr, view.len as i64);
        // SAFETY: `wide` holds `len` f32 on this GPU and lives until the stream has used it
        // (cudarc frees it in stream order).
        unsafe { nccl.in_place(&self.launcher.stream, wide_ptr, view.len, op) }?;
        launch!(self.launcher, "narrow", elementwise(view.len), view.ptr, wide_ptr, view.len as i64);
        Ok(())
    }
}
