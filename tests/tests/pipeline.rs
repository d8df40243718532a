//! Pipeline parallelism across rank processes: both schedules give the losses of one
//! rank, the bubble is what the formula says, 1F1B holds fewer activations than GPipe, and
//! pipelines compose with data parallelism.

use distlab_common::planner::plan;
use distlab_common::trace::{ExperimentTrace, SpanKind};
use distlab_common::*;
use distlab_tests::*;

/// The tests of this file run one at a time: the bubble is a timing, and every test here
/// starts several rank processes on a 2-core machine.
static ONE_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn serial() -> std::sync::MutexGuard<'static, ()> {
    ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner())
}

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
    let _serial = serial();
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
    let _serial = serial();
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
    let _serial = serial();
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

/// (P-1)/(M+P-1) on equal stages. Measured with wall clocks on a shared 2-core machine, so
/// the tolerance is loose: the mean over ranks and steps within 0.12 of the formula.
#[test]
fn the_measured_bubble_is_close_to_the_formula() {
    let _serial = serial();
    for schedule in [PpSchedule::Gpipe, PpSchedule::OneFOneB] {
        let mut s = spec("bubble", 2, schedule, 4);
        s.model = ModelSpec { layers: 4, d_model: 256, heads: 4, seq_len: 64, vocab: 64 };
        s.train.steps = 3;
        s.train.warmup_steps = 1;
        let (_, trace) = run_with_trace(&s);
        let bubbles = measured_bubbles(&trace);
        let mean = bubbles.iter().sum::<f64>() / bubbles.len() as f64;
        let formula = 1.0 / 5.0;
        println!("{schedule:?}: measured bubble {mean:.3} (per rank and step {bubbles:.3?}), formula {formula}");
        assert!((mean - formula).abs() < 0.12, "{schedule:?}: measured {mean:.3} ({bubbles:?}) vs {formula}");
    }
}
