//! Checkpoints and resume: a worker is SIGKILLed mid-run, its lease expires, a second
//! worker resumes from the latest complete checkpoint, and the loss curve is bit-identical
//! to a run that was never interrupted (fp32, CPU).

use distlab_common::*;
use distlab_tests::*;

/// 40 steps on two data-parallel ranks, a checkpoint every 10.
fn spec(name: &str, sharding: Sharding) -> ExperimentSpec {
    let mut spec = quick_spec(name, 40);
    spec.model = ModelSpec::dense(2, 64, 4, 32, 64);
    spec.train.micro_batch = 4;
    spec.parallel.dp = 2;
    spec.parallel.sharding = sharding;
    spec.train.checkpoint_every = 10;
    spec
}

fn killed_worker_resumes_with_identical_losses(sharding: Sharding) {
    resumes_with_identical_losses(spec(&format!("resume-{}", sharding.as_str()), sharding));
}

fn resumes_with_identical_losses(spec: ExperimentSpec) {
    let straight = run_losses(&spec);
    assert_eq!(straight.len(), 40);

    let mut lab = Lab::start_with(LabOptions {
        local_workers: 0,
        lease_seconds: 2.0,
        heartbeat_seconds: 0.5,
        ..LabOptions::default()
    });
    // Rank 0 of the first worker stops after step 24: steps 0-23 are stored, and the
    // checkpoints of steps 10 and 20 were written (only 20 is kept).
    let (id, exp) = kill_and_resume(&mut lab, &spec, 24);
    assert_eq!(exp.status, ExperimentStatus::Succeeded, "{exp:?}");

    let metrics: Metrics = lab.get_as(&format!("/api/experiments/{id}/metrics"));
    let resumed: Vec<f64> = metrics.steps.iter().map(|m| m.loss).collect();
    assert_eq!(metrics.steps.iter().map(|m| m.step).collect::<Vec<_>>(), (0..40).collect::<Vec<_>>());
    for (step, (a, b)) in straight.iter().zip(&resumed).enumerate() {
        assert_eq!(a.to_bits(), b.to_bits(), "step {step}: straight {a} vs resumed {b}");
    }

    let attempts: Attempts = lab.get_as(&format!("/api/experiments/{id}/attempts"));
    let summary: Vec<(i64, Option<u64>, u64)> =
        attempts.attempts.iter().map(|a| (a.attempt, a.from_step, a.lost_steps)).collect();
    assert_eq!(summary, vec![(1, Some(0), 0), (2, Some(20), 4)], "attempt 2 redid steps 20-23");
    assert_eq!(attempts.attempts[1].worker.as_deref(), Some("second"));
    // The latest checkpoint stays for another run to start from, until the experiment goes.
    let experiment_dir = lab.checkpoint_dir().join(format!("experiment-{id}"));
    let steps: Vec<String> = std::fs::read_dir(&experiment_dir)
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|name| name.starts_with("step-"))
        .collect();
    assert_eq!(steps, ["step-000030"], "a finished run keeps its latest checkpoint");
    assert_eq!(lab.delete(&format!("/api/experiments/{id}")), 204);
    assert!(!experiment_dir.exists(), "a deleted experiment's checkpoints are deleted");
}

#[test]
fn ddp_resumes_bit_identically_after_its_worker_is_killed() {
    killed_worker_resumes_with_identical_losses(Sharding::None);
}

#[test]
fn fsdp_resumes_bit_identically_from_sharded_checkpoints() {
    killed_worker_resumes_with_identical_losses(Sharding::Fsdp);
}

/// ZeRO-Offload to disk: the checkpoint is read from the state's file and put back into a
/// new one by the worker that resumes.
#[test]
fn zero1_with_its_state_on_disk_resumes_bit_identically() {
    let mut spec = spec("resume-zero1-offload", Sharding::Zero1);
    spec.parallel.offload = Offload::Disk;
    resumes_with_identical_losses(spec);
}

/// Gradient compression with error feedback: each rank's residual (and PowerSGD's Q) is
/// in its checkpoint, so the resumed run sends what the uninterrupted one sent.
#[test]
fn compressed_ddp_resumes_bit_identically_with_each_rank_s_residual() {
    for method in [GradCompression::Topk, GradCompression::Powersgd] {
        let mut spec = spec(&format!("resume-{}", method.as_str()), Sharding::None);
        spec.parallel.grad_compression = method;
        spec.parallel.compression_ratio = 0.05;
        resumes_with_identical_losses(spec);
    }
}

/// Expert parallelism: each rank holds its own experts, so every rank writes its own
/// parameters and optimizer state, and each reloads its own.
#[test]
fn expert_parallel_ddp_resumes_bit_identically_from_each_rank_s_experts() {
    let mut spec = spec("resume-experts-ep2", Sharding::None);
    spec.model = ModelSpec { experts: 4, expert_top_k: 2, ..spec.model };
    spec.parallel.ep = 2;
    resumes_with_identical_losses(spec);
}

/// The copy of the state a checkpoint is written from is booked in the ledger (measured
/// only): DDP's DP rank 0 copies the parameters and the optimizer state every rank holds
/// alike, rank 1 nothing; with ZeRO-1 rank 1 copies the optimizer shard it owns.
#[test]
fn the_checkpoint_copy_is_booked_by_the_ranks_that_write() {
    for sharding in [Sharding::None, Sharding::Zero1] {
        let mut spec = spec(&format!("booked-{}", sharding.as_str()), sharding);
        (spec.train.steps, spec.train.warmup_steps, spec.train.checkpoint_every) = (4, 1, 2);
        let trace = run_with_checkpoints(&spec);
        for rank in &trace.ranks {
            let peak = &rank.memory.as_ref().expect("memory report").peak;
            let expected = match (rank.rank, sharding) {
                (0, _) => peak.parameters + peak.optimizer_state,
                (_, Sharding::Zero1) => peak.optimizer_state,
                _ => 0,
            };
            assert!(expected > 0 || rank.rank > 0);
            assert_eq!(peak.checkpoint, expected, "{sharding:?} rank {}", rank.rank);
        }
    }
}
