//! Checkpoints: what each rank needs to continue a run exactly where it stopped.
//!
//! The state of a run before optimizer step t is: the parameters, the optimizer state
//! (AdamW's m and v and its step count) and the position in the data. The batch of step t
//! is a function of (data seed, t) alone and nothing else draws random numbers, so the
//! data position is t itself and there is no RNG state to carry.
//!
//! On disk, one directory per experiment:
//!
//! ```text
//!   <root>/spec.json                       the spec these checkpoints belong to
//!   <root>/step-000020/dp0-tp0-pp0.ckpt    one file per rank: "resume at step 20"
//!   <root>/step-000020/dp1-tp0-pp0.ckpt
//!   <root>/finished                        the run ended: only its latest step is kept
//! ```
//!
//! A rank writes a temp file of its own (`.<file>.<pid>.tmp`), syncs it to disk and renames
//! it over `<file>`. A rename is atomic, so a crash leaves the file whole or absent, never
//! torn. A step is complete when
//! every rank's file is there, and a resume takes the latest complete step.
//!
//! Who writes what follows the strategy. State that every rank of a data-parallel group
//! holds alike (DDP's parameters and optimizer state, ZeRO's parameters) is written once,
//! by DP rank 0, and read from there on resume. Sharded state (the ZeRO optimizer state,
//! all of FSDP's) is written by the rank that owns it. A rank that owns nothing still
//! writes a file with just the header, so "complete" is a count of files.
//!
//! A file is one JSON header line, then each section's f32 values, little-endian, in the
//! header's order.

use std::fs::{self, File};
use std::io::{BufWriter, Read, Write};
use std::path::{Path, PathBuf};
use std::sync::mpsc;
use std::thread::JoinHandle;
use std::time::Instant;

use distlab_common::ExperimentSpec;
use serde::{Deserialize, Serialize};

use crate::memory::Receipt;

const FORMAT: &str = "distlab-checkpoint-1";
/// The file that marks a finished run's directory (see [`CheckpointDir::mark_finished`]).
const FINISHED: &str = "finished";

/// Where a rank sits in the dp x tp x pp mesh (its checkpoint file's name).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RankPlace {
    pub dp: usize,
    pub tp: usize,
    pub pp: usize,
}

impl RankPlace {
    fn file_name(self) -> String {
        format!("dp{}-tp{}-pp{}.ckpt", self.dp, self.tp, self.pp)
    }

    /// The rank of the same tensor and pipeline coordinates that writes replicated state.
    pub fn dp_rank_zero(self) -> RankPlace {
        RankPlace { dp: 0, ..self }
    }
}

/// One rank's checkpoint: the header's numbers and the sections this rank owns.
#[derive(Debug, Default)]
pub struct RankCheckpoint {
    /// The next optimizer step to run.
    pub step: u64,
    /// Updates the optimizer has made (AdamW's bias corrections depend on it).
    pub optimizer_steps: u64,
    /// The lowest step loss so far (for the run's summary).
    pub min_loss: f64,
    /// Named runs of floats: "params", "adam_m", "adam_v".
    pub sections: Vec<(String, Vec<f32>)>,
    /// The sections' booking in the rank's ledger (a copy made for writing; None for one
    /// read back from a file).
    pub booked: Option<Receipt>,
}

/// The same checkpoint: the same numbers (wherever they are booked).
impl PartialEq for RankCheckpoint {
    fn eq(&self, other: &Self) -> bool {
        (self.step, self.optimizer_steps, self.min_loss, &self.sections)
            == (other.step, other.optimizer_steps, other.min_loss, &other.sections)
    }
}

impl RankCheckpoint {
    pub fn section(&self, name: &str) -> Option<&[f32]> {
        self.sections.iter().find(|(n, _)| n == name).map(|(_, v)| &v[..])
    }

    pub fn bytes(&self) -> u64 {
        self.sections.iter().map(|(_, v)| v.len() as u64 * 4).sum()
    }
}

#[derive(Serialize, Deserialize)]
struct Header {
    format: String,
    step: u64,
    optimizer_steps: u64,
    min_loss: f64,
    sections: Vec<SectionInfo>,
}

#[derive(Serialize, Deserialize)]
struct SectionInfo {
    name: String,
    len: usize,
}

