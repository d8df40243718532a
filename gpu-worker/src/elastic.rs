//! Elastic resume (`train.resume_from`): another experiment's checkpoint re-cut for this
//! run's data-parallel degree and sharding, written into this run's checkpoint directory
//! as if this run had saved it; the run then resumes from it the usual way.
//!
//! A checkpoint has one file per rank (`checkpoint.rs`). For one stage of one TP rank the
//! data-parallel ranks' files together hold the stage's whole state, each section either
//! whole in DP rank 0's file (replicated) or cut into every rank's shard of every unit
//! (`parallel/shard.rs`):
//!
//! ```text
//!   section          none (DDP)   zero1    zero2    fsdp
//!   params           whole        whole    whole    shards
//!   adam_m, adam_v,  whole        shards   shards   shards
//!   master
//!   loss_scale       in every file
//! ```
//!
//! Re-cutting = putting each section back together from the old files, then cutting it as
//! the new run's ranks hold it. Nothing is summed or rounded: the new run starts from the
//! same numbers, bit for bit.

use std::path::{Path, PathBuf};

use distlab_common::elastic::{fit_to_source, sibling_dir_name};
use distlab_common::schedule::Pipeline;
use distlab_common::{ExperimentSpec, ResumeFrom, Sharding};

use crate::checkpoint::{self, CheckpointDir, CheckpointError, RankCheckpoint, RankPlace};
use crate::model::{ParamLayout, Stage, TpPlace};
use crate::parallel::compression::{COMPRESSION_Q, COMPRESSION_RESIDUAL};
use crate::parallel::pipeline::stage_of;
use crate::parallel::shard::ShardLayout;

/// How a section of a checkpoint is held across the data-parallel ranks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Held {
    /// Whole, in DP rank 0's file.
    Whole,
    /// Cut into each rank's shard of each unit.
    Sharded,
    /// The same in every rank's file.
    Everywhere,
    /// Each rank's own (gradient compression's residual): not carried to other ranks, whose
    /// residual starts at zero.
    Own,
}

fn held(section: &str, sharding: Sharding) -> Held {
    match section {
        "loss_scale" => Held::Everywhere,
        COMPRESSION_RESIDUAL | COMPRESSION_Q => Held::Own,
        "params" if sharding == Sharding::Fsdp => Held::Sharded,
        "params" => Held::Whole,
        _ if sharding == Sharding::None => Held::Whole,
        _ => Held::Sharded,
    }
}

/// The checkpoint directory of experiment `experiment`, a sibling of `own` (every
/// experiment's directory is `experiment-<id>-<store>` under the worker's
/// `--checkpoint-dir`, `store` the server database's id).
pub fn experiment_dir(own: &Path, experiment: i64) -> PathBuf {
    let own_name = own.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    own.parent().unwrap_or(Path::new(".")).join(sibling_dir_name(&own_name, experiment))
}

/// Writes `from`'s checkpoint re-cut for `spec` into `own` (this run's directory, made
/// ready by `CheckpointDir::prepare`). Returns what `fit_to_source` said about the
/// global batch. The source's spec is the one saved with its checkpoints.
pub fn recut_into(own: &Path, spec: &ExperimentSpec, from: ResumeFrom) -> Result<Option<String>, CheckpointError> {
    let source_root = experiment_dir(own, from.experiment);
    let spec_path = source_root.join("spec.json");
    let missing = |why: String| CheckpointError::Mismatch { path: source_root.clone(), why };
    let text = std::fs::read_to_string(&spec_path).map_err(|e| {
        missing(format!(
            "experiment {}'s checkpoints are not on this worker ({e}): a run resumes on the worker that saved them, \
             or on any local worker of the same server",
            from.experiment
        ))
    })?;
    let source: ExperimentSpec = serde_json::from_str(&text)
        .map_err(|e| CheckpointError::Corrupt { path: spec_path.clone(), why: e.to_string() })?;
    // The server has made the spec fit already (grad_accum); anything left is a mismatch.
    let mut fitted = spec.clone();
    fit_to_source(&mut fitted, &source)
        .map_err(|errors| missing(errors.iter().map(|e| e.to_string()).collect::<Vec<_>>().join("; ")))?;
    if fitted != *spec {
        return Err(missing(format!(
            "set train.grad_accum to {} to keep experiment {}'s global batch of {} sequences",
            fitted.train.grad_accum,
            from.experiment,
            source.global_batch()
        )));
    }
    let (source_dir, own_dir) =
        (CheckpointDir::new(&source_root, source.world_size()), CheckpointDir::new(own, spec.world_size()));
    recut(&source_dir, &source, &own_dir, spec, from.step)?;
    let (old, new) = (source.global_batch(), spec.global_batch());
    Ok(Some(format!(
        "resumed from experiment {}'s checkpoint of step {}: dp {} {} -> dp {} {}, {new} sequences per step{}",
        from.experiment,
        from.step,
        source.parallel.dp,
        source.parallel.sharding.as_str(),
        spec.parallel.dp,
        spec.parallel.sharding.as_str(),
        if old == new && source.train.grad_accum != spec.train.grad_accum {
            format!(" (grad_accum {} -> {})", source.train.grad_accum, spec.train.grad_accum)
        } else {
            String::new()
        }
    )))
}

