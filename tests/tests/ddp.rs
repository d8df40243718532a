//! Data parallelism across rank processes: exactness against one rank, the trace, and
//! what happens when a rank dies or hangs.

use std::time::{Duration, Instant};

use distlab_common::trace::{CollectiveOp, SpanKind};
use distlab_common::*;
use distlab_tests::*;

fn spec(name: &str, dp: usize, micro_batch: usize, steps: u64) -> ExperimentSpec {
    let mut spec = quick_spec(name, steps);
    spec.parallel.dp = dp;
    spec.train.micro_batch = micro_batch;
    spec
}

/// dp=W with micro-batch b sees the same global batch as one rank with W*b, and sums the
/// same gradients (in another order), so losses and gradient norms agree to float rounding,
/// under AdamW and under SGD with weight decay, with the gradients in several buckets.
/// Tolerance: 1e-5 relative per step over 20 steps for the loss (seen: up to 4.7e-7), 2e-5
/// for the gradient norm (seen: up to 4.6e-6).
#[test]
fn ddp_trains_like_one_rank_with_the_whole_batch() {
    for world in [2, 4] {
        for optimizer in OPTIMIZERS {
            let single = optimizer.on(spec("single", 1, 2 * world, 20));
            let mut ddp = optimizer.on(spec("ddp", world, 2, 20));
            ddp.parallel.bucket_bytes = 64 * 1024; // several buckets for a 0.42 MiB model
            assert_same_training(&run_steps(&single), &run_steps(&ddp), &format!("dp={world} {optimizer:?}"));
        }
    }
}

#[test]
fn ddp_with_accumulation_trains_like_one_rank() {
    for optimizer in OPTIMIZERS {
        let single = optimizer.on(spec("single", 1, 8, 20));
        let mut accumulated = optimizer.on(spec("ddp-accum", 2, 2, 20));
        accumulated.train.grad_accum = 2;
        assert_same_training(&run_steps(&single), &run_steps(&accumulated), &format!("dp=2 x accum 2 {optimizer:?}"));
    }
}

#[test]
fn ddp_run_through_the_server_stores_a_trace_with_overlapping_buckets() {
    let lab = Lab::start();
    let mut s = spec("ddp-trace", 2, 4, 6);
    s.parallel.bucket_bytes = 64 * 1024; // several buckets for a 0.42 MiB model
    let id = lab.submit(&s);
    let exp = lab.wait_finished(id, Duration::from_secs(120));
    assert_eq!(exp.status, ExperimentStatus::Succeeded, "{exp:?}");
    assert_eq!(exp.summary.as_ref().unwrap().world_size, 2);

    let trace: trace::ExperimentTrace = lab.get_as(&format!("/api/experiments/{id}/trace"));
    assert_eq!(trace.ranks.len(), 2);
    let params = s.model.param_count();
    for rank in &trace.ranks {
        let kinds: Vec<SpanKind> = rank.spans.iter().map(|s| s.kind).collect();
        for k in [SpanKind::Forward, SpanKind::Backward, SpanKind::Comm, SpanKind::Optimizer] {
            assert!(kinds.contains(&k), "rank {} has no {k:?} span", rank.rank);
        }
        let buckets = rank.spans.iter().filter(|s| s.kind == SpanKind::Comm && s.step == 0).count();
        assert!(buckets >= 3, "several buckets per step: {buckets}");
        // Each step all-reduces every gradient once: 2(W-1)/W * D bytes per rank, with W=2.
        let grads_sent: u64 = rank
            .comm
            .collectives
            .iter()
            .filter(|c| c.op == CollectiveOp::AllReduce && c.group == "dp")
            .map(|c| c.bytes_sent)
            .sum::<u64>();
        let per_step = grads_sent / 6;
        assert_eq!(per_step, params * 4, "2(W-1)/W * D = D bytes per step for W=2");
    }
}

fn assert_no_ranks_left(marker: &str) {
    let start = Instant::now();
    loop {
        let left = processes_with(marker, "rank");
        if left.is_empty() {
            return;
        }
        assert!(start.elapsed() < Duration::from_secs(5), "rank processes left behind: {left:?}");
        std::thread::sleep(Duration::from_millis(100));
    }
}

fn failing_lab(marker: &str, fault: &str) -> Lab {
    Lab::start_with(LabOptions {
        env: vec![
            ("DISTLAB_FAULT".into(), fault.into()),
            ("DISTLAB_COLLECTIVE_TIMEOUT_SECONDS".into(), "2".into()),
            ("DISTLAB_TEST_MARKER".into(), marker.into()),
        ],
        ..LabOptions::default()
    })
}

#[test]
fn a_rank_that_exits_fails_the_run_with_its_message() {
    let marker = format!("exit-{}", std::process::id());
    let lab = failing_lab(&marker, "1:3:exit");
    let id = lab.submit(&spec("rank-exits", 2, 4, 200));
    let started = lab.wait_for(id, Duration::from_secs(60), |e| e.status != ExperimentStatus::Queued);
    let t0 = Instant::now();
    let exp = lab.wait_finished(id, Duration::from_secs(30));
    assert!(t0.elapsed() < Duration::from_secs(10), "failure noticed within 10 s");
    assert_eq!(exp.status, ExperimentStatus::Failed, "{started:?}");
    let error = exp.error.unwrap_or_default();
    assert!(error.contains("rank 1 exited with code 3"), "{error}");
    assert!(error.contains("injected fault"), "the rank's stderr tail is included: {error}");
    assert_no_ranks_left(&marker);
}

#[test]
fn a_rank_that_hangs_is_caught_by_the_collective_timeout() {
    let marker = format!("hang-{}", std::process::id());
    let lab = failing_lab(&marker, "1:3:hang");
    let id = lab.submit(&spec("rank-hangs", 2, 4, 200));
    lab.wait_for(id, Duration::from_secs(60), |e| e.steps_done >= 3);
    let t0 = Instant::now();
    let exp = lab.wait_finished(id, Duration::from_secs(30));
    assert!(t0.elapsed() < Duration::from_secs(10), "hang noticed within 10 s");
    assert_eq!(exp.status, ExperimentStatus::Failed);
    let error = exp.error.unwrap_or_default();
    assert!(error.contains("rank 0 failed") && error.contains("all_reduce"), "{error}");
    assert!(error.contains("waited 2.0 s for rank 1"), "names the peer: {error}");
    assert_no_ranks_left(&marker);
}
