//! [`DeviceCollectives`]: collectives that run where a backend's buffers live (NCCL on a
//! GPU's memory), so that the bytes need no trip through the host.

use super::Buffers;
use crate::comm::{CommError, Communicator, InPlace};

/// Collectives on a backend's own memory. The defaults are the CPU backend's: its buffers
/// are host memory, which every communicator reaches without the backend's help.
pub trait DeviceCollectives: Buffers {
    /// Whether `comm` moves this backend's memory itself (NCCL between GPUs), so that a
    /// collective on a buffer needs no trip through the host. The CPU backend's buffers are
    /// host memory: every communicator works on them directly.
    fn reaches(&self, _comm: &mut dyn Communicator) -> bool {
        false
    }
    /// Runs `op` through `comm` on `view` where it lives, summing in f32 whatever `Elem`
    /// is; its result is there for every kernel queued afterwards. Only for a `comm` this
    /// backend [`reaches`](DeviceCollectives::reaches).
    fn device_collective(
        &self,
        _comm: &mut dyn Communicator,
        _view: Self::ViewMut<'_>,
        op: InPlace,
    ) -> Result<(), CommError> {
        Err(CommError::BadBuffer {
            collective: format!("{op:?}"),
            detail: format!("the {} backend's buffers are host memory: no collective runs on a device", self.name()),
        })
    }
}