#[derive(Debug, thiserror::Error)]
pub enum CheckpointError {
    #[error("checkpoint {path}: {source}")]
    Io { path: PathBuf, source: std::io::Error },
    #[error("checkpoint {path} is not a distlab checkpoint: {why}")]
    Corrupt { path: PathBuf, why: String },
    #[error("checkpoint {path} does not fit this rank: {why}")]
    Mismatch { path: PathBuf, why: String },
}

fn io_error(path: &Path) -> impl FnOnce(std::io::Error) -> CheckpointError + '_ {
    move |source| CheckpointError::Io { path: path.to_path_buf(), source }
}

/// Writes `ckpt` to `path` atomically (temp file, sync, rename); returns the bytes written.
pub fn write(path: &Path, ckpt: &RankCheckpoint) -> Result<u64, CheckpointError> {
    let dir = path.parent().unwrap_or(Path::new("."));
    fs::create_dir_all(dir).map_err(io_error(dir))?;
    let header = Header {
        format: FORMAT.into(),
        step: ckpt.step,
        optimizer_steps: ckpt.optimizer_steps,
        min_loss: ckpt.min_loss,
        sections: ckpt.sections.iter().map(|(name, v)| SectionInfo { name: name.clone(), len: v.len() }).collect(),
    };
    let tmp = temp_path(path);
    let write_all = || -> std::io::Result<u64> {
        let file = fs::OpenOptions::new().write(true).create_new(true).open(&tmp)?;
        let mut out = BufWriter::with_capacity(1 << 20, file);
        let line = serde_json::to_string(&header).map_err(std::io::Error::other)?;
        writeln!(out, "{line}")?;
        for (_, values) in &ckpt.sections {
            out.write_all(bytemuck::cast_slice(values))?;
        }
        let file = out.into_inner().map_err(|e| e.into_error())?;
        file.sync_all()?;
        Ok(line.len() as u64 + 1 + ckpt.bytes())
    };
    let renamed = write_all()
        .map_err(io_error(&tmp))
        .and_then(|bytes| fs::rename(&tmp, path).map(|_| bytes).map_err(io_error(path)));
    match renamed {
        Ok(bytes) => {
            // The rename is durable once the directory entry is on disk too.
            let _ = File::open(dir).and_then(|d| d.sync_all());
            Ok(bytes)
        }
        Err(e) => {
            let _ = fs::remove_file(&tmp);
            Err(e)
        }
    }
}

/// A temp name no other process uses: `.<file>.<pid>.tmp` next to `path` (a rank left running
/// by a worker that lost its lease must not write into the new attempt's temp file).
fn temp_path(path: &Path) -> PathBuf {
    let name = path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    path.with_file_name(format!(".{name}.{}.tmp", std::process::id()))
}

/// Reads a checkpoint written by [`write`], checking its format and length.
pub fn read(path: &Path) -> Result<RankCheckpoint, CheckpointError> {
    let corrupt = |why: String| CheckpointError::Corrupt { path: path.to_path_buf(), why };
    let mut bytes = Vec::new();
    File::open(path).and_then(|mut f| f.read_to_end(&mut bytes)).map_err(io_error(path))?;
    let newline = bytes.iter().position(|&b| b == b'\n').ok_or_else(|| corrupt("no header line".into()))?;
    let header: Header = serde_json::from_slice(&bytes[..newline]).map_err(|e| corrupt(e.to_string()))?;
    if header.format != FORMAT {
        return Err(corrupt(format!("format {:?}, expected {FORMAT:?}", header.format)));
    }
    let mut body = &bytes[newline + 1..];
    let expected: usize = header.sections.iter().map(|s| s.len.saturating_mul(4)).sum();
    if body.len() != expected {
        return Err(corrupt(format!("{} bytes of values, the header describes {expected}", body.len())));
    }
    let mut sections = Vec::with_capacity(header.sections.len());
    for s in header.sections {
        let (values, rest) = body.split_at(s.len * 4);
        sections.push((s.name, values.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect()));
        body = rest;
    }
    Ok(RankCheckpoint {
        step: header.step,
        optimizer_steps: header.optimizer_steps,
        min_loss: header.min_loss,
        sections,
        booked: None,
    })
}

/// One experiment's checkpoint directory, for a run of `world` ranks.
#[derive(Clone, Debug)]
pub struct CheckpointDir {
    pub root: PathBuf,
    pub world: usize,
}

impl CheckpointDir {
    pub fn new(root: impl Into<PathBuf>, world: usize) -> Self {
        Self { root: root.into(), world }
    }

    fn step_dir(&self, step: u64) -> PathBuf {
        self.root.join(format!("step-{step:06}"))
    }

