//! Elastic resume (`train.resume_from`): a new experiment starts from another one's
//! checkpoint with another data-parallel degree or sharding. The worker re-cuts the saved
//! shards for the new ranks (`gpu-worker/src/elastic.rs`); what a checkpoint holds fixes the
//! rest: the model and its tensor-parallel and pipeline cut (each rank file holds one
//! stage of one TP rank), the precision, optimizer and loss scaling (which sections there
//! are), and the data and the global batch (step t's batch is a function of the data seed
//! and t alone, and a step is one global batch).
//!
//! Changing dp or the micro-batch changes the global batch, dp x micro_batch x
//! micro_batches x grad_accum: [`fit_to_source`] keeps it through grad_accum when it can.

use crate::spec::field_error::FieldError;
use crate::spec::{ExperimentSpec, ResumeFrom};

/// The directory of experiment `id`'s checkpoints under a worker's `--checkpoint-dir` (the
/// server's local workers: DATA_DIR/checkpoints), where `resume_from` finds them next to a
/// run's own and the server deletes them with the experiment: `experiment-<id>-<store>`,
/// `store` being the server database's own id (`Lease::store`), so that the experiments of
/// another database never share a directory; `experiment-<id>` without one.
pub fn checkpoint_dir_name(store: Option<&str>, id: i64) -> String {
    match store {
        Some(store) => format!("experiment-{id}-{store}"),
        None => format!("experiment-{id}"),
    }
}

/// The name of experiment `other`'s directory beside the directory named `own` (the same
/// database's).
pub fn sibling_dir_name(own: &str, other: i64) -> String {
    let store = own.strip_prefix("experiment-").and_then(|rest| rest.split_once('-')).map(|(_, store)| store);
    checkpoint_dir_name(store, other)
}

/// Checks that `spec` (whose `train.resume_from` names `source`) can continue a checkpoint
/// of `source` (which step it keeps: [`check_resume_step`]), and keeps the global batch through `grad_accum` when dp or the micro-batch
/// changed it. Returns what it changed, or one error per field that does not fit.
pub fn fit_to_source(spec: &mut ExperimentSpec, source: &ExperimentSpec) -> Result<Option<String>, Vec<FieldError>> {
    let Some(ResumeFrom { experiment, .. }) = spec.train.resume_from else { return Ok(None) };
    let mut errors = Vec::new();
    let mut differs = |field: &str, ours: String, theirs: String| {
        if ours != theirs {
            errors.push(FieldError::new(
                field,
                format!("a checkpoint continues with the {field} it was saved with: {theirs} in experiment {experiment} (here {ours})"),
            ));
        }
    };
    let (s, src) = (&spec, source);
    differs("model", format!("{:?}", s.model), format!("{:?}", src.model));
    differs("data", format!("{:?}", s.data), format!("{:?}", src.data));
    differs("parallel.tp", s.parallel.tp.to_string(), src.parallel.tp.to_string());
    differs("parallel.pp", s.parallel.pp.to_string(), src.parallel.pp.to_string());
    // (an interleaved run lays the blocks out in another order)
    let chunks = |spec: &ExperimentSpec| crate::plan::schedule::Pipeline::of(spec).chunks.to_string();
    differs("parallel.virtual_stages", chunks(s), chunks(src));
    differs("train.precision", s.train.precision.as_str().into(), src.train.precision.as_str().into());
    differs("train.optimizer", format!("{:?}", s.train.optimizer), format!("{:?}", src.train.optimizer));
    differs("train.loss_scaling", format!("{:?}", s.train.loss_scaling), format!("{:?}", src.train.loss_scaling));
    if src.demo.is_some() {
        errors.push(FieldError::new("train.resume_from", format!("experiment {experiment} is a collective demo")));
    }
    if src.parallel.ep > 1 {
        errors.push(FieldError::new(
            "train.resume_from",
            format!(
                "experiment {experiment} spread its experts over ep={} ranks, each holding its own: an elastic resume \
                 re-cuts checkpoints whose ranks hold the same model",
                src.parallel.ep
            ),
        ));
    }
    let (ours, theirs) = (spec.global_batch(), source.global_batch());
    let mut note = None;
    if errors.is_empty() && ours != theirs {
        let t = &spec.train;
        let per_accumulation = spec.parallel.dp * t.micro_batch * t.micro_batches;
        if per_accumulation > 0 && theirs % per_accumulation == 0 {
            let grad_accum = theirs / per_accumulation;
            note = Some(format!(
                "global batch kept at experiment {experiment}'s {theirs} sequences: grad_accum {} -> {grad_accum} \
                 (dp {} x micro_batch {} x micro_batches {} x grad_accum {grad_accum})",
                t.grad_accum, spec.parallel.dp, t.micro_batch, t.micro_batches
            ));
            spec.train.grad_accum = grad_accum;
        } else {
            errors.push(FieldError::new(
                "train.grad_accum",
                format!(
                    "experiment {experiment} trains on {theirs} sequences per step; dp {} x micro_batch {} x \
                     micro_batches {} = {per_accumulation} does not divide it, so no grad_accum keeps it",
                    spec.parallel.dp, t.micro_batch, t.micro_batches
                ),
            ));
        }
    }
    if errors.is_empty() {
        Ok(note)
    } else {
        Err(errors)
    }
}

