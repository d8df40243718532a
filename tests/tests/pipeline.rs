//! Pipeline parallelism across rank processes: every schedule gives the losses of one
//! rank, the bubble is what the formula says, 1F1B holds fewer activations than GPipe,
//! interleaving holds what the planner says, and pipelines compose with data and tensor
//! parallelism.

use distlab_common::planner::plan;
use distlab_common::trace::{ExperimentTrace, SpanKind};
use distlab_common::*;
use distlab_tests::*;

fn spec(name: &str, pp: usize, schedule: PpSchedule, micro_batches: usize) -> ExperimentSpec {
    let mut spec = quick_spec(name, 12);
    spec.model = ModelSpec::dense(4, 64, 4, 32, 64);
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

/// Interleaved 1F1B: each stage holds v chunks of an 8-block model, a micro-batch goes
/// round the stages v times; the losses are one rank's, with dp (and FSDP) and with tp.
#[test]
fn interleaved_trains_like_one_rank_with_dp_and_tp() {
    let _serial = one_at_a_time();
    let interleaved = |pp: usize, v: usize, micro_batches: usize| {
        let mut s = spec("interleaved", pp, PpSchedule::Interleaved, micro_batches);
        s.model.layers = 8;
        s.parallel.virtual_stages = v;
        s
    };
    let mut one = spec("one rank", 1, PpSchedule::OneFOneB, 4);
    one.model.layers = 8;
    for optimizer in OPTIMIZERS {
        let single = run_steps(&optimizer.on(one.clone()));
        for (pp, v) in [(2, 2), (4, 2), (2, 4)] {
            let piped = run_steps(&optimizer.on(interleaved(pp, v, 4)));
            assert_same_training(&single, &piped, &format!("interleaved pp={pp} v={v} {optimizer:?}"));
        }
        let mut with_tp = interleaved(2, 2, 4);
        with_tp.parallel.tp = 2;
        assert_same_training(&single, &run_steps(&optimizer.on(with_tp)), &format!("tp2 x interleaved {optimizer:?}"));
    }
    let mut single = one.clone();
    single.train.micro_batch = 4;
    single.train.micro_batches = 2;
    let single = run_steps(&single);
    for sharding in [Sharding::None, Sharding::Fsdp] {
        let mut mixed = interleaved(2, 2, 2);
        mixed.parallel.dp = 2;
        mixed.parallel.sharding = sharding;
        assert_same_training(&single, &run_steps(&mixed), &format!("dp2 x interleaved pp2 {sharding:?}"));
    }
}

/// ZB-H1: every backward split into B and W, the W passes held back; the losses are one
/// rank's, alone and with dp (ZeRO-1 too) and tp.
#[test]
fn zero_bubble_trains_like_one_rank_with_dp_and_tp() {
    let _serial = one_at_a_time();
    for optimizer in OPTIMIZERS {
        let single = run_steps(&optimizer.on(spec("one rank", 1, PpSchedule::OneFOneB, 4)));
        for pp in [2, 4] {
            let piped = run_steps(&optimizer.on(spec("zb-h1", pp, PpSchedule::ZbH1, 4)));
            assert_same_training(&single, &piped, &format!("zb-h1 pp={pp} {optimizer:?}"));
        }
        let mut with_tp = spec("tp2 x zb-h1", 2, PpSchedule::ZbH1, 4);
        with_tp.parallel.tp = 2;
        assert_same_training(&single, &run_steps(&optimizer.on(with_tp)), &format!("tp2 x zb-h1 {optimizer:?}"));
    }
    let mut single = spec("one rank", 1, PpSchedule::OneFOneB, 2);
    single.train.micro_batch = 4;
    let single = run_steps(&single);
    for sharding in [Sharding::None, Sharding::Zero1] {
        let mut mixed = spec("dp2 x zb-h1", 2, PpSchedule::ZbH1, 2);
        mixed.parallel.dp = 2;
        mixed.parallel.sharding = sharding;
        assert_same_training(&single, &run_steps(&mixed), &format!("dp2 x zb-h1 pp2 {sharding:?}"));
    }
}

/// ZeRO-2 and FSDP under the split backwards (ZB-H1, ZBV, DualPipeV): a unit's gradient
/// waits from its B to its W before it is reduce-scattered. The losses are one rank's; the
/// gradient shards and parameters every rank holds are the planner's, and so are its
/// communication buffers (the waiting gradients among them), up to the copies queued for
/// sending, which the planner leaves out (at most M activations each way), and in a V the
/// messages held early, whose peak the planner adds to the waiting gradients' though the
/// two need not meet.
#[test]
fn split_backwards_train_like_one_rank_with_sharded_gradients() {
    let _serial = one_at_a_time();
    let mut single = spec("one rank", 1, PpSchedule::OneFOneB, 4);
    single.train.micro_batch = 4;
    let single = run_steps(&single);
    for schedule in [PpSchedule::ZbH1, PpSchedule::Zbv, PpSchedule::DualPipeV] {
        for sharding in [Sharding::Zero2, Sharding::Fsdp] {
            let what = format!("dp2 x {} pp2 {sharding:?}", schedule.as_str());
            let mut s = spec(&what, 2, schedule, 4);
            (s.parallel.dp, s.parallel.sharding) = (2, sharding);
            let (points, trace) = run_points_with_trace(&s);
            assert_same_training(&single, &points, &what);
            let predicted = plan(&s).unwrap();
            // (one activation message: micro-batch x seq x d_model, fp32)
            let message = (s.train.micro_batch * s.model.seq_len * s.model.d_model * 4) as u64;
            let queued = 2 * s.train.micro_batches as u64 * message;
            let pipe = distlab_common::schedule::Pipeline::of(&s);
            for r in &trace.ranks {
                let measured = &r.memory.as_ref().unwrap().peak;
                let stage_index = s.stage_of(r.rank as usize);
                let stage = &predicted.stages[stage_index].memory;
                let early = pipe.held_early(stage_index) as u64 * message;
                println!(
                    "{what} rank {}: communication buffers {} B, the planner's {} B",
                    r.rank, measured.comm_buffers, stage.comm_buffers
                );
                assert_eq!(measured.gradients, stage.gradients, "{what} rank {}", r.rank);
                assert_eq!(measured.parameters, stage.parameters, "{what} rank {}", r.rank);
                assert!(
                    (stage.comm_buffers - early..=stage.comm_buffers + queued).contains(&measured.comm_buffers),
                    "{what} rank {}: communication buffers {} against the planner's {} (- {early} held early, + at \
                     most {queued} queued)",
                    r.rank,
                    measured.comm_buffers,
                    stage.comm_buffers
                );
            }
        }
    }
}

/// ZBV: 2P chunks in a V, the first stage holding the embeddings and the head, the last
/// handing its first chunk's output to its second; the losses are one rank's, alone and
/// with dp and tp.
#[test]
fn zbv_trains_like_one_rank_with_dp_and_tp() {
    v_trains_like_one_rank_with_dp_and_tp(PpSchedule::Zbv);
}

/// DualPipeV: ZBV's V in DeepSeek's order, whole backwards (B then W) in the steady state
/// and split ones at the ends; the losses are one rank's, alone and with dp and tp.
#[test]
fn dualpipev_trains_like_one_rank_with_dp_and_tp() {
    v_trains_like_one_rank_with_dp_and_tp(PpSchedule::DualPipeV);
}

/// A V schedule at pp 2 and 4, with tp 2, and with dp 2 (ZeRO-1), against one rank.
fn v_trains_like_one_rank_with_dp_and_tp(schedule: PpSchedule) {
    let _serial = one_at_a_time();
    let v = |pp: usize, micro_batches: usize| {
        let mut s = spec(schedule.as_str(), pp, schedule, micro_batches);
        s.model.layers = 8;
        s
    };
    let mut one = spec("one rank", 1, PpSchedule::OneFOneB, 8);
    one.model.layers = 8;
    let name = schedule.as_str();
    for optimizer in OPTIMIZERS {
        let single = run_steps(&optimizer.on(one.clone()));
        for pp in [2, 4] {
            let piped = run_steps(&optimizer.on(v(pp, 8)));
            assert_same_training(&single, &piped, &format!("{name} pp={pp} {optimizer:?}"));
        }
        let mut with_tp = v(2, 8);
        with_tp.parallel.tp = 2;
        assert_same_training(&single, &run_steps(&optimizer.on(with_tp)), &format!("tp2 x {name} {optimizer:?}"));
    }
    let mut single = one.clone();
    single.train.micro_batch = 4;
    single.train.micro_batches = 4;
    let single = run_steps(&single);
    let mut mixed = v(2, 4);
    mixed.parallel.dp = 2;
    mixed.parallel.sharding = Sharding::Zero1;
    assert_same_training(&single, &run_steps(&mixed), &format!("dp2 x {name} pp2 zero1"));
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
        if schedule == PpSchedule::Interleaved {
            s.parallel.virtual_stages = 2;
        }
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
                // Activations and their gradients on the wire: the planner's bytes per step.
                let sent: u64 =
                    r.comm.counters.iter().filter(|c| c.op == trace::CollectiveOp::Send).map(|c| c.bytes_sent).sum();
                let comm = &predicted.stages[s.stage_of(r.rank as usize)].comm;
                assert_eq!(sent, comm.pp_send * s.train.steps, "{schedule:?} rank {}: bytes sent", r.rank);
                measured.activations
            })
            .collect::<Vec<u64>>()
    };
    let gpipe = peak(PpSchedule::Gpipe);
    let one_f_one_b = peak(PpSchedule::OneFOneB);
    assert!(one_f_one_b[0] < gpipe[0], "stage 0: 1F1B {} vs GPipe {}", one_f_one_b[0], gpipe[0]);
    assert!(one_f_one_b[1] < gpipe[1], "stage 1: 1F1B {} vs GPipe {}", one_f_one_b[1], gpipe[1]);
    // Interleaved: more chunk passes in flight, each holding half a stage's blocks.
    let interleaved = peak(PpSchedule::Interleaved);
    // ZB-H1: every stage holds P micro-batches until their W, and what the B keeps for it.
    let zero_bubble = peak(PpSchedule::ZbH1);
    // ZBV: 2P chunk passes (P micro-batches of a stage's blocks) on every stage, the head's
    // activations on the first.
    let v = peak(PpSchedule::Zbv);
    // DualPipeV: the same V, 2P+1 chunk passes on every stage.
    let dualpipev = peak(PpSchedule::DualPipeV);
    println!(
        "activation peaks per stage: GPipe {gpipe:?}, 1F1B {one_f_one_b:?}, interleaved v=2 {interleaved:?}, \
         ZB-H1 {zero_bubble:?}, ZBV {v:?}, DualPipeV {dualpipev:?}"
    );
    assert!(dualpipev.iter().zip(&v).all(|(d, v)| d > v), "DualPipeV {dualpipev:?} against ZBV {v:?}");
    assert!(interleaved[0] > one_f_one_b[0] && interleaved[0] < gpipe[0], "stage 0: {interleaved:?}");
    assert!(zero_bubble[1] > one_f_one_b[1] && zero_bubble[0] < gpipe[0], "{zero_bubble:?}");
    assert!(v[0] > v[1] && v[1] > one_f_one_b[1] && v[0] < gpipe[0], "{v:?}");
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
                .filter(|s| {
                    s.step == step && matches!(s.kind, SpanKind::Forward | SpanKind::Backward | SpanKind::Weights)
                })
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

