//! Pipeline parallelism across rank processes: both schedules give the losses of one
//! rank, the bubble is what the formula says, 1F1B holds fewer activations than GPipe, and
//! pipelines compose with data parallelism.

use distlab_common::planner::plan;
use distlab_common::trace::{ExperimentTrace, SpanKind};
use distlab_common::*;
use distlab_tests::*;

fn spec(name: &str, pp: usize, schedule: PpSchedule, micro_batches: usize) -> ExperimentSpec {
    let mut spec = quick_spec(name, 12);
    spec.model = ModelSpec { layers: 4, d_model: 64, heads: 4, seq_len: 32, vocab: 64 };
    spec.parallel.pp = pp;
    spec.parallel.pp_schedule = schedule;
    spec.train.micro_batch = 2;
    spec.train.micro_batches = micro_batches;
    spec
}

/// The same micro-batches through the same blocks, their gradients accumulated in the
/// same order: only the loss's and the norm's trips through an f32 all-reduce differ
/// (`assert_same_training`'s bounds), under AdamW and SGD.
#[test]
fn both_schedules_train_like_one_rank() {
    let _serial = one_at_a_time();
    for optimizer in OPTIMIZERS {
        let single = run_steps(&optimizer.on(spec("one rank", 1, PpSchedule::Gpipe, 4)));
        for pp in [2, 4] {
            for schedule in [PpSchedule::Gpipe, PpSchedule::OneFOneB] {
                let piped = run_steps(&optimizer.on(spec("pipeline", pp, schedule, 4)));
                assert_same_training(&single, &piped, &format!("pp={pp} {schedule:?} {optimizer:?}"));
            }
        }
    }
}

#[test]
fn pipelines_compose_with_data_parallelism() {
    let _serial = one_at_a_time();
    for optimizer in OPTIMIZERS {
        let mut single = spec("one rank", 1, PpSchedule::Gpipe, 2);
        single.train.micro_batch = 4;
        let single = run_steps(&optimizer.on(single));
        for sharding in [Sharding::None, Sharding::Fsdp] {
            let mut mixed = spec("dp2 x pp2", 2, PpSchedule::OneFOneB, 2);
            mixed.parallel.dp = 2;
            mixed.parallel.sharding = sharding;
            let what = format!("dp2 x pp2 {sharding:?} {optimizer:?}");
            assert_same_training(&single, &run_steps(&optimizer.on(mixed)), &what);
        }
    }
}

/// Peak activation memory per stage: GPipe keeps all M micro-batches, 1F1B at most P -
/// stage. Both measured by the engine's ledger and equal to the planner's prediction.
#[test]
fn one_f_one_b_holds_fewer_activations_than_gpipe() {
    let _serial = one_at_a_time();
    let peak = |schedule| {
        let mut s = spec("memory", 2, schedule, 8);
        s.train.steps = 2;
        s.train.warmup_steps = 1;
        let predicted = plan(&s).unwrap();
        let (_, trace) = run_with_trace(&s);
        trace
            .ranks
            .iter()
            .map(|r| {
                let measured = &r.memory.as_ref().unwrap().peak;
                let stage = &predicted.stages[s.stage_of(r.rank as usize)].memory;
                assert_eq!(measured.activations, stage.activations, "{schedule:?} rank {}", r.rank);
                assert_eq!(measured.activation_grads, stage.activation_grads, "{schedule:?} rank {}", r.rank);
                assert_eq!(measured.parameters, stage.parameters, "{schedule:?} rank {}", r.rank);
                // Receive buffers are predicted; copies queued for sending come on top.
                assert!(measured.comm_buffers >= stage.comm_buffers, "{schedule:?} rank {}", r.rank);
                measured.activations
            })
            .collect::<Vec<u64>>()
    };
    let gpipe = peak(PpSchedule::Gpipe);
    let one_f_one_b = peak(PpSchedule::OneFOneB);
    assert!(one_f_one_b[0] < gpipe[0], "stage 0: 1F1B {} vs GPipe {}", one_f_one_b[0], gpipe[0]);
    assert!(one_f_one_b[1] < gpipe[1], "stage 1: 1F1B {} vs GPipe {}", one_f_one_b[1], gpipe[1]);
}

/// The idle share of each rank between the pipeline's first forward and last backward
/// (over all ranks), for every recorded step.
fn measured_bubbles(trace: &ExperimentTrace) -> Vec<f64> {
    let steps: Vec<u64> = trace.ranks[0].spans.iter().map(|s| s.step).collect();
    let mut out = Vec::new();
    for step in 1..=steps.iter().copied().max().unwrap_or(0) {
        let work = |r: &trace::RankTrace| -> Vec<(u64, u64)> {
            r.spans
                .iter()
                .filter(|s| s.step == step && matches!(s.kind, SpanKind::Forward | SpanKind::Backward))
                .map(|s| (s.start_us, s.end_us))
                .collect()
        };
        let all: Vec<(u64, u64)> = trace.ranks.iter().flat_map(work).collect();
        let window = all.iter().map(|w| w.1).max().unwrap() - all.iter().map(|w| w.0).min().unwrap();
        for r in &trace.ranks {
            let busy: u64 = work(r).iter().map(|w| w.1 - w.0).sum();
            out.push(1.0 - busy as f64 / window as f64);
        }
    }
    out
}

