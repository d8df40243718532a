//! Training that survives a lost replica (`parallel.fault_tolerance: replicas`): one
//! replica's rank process is SIGKILLed mid-run; the others finish the step without it, a
//! new process for it rejoins a few steps later with the parameters and optimizer state of
//! a live replica, and the run ends as one attempt with every step's point and every
//! replica's parameters equal bit for bit.

use std::time::Duration;

use distlab_common::api::Attempts;
use distlab_common::trace::ExperimentTrace;
use distlab_common::*;
use distlab_tests::*;

fn spec(steps: u64) -> ExperimentSpec {
    let mut spec = quick_spec("replicas", steps);
    (spec.parallel.dp, spec.parallel.fault_tolerance) = (4, FaultTolerance::Replicas);
    spec.train.micro_batch = 2;
    spec
}

/// The number after `before` on the first line holding it.
fn number_after(log: &str, before: &str) -> Option<u64> {
    let rest = log.lines().find_map(|l| l.split(before).nth(1))?;
    rest.split(|c: char| !c.is_ascii_digit()).next()?.parse().ok()
}

#[test]
fn a_killed_replica_rejoins_without_a_lost_step_with_every_replicas_parameters() {
    let _serial = one_at_a_time();
    let steps = 100;
    let (points, log) = run_steps_with_env(&spec(steps), &[("DISTLAB_FAULT", "2:3:kill")]);
    // (run_steps_with_env checks one point per step, in order)
    assert_eq!(points.len(), steps as usize);
    assert!(log.contains("rank 2's process was killed by signal 9"), "{log}");
    let lost =
        number_after(&log, "replica rank 2 lost (the replicas last agreed on step ").expect("the loss in the log");
    let rejoined = number_after(&log, "replica rank 2 rejoined at step ").expect("the rejoin in the log");
    assert!(lost >= 3 && rejoined > lost && rejoined < steps, "lost at {lost}, rejoined at {rejoined}: {log}");
    // Every replica, the rejoined one too, ends with the same parameters.
    let ends: Vec<&str> = log
        .lines()
        .filter_map(|l| l.split("fault-tolerant replica: rank ").nth(1))
        .filter_map(|l| l.split("ends with parameters ").nth(1))
        .collect();
    assert_eq!(ends.len(), 4, "one line per replica: {log}");
    assert!(ends.iter().all(|h| *h == ends[0]), "the replicas' parameters differ: {ends:?}");
    assert!(points.last().unwrap().loss < 0.8 * points[0].loss, "{points:?}");
    let line = log.lines().find(|l| l.contains("rejoined at step")).unwrap_or_default();
    println!("rank 2 lost at step {lost}, rejoined at step {rejoined}: {line}");
}

/// With no replica lost, fault-tolerant replicas train as DDP does, bit for bit: the same
/// ring sum (one message for the whole gradient), the mean over all W, the same update.
#[test]
fn with_no_loss_the_replicas_train_as_ddp_bit_for_bit() {
    let _serial = one_at_a_time();
    let replicas = spec(12);
    let ddp = ExperimentSpec {
        parallel: ParallelSpec { fault_tolerance: FaultTolerance::None, ..replicas.parallel.clone() },
        ..replicas.clone()
    };
    let (a, b) = (run_steps(&replicas), run_steps(&ddp));
    for (x, y) in a.iter().zip(&b) {
        assert_eq!(x.loss.to_bits(), y.loss.to_bits(), "step {}: replicas {} DDP {}", x.step, x.loss, y.loss);
        assert_eq!(x.grad_norm.to_bits(), y.grad_norm.to_bits(), "step {}", x.step);
    }
}

/// Through a server, the spec's own drill killing rank 1 after step 2: the kill costs no
/// attempt (the run is not re-queued), the metrics have every step, and the rejoined
/// rank's trace marks the state it took, the same parameters the source marks it sent, in
/// the planner's bytes.
#[test]
fn a_server_run_survives_its_drill_in_one_attempt() {
    let _serial = one_at_a_time();
    let lab = Lab::start();
    let steps = 100;
    let mut s = spec(steps);
    s.parallel.fault_drill = Some(FaultDrill { rank: 1, after_step: 2 });
    let id = lab.submit(&s);
    let exp = lab.wait_finished(id, Duration::from_secs(120));
    assert_eq!(exp.status, ExperimentStatus::Succeeded, "{exp:?}");
    let metrics: Metrics = lab.get_as(&format!("/api/experiments/{id}/metrics"));
    assert_eq!(metrics.steps.iter().map(|m| m.step).collect::<Vec<_>>(), (0..steps).collect::<Vec<_>>());
    let attempts: Attempts = lab.get_as(&format!("/api/experiments/{id}/attempts"));
    assert_eq!(attempts.attempts.len(), 1, "{attempts:?}");

    let trace: ExperimentTrace = lab.get_as(&format!("/api/experiments/{id}/trace"));
    let span = |rank: u32, starts: &str| {
        let r = trace.ranks.iter().find(|r| r.rank == rank).expect("the rank's trace");
        r.spans.iter().find(|s| s.name.starts_with(starts)).cloned()
    };
    let took = span(1, "rejoined: state copied from rank 0").expect("the rejoin on rank 1's timeline");
    let gave = span(0, "state copied to rank 1").expect("the copy on rank 0's timeline");
    let parameters = |name: &str| name.split("parameters ").nth(1).map(str::to_string);
    assert_eq!(parameters(&took.name), parameters(&gave.name), "{} / {}", took.name, gave.name);
    assert_eq!(took.step, gave.step);
    assert_eq!(took.bytes, gave.bytes, "the state's bytes");
    let rejoin = distlab_common::planner::plan(&s).unwrap().rejoin.expect("the planner's rejoin").state_bytes;
    assert_eq!(took.bytes, Some(rejoin), "the state's bytes against the planner's 24 + 4N (1 + 2)");
    assert!(span(0, "replica lost: rank(s) [1]").is_some() || span(0, "replica lost: gradients").is_some());
    // Every replica, the replacement too, holds the planner's memory: DDP's without its
    // buckets, with the host copies of its own gradient and the quorum's sum.
    assert_rank_memory_is_planned(&s, &trace);
}
