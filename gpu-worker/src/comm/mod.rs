//! Collective communication between rank processes.
//!
//! `Communicator` is the small interface the parallel strategies use (DDP, ZeRO, FSDP,
//! tensor and pipeline parallel). `ring.rs` implements it with the ring algorithms written
//! out step by step; `transport.rs` connects the rank processes (inside a host a Unix domain
//! socket per pair for rendezvous and liveness and shared-memory pipes from `shm.rs` for the
//! data; between hosts a TCP connection per pair, `tcp.rs`).
//! With the `cuda` feature, `nccl.rs` implements it with NCCL on GPUs.
//!
//! Buffers are split into W chunks for the ring; when W does not divide the length the
//! first `len % W` chunks are one element longer (`chunk_range`).

pub mod alone;
pub mod cma;
#[cfg(feature = "cuda")]
pub mod nccl;
#[cfg(feature = "cuda")]
pub mod nccl_library;
pub mod ring;
pub mod shm;
pub mod stream_copy;
pub mod tcp;
pub mod transport;

pub use alone::Alone;
pub use ring::RingCommunicator;
pub use shm::SharedBuffer;
pub use tcp::{AddressBook, AddressFiles};
pub use transport::{Hosts, Mesh, RendezvousError};

use distlab_common::Precision;

#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ReduceOp {
    Sum,
    /// Sum divided by the group size (what data parallelism does with gradients).
    Avg,
}

/// A collective that works on one buffer in place (the form the strategies use on their
/// backend's buffers; see `parallel::collective`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum InPlace {
    AllReduce(ReduceOp),
    /// Afterwards this rank's chunk (`chunk_range`) holds the reduced values.
    ReduceScatter(ReduceOp),
    /// This rank's chunk is its contribution; afterwards every chunk is filled.
    AllGather,
}

impl InPlace {
    /// Runs it on a host buffer.
    pub fn run(self, comm: &mut dyn Communicator, buf: &mut [f32]) -> Result<(), CommError> {
        match self {
            InPlace::AllReduce(op) => comm.all_reduce(buf, op),
            InPlace::ReduceScatter(op) => comm.reduce_scatter_in_place(buf, op),
            InPlace::AllGather => comm.all_gather_in_place(buf),
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum CommError {
    #[error("{collective}: waited {waited_s:.1} s for rank {peer}, which sent nothing (is it stuck or dead?)")]
    Timeout { collective: String, peer: usize, waited_s: f64 },
    #[error("{collective}: the connection to rank {peer} broke ({cause}); that rank probably exited")]
    Disconnected { collective: String, peer: usize, cause: std::io::Error },
    #[error("{collective}: rank {peer} sent {got}, but this rank expected {expected}: the ranks are not running the same collectives")]
    Mismatch { collective: String, peer: usize, got: String, expected: String },
    #[error("{collective}: {detail}")]
    BadBuffer { collective: String, detail: String },
    /// The GPU or its communication library failed (NCCL).
    #[error("{collective}: {detail}")]
    Device { collective: String, detail: String },
}

/// One group of ranks that run collectives together (all ranks, or a data-, tensor- or
/// pipeline-parallel group of the mesh). Ranks here are positions in the group: 0..size.
pub trait Communicator: Send {
    fn rank(&self) -> usize;
    fn size(&self) -> usize;

    /// Every rank ends with the element-wise sum (or mean) of all ranks' `buf`.
    fn all_reduce(&mut self, buf: &mut [f32], op: ReduceOp) -> Result<(), CommError>;

    /// Reduces `input` (the same length on every rank) and leaves chunk `rank` of the result
    /// in `output` (`chunk_range(input.len(), size, rank)`). `input` is used as scratch.
    fn reduce_scatter(&mut self, input: &mut [f32], output: &mut [f32], op: ReduceOp) -> Result<(), CommError>;

    /// Concatenates every rank's chunk: rank r's `input` lands in
    /// `output[chunk_range(output.len(), size, r)]`.
    fn all_gather(&mut self, input: &[f32], output: &mut [f32]) -> Result<(), CommError>;

    /// `reduce_scatter` without a separate output: afterwards this rank's chunk of `buf`
    /// (`chunk_range(buf.len(), size, rank)`) holds the reduced values; the rest is scratch.
    fn reduce_scatter_in_place(&mut self, buf: &mut [f32], op: ReduceOp) -> Result<(), CommError>;

    /// `all_gather` without a separate input: this rank's chunk of `buf` is its contribution,
    /// and afterwards every chunk is filled.
    fn all_gather_in_place(&mut self, buf: &mut [f32]) -> Result<(), CommError>;

    /// Every rank ends with `root`'s `buf`.
    fn broadcast(&mut self, buf: &mut [f32], root: usize) -> Result<(), CommError>;

    /// Every rank's `input` is cut into `size` equal chunks: chunk j goes to rank j, and
    /// what rank i sent this rank lands in chunk i of `output` (as long as `input`, a
    /// multiple of `size`). Mixture-of-Experts sends each expert its tokens with it.
    fn all_to_all(&mut self, input: &[f32], output: &mut [f32]) -> Result<(), CommError>;

    /// Point to point (pipeline parallelism): the receiver knows the length.
    fn send(&mut self, buf: &[f32], to: usize) -> Result<(), CommError>;
    fn recv(&mut self, buf: &mut [f32], from: usize) -> Result<(), CommError>;

    /// Returns once every rank of the group has called it.
    fn barrier(&mut self) -> Result<(), CommError>;

    /// Bytes this rank has sent since it was created (payload only).
    fn bytes_sent(&self) -> u64;

    /// `len` zeros in memory the other members map too, so a collective on (part of) it moves
    /// each chunk with one plain copy straight from the peer. Every member must call it, with
    /// the same `len`, in the same order. The memory lives as long as the communicator.
    fn alloc_shared(&mut self, len: usize) -> Result<SharedBuffer, CommError>;

    /// The format the values of the collectives that follow cross the wire in: f32, or
    /// rounded to bf16/fp16 when sent (halving the bytes), summed in f32 where they
    /// arrive. Set around the data-parallel collectives of a run with `comm_dtype`.
    fn set_wire(&mut self, wire: Precision);

    /// Heap bytes the communicator keeps for staging data it moves (booked by the trainer
    /// as transport).
    fn staging_bytes(&self) -> u64 {
        0
    }

    /// This communicator as NCCL, which moves GPU memory itself (then a GPU backend runs
    /// collectives on its buffers without a trip through the host).
    #[cfg(feature = "cuda")]
    fn nccl(&mut self) -> Option<&mut nccl::NcclCommunicator> {
        None
    }
}

/// How a buffer is cut into one chunk per rank (shared with the browser's replay).
pub use distlab_common::trace::chunk_range;

/// Sums `value` over the group (f64 carried as f32: the step loss needs ~7 digits).
pub fn sum_scalar(comm: &mut dyn Communicator, value: f64) -> Result<f64, CommError> {
    let mut buf = [value as f32];
    comm.all_reduce(&mut buf, ReduceOp::Sum)?;
    Ok(buf[0] as f64)
}
