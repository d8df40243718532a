//! What a spec must be for the planner to plan it at all: positive sizes, whole heads per
//! TP rank, a block per pipeline stage, a model and a schedule of a size it can follow.
//! The server's run limits are not checked here (see `spec/validate.rs`).

use crate::plan::schedule::Pipeline;
use crate::spec::field_error::FieldError;
use crate::spec::ExperimentSpec;

/// The planner models models up to this many parameters (a thousand times GPT-3).
pub const MAX_PLANNED_PARAMS: f64 = 1e15;
/// An interleaved or ZB-H1 stage's activation peak is found by following its schedule:
/// at most this many passes over all stages.
const MAX_FOLLOWED_PASSES: usize = 1 << 22;

/// The plan lists every pipeline stage, so `pp` is bounded.
pub const MAX_PLANNED_STAGES: usize = 1024;

/// Checks that `spec` describes a model and a mesh that can exist at all: positive
/// sizes, whole heads per TP rank, at least one block per pipeline stage. Run limits
/// (world size, parameters, steps) are NOT checked: see [`ExperimentSpec::validate`].
pub fn check_structure(spec: &ExperimentSpec) -> Result<(), Vec<FieldError>> {
    let mut errs = Vec::new();
    let mut err = |field: &str, message: String| errs.push(FieldError::new(field, message));
    let (m, p, t) = (&spec.model, &spec.parallel, &spec.train);
    for (field, value) in [
        ("model.layers", m.layers),
        ("model.d_model", m.d_model),
        ("model.heads", m.heads),
        ("model.seq_len", m.seq_len),
        ("model.vocab", m.vocab),
        ("parallel.dp", p.dp),
        ("parallel.tp", p.tp),
        ("parallel.pp", p.pp),
        ("train.micro_batch", t.micro_batch),
        ("train.micro_batches", t.micro_batches),
        ("train.grad_accum", t.grad_accum),
    ] {
        if value == 0 {
            let name = field.rsplit('.').next().unwrap_or(field);
            err(field, format!("{name} must be at least 1 (it is 0)"));
        }
    }
    if m.heads >= 1 && m.d_model % m.heads != 0 {
        err(
            "model.heads",
            format!("heads={} does not divide d_model={}: every head needs the same width", m.heads, m.d_model),
        );
    }
    if p.tp >= 1 && m.heads >= 1 && m.heads % p.tp != 0 {
        err(
            "parallel.tp",
            format!("tp={} does not divide heads={}: each tensor-parallel rank takes whole heads", p.tp, m.heads),
        );
    }
    let kv_heads = m.key_value_heads();
    if m.heads >= 1 && (kv_heads > m.heads || m.heads % kv_heads != 0) {
        err(
            "model.kv_heads",
            format!(
                "kv_heads={kv_heads} does not divide heads={}: each K/V head serves a whole group of query heads",
                m.heads
            ),
        );
    } else if p.tp >= 1 && m.heads >= 1 && m.heads % p.tp == 0 && kv_heads % p.tp != 0 {
        err(
            "parallel.tp",
            format!("tp={} does not divide kv_heads={kv_heads}: each tensor-parallel rank takes whole K/V heads", p.tp),
        );
    }
    if p.tp >= 1 && m.d_ff() % p.tp != 0 {
        err("parallel.tp", format!("tp={} does not divide the MLP width {}", p.tp, m.d_ff()));
    }
    if p.pp >= 1 && m.layers >= 1 && p.pp > m.layers {
        err(
            "parallel.pp",
            format!("pp={} is more than layers={}: every pipeline stage needs at least one layer", p.pp, m.layers),
        );
    } else if p.pp > MAX_PLANNED_STAGES {
        err(
            "parallel.pp",
            format!("pp={}: the planner lists every stage and handles at most {MAX_PLANNED_STAGES}", p.pp),
        );
    } else {
        spec.check_pipeline_schedule(&mut err);
        spec.check_experts(&mut err);
        // Interleaved, ZB-H1 and ZBV peaks are found by following every stage's passes.
        let pipe = Pipeline::of(spec);
        let passes = pipe.passes();
        if pipe.followed_pass_by_pass() && passes > MAX_FOLLOWED_PASSES {
            err(
                "train.micro_batches",
                format!(
                    "pp x virtual_stages x micro_batches x grad_accum = {passes}: the planner follows an {} \
                     schedule pass by pass and handles at most {MAX_FOLLOWED_PASSES}",
                    p.pp_schedule.as_str()
                ),
            );
        }
    }
    // Estimated in f64 first, so that param_count (u64) is only called when it cannot overflow.
    let (v, s, d, l) = (m.vocab as f64, m.seq_len as f64, m.d_model as f64, m.layers as f64);
    let (ff, copies) = (m.d_ff() as f64, m.experts.max(1) as f64);
    let matrices = if m.family.is_gpt2() { 2.0 } else { 3.0 };
    let estimate = 2.0 * v * d + s * d + l * (4.0 * d * d + 13.0 * d + copies * (matrices * d * ff + ff)) + 2.0 * d;
    if estimate > MAX_PLANNED_PARAMS {
        err("model", format!("this model has about {estimate:.3e} parameters; the planner handles at most 1e15"));
    }
    if errs.is_empty() {
        Ok(())
    } else {
        Err(errs)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plan::planner::plan;
    use crate::spec::validate::Limits;
    use crate::spec::{ModelSpec, Sharding};

    #[test]
    fn impossible_specs_are_field_errors() {
        type Edit = fn(&mut ExperimentSpec);
        let cases: Vec<(Edit, &str, &str)> = vec![
            (|s| s.parallel.dp = 0, "parallel.dp", "dp must be at least 1"),
            (|s| s.parallel.tp = 3, "parallel.tp", "tp=3 does not divide heads=4"),
            (|s| s.parallel.pp = 3, "parallel.pp", "pp=3 is more than layers=2"),
            (|s| s.model.heads = 3, "model.heads", "heads=3 does not divide d_model=64"),
            (|s| s.model.layers = 0, "model.layers", "layers must be at least 1"),
            (|s| s.train.micro_batch = 0, "train.micro_batch", "micro_batch must be at least 1"),
            (|s| s.model.d_model = 1 << 30, "model", "the planner handles at most 1e15"),
            (
                |s| {
                    s.model.layers = 4096;
                    s.parallel.pp = 2048;
                },
                "parallel.pp",
                "at most 1024",
            ),
        ];
        for (edit, field, needle) in cases {
            let mut spec = ExperimentSpec::default();
            edit(&mut spec);
            let errs = plan(&spec).unwrap_err();
            assert!(
                errs.iter().any(|e| e.field == field && e.message.contains(needle)),
                "{field} ~ {needle}: {errs:?}"
            );
        }
        // Zero everything: every problem at once, and no panic.
        let mut spec = ExperimentSpec { model: ModelSpec::dense(0, 0, 0, 0, 0), ..ExperimentSpec::default() };
        spec.parallel.dp = 0;
        assert!(plan(&spec).unwrap_err().len() >= 6);
    }

    #[test]
    fn run_limits_do_not_apply() {
        // dp=1 with zero sharding is rejected for runs but plans as unsharded state.
        let mut spec = ExperimentSpec::default();
        spec.parallel.sharding = Sharding::Zero2;
        assert!(spec.validate(&Limits::default()).is_err());
        let p = plan(&spec).unwrap();
        assert_eq!(p.stages[0].memory.gradients, 4 * p.param_count);
    }

    #[test]
    fn absurd_sizes_saturate_instead_of_overflowing() {
        let mut spec = ExperimentSpec::default();
        spec.parallel.dp = usize::MAX;
        spec.parallel.tp = 4;
        spec.train.micro_batch = usize::MAX;
        spec.train.micro_batches = usize::MAX;
        spec.train.grad_accum = usize::MAX;
        spec.model.seq_len = 1 << 20;
        let p = plan(&spec).unwrap();
        assert_eq!(p.world_size, u64::MAX);
        assert_eq!(p.flops.tokens_per_step, u64::MAX);
        assert!(p.flops.total.is_finite());
        assert_eq!(p.stages[0].memory.total, u64::MAX);
    }
}
