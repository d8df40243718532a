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
    let experiment_dir = lab.experiment_checkpoints(id).expect("the experiment's checkpoint directory");
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

/// The points of the steps since the last checkpoint may still be on their way when a
/// worker dies (it sends them every half second). A resumed attempt starts no later than
/// the first step the server lacks, so the run still ends with every step's point, bit
/// for bit those of a run never interrupted, and the lost work is counted.
#[test]
fn a_worker_killed_before_its_points_arrive_leaves_no_step_without_one() {
    let _one = one_at_a_time();
    let spec = spec("resume-undelivered", Sharding::None);
    let straight = run_losses(&spec);
    let mut lab = Lab::start_with(LabOptions {
        local_workers: 0,
        lease_seconds: 2.0,
        heartbeat_seconds: 0.5,
        ..LabOptions::default()
    });
    // The first worker delivers the points of steps 0-14 only; its rank 0 stops after step
    // 24, so the checkpoints of steps 10 and 20 are written.
    let marker = format!("undelivered-{}", std::process::id());
    let first = lab.spawn_worker_with_env(
        "first",
        &[
            ("DISTLAB_FAULT", "0:24:hang"),
            ("DISTLAB_FAULT_WITHHOLD_METRICS_FROM", "15"),
            ("DISTLAB_TEST_MARKER", &marker),
        ],
    );
    let id = lab.submit(&spec);
    lab.wait_for(id, std::time::Duration::from_secs(120), |e| e.steps_done >= 15);
    let step_20 = std::time::Instant::now();
    while !lab.experiment_checkpoints(id).is_some_and(|dir| {
        std::fs::read_dir(dir.join("step-000020"))
            .is_ok_and(|d| d.flatten().filter(|f| f.file_name().to_string_lossy().ends_with(".ckpt")).count() == 2)
    }) {
        assert!(step_20.elapsed() < std::time::Duration::from_secs(120), "no checkpoint of step 20");
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
    lab.kill_worker(first);
    lab.wait_for(id, std::time::Duration::from_secs(20), |e| e.status == ExperimentStatus::Queued);
    lab.spawn_worker("second");
    let exp = lab.wait_finished(id, std::time::Duration::from_secs(120));
    assert_eq!(exp.status, ExperimentStatus::Succeeded, "{exp:?}");

    let metrics: Metrics = lab.get_as(&format!("/api/experiments/{id}/metrics"));
    assert_eq!(metrics.steps.iter().map(|m| m.step).collect::<Vec<_>>(), (0..40).collect::<Vec<_>>());
    for (step, (a, m)) in straight.iter().zip(&metrics.steps).enumerate() {
        assert_eq!(a.to_bits(), m.loss.to_bits(), "step {step}: straight {a} vs resumed {}", m.loss);
    }
    let attempts: Attempts = lab.get_as(&format!("/api/experiments/{id}/attempts"));
    let summary: Vec<(i64, Option<u64>, u64)> =
        attempts.attempts.iter().map(|a| (a.attempt, a.from_step, a.lost_steps)).collect();
    assert_eq!(summary, vec![(1, Some(0), 0), (2, Some(10), 5)], "step 20's checkpoint skipped; 10-14 redone");
}

/// A database started afresh in the same data directory numbers its experiments from 1
/// again: its experiment 1 must not "resume" from the old experiment 1's checkpoints,
/// even with the same spec.
#[test]
fn a_fresh_database_does_not_inherit_old_checkpoints() {
    let _one = one_at_a_time();
    let spec = spec("fresh-database", Sharding::None);
    let mut lab = Lab::start_with(LabOptions { lease_seconds: 2.0, heartbeat_seconds: 0.5, ..LabOptions::default() });
    let id = lab.submit(&spec);
    lab.wait_for(id, std::time::Duration::from_secs(120), |e| e.steps_done >= 12);
    let old = lab.experiment_checkpoints(id).expect("the first database's checkpoints");
    lab.kill_server_and_start_afresh();
    let again = lab.submit(&spec);
    assert_eq!(again, id, "the new database numbers from 1 again");
    let exp = lab.wait_finished(again, std::time::Duration::from_secs(120));
    assert_eq!(exp.status, ExperimentStatus::Succeeded, "{exp:?}");
    let attempts: Attempts = lab.get_as(&format!("/api/experiments/{again}/attempts"));
    assert_eq!(attempts.attempts[0].from_step, Some(0), "started afresh");
    assert_eq!(lab.get_as::<Metrics>(&format!("/api/experiments/{again}/metrics")).steps.len(), 40);
    assert!(old.exists(), "the old database's checkpoints are left alone");
    let prefix = format!("experiment-{again}-");
    let dirs = std::fs::read_dir(lab.checkpoint_dir())
        .expect("checkpoints")
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().starts_with(&prefix))
        .count();
    assert_eq!(dirs, 2, "each database's experiment 1 has a directory of its own");
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
/// Delayed scaling's next scales come from each rank's last 16 amaxes: the checkpoint
/// keeps them, or the resumed steps would cast with other scales.
#[test]
fn fp8_with_delayed_scaling_resumes_bit_identically_with_its_amax_histories() {
    let mut spec = spec("resume-fp8-delayed", Sharding::None);
    spec.train.fp8 = Fp8Recipe::Delayed;
    resumes_with_identical_losses(spec);
}

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