    pub fn file(&self, step: u64, place: RankPlace) -> PathBuf {
        self.step_dir(step).join(place.file_name())
    }

    /// Steps with a directory, each with how many rank files it holds.
    fn steps(&self) -> Vec<(u64, usize, PathBuf)> {
        let Ok(entries) = fs::read_dir(&self.root) else { return Vec::new() };
        let mut steps: Vec<(u64, usize, PathBuf)> = entries
            .flatten()
            .filter_map(|e| {
                let step = e.file_name().to_str()?.strip_prefix("step-")?.parse().ok()?;
                let files = fs::read_dir(e.path())
                    .map(|d| d.flatten().filter(|f| f.file_name().to_string_lossy().ends_with(".ckpt")).count())
                    .unwrap_or(0);
                Some((step, files, e.path()))
            })
            .collect();
        steps.sort_by_key(|s| s.0);
        steps
    }

    /// The latest step every rank has written its file for.
    pub fn latest_complete(&self) -> Option<u64> {
        self.steps().into_iter().rev().find(|s| s.1 == self.world).map(|s| s.0)
    }

    /// After a run: deletes every step older than the latest complete one (no rank writes
    /// those any more).
    pub fn prune(&self) {
        self.prune_keeping(1);
    }

    /// While a run goes on: deletes every step older than the two latest complete ones. The
    /// one before the latest stays because the server may not have the metric points of the
    /// steps since it yet (a worker sends them every half second): a run resumes only from
    /// a checkpoint whose steps' points are stored (`prepare`).
    pub fn prune_while_running(&self) {
        self.prune_keeping(2);
    }

    fn prune_keeping(&self, complete: usize) {
        let steps = self.steps();
        let Some(oldest_kept) = steps.iter().rev().filter(|s| s.1 == self.world).nth(complete - 1).map(|s| s.0) else {
            return;
        };
        for (_, _, path) in steps.into_iter().filter(|s| s.0 < oldest_kept) {
            let _ = fs::remove_dir_all(path);
        }
    }

    /// Marks the run these checkpoints belong to as finished: its latest checkpoint stays
    /// for other runs to start from (`train.resume_from`), and the same spec run here again
    /// starts afresh instead of resuming.
    pub fn mark_finished(&self) {
        let _ = fs::write(self.root.join(FINISHED), b"");
    }

    /// Before a run: creates the directory for `spec` and returns the step to resume from:
    /// the latest complete checkpoint, and at most `at_most` (the server has the metric
    /// points of the steps before it: resuming later would leave the steps between without
    /// theirs). Checkpoints of another spec (a reused experiment id) or of a finished run are
    /// deleted first, and so are steps after the one resumed from (incomplete, unreadable,
    /// or past `at_most`: a warning says which).
    pub fn prepare(&self, spec: &ExperimentSpec, at_most: Option<u64>) -> Result<Resume, CheckpointError> {
        let spec_path = self.root.join("spec.json");
        let written = fs::read_to_string(&spec_path).ok().and_then(|s| serde_json::from_str::<ExperimentSpec>(&s).ok());
        if written.as_ref() != Some(spec) || self.root.join(FINISHED).exists() {
            self.remove();
            fs::create_dir_all(&self.root).map_err(io_error(&self.root))?;
            let json = serde_json::to_vec_pretty(spec).map_err(|e| io_error(&spec_path)(std::io::Error::other(e)))?;
            fs::write(&spec_path, json).map_err(io_error(&spec_path))?;
            return Ok(Resume::default());
        }
        let mut resume = Resume::default();
        for (step, files, path) in self.steps().into_iter().rev() {
            if let Some(stored) =
                at_most.filter(|&stored| resume.step.is_none() && files == self.world && step > stored)
            {
                resume.warnings.push(format!(
                    "not resuming from step {step}: the server has the metrics of the steps before {stored} only (the \
                     rest were not delivered), so the run goes back to an earlier checkpoint"
                ));
            } else if resume.step.is_none() && files == self.world {
                match self.check_step(&path) {
                    Ok(()) => {
                        resume.step = Some(step);
                        continue;
                    }
                    Err(e) => resume.warnings.push(format!("not resuming from step {step}: {e}")),
                }
            }
            if resume.step.is_none() {
                let _ = fs::remove_dir_all(path);
            }
        }
        Ok(resume)
    }