/// What each stage should run in one step (pass, micro-batch, chunk), written from the
/// textbook independently of the engine's `schedule.rs`: GPipe runs all M forwards, then
/// all M backwards; 1F1B runs P - 1 - stage forwards to fill the pipe, then alternates one
/// forward and one backward, then drains the remaining backwards. Interleaved (Narayanan et
/// al. 2021, v = 2): the forwards take micro-batches P at a time through chunk 0, then the
/// same P through chunk 1, then the next P; backwards the same groups through chunk 1
/// first; 2(P - 1 - stage) + P forwards fill the pipe, then one forward, one backward.
fn expected_order(schedule: PpSchedule, stages: usize, stage: usize, m: usize) -> Vec<(SpanKind, u32, u32)> {
    let f = |i: usize| (SpanKind::Forward, i as u32, 0);
    let b = |i: usize| (SpanKind::Backward, i as u32, 0);
    if schedule == PpSchedule::ZbH1 {
        // 1F1B with B for the backward; stage s runs the W of micro-batch k - s right after
        // the B of k, and the W passes still owed at the end.
        let mut order = Vec::new();
        let mut weights = 0;
        for pass in expected_order(PpSchedule::OneFOneB, stages, stage, m) {
            order.push(pass);
            if pass.0 == SpanKind::Backward && pass.1 as usize >= stage {
                order.push((SpanKind::Weights, weights, 0));
                weights += 1;
            }
        }
        order.extend((weights..m as u32).map(|i| (SpanKind::Weights, i, 0)));
        return order;
    }
    if schedule == PpSchedule::Interleaved {
        let mut forwards = Vec::new();
        let mut backwards = Vec::new();
        for group in 0..m / stages {
            let micros = group * stages..(group + 1) * stages;
            for chunk in 0..2u32 {
                forwards.extend(micros.clone().map(|i| (SpanKind::Forward, i as u32, chunk)));
                backwards.extend(micros.clone().map(|i| (SpanKind::Backward, i as u32, 1 - chunk)));
            }
        }
        let warmup = if m == stages { 2 * m } else { (2 * (stages - 1 - stage) + stages).min(2 * m) };
        let mut order: Vec<_> = forwards[..warmup].to_vec();
        for (i, forward) in forwards[warmup..].iter().enumerate() {
            order.push(*forward);
            order.push(backwards[i]);
        }
        order.extend_from_slice(&backwards[forwards.len() - warmup..]);
        return order;
    }
    match schedule {
        PpSchedule::Gpipe => (0..m).map(f).chain((0..m).map(b)).collect(),
        _ => {
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
    for (pp, m) in [(2, 4), (4, 8)] {
        for schedule in PIPELINE_SCHEDULES {
            let mut s = spec("bubble", pp, schedule, m);
            s.model = ModelSpec::dense(8, 256, 4, 64, 64);
            if schedule == PpSchedule::Interleaved {
                s.parallel.virtual_stages = 2;
            }
            s.train.steps = 3;
            s.train.warmup_steps = 1;
            let (_, trace) = run_with_trace(&s);
            let steps = distlab_common::pipeline::recorded_steps(&trace.ranks);
            assert!(steps.len() >= 2, "{schedule:?}: recorded steps {steps:?}");
            for rank in &trace.ranks {
                for &step in &steps {
                    let order: Vec<(SpanKind, u32, u32)> = rank
                        .spans
                        .iter()
                        .filter(|sp| sp.step == step && sp.micro.is_some())
                        .filter(|sp| matches!(sp.kind, SpanKind::Forward | SpanKind::Backward | SpanKind::Weights))
                        .map(|sp| (sp.kind, sp.micro.unwrap_or_default(), sp.chunk.unwrap_or_default()))
                        .collect();
                    let stage = s.stage_of(rank.rank as usize);
                    let what = format!("pp={pp} M={m} {schedule:?} rank {} step {step}", rank.rank);
                    let expected = match schedule {
                        // (their orders are checked against PyTorch's and DeepSeek's in
                        // schedule.rs's tests)
                        PpSchedule::Zbv | PpSchedule::DualPipeV => distlab_common::schedule::Pipeline::of(&s)
                            .actions(stage)
                            .into_iter()
                            .map(|a| (span_kind(a), a.micro() as u32, a.chunk() as u32))
                            .collect(),
                        _ => expected_order(schedule, pp, stage, m),
                    };
                    assert_eq!(order, expected, "{what}");
                }
            }
            let bubbles = measured_bubbles(&trace);
            let mean = bubbles.iter().sum::<f64>() / bubbles.len() as f64;
            let formula = distlab_common::schedule::Pipeline::of(&s).formula_bubble();
            println!("pp={pp} M={m} {schedule:?}: measured bubble {mean:.3} (per rank and step {bubbles:.3?}), formula {formula:.3}");
        }
    }
}

/// Every schedule this lab runs.
const PIPELINE_SCHEDULES: [PpSchedule; 6] = [
    PpSchedule::Gpipe,
    PpSchedule::OneFOneB,
    PpSchedule::Interleaved,
    PpSchedule::ZbH1,
    PpSchedule::Zbv,
    PpSchedule::DualPipeV,
];

/// The span a pass leaves on the timeline.
fn span_kind(action: distlab_common::schedule::Action) -> SpanKind {
    use distlab_common::schedule::Action;
    match action {
        Action::Forward { .. } => SpanKind::Forward,
        Action::Backward { .. } => SpanKind::Backward,
        Action::Weights { .. } => SpanKind::Weights,
    }
}

#[test]
fn the_expected_orders_are_the_textbook_ones() {
    let order = |schedule, stages, stage, m| -> Vec<(SpanKind, u32)> {
        expected_order(schedule, stages, stage, m).into_iter().map(|(kind, micro, _)| (kind, micro)).collect()
    };
    use SpanKind::{Backward as B, Forward as F};
    assert_eq!(order(PpSchedule::Gpipe, 2, 0, 2), vec![(F, 0), (F, 1), (B, 0), (B, 1)]);
    // 1F1B, 4 stages, 6 micro-batches: stage 0 fills with 3 forwards, stage 3 alternates at once.
    assert_eq!(
        order(PpSchedule::OneFOneB, 4, 0, 6),
        vec![(F, 0), (F, 1), (F, 2), (F, 3), (B, 0), (F, 4), (B, 1), (F, 5), (B, 2), (B, 3), (B, 4), (B, 5)]
    );
    assert_eq!(order(PpSchedule::OneFOneB, 4, 3, 3), vec![(F, 0), (B, 0), (F, 1), (B, 1), (F, 2), (B, 2)]);
    // Interleaved, P = 2, M = 4, the last stage: chunk 0 of micro-batches 0, 1, then chunk 1.
    assert_eq!(
        expected_order(PpSchedule::Interleaved, 2, 1, 4)[..6],
        [(F, 0, 0), (F, 1, 0), (F, 0, 1), (B, 0, 1), (F, 1, 1), (B, 1, 1)]
    );
    // More stages than micro-batches: 1F1B degenerates to GPipe on the first stage.
    assert_eq!(order(PpSchedule::OneFOneB, 4, 0, 2), order(PpSchedule::Gpipe, 4, 0, 2));
}