/// Re-cuts the checkpoint of `step` in `from` (saved by a run of `source`) into `to` for a
/// run of `spec` (same model, tp and pp; any dp and sharding).
pub fn recut(
    from: &CheckpointDir,
    source: &ExperimentSpec,
    to: &CheckpointDir,
    spec: &ExperimentSpec,
    step: u64,
) -> Result<(), CheckpointError> {
    let (tp, pp) = (spec.parallel.tp, spec.parallel.pp);
    let pipe = Pipeline::of(spec);
    for tp_rank in 0..tp {
        for stage in 0..pp {
            let stage_blocks = stage_of(&pipe, spec.model.layers, stage);
            let place = TpPlace { rank: tp_rank, size: tp };
            let layout = ParamLayout::with_unit_order(&spec.model, place, &stage_blocks.unit_order);
            let place = |dp| RankPlace { dp, tp: tp_rank, pp: stage };
            let old: Vec<RankCheckpoint> = (0..source.parallel.dp)
                .map(|dp| checkpoint::read(&from.file(step, place(dp))))
                .collect::<Result<_, _>>()?;
            let cut = StageCut { layout: &layout, stage: &stage_blocks };
            let whole = cut
                .assemble(&old, source.parallel.sharding)
                .map_err(|why| CheckpointError::Mismatch { path: from.file(step, place(0)), why })?;
            for dp in 0..spec.parallel.dp {
                let ckpt = cut.rank_file(&whole, &old[0], spec.parallel.sharding, dp, spec.parallel.dp);
                checkpoint::write(&to.file(step, place(dp)), &ckpt)?;
            }
        }
    }
    Ok(())
}

/// A stage's sections, each whole: (name, the stage's flat buffer of it).
pub type Sections = Vec<(String, Vec<f32>)>;

/// Every section of one stage of one TP rank, whole (the stage's flat buffer), put
/// back together from the files its data-parallel ranks wrote for `step` in `dir` (saved
/// by a run of `spec`). The model's export reads the parameters this way.
pub fn stage_sections(
    dir: &CheckpointDir,
    spec: &ExperimentSpec,
    step: u64,
    tp_rank: usize,
    stage: usize,
) -> Result<(ParamLayout, Stage, Sections), CheckpointError> {
    let stage_blocks = stage_of(&Pipeline::of(spec), spec.model.layers, stage);
    let layout = ParamLayout::with_unit_order(
        &spec.model,
        TpPlace { rank: tp_rank, size: spec.parallel.tp },
        &stage_blocks.unit_order,
    );
    let place = |dp| RankPlace { dp, tp: tp_rank, pp: stage };
    let files: Vec<RankCheckpoint> =
        (0..spec.parallel.dp).map(|dp| checkpoint::read(&dir.file(step, place(dp)))).collect::<Result<_, _>>()?;
    let whole = StageCut { layout: &layout, stage: &stage_blocks }
        .assemble(&files, spec.parallel.sharding)
        .map_err(|why| CheckpointError::Mismatch { path: dir.file(step, place(0)), why })?;
    Ok((layout, stage_blocks, whole))
}

/// One stage of one TP rank: how its sections are cut.
struct StageCut<'a> {
    layout: &'a ParamLayout,
    stage: &'a Stage,
}