    /// Every rank file of a step reads back whole.
    fn check_step(&self, path: &Path) -> Result<(), CheckpointError> {
        for entry in fs::read_dir(path).map_err(io_error(path))?.flatten() {
            if entry.file_name().to_string_lossy().ends_with(".ckpt") {
                read(&entry.path())?;
            }
        }
        Ok(())
    }

    /// Deletes what distlab wrote here (the steps and spec.json), then the directory itself
    /// if nothing else is in it: a directory a user named may hold files of their own.
    pub fn remove(&self) {
        for (_, _, path) in self.steps() {
            let _ = fs::remove_dir_all(path);
        }
        let _ = fs::remove_file(self.root.join("spec.json"));
        let _ = fs::remove_file(self.root.join(FINISHED));
        let _ = fs::remove_dir(&self.root);
    }
}

/// Where a run starts: the step of the checkpoint to resume from (none: from scratch), and
/// why newer checkpoints were passed over.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Resume {
    pub step: Option<u64>,
    pub warnings: Vec<String>,
}

/// How one checkpoint write went.
#[derive(Clone, Debug, PartialEq)]
pub struct Written {
    pub step: u64,
    pub bytes: u64,
    /// Time spent writing (and syncing) the file.
    pub write_ms: f64,
    /// Time the training loop stood still for it: the whole write when synchronous, only the
    /// copy of the state when a writer thread does the rest.
    pub waited_ms: f64,
}

/// Writes a rank's checkpoints, on the training thread or on a writer thread of its own.
pub struct CheckpointWriter {
    dir: CheckpointDir,
    place: RankPlace,
    /// Rank 0 deletes the steps a newer complete one makes useless.
    prunes: bool,
    thread: Option<WriterThread>,
    done: Vec<Result<Written, CheckpointError>>,
    /// A written checkpoint whose buffers the next one can reuse.
    spare: Option<RankCheckpoint>,
}

/// What the writer thread sends back: how the write went, and the checkpoint to reuse.
type WriteResult = (Result<Written, CheckpointError>, RankCheckpoint);

struct WriterThread {
    jobs: mpsc::SyncSender<(RankCheckpoint, f64)>,
    results: mpsc::Receiver<WriteResult>,
    handle: JoinHandle<()>,
}

impl CheckpointWriter {
    pub fn new(dir: CheckpointDir, place: RankPlace, asynchronous: bool) -> Self {
        let prunes = place == RankPlace { dp: 0, tp: 0, pp: 0 };
        let thread = asynchronous.then(|| {
            // One checkpoint queued behind the one being written, at most: a run that
            // checkpoints faster than the disk takes them waits instead of piling up copies.
            let (jobs, job_rx) = mpsc::sync_channel::<(RankCheckpoint, f64)>(1);
            let (result_tx, results) = mpsc::channel();
            let (dir, place) = (dir.clone(), place);
            let handle = std::thread::Builder::new()
                .name("checkpoint-writer".into())
                .spawn(move || {
                    for (ckpt, waited_ms) in job_rx {
                        let written = write_step(&dir, place, prunes, &ckpt, waited_ms);
                        let _ = result_tx.send((written, ckpt));
                    }
                })
                .ok();
            handle.map(|handle| WriterThread { jobs, results, handle })
        });
        Self { dir, place, prunes, thread: thread.flatten(), done: Vec::new(), spare: None }
    }

    /// An earlier checkpoint the writer is done with (its buffers are paged in: copying into
    /// them is several times faster than into fresh memory), or an empty one.
    pub fn spare(&mut self) -> RankCheckpoint {
        self.collect();
        self.spare.take().unwrap_or_default()
    }

    fn collect(&mut self) {
        if let Some(t) = &self.thread {
            for (written, ckpt) in t.results.try_iter() {
                self.done.push(written);
                self.spare = Some(ckpt);
            }
        }
    }

    /// Saves `ckpt` (made `copy_ms` ago by copying the state). Synchronous writers return
    /// when the file is on disk; asynchronous ones at once.
    pub fn save(&mut self, ckpt: RankCheckpoint, copy_ms: f64) {
        match &self.thread {
            Some(t) => {
                if let Err(mpsc::SendError((ckpt, waited))) = t.jobs.send((ckpt, copy_ms)) {
                    self.done.push(write_step(&self.dir, self.place, self.prunes, &ckpt, waited));
                    self.spare = Some(ckpt);
                }
            }
            None => {
                let mut written = write_step(&self.dir, self.place, self.prunes, &ckpt, 0.0);
                if let Ok(w) = &mut written {
                    w.waited_ms = copy_ms + w.write_ms;
                }
                self.done.push(written);
                self.spare = Some(ckpt);
            }
        }
    }