/// The step of the checkpoint a run of `spec` keeps once it has run up to step `done`
/// (one past its last step): the latest multiple of `checkpoint_every` before its last step
/// that it ran to (each new one replaces the one before), or, for a run that itself
/// resumed at step k and saved none since, the copy it resumed from. None when it saves
/// none.
pub fn latest_checkpoint(spec: &ExperimentSpec, done: u64) -> Option<u64> {
    let t = &spec.train;
    let every = t.checkpoint_every;
    let started = t.resume_from.map_or(0, |from| from.step);
    let last = done.min(t.steps.saturating_sub(1));
    let saved = (last.checked_div(every)? * every).max(started);
    (saved > 0).then_some(saved)
}

/// Whether `from` names the checkpoint experiment `source` keeps, having run up to step
/// `done` and `finished` (a running one still replaces its checkpoint).
pub fn check_resume_step(from: ResumeFrom, source: &ExperimentSpec, done: u64, finished: bool) -> Option<FieldError> {
    let experiment = from.experiment;
    let why = if !finished {
        format!("experiment {experiment} is still running (or queued): continue from it once it has ended")
    } else {
        match latest_checkpoint(source, done) {
            Some(step) if step == from.step => return None,
            Some(step) => format!(
                "experiment {experiment} keeps only its latest checkpoint, of step {step} (each one replaces the one \
                 before): resume from step {step}"
            ),
            None => format!("experiment {experiment} saved no checkpoint"),
        }
    };
    Some(FieldError::new("train.resume_from", why))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::spec::{Precision, Sharding};

    #[test]
    fn directories_carry_their_database_and_find_their_siblings() {
        assert_eq!(checkpoint_dir_name(Some("00ff"), 7), "experiment-7-00ff");
        assert_eq!(checkpoint_dir_name(None, 7), "experiment-7");
        assert_eq!(sibling_dir_name("experiment-7-00ff", 3), "experiment-3-00ff");
        assert_eq!(sibling_dir_name("experiment-7", 3), "experiment-3");
        assert_eq!(sibling_dir_name("my-run", 3), "experiment-3");
    }

    fn source() -> ExperimentSpec {
        let mut s = ExperimentSpec::default();
        (s.parallel.dp, s.parallel.sharding, s.train.micro_batch) = (4, Sharding::Zero2, 2);
        (s.train.steps, s.train.checkpoint_every) = (20, 5);
        s
    }

    fn resuming(step: u64) -> ExperimentSpec {
        let mut s = source();
        s.train.resume_from = Some(ResumeFrom { experiment: 7, step });
        s
    }

    #[test]
    fn another_dp_and_sharding_fit_and_keep_the_global_batch() {
        let mut spec = resuming(10);
        (spec.parallel.dp, spec.parallel.sharding) = (2, Sharding::Fsdp);
        let note = fit_to_source(&mut spec, &source()).unwrap().unwrap();
        assert_eq!(spec.train.grad_accum, 2);
        assert_eq!(spec.global_batch(), source().global_batch());
        assert!(note.contains("grad_accum 1 -> 2"), "{note}");
        // Nothing to change, nothing said.
        assert_eq!(fit_to_source(&mut resuming(5), &source()), Ok(None));
        // No resume_from: nothing checked.
        assert_eq!(fit_to_source(&mut ExperimentSpec::default(), &source()), Ok(None));
    }

    #[test]
    fn the_checkpoint_kept_is_the_last_multiple_before_the_last_step_or_the_one_resumed_from() {
        let mut s = source();
        assert_eq!(latest_checkpoint(&s, 20), Some(15), "none after the last step");
        assert_eq!(latest_checkpoint(&s, 12), Some(10), "a run that stopped after 12 steps");
        assert_eq!(latest_checkpoint(&s, 4), None);
        s.train.resume_from = Some(ResumeFrom { experiment: 1, step: 12 });
        assert_eq!(latest_checkpoint(&s, 14), Some(12), "nothing saved since it resumed at 12");
        assert_eq!(latest_checkpoint(&s, 20), Some(15));
        s.train.checkpoint_every = 0;
        assert_eq!(latest_checkpoint(&s, 20), None, "saves none");
        let from = |step| ResumeFrom { experiment: 7, step };
        assert_eq!(check_resume_step(from(15), &source(), 20, true), None);
        let older = check_resume_step(from(10), &source(), 20, true).unwrap();
        assert!(older.message.contains("only its latest checkpoint, of step 15"), "{older}");
        assert!(check_resume_step(from(15), &source(), 20, false).unwrap().message.contains("still running"));
    }

    #[test]
    fn what_a_checkpoint_fixes_is_refused_field_by_field() {
        let mut spec = resuming(7);
        (spec.parallel.tp, spec.train.precision) = (2, Precision::Bf16);
        let fields: Vec<String> =
            fit_to_source(&mut spec, &source()).unwrap_err().into_iter().map(|e| e.field).collect();
        assert_eq!(fields, ["parallel.tp", "train.precision"]);
        let mut spec = resuming(5);
        (spec.parallel.dp, spec.train.micro_batch) = (3, 1);
        let errors = fit_to_source(&mut spec, &source()).unwrap_err();
        assert!(errors[0].message.contains("3 does not divide it"), "{errors:?}");
        let mut no_checkpoints = source();
        no_checkpoints.train.checkpoint_every = 0;
        let why = check_resume_step(ResumeFrom { experiment: 7, step: 5 }, &no_checkpoints, 20, true).unwrap();
        assert!(why.message.contains("saved no checkpoint"), "{why}");
    }
}