impl StageCut<'_> {
    fn shards(&self, rank: usize, world: usize) -> ShardLayout {
        ShardLayout::new(self.layout, &self.stage.units(), rank, world)
    }

    /// Every section of DP rank 0's file, whole (the stage's flat buffer), from the files
    /// of all DP ranks of a run sharded as `sharding`.
    fn assemble(&self, files: &[RankCheckpoint], sharding: Sharding) -> Result<Vec<(String, Vec<f32>)>, String> {
        let stage_len = self.stage.range(self.layout).len();
        let mut whole = Vec::new();
        for (name, values) in &files[0].sections {
            let section = match held(name, sharding) {
                Held::Own => continue,
                Held::Whole | Held::Everywhere => values.clone(),
                Held::Sharded => {
                    let mut out = vec![0.0; stage_len];
                    for (rank, file) in files.iter().enumerate() {
                        let theirs = file.section(name).ok_or_else(|| format!("DP rank {rank} saved no {name}"))?;
                        let shards = self.shards(rank, files.len());
                        if theirs.len() != shards.len {
                            return Err(format!(
                                "DP rank {rank}'s {name} holds {}, its shard {}",
                                theirs.len(),
                                shards.len
                            ));
                        }
                        for u in &shards.units {
                            let at = shards.in_buffer(u).start + u.mine.start;
                            out[at..at + u.mine.len()].copy_from_slice(&theirs[u.local()]);
                        }
                    }
                    out
                }
            };
            if held(name, sharding) != Held::Everywhere && section.len() != stage_len {
                return Err(format!("{name} holds {} values, the stage {stage_len}", section.len()));
            }
            whole.push((name.clone(), section));
        }
        Ok(whole)
    }

    /// The file DP rank `rank` of `world` writes under `sharding`, from the whole sections.
    fn rank_file(
        &self,
        whole: &[(String, Vec<f32>)],
        header: &RankCheckpoint,
        sharding: Sharding,
        rank: usize,
        world: usize,
    ) -> RankCheckpoint {
        let shards = self.shards(rank, world);
        let sections = whole
            .iter()
            .filter_map(|(name, values)| match held(name, sharding) {
                Held::Everywhere => Some((name.clone(), values.clone())),
                Held::Whole => (rank == 0).then(|| (name.clone(), values.clone())),
                Held::Own => None,
                Held::Sharded => {
                    let mine = shards.units.iter().flat_map(|u| {
                        let at = shards.in_buffer(u).start + u.mine.start;
                        values[at..at + u.mine.len()].iter().copied()
                    });
                    Some((name.clone(), mine.collect()))
                }
            })
            .collect();
        RankCheckpoint {
            step: header.step,
            optimizer_steps: header.optimizer_steps,
            min_loss: header.min_loss,
            sections,
            booked: None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use distlab_common::{ModelSpec, PpSchedule};

    /// A stage's state, made up, saved the way a run of `dp` ranks sharded as `sharding` would.
    fn saved(cut: &StageCut, whole: &[(String, Vec<f32>)], sharding: Sharding, dp: usize) -> Vec<RankCheckpoint> {
        let header = RankCheckpoint { step: 6, optimizer_steps: 6, min_loss: 2.5, ..Default::default() };
        (0..dp).map(|rank| cut.rank_file(whole, &header, sharding, rank, dp)).collect()
    }

    #[test]
    fn any_dp_and_sharding_re_cut_to_any_other_gives_back_the_same_numbers() {
        let model = ModelSpec::dense(3, 8, 2, 5, 11);
        let layout = ParamLayout::for_tp(&model, TpPlace { rank: 1, size: 2 });
        let pipe = Pipeline { kind: PpSchedule::OneFOneB, stages: 2, chunks: 1, micro_batches: 2 };
        let stage = stage_of(&pipe, model.layers, 1);
        let cut = StageCut { layout: &layout, stage: &stage };
        let len = stage.range(&layout).len();
        let whole: Vec<(String, Vec<f32>)> = ["params", "adam_m", "adam_v", "master"]
            .iter()
            .enumerate()
            .map(|(k, name)| (name.to_string(), (0..len).map(|i| (k * 10_000 + i) as f32).collect()))
            .chain([("loss_scale".to_string(), vec![1024.0, 3.0, 1.0])])
            .collect();
        let shardings = [Sharding::None, Sharding::Zero1, Sharding::Zero2, Sharding::Fsdp];
        for from in shardings {
            for from_dp in 1..=4 {
                let files = saved(&cut, &whole, from, from_dp);
                assert_eq!(cut.assemble(&files, from).unwrap(), whole, "{from:?} dp={from_dp}");
                for to in shardings {
                    for to_dp in 1..=3 {
                        let assembled = cut.assemble(&files, from).unwrap();
                        let recut: Vec<RankCheckpoint> =
                            (0..to_dp).map(|r| cut.rank_file(&assembled, &files[0], to, r, to_dp)).collect();
                        let what = format!("{from:?} dp={from_dp} -> {to:?} dp={to_dp}");
                        assert_eq!(cut.assemble(&recut, to).unwrap(), whole, "{what}");
                        // Only DP rank 0 holds what is whole; every rank holds the loss scale.
                        let has = |r: &RankCheckpoint, name: &str| r.section(name).is_some();
                        assert!(recut.iter().all(|r| has(r, "loss_scale")), "{what}");
                        assert_eq!(
                            recut.iter().filter(|r| has(r, "params")).count(),
                            if to == Sharding::Fsdp { to_dp } else { 1 }
                        );
                    }
                }
            }
        }
        // A shard of the wrong size is named, not misread.
        let mut files = saved(&cut, &whole, Sharding::Fsdp, 2);
        files[1].sections[0].1.pop();
        assert!(cut.assemble(&files, Sharding::Fsdp).unwrap_err().contains("DP rank 1's params"));
        // Each rank's compression residual is its own: not carried to the new ranks.
        let mut files = saved(&cut, &whole, Sharding::None, 2);
        for file in &mut files {
            file.sections.push((COMPRESSION_RESIDUAL.into(), vec![1.0; len]));
        }
        let assembled = cut.assemble(&files, Sharding::None).unwrap();
        assert_eq!(assembled, whole, "the residual is left out");
    }
}
