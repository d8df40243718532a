//! A group of one rank: every collective leaves the buffer as it is (a strategy written for
//! a data-parallel group runs unchanged on one rank).

use super::{CommError, Communicator, ReduceOp, SharedBuffer};

pub struct Alone;

impl Communicator for Alone {
    fn rank(&self) -> usize {
        0
    }
    fn size(&self) -> usize {
        1
    }
    fn all_reduce(&mut self, _buf: &mut [f32], _op: ReduceOp) -> Result<(), CommError> {
        Ok(())
    }
    fn reduce_scatter(&mut self, input: &mut [f32], output: &mut [f32], _op: ReduceOp) -> Result<(), CommError> {
        output.copy_from_slice(input);
        Ok(())
    }
    fn all_gather(&mut self, input: &[f32], output: &mut [f32]) -> Result<(), CommError> {
        output.copy_from_slice(input);
        Ok(())
    }
    fn reduce_scatter_in_place(&mut self, _buf: &mut [f32], _op: ReduceOp) -> Result<(), CommError> {
        Ok(())
    }
    fn all_gather_in_place(&mut self, _buf: &mut [f32]) -> Result<(), CommError> {
        Ok(())
    }
    fn broadcast(&mut self, _buf: &mut [f32], _root: usize) -> Result<(), CommError> {
        Ok(())
    }
    fn all_to_all(&mut self, input: &[f32], output: &mut [f32]) -> Result<(), CommError> {
        if input.len() != output.len() {
            let detail = format!("input has {} elements, output {}", input.len(), output.len());
            return Err(CommError::BadBuffer { collective: "all_to_all".into(), detail });
        }
        output.copy_from_slice(input);
        Ok(())
    }
    fn send(&mut self, _buf: &[f32], _to: usize) -> Result<(), CommError> {
        Err(CommError::BadBuffer { collective: "send".into(), detail: "a group of one rank has no peer".into() })
    }
    fn recv(&mut self, _buf: &mut [f32], _from: usize) -> Result<(), CommError> {
        Err(CommError::BadBuffer { collective: "recv".into(), detail: "a group of one rank has no peer".into() })
    }
    fn barrier(&mut self) -> Result<(), CommError> {
        Ok(())
    }
    /// Nothing crosses a wire.
    fn set_wire(&mut self, _wire: distlab_common::Precision) {}

    fn bytes_sent(&self) -> u64 {
        0
    }
    fn alloc_shared(&mut self, len: usize) -> Result<SharedBuffer, CommError> {
        SharedBuffer::create(len).map(|(b, _)| b).map_err(|cause| CommError::Disconnected {
            collective: "alloc_shared".into(),
            peer: 0,
            cause,
        })
    }
}
