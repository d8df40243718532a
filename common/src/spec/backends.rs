//! What each backend can run, shared by the worker (which refuses the rest), the server
//! (which refuses it at submission) and the browser (which says so while the form is
//! filled in).

use crate::spec::field_error::FieldError;
use crate::spec::{AllReduce, Attention, BackendKind, ExperimentSpec, Offload, Precision};

/// The settings of a valid `spec` its backend cannot run yet, one error per field.
pub fn unsupported_on_backend(spec: &ExperimentSpec) -> Vec<FieldError> {
    match spec.backend {
        BackendKind::Cpu => unsupported_on_cpu(spec),
        BackendKind::Cuda => unsupported_on_cuda(spec),
    }
}

/// The CPU backend runs every valid spec but one that offloads the optimizer's state or
/// the activations to the host, which is where its buffers already are.
fn unsupported_on_cpu(spec: &ExperimentSpec) -> Vec<FieldError> {
    let mut out = Vec::new();
    if spec.parallel.offload == Offload::Host {
        out.push(FieldError::new(
            "parallel.offload",
            "on the cpu backend the host is the device: offload=host would move nothing (offload=disk moves \
             the optimizer's state to files)",
        ));
    }
    if spec.train.activation_offload == Offload::Host {
        out.push(FieldError::new(
            "train.activation_offload",
            "on the cpu backend the host is the device: activation_offload=host would move nothing \
             (activation_offload=disk moves each block's activations to a file)",
        ));
    }
    out
}

/// The widest attention head the CUDA flash-attention kernels hold (a warp of 32 lanes,
/// 32 values each, in registers).
pub const CUDA_FLASH_MAX_HEAD: usize = 1024;

/// The widest attention head the CUDA ring-attention kernels hold (one thread per row, its
/// running output in registers).
pub const CUDA_RING_MAX_HEAD: usize = 256;

/// The CUDA backend runs the same engine as the CPU: every strategy, mesh, precision and
/// checkpoint. What it leaves to the CPU: the collective demos, which show the ring's
/// steps between rank processes and have no model to put on a GPU; flash attention with
/// heads wider than its kernels hold; 2-byte communication, which the ranks' ring does
/// (NCCL would carry it in its own bf16/fp16 types, not used yet); the other all-reduce
/// algorithms, written step by step on the ranks' ring. (Gradient compression and expert
/// parallelism run there: their collectives go through host memory, over NCCL.)
fn unsupported_on_cuda(spec: &ExperimentSpec) -> Vec<FieldError> {
    let mut out = Vec::new();
    if spec.demo.is_some() {
        out.push(FieldError::new("demo", "the collective demos run on the cpu backend"));
    }
    if spec.parallel.allreduce != AllReduce::Ring {
        out.push(FieldError::new(
            "parallel.allreduce",
            "on cuda NCCL all-reduces the gradients with its own algorithms; naive, tree and hierarchical run on \
             the cpu backend's ranks",
        ));
    }
    if spec.parallel.comm_dtype != Precision::Fp32 {
        out.push(FieldError::new(
            "parallel.comm_dtype",
            "2-byte communication runs on the cpu backend (its ring); on cuda the collectives carry fp32",
        ));
    }
    let head = spec.model.d_model / spec.model.heads.max(1);
    if spec.train.attention == Attention::Flash && head > CUDA_FLASH_MAX_HEAD {
        out.push(FieldError::new(
            "train.attention",
            format!("flash attention on cuda holds heads of up to {CUDA_FLASH_MAX_HEAD} values (this one: {head})"),
        ));
    }
    if spec.parallel.cp > 1 && spec.parallel.cp_kind.is_ring() && head > CUDA_RING_MAX_HEAD {
        out.push(FieldError::new(
            "parallel.cp_kind",
            format!("ring attention on cuda holds heads of up to {CUDA_RING_MAX_HEAD} values (this one: {head})"),
        ));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::spec::Sharding;

    #[test]
    fn both_backends_run_every_strategy_and_demos_run_on_the_cpu() {
        let mut spec = ExperimentSpec::default();
        (spec.parallel.dp, spec.parallel.tp, spec.parallel.pp) = (2, 2, 2);
        spec.parallel.sharding = Sharding::Fsdp;
        spec.train.checkpoint_every = 5;
        assert!(unsupported_on_backend(&spec).is_empty());
        spec.backend = BackendKind::Cuda;
        assert!(unsupported_on_backend(&spec).is_empty(), "the same engine runs on GPUs");
        spec.demo = Some(Default::default());
        let fields: Vec<String> = unsupported_on_backend(&spec).into_iter().map(|e| e.field).collect();
        assert_eq!(fields, ["demo"]);
        spec.demo = None;
        spec.train.attention = Attention::Flash;
        assert!(unsupported_on_backend(&spec).is_empty(), "flash attention with narrow heads");
        (spec.model.d_model, spec.model.heads) = (2048, 1);
        let fields: Vec<String> = unsupported_on_backend(&spec).into_iter().map(|e| e.field).collect();
        assert_eq!(fields, ["train.attention"]);
        spec.model = Default::default();
        (spec.train.precision, spec.parallel.comm_dtype) = (Precision::Bf16, Precision::Bf16);
        let fields: Vec<String> = unsupported_on_backend(&spec).into_iter().map(|e| e.field).collect();
        assert_eq!(fields, ["parallel.comm_dtype"]);
        spec = ExperimentSpec { backend: BackendKind::Cuda, ..ExperimentSpec::default() };
        spec.parallel.offload = Offload::Host;
        assert!(unsupported_on_backend(&spec).is_empty(), "a GPU run offloads to its host");
        spec.backend = BackendKind::Cpu;
        let fields: Vec<String> = unsupported_on_backend(&spec).into_iter().map(|e| e.field).collect();
        assert_eq!(fields, ["parallel.offload"]);
        spec.parallel.offload = Offload::Disk;
        assert!(unsupported_on_backend(&spec).is_empty(), "the cpu backend offloads to disk");
        spec.train.activation_offload = Offload::Host;
        let fields: Vec<_> = unsupported_on_backend(&spec).into_iter().map(|e| e.field).collect();
        assert_eq!(fields, ["train.activation_offload"]);
        spec.train.activation_offload = Offload::Disk;
        assert!(unsupported_on_backend(&spec).is_empty(), "the cpu backend offloads activations to disk");
        // Compressed gradients and experts spread over ranks go through host memory on cuda.
        spec = ExperimentSpec { backend: BackendKind::Cuda, ..ExperimentSpec::default() };
        spec.parallel.dp = 2;
        spec.parallel.grad_compression = crate::spec::GradCompression::Topk;
        assert!(unsupported_on_backend(&spec).is_empty());
        spec.parallel.grad_compression = crate::spec::GradCompression::None;
        (spec.model.experts, spec.parallel.ep) = (4, 2);
        assert!(unsupported_on_backend(&spec).is_empty());
        assert_eq!(spec.validate(&crate::spec::validate::Limits::default()), Ok(()));
    }
}
