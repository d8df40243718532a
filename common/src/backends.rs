//! What each backend can run, shared by the worker (which refuses the rest), the server
//! (which refuses it at submission) and the browser (which says so while the form is
//! filled in). The CPU backend runs every valid spec.

use crate::spec::{BackendKind, ExperimentSpec, Sharding};
use crate::validate::FieldError;

/// The settings of a valid `spec` its backend cannot run yet, one error per field.
pub fn unsupported_on_backend(spec: &ExperimentSpec) -> Vec<FieldError> {
    match spec.backend {
        BackendKind::Cpu => Vec::new(),
        BackendKind::Cuda => unsupported_on_cuda(spec),
    }
}

/// The CUDA backend runs one rank per GPU with plain data parallelism (DDP).
fn unsupported_on_cuda(spec: &ExperimentSpec) -> Vec<FieldError> {
    let p = &spec.parallel;
    let mut out = Vec::new();
    if p.tp > 1 {
        out.push(FieldError::new("parallel.tp", "the cuda backend runs data parallelism only so far (tp = 1)"));
    }
    if p.pp > 1 {
        out.push(FieldError::new("parallel.pp", "the cuda backend runs data parallelism only so far (pp = 1)"));
    }
    if p.dp > 1 && p.sharding != Sharding::None {
        out.push(FieldError::new("parallel.sharding", "the cuda backend runs plain DDP only so far (sharding none)"));
    }
    if spec.train.checkpoint_every > 0 {
        out.push(FieldError::new("train.checkpoint_every", "the cuda backend writes no checkpoints yet (set it to 0)"));
    }
    if spec.demo.is_some() {
        out.push(FieldError::new("demo", "the collective demos run on the cpu backend"));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_cpu_runs_everything_cuda_runs_data_parallelism() {
        let mut spec = ExperimentSpec::default();
        spec.parallel.tp = 2;
        spec.parallel.dp = 2;
        spec.parallel.sharding = Sharding::Fsdp;
        assert!(unsupported_on_backend(&spec).is_empty());
        spec.backend = BackendKind::Cuda;
        let fields: Vec<String> = unsupported_on_backend(&spec).into_iter().map(|e| e.field).collect();
        assert_eq!(fields, ["parallel.tp", "parallel.sharding"]);
        spec.parallel.tp = 1;
        spec.parallel.sharding = Sharding::None;
        assert!(unsupported_on_backend(&spec).is_empty(), "DDP on GPUs runs");
    }
}
