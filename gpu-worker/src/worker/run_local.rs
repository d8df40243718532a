//! `distlab-worker run SPEC.json [--out DIR] [--dataset FILE] [--limits FILE]`: train one
//! spec with no server (`--dataset`: the text of a spec with `data.dataset: upload`;
//! `--limits`: the limits it is held to, the server's defaults otherwise).
//! stdout: one JSON line per optimizer step, then `{"summary": {...}}`. With `--out DIR`:
//! spec.json, metrics.jsonl, summary.json and trace.json (timeline, collectives, memory),
//! and the trained model in Hugging Face's format (model.safetensors and config.json).
//! With `--checkpoint-dir DIR` a spec with `checkpoint_every` > 0 saves its checkpoints
//! there, a second run of the same spec resumes from the latest complete one (after a
//! crash or a kill), and a run that succeeds keeps only the latest, for another spec to
//! start from (`train.resume_from`, with DIR named `experiment-<id>` next to the other
//! experiment's); the same spec run again after a success starts afresh.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::atomic::AtomicBool;

use anyhow::Context;
use distlab_common::*;

use super::execute::{execute, ExecError, Hosts, RunPaths};

/// Exit codes: 0 done, 1 the run failed, 2 the spec is invalid or unsupported.
#[allow(clippy::too_many_arguments)]
pub fn run_spec_file(
    spec_path: &Path,
    out: Option<PathBuf>,
    checkpoint_dir: Option<PathBuf>,
    dataset: Option<PathBuf>,
    limits: Option<PathBuf>,
    threads: usize,
    collective_timeout: std::time::Duration,
    simulated_hosts: usize,
) -> anyhow::Result<i32> {
    let text = std::fs::read_to_string(spec_path).with_context(|| format!("cannot read {}", spec_path.display()))?;
    let limits: Limits = match limits {
        Some(path) => {
            let text = std::fs::read_to_string(&path).with_context(|| format!("cannot read {}", path.display()))?;
            serde_json::from_str(&text).with_context(|| format!("{} is not a limits object", path.display()))?
        }
        None => Limits::default(),
    };
    let spec = match ExperimentSpec::from_json_str(&text).and_then(|spec| spec.validated(&limits)) {
        Ok(spec) => spec,
        Err(errors) => return Ok(invalid(spec_path, &errors)),
    };
    let mut metrics_file = match &out {
        Some(dir) => {
            std::fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;
            std::fs::write(dir.join("spec.json"), serde_json::to_string_pretty(&spec)?)?;
            Some(std::io::BufWriter::new(std::fs::File::create(dir.join("metrics.jsonl"))?))
        }
        None => None,
    };

    let stdout = std::io::stdout();
    let mut write_error = None;
    let mut traces: Vec<distlab_common::trace::RankTrace> = Vec::new();
    let mut on_event = |event: RunEvent| match event {
        RunEvent::Metric(point) => {
            let line = serde_json::to_string(&point).unwrap_or_default();
            let mut w = stdout.lock();
            let res = writeln!(w, "{line}").and_then(|_| w.flush());
            let res = res.and_then(|_| metrics_file.as_mut().map_or(Ok(()), |f| writeln!(f, "{line}")));
            if let Err(e) = res {
                write_error.get_or_insert(e);
            }
        }
        RunEvent::Log(log) => eprintln!("[{:?}] {}", log.level, log.message),
        RunEvent::Start { from_step } if from_step > 0 => eprintln!("resuming at step {from_step}"),
        RunEvent::Start { .. } => {}
        RunEvent::Trace(trace) => traces.push(trace),
    };
    let cancel = AtomicBool::new(false);
    let paths = RunPaths {
        checkpoints: checkpoint_dir.as_deref(),
        model_out: out.as_deref(),
        dataset: dataset.as_deref(),
        ..RunPaths::default()
    };
    let hosts = Hosts::Here { simulated: simulated_hosts };
    // The CPU's peak (a CPU run's MFU), measured before the ranks take the cores. A cuda
    // run's peak is its GPU's datasheet figure.
    if spec.backend == BackendKind::Cpu {
        super::peak::cpu_thread_peak();
    }
    let result = execute(&spec, threads, collective_timeout, hosts, paths, &mut on_event, &cancel)
        .and_then(|summary| summary.ok_or_else(|| ExecError::Other("the run ended without a summary".into())));
    if let Some(e) = write_error {
        return Err(e).context("cannot write the metrics");
    }
    match result {
        Ok(summary) => {
            if let Some(dir) = &checkpoint_dir {
                // The latest checkpoint stays, for another run to start from (`train.resume_from`).
                let dir = distlab_worker::checkpoint::CheckpointDir::new(dir, spec.world_size());
                dir.prune();
                dir.mark_finished();
            }
            println!("{}", serde_json::json!({ "summary": summary }));
            if let Some(dir) = &out {
                std::fs::write(dir.join("summary.json"), serde_json::to_string_pretty(&summary)?)?;
                if !traces.is_empty() {
                    traces.sort_by_key(|t| t.rank);
                    let trace = distlab_common::trace::ExperimentTrace { ranks: traces };
                    std::fs::write(dir.join("trace.json"), serde_json::to_string(&trace)?)?;
                }
            }
            Ok(0)
        }
        Err(e) if e.is_spec_problem() => {
            eprintln!("error: {e}");
            Ok(2)
        }
        Err(e) => {
            eprintln!("error: the run failed: {e}");
            Ok(1)
        }
    }
}

fn invalid(path: &Path, errors: &[FieldError]) -> i32 {
    eprintln!("error: {} is not a valid experiment spec:", path.display());
    for e in errors {
        eprintln!("  - {e}");
    }
    2
}