    /// The writes that have finished since the last call.
    pub fn finished(&mut self) -> Vec<Result<Written, CheckpointError>> {
        self.collect();
        std::mem::take(&mut self.done)
    }

    /// Waits for every write still in flight; returns those not yet reported.
    pub fn finish(mut self) -> Vec<Result<Written, CheckpointError>> {
        self.join();
        std::mem::take(&mut self.done)
    }

    fn join(&mut self) {
        if let Some(t) = self.thread.take() {
            drop(t.jobs);
            let _ = t.handle.join();
            self.done.extend(t.results.try_iter().map(|(written, _)| written));
        }
    }
}

/// A run that stops early (an error, a cancel) still lets the write in flight finish, so a
/// rank never exits with its checkpoint half written by a thread killed with the process.
impl Drop for CheckpointWriter {
    fn drop(&mut self) {
        self.join();
    }
}

fn write_step(
    dir: &CheckpointDir,
    place: RankPlace,
    prunes: bool,
    ckpt: &RankCheckpoint,
    waited_ms: f64,
) -> Result<Written, CheckpointError> {
    let start = Instant::now();
    let bytes = write(&dir.file(ckpt.step, place), ckpt)?;
    let write_ms = start.elapsed().as_secs_f64() * 1e3;
    if prunes {
        dir.prune_while_running();
    }
    Ok(Written { step: ckpt.step, bytes, write_ms, waited_ms })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample(step: u64) -> RankCheckpoint {
        RankCheckpoint {
            step,
            optimizer_steps: step,
            min_loss: 1.25,
            sections: vec![("params".into(), vec![1.0, -2.5, f32::MIN_POSITIVE]), ("adam_m".into(), vec![])],
            booked: None,
        }
    }

    #[test]
    fn a_checkpoint_reads_back_bit_for_bit() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("a/b.ckpt");
        let ckpt = sample(20);
        write(&path, &ckpt).unwrap();
        assert_eq!(read(&path).unwrap(), ckpt);
        assert_eq!(fs::read_dir(path.parent().unwrap()).unwrap().count(), 1, "the temp file is renamed away");
    }

    #[test]
    fn a_torn_or_foreign_file_is_refused_with_a_reason() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("x.ckpt");
        write(&path, &sample(3)).unwrap();
        let bytes = fs::read(&path).unwrap();
        fs::write(&path, &bytes[..bytes.len() - 2]).unwrap();
        let err = read(&path).unwrap_err().to_string();
        assert!(err.contains("bytes of values"), "{err}");
        fs::write(&path, b"hello\n").unwrap();
        assert!(matches!(read(&path), Err(CheckpointError::Corrupt { .. })));
    }

    #[test]
    fn only_steps_every_rank_wrote_are_complete_and_older_ones_are_pruned() {
        let root = tempfile::tempdir().unwrap();
        let dir = CheckpointDir::new(root.path(), 2);
        let (r0, r1) = (RankPlace { dp: 0, tp: 0, pp: 0 }, RankPlace { dp: 1, tp: 0, pp: 0 });
        assert_eq!(dir.latest_complete(), None);
        for place in [r0, r1] {
            write(&dir.file(10, place), &sample(10)).unwrap();
            write(&dir.file(20, place), &sample(20)).unwrap();
        }
        write(&dir.file(30, r0), &sample(30)).unwrap();
        // A crash mid-write leaves a temp file, which does not count.
        fs::write(temp_path(&dir.file(30, r1)), b"half").unwrap();
        assert_eq!(dir.latest_complete(), Some(20));
        dir.prune();
        assert!(!dir.file(10, r0).exists());
        assert!(dir.file(20, r1).exists() && dir.file(30, r0).exists());
    }

    #[test]
    fn checkpoints_of_another_spec_are_not_resumed() {
        let root = tempfile::tempdir().unwrap();
        let dir = CheckpointDir::new(root.path().join("experiment-1"), 1);
        let spec = ExperimentSpec::default();
        assert_eq!(dir.prepare(&spec, None).unwrap().step, None);
        write(&dir.file(5, RankPlace { dp: 0, tp: 0, pp: 0 }), &sample(5)).unwrap();
        assert_eq!(dir.prepare(&spec, None).unwrap().step, Some(5));
        let mut other = spec.clone();
        other.train.seed += 1;
        assert_eq!(dir.prepare(&other, None).unwrap().step, None);
        assert_eq!(dir.latest_complete(), None);
    }

    #[test]
    fn an_unreadable_latest_checkpoint_falls_back_to_the_one_before() {
        let root = tempfile::tempdir().unwrap();
        let dir = CheckpointDir::new(root.path().join("experiment-2"), 1);
        let spec = ExperimentSpec::default();
        dir.prepare(&spec, None).unwrap();
        let place = RankPlace { dp: 0, tp: 0, pp: 0 };
        for step in [5, 10, 15] {
            write(&dir.file(step, place), &sample(step)).unwrap();
        }
        fs::write(dir.file(15, place), b"{}\n").unwrap();
        let resume = dir.prepare(&spec, None).unwrap();
        assert_eq!(resume.step, Some(10));
        assert!(resume.warnings[0].contains("not resuming from step 15"), "{:?}", resume.warnings);
        assert!(!dir.file(15, place).exists(), "the unreadable step is deleted");
        assert!(dir.file(5, place).exists(), "older steps stay until the next checkpoint");
    }

    #[test]
    fn a_run_resumes_no_later_than_the_steps_the_server_has() {
        let root = tempfile::tempdir().unwrap();
        let dir = CheckpointDir::new(root.path().join("experiment-3"), 1);
        let spec = ExperimentSpec::default();
        dir.prepare(&spec, None).unwrap();
        let place = RankPlace { dp: 0, tp: 0, pp: 0 };
        for step in [10, 20, 30] {
            write(&dir.file(step, place), &sample(step)).unwrap();
            dir.prune_while_running();
        }
        assert!(!dir.file(10, place).exists() && dir.file(20, place).exists(), "the two latest stay");
        // The points of steps 25..30 never reached the server: step 30's checkpoint would
        // leave them missing for good, so the run goes back to step 20.
        let resume = dir.prepare(&spec, Some(25)).unwrap();
        assert_eq!(resume.step, Some(20));
        assert!(resume.warnings[0].contains("not resuming from step 30"), "{:?}", resume.warnings);
        assert!(!dir.file(30, place).exists());
        // A checkpoint at exactly the first missing step is fine.
        assert_eq!(dir.prepare(&spec, Some(20)).unwrap().step, Some(20));
        // None older: from the start.
        assert_eq!(dir.prepare(&spec, Some(5)).unwrap().step, None);
    }

    #[test]
    fn removing_keeps_files_distlab_did_not_write() {
        let root = tempfile::tempdir().unwrap();
        let dir = CheckpointDir::new(root.path(), 1);
        dir.prepare(&ExperimentSpec::default(), None).unwrap();
        write(&dir.file(5, RankPlace { dp: 0, tp: 0, pp: 0 }), &sample(5)).unwrap();
        fs::write(root.path().join("notes.txt"), b"mine").unwrap();
        dir.remove();
        let left: Vec<_> = fs::read_dir(root.path()).unwrap().map(|e| e.unwrap().file_name()).collect();
        assert_eq!(left, vec![std::ffi::OsString::from("notes.txt")]);
        let empty = CheckpointDir::new(root.path().join("only-ours"), 1);
        empty.prepare(&ExperimentSpec::default(), None).unwrap();
        empty.remove();
        assert!(!empty.root.exists(), "a directory holding only checkpoints goes");
    }

    #[test]
    fn the_writer_thread_writes_what_it_is_given() {
        let root = tempfile::tempdir().unwrap();
        let dir = CheckpointDir::new(root.path(), 1);
        let place = RankPlace { dp: 0, tp: 0, pp: 0 };
        let mut writer = CheckpointWriter::new(dir.clone(), place, true);
        writer.save(sample(4), 0.5);
        writer.save(sample(8), 0.5);
        writer.save(sample(12), 0.5);
        let written: Vec<Written> = writer.finish().into_iter().map(|w| w.unwrap()).collect();
        assert_eq!(written.iter().map(|w| w.step).collect::<Vec<_>>(), vec![4, 8, 12]);
        assert!(written.iter().all(|w| w.waited_ms == 0.5 && w.bytes > 12));
        assert_eq!(read(&dir.file(12, place)).unwrap(), sample(12));
        assert!(dir.file(8, place).exists(), "the one before the latest stays while the run goes on");
        assert!(!dir.file(4, place).exists(), "rank 0 prunes older steps");
    }
}
