//! FSDP's prefetch (`parallel.prefetch`): the next unit is gathered on a communication
//! thread while the current one computes. It changes when the bytes move, never which:
//! the training is bit for bit the same, the same bytes are sent, and the ranks hold two
//! gathered units at their peak (the planner's count) instead of one.

use distlab_common::planner::plan;
use distlab_common::trace::{self, lane};
use distlab_common::*;
use distlab_tests::*;

fn fsdp(name: &str, prefetch: bool) -> ExperimentSpec {
    let mut spec = quick_spec(name, 6);
    spec.model = ModelSpec::dense(5, 64, 4, 32, 64);
    spec.train.micro_batch = 2;
    spec.parallel.dp = 2;
    spec.parallel.sharding = Sharding::Fsdp;
    spec.parallel.prefetch = prefetch;
    spec
}

type Variant = fn(&mut ExperimentSpec);

const VARIANTS: [(&str, Variant); 4] = [
    ("dp=2", |_| {}),
    ("dp=2, sqrt checkpointing (recomputes gathered in backward)", |s| s.train.checkpointing = Checkpointing::Sqrt),
    ("dp=2 x pp=2 1F1B, 2 micro-batches", |s| {
        s.parallel.pp = 2;
        s.train.micro_batches = 2;
    }),
    ("dp=2 bf16", |s| s.train.precision = Precision::Bf16),
];

#[test]
fn prefetch_trains_bit_for_bit_like_gathering_on_demand() {
    let _serial = one_at_a_time();
    let same = |m: &[MetricPoint]| m.iter().map(|p| (p.loss, p.grad_norm)).collect::<Vec<_>>();
    for (name, variant) in VARIANTS {
        let (mut waiting, mut prefetching) = (fsdp(name, false), fsdp(name, true));
        variant(&mut waiting);
        variant(&mut prefetching);
        assert_eq!(same(&run_steps(&prefetching)), same(&run_steps(&waiting)), "{name}");
    }
}

/// The same all-gather bytes per step with and without prefetch (the planner's), two
/// gathered units at the peak with it (the planner's count, above one without), and the
/// gathers drawn on the communication lane, with the waits for them on the blocking one.
#[test]
fn prefetch_sends_the_same_bytes_and_holds_two_gathered_units() {
    let _serial = one_at_a_time();
    for checkpointing in [Checkpointing::None, Checkpointing::Sqrt] {
        let mut gathered = Vec::new();
        for prefetch in [false, true] {
            let mut s = fsdp("memory", prefetch);
            (s.train.steps, s.train.warmup_steps, s.train.checkpointing) = (2, 1, checkpointing);
            let predicted = plan(&s).unwrap();
            let (_, trace) = run_with_trace(&s);
            let sent = sent_per_step(&trace, trace::CollectiveOp::AllGather, s.train.steps);
            assert_eq!(sent, predicted.stages[0].comm.dp_all_gather, "{checkpointing:?} prefetch={prefetch}: bytes");
            for r in &trace.ranks {
                let peak = r.memory.as_ref().unwrap().peak.gathered_parameters;
                let want = predicted.stages[0].memory.gathered_parameters;
                assert_eq!(peak, want, "{checkpointing:?} prefetch={prefetch} rank {}: gathered at the peak", r.rank);
            }
            gathered.push(predicted.stages[0].memory.gathered_parameters);
            let spans = &trace.ranks[0].spans;
            let on_comm_lane = spans.iter().filter(|x| x.lane == lane::COMM && x.name.contains("(prefetch)")).count();
            let waits = spans.iter().filter(|x| x.lane == lane::DP_BLOCKING && x.name.starts_with("wait for")).count();
            if prefetch {
                assert!(on_comm_lane > 0 && waits == on_comm_lane, "{on_comm_lane} prefetches, {waits} waits");
            } else {
                assert_eq!((on_comm_lane, waits), (0, 0));
            }
        }
        assert!(gathered[1] > gathered[0], "{checkpointing:?}: two units {} vs one {}", gathered[1], gathered[0]);
    }
}
