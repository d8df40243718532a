//! Tensor parallelism (Megatron-LM, Shoeybi et al. 2019): the ranks of a TP group split
//! every block's matrices and run each block together.
//!
//! A linear layer `Y = X·W` can be cut two ways:
//!
//! ```text
//!   column-parallel  W = [W1 | W2]      Y = [X·W1 | X·W2]   each rank makes its columns of Y
//!   row-parallel     W = [W1 ; W2]      Y = X1·W1 + X2·W2   each rank makes a partial Y: sum them
//!                    X = [X1 | X2]
//! ```
//!
//! Megatron chains them so that only one sum is needed per half-block. Attention: QKV is
//! column-parallel by heads (a rank computes whole heads, the softmax needs nothing from the
//! other ranks), the output projection row-parallel over the same heads. MLP: fc is
//! column-parallel (GELU acts element by element, so each rank applies it to its hidden
//! units), fc_proj row-parallel. Two conjugate operators bracket each half:
//!
//! ```text
//!   f: forward identity (every rank has the whole ln output), backward all-reduce
//!      (each rank's columns contribute a partial gradient of the ln output)
//!   g: forward all-reduce (the row-parallel partial sums), backward identity
//! ```
//!
//! so each block costs two all-reduces of b x s x d activations forward (g after the
//! attention projection, g after fc_proj) and two backward (f at ln2's output, f at ln1's),
//! on the critical path: nothing else can run while they are in flight. That is why TP
//! stays inside a node, on the fastest links.
//!
//! What is whole on every TP rank: the LayerNorms, the residual stream, the two
//! row-parallel biases (rank 0 adds them before the sum), the embeddings and the LM head.
//! The embeddings and LM head are replicated rather than vocab-parallel: every TP rank
//! computes the logits and the loss in full, the same on each. Replicated tensors get the
//! same gradient on every rank (their inputs and output gradients are whole), so they stay
//! identical without any extra communication; for the gradient norm each rank counts them
//! 1/tp (`ParamLayout::grad_squares`). The split itself is in `model/layout.rs`, the
//! sums in `model/tensor_parallel.rs` (the f/g points) and `model/block.rs` (where they sit).
//!
//! Sequence parallelism (`parallel.sequence_parallel`, Korthikanti et al. 2022) splits
//! what is whole above along the tokens: each rank keeps the LayerNorms and residual
//! stream of its b*s/t tokens. Each all-reduce becomes its two halves at two places:
//!
//! ```text
//!   before a column-parallel matmul   all-gather the LayerNorm output   (backward: reduce-scatter its gradient)
//!   after a row-parallel matmul       reduce-scatter the partial output (backward: all-gather its gradient)
//! ```
//!
//! the same bytes, with the LayerNorm-region activations divided by t. Backward gathers
//! each LayerNorm output once more (for the column-parallel weight gradient) rather than
//! keeping it whole, and the LayerNorm parameter gradients, each rank's from its own
//! tokens, are all-reduced (4d per block).

use std::sync::Arc;

use distlab_common::trace::{lane, Span, SpanKind};
use distlab_common::Precision;

use super::{collective, TrainBackend};
use crate::comm::{CommError, Communicator, InPlace};
use crate::memory::MemoryTracker;
use crate::model::TpPlace;
use crate::model::{TensorParallelGroup, TpPoint};
use crate::trace::now_us;

/// One rank's tensor-parallel group: its communicator and the record of its collectives.
pub struct TensorParallel {
    comm: Box<dyn Communicator>,
    step: u64,
    record: bool,
    spans: Vec<Span>,
    calls: u64,
    payload_bytes: u64,
    /// The rank's memory ledger (its own until the model attaches the rank's).
    memory: Arc<MemoryTracker>,
}

impl TensorParallel {
    pub fn new(comm: Box<dyn Communicator>) -> Self {
        let memory = MemoryTracker::new();
        TensorParallel { comm, step: 0, record: false, spans: Vec::new(), calls: 0, payload_bytes: 0, memory }
    }

    pub fn place(&self) -> TpPlace {
        TpPlace { rank: self.comm.rank(), size: self.comm.size() }
    }

    /// The group's communicator, for a faster one over the same ranks to take its place
    /// (NCCL, see `train/cuda.rs`).
    pub fn comm_mut(&mut self) -> &mut Box<dyn Communicator> {
        &mut self.comm
    }

    /// What the group's communicator keeps for staging (see `Communicator::staging_bytes`).
    pub fn staging_bytes(&self) -> u64 {
        self.comm.staging_bytes()
    }
}

/// How the timeline names a collective: "all_reduce tp g: layer 2 attention output" (g and
/// f, Megatron's operators, name tensor parallelism's four sums), "all_gather tp: layer 2
/// ln1 output", "reduce_scatter tp: final LayerNorm output".
pub fn span_name(op: InPlace, point: TpPoint, layer: Option<usize>) -> String {
    let (op_name, operator) = match op {
        InPlace::AllReduce(_) => {
            let operator = match point {
                TpPoint::AttentionOutput | TpPoint::MlpOutput => " g",
                TpPoint::Ln1OutputGrad | TpPoint::Ln2OutputGrad => " f",
                _ => "",
            };
            ("all_reduce", operator)
        }
        InPlace::ReduceScatter(_) => ("reduce_scatter", ""),
        InPlace::AllGather => ("all_gather", ""),
    };
    let place = layer.map_or(String::new(), |l| format!("layer {l} "));
    format!("{op_name} tp{operator}: {place}{}", point.tensor())
}

impl<B: TrainBackend> TensorParallelGroup<B> for TensorParallel {
    fn place(&self) -> TpPlace {
        TensorParallel::place(self)
    }

    fn collective(
        &mut self,
        be: &B,
        buf: &mut B::Buf,
        op: InPlace,
        point: TpPoint,
        layer: Option<usize>,
    ) -> Result<(), CommError> {
        if self.record {
            be.synchronize();
        }
        let (start, sent_before) = (now_us(), self.comm.bytes_sent());
        let everything = 0..be.buf_len(buf);
        collective(be, &self.memory, self.comm.as_mut(), buf, everything, op, Precision::Fp32)?;
        self.calls += 1;
        self.payload_bytes += (be.buf_len(buf) * 4) as u64;
        if self.record {
            be.synchronize();
            self.spans.push(Span {
                kind: SpanKind::Comm,
                name: span_name(op, point, layer),
                step: self.step,
                lane: lane::TP.into(),
                start_us: start,
                end_us: now_us(),
                layer: layer.map(|l| l as u32),
                bucket: None,
                bytes: Some(self.comm.bytes_sent() - sent_before),
                micro: None,
                chunk: None,
            });
        }
        Ok(())
    }

    fn sum_scalar(&mut self, value: f64) -> Result<f64, CommError> {
        crate::comm::sum_scalar(self.comm.as_mut(), value)
    }

    fn begin_step(&mut self, step: u64, record: bool) {
        self.step = step;
        self.record = record;
    }

    fn spans(&self) -> Vec<Span> {
        self.spans.clone()
    }

    fn totals(&self) -> (u64, u64, u64) {
        (self.calls, self.payload_bytes, self.comm.bytes_sent())
    }

    fn attach_memory(&mut self, memory: &Arc<MemoryTracker>) {
        self.memory = memory.clone();
    }
}
