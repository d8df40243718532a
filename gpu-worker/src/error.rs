//! Why a rank's training stopped: one error type for the trainer, the strategies and the
//! launcher, with the reasons a user reads (an invalid spec, a feature this worker cannot
//! run, a diverged loss, a lost peer, too little memory).

use distlab_common::FieldError;

use crate::checkpoint::CheckpointError;
use crate::comm::CommError;
use crate::data::DataError;

#[derive(Debug, thiserror::Error)]
pub enum TrainError {
    #[error("invalid spec: {}", join_field_errors(.0))]
    Invalid(Vec<FieldError>),
    /// A valid spec asking for something this worker does not implement yet.
    #[error("{0}")]
    Unsupported(String),
    #[error("cancelled")]
    Cancelled,
    #[error(
        "training diverged at step {step}: loss {loss}, gradient norm {grad_norm} (not finite); \
         try a lower learning rate or gradient clipping (with fp16: loss_scaling=dynamic)"
    )]
    Diverged { step: u64, loss: f64, grad_norm: f64 },
    #[error("data: {0}")]
    Data(#[from] DataError),
    #[error(transparent)]
    Checkpoint(#[from] CheckpointError),
    #[error(transparent)]
    Comm(#[from] CommError),
    #[error(transparent)]
    Offload(#[from] crate::offload::OffloadError),
    #[error(transparent)]
    ActivationOffload(#[from] crate::model::ActivationOffloadError),
    /// The GPU or its libraries failed (not the spec's fault).
    #[error("GPU: {0}")]
    Device(String),
    #[error("could not start {threads} kernel threads: {message}")]
    Threads { threads: usize, message: String },
    /// The run would need more memory than this machine has available.
    #[error(
        "this run needs about {needed_mib} MiB (parameters, gradients, optimizer state and activations) but only \
         {available_mib} MiB are available on this worker; use a smaller micro_batch, seq_len or model"
    )]
    OutOfMemory { needed_mib: u64, available_mib: u64 },
}

fn join_field_errors(errors: &[FieldError]) -> String {
    errors.iter().map(|e| e.to_string()).collect::<Vec<_>>().join("; ")
}