/// What each stage should run in one step, written from the textbook independently of the
/// engine's `schedule.rs`: GPipe runs all M forwards, then all M backwards; 1F1B runs
/// P - 1 - stage forwards to fill the pipe, then alternates one forward and one backward,
/// then drains the remaining backwards.
fn expected_order(schedule: PpSchedule, stages: usize, stage: usize, m: usize) -> Vec<(SpanKind, u32)> {
    let f = |i: usize| (SpanKind::Forward, i as u32);
    let b = |i: usize| (SpanKind::Backward, i as u32);
    match schedule {
        PpSchedule::Gpipe => (0..m).map(f).chain((0..m).map(b)).collect(),
        PpSchedule::OneFOneB => {
            let warmup = (stages - 1 - stage).min(m);
            let mut order: Vec<_> = (0..warmup).map(f).collect();
            for i in warmup..m {
                order.push(f(i));
                order.push(b(i - warmup));
            }
            order.extend((m - warmup..m).map(b));
            order
        }
    }
}

/// Each stage runs its micro-batches in the schedule's order, read from the spans of every
/// recorded step. The bubble is a wall-clock measurement on a shared 2-core machine, so it
/// is reported next to (P-1)/(M+P-1), not asserted.
#[test]
fn every_stage_runs_the_schedules_order_and_the_bubble_is_reported() {
    let _serial = one_at_a_time();
    for (pp, m) in [(2, 4), (4, 6)] {
        for schedule in [PpSchedule::Gpipe, PpSchedule::OneFOneB] {
            let mut s = spec("bubble", pp, schedule, m);
            s.model = ModelSpec { layers: 4, d_model: 256, heads: 4, seq_len: 64, vocab: 64 };
            s.train.steps = 3;
            s.train.warmup_steps = 1;
            let (_, trace) = run_with_trace(&s);
            let steps = distlab_common::pipeline::recorded_steps(&trace.ranks);
            assert!(steps.len() >= 2, "{schedule:?}: recorded steps {steps:?}");
            for rank in &trace.ranks {
                for &step in &steps {
                    let order: Vec<(SpanKind, u32)> = rank
                        .spans
                        .iter()
                        .filter(|sp| sp.step == step && sp.micro.is_some())
                        .filter(|sp| matches!(sp.kind, SpanKind::Forward | SpanKind::Backward))
                        .map(|sp| (sp.kind, sp.micro.unwrap_or_default()))
                        .collect();
                    let stage = s.stage_of(rank.rank as usize);
                    let what = format!("pp={pp} M={m} {schedule:?} rank {} step {step}", rank.rank);
                    assert_eq!(order, expected_order(schedule, pp, stage, m), "{what}");
                }
            }
            let bubbles = measured_bubbles(&trace);
            let mean = bubbles.iter().sum::<f64>() / bubbles.len() as f64;
            let formula = distlab_common::pipeline::formula_bubble(pp, m);
            println!("pp={pp} M={m} {schedule:?}: measured bubble {mean:.3} (per rank and step {bubbles:.3?}), formula {formula:.3}");
        }
    }
}

#[test]
fn the_expected_orders_are_the_textbook_ones() {
    use SpanKind::{Backward as B, Forward as F};
    assert_eq!(expected_order(PpSchedule::Gpipe, 2, 0, 2), vec![(F, 0), (F, 1), (B, 0), (B, 1)]);
    // 1F1B, 4 stages, 6 micro-batches: stage 0 fills with 3 forwards, stage 3 alternates at once.
    assert_eq!(
        expected_order(PpSchedule::OneFOneB, 4, 0, 6),
        vec![(F, 0), (F, 1), (F, 2), (F, 3), (B, 0), (F, 4), (B, 1), (F, 5), (B, 2), (B, 3), (B, 4), (B, 5)]
    );
    assert_eq!(expected_order(PpSchedule::OneFOneB, 4, 3, 3), vec![(F, 0), (B, 0), (F, 1), (B, 1), (F, 2), (B, 2)]);
    // More stages than micro-batches: 1F1B degenerates to GPipe on the first stage.
    assert_eq!(expected_order(PpSchedule::OneFOneB, 4, 0, 2), expected_order(PpSchedule::Gpipe, 4, 0, 2));
}
