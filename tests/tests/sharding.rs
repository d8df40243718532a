//! ZeRO-1, ZeRO-2 and FSDP across rank processes: the same losses as DDP, and every rank's
//! measured memory equal to the planner's prediction.

use distlab_common::planner::plan;
use distlab_common::*;
use distlab_tests::*;

fn spec(name: &str, dp: usize, sharding: Sharding) -> ExperimentSpec {
    let mut spec = quick_spec(name, 20);
    spec.parallel.dp = dp;
    spec.parallel.sharding = sharding;
    spec.train.micro_batch = 2;
    spec
}

const SHARDED: [Sharding; 3] = [Sharding::Zero1, Sharding::Zero2, Sharding::Fsdp];

/// Same data, same gradients summed in another order (per unit, per micro-batch), the
/// same optimizer math on shards: losses and gradient norms agree with DDP to float
/// rounding (DDP itself is held to one rank in ddp.rs), under AdamW and SGD with weight
/// decay. Tolerances as for DDP.
#[test]
fn zero_and_fsdp_train_like_ddp() {
    for world in [2, 4] {
        for optimizer in OPTIMIZERS {
            let ddp = run_steps(&optimizer.on(spec("ddp", world, Sharding::None)));
            for sharding in SHARDED {
                let mut s = optimizer.on(spec(sharding.as_str(), world, sharding));
                let what = format!("dp={world} {sharding:?} {optimizer:?}");
                assert_same_training(&ddp, &run_steps(&s), &what);
                // Accumulation: ZeRO-2 and FSDP reduce-scatter every micro-batch into the shard.
                if world == 2 {
                    s.train.micro_batch = 1;
                    s.train.grad_accum = 2;
                    assert_same_training(&ddp, &run_steps(&s), &format!("{what} accumulated"));
                }
            }
        }
    }
}

/// HSDP at dp = 4 in two groups of 2: one rank's losses; each rank holds FSDP-at-2's
/// memory, sends FSDP-at-2's gathers and reduce-scatters and all-reduces its shard with
/// the other group's, each the planner's.
#[test]
fn hsdp_trains_like_one_rank_with_fsdp_inside_a_group() {
    let _serial = one_at_a_time();
    let mut one = spec("one rank", 1, Sharding::None);
    one.train.micro_batch = 8;
    let single = run_steps(&one);
    let mut hsdp = spec("hsdp", 4, Sharding::Hsdp);
    (hsdp.parallel.shard_group, hsdp.train.micro_batch) = (2, 2);
    assert_same_training(&single, &run_steps(&hsdp), "hsdp dp=4 S=2");
    (hsdp.train.steps, hsdp.train.warmup_steps) = (3, 1);
    let predicted = plan(&hsdp).unwrap().stages[0].clone();
    let (_, trace) = run_with_trace(&hsdp);
    for rank in &trace.ranks {
        let measured = &rank.memory.as_ref().expect("ranks report their memory").peak;
        assert_eq!(measured.parameters, predicted.memory.parameters, "rank {}", rank.rank);
        assert_eq!(measured.optimizer_state, predicted.memory.optimizer_state, "rank {}", rank.rank);
    }
    use distlab_common::trace::CollectiveOp;
    let sent = |op| sent_per_step(&trace, op, 3);
    assert_eq!(sent(CollectiveOp::AllGather), predicted.comm.dp_all_gather);
    assert_eq!(sent(CollectiveOp::ReduceScatter), predicted.comm.dp_reduce_scatter);
    let all_reduce = sent(CollectiveOp::AllReduce);
    assert!((predicted.comm.dp_all_reduce..=predicted.comm.dp_all_reduce + 1024).contains(&all_reduce), "{all_reduce}");
}

#[test]
fn every_rank_measures_the_memory_the_planner_predicts() {
    for sharding in [Sharding::None, Sharding::Zero1, Sharding::Zero2, Sharding::Fsdp] {
        let mut s = spec(sharding.as_str(), 2, sharding);
        s.train.steps = 2;
        s.train.warmup_steps = 1;
        let predicted = plan(&s).unwrap().stages[0].memory.clone();
        let (_, trace) = run_with_trace(&s);
        assert_eq!(trace.ranks.len(), 2);
        for rank in &trace.ranks {
            let measured = &rank.memory.as_ref().expect("ranks report their memory").peak;
            let what = format!("{sharding:?} rank {}", rank.rank);
            assert_eq!(measured.parameters, predicted.parameters, "{what}");
            assert_eq!(measured.gradients, predicted.gradients, "{what}");
            assert_eq!(measured.optimizer_state, predicted.optimizer_state, "{what}");
            assert_eq!(measured.gathered_parameters, predicted.gathered_parameters, "{what}");
            assert_eq!(measured.comm_buffers, predicted.comm_buffers, "{what}");
            assert_eq!(measured.activations, predicted.activations, "{what}");
            assert_eq!(measured.activation_grads, predicted.activation_grads, "{what}");
        }
    }
}

/// Bytes sent per step by each kind of collective, from rank 0's trace counters, next to
/// the planner's CommVolume. Gathers and reduce-scatters are exact; all-reduces may carry a
/// few bytes more: the one-float all-reduces of the loss and the gradient norm.
#[test]
fn bytes_sent_per_step_match_the_planner() {
    // bf16 too: the engine's collectives carry f32 whatever the model's format.
    let layouts = [Sharding::None, Sharding::Zero1, Sharding::Zero2, Sharding::Fsdp]
        .into_iter()
        .flat_map(|s| [(s, Precision::Fp32), (s, Precision::Bf16)]);
    for (sharding, precision) in layouts {
        let mut s = spec(sharding.as_str(), 2, sharding);
        s.train.precision = precision;
        s.train.steps = 3;
        s.train.warmup_steps = 1;
        let predicted = plan(&s).unwrap().stages[0].comm.clone();
        let (_, trace) = run_with_trace(&s);
        let sent = |op| sent_per_step(&trace, op, s.train.steps);
        let what = format!("{sharding:?} {}", precision.as_str());
        assert_eq!(sent(trace::CollectiveOp::AllGather), predicted.dp_all_gather, "{what} all_gather");
        assert_eq!(sent(trace::CollectiveOp::ReduceScatter), predicted.dp_reduce_scatter, "{what} reduce_scatter");
        let all_reduce = sent(trace::CollectiveOp::AllReduce);
        assert!(
            (predicted.dp_all_reduce..=predicted.dp_all_reduce + 16).contains(&all_reduce),
            "{what} all_reduce: {all_reduce} vs {}",
            predicted.dp_all_reduce
        );
    }
}

/// Each rank measures its own process beside the ledger (a counting allocator), and no
/// FSDP rank ever holds the whole model's initial values: each computes only its shard's.
/// At start-up the heap holds less beside the ledger's bookings than half the whole model
/// in fp32 (a rank that initialised the whole model first would hold all of it there).
#[test]
fn fsdp_ranks_never_hold_the_whole_model() {
    let mut s = spec("fsdp-init", 4, Sharding::Fsdp);
    s.model = ModelSpec::dense(4, 128, 4, 8, 64);
    s.train.micro_batch = 1;
    s.train.steps = 1;
    s.train.warmup_steps = 1;
    let whole = s.model.param_count() * 4;
    let (_, trace) = run_with_trace(&s);
    assert_eq!(trace.ranks.len(), 4);
    for rank in &trace.ranks {
        let m = rank.memory.as_ref().expect("ranks report their memory");
        let p = m.process.as_ref().expect("the worker measures its process");
        let start = p.start_up.as_ref().expect("the start-up peak is measured");
        let beside = start.heap_peak.saturating_sub(start.ledger_peak);
        let what = format!(
            "rank {}: start-up heap {} B, ledger {} B, whole model {whole} B",
            rank.rank, start.heap_peak, start.ledger_peak
        );
        assert!(start.heap_peak >= start.ledger_peak, "{what}: every booked buffer is on the heap");
        assert!(beside < whole / 2, "{what}");
        let heap = p.heap_peak.expect("heap peak");
        let booked = m.booked_heap_peak.expect("the ledger's heap bookings");
        assert!(heap >= booked, "rank {}: heap peak {heap} below the ledger's {booked}", rank.rank);
        assert!(p.peak_resident.expect("peak resident set") >= heap, "rank {}", rank.rank);
    }
}

/// DDP's gradient buckets (and the pipes between the ranks) live in shared memory every
/// rank of the group maps: the ledger books them apart from the heap, and the heap (every allocation counted) holds at least
/// what the ledger books on it; "untracked" is the difference.
#[test]
fn ddp_buckets_are_booked_in_shared_memory_and_the_heap_holds_the_rest() {
    let mut s = spec("ddp-shared", 2, Sharding::None);
    s.train.steps = 2;
    s.train.warmup_steps = 1;
    let (_, trace) = run_with_trace(&s);
    for rank in &trace.ranks {
        let m = rank.memory.as_ref().expect("ranks report their memory");
        let what = format!("rank {}", rank.rank);
        // Shared memory: the buckets; the pipes to the other rank (one each way, 2 MiB + a
        // 4 KiB header each) are reported apart; the two rings' 256 KiB staging pieces are
        // booked as transport.
        assert!(m.shared_peak > 0 && m.shared_peak == m.peak.comm_buffers, "{what}: shared memory");
        assert_eq!(m.pipe_bytes, 2 * ((2 << 20) + 4096), "{what}: pipes");
        assert_eq!(m.peak.transport, 2 * (256 << 10), "{what}: transport");
        let booked = m.booked_heap_peak.expect("heap bookings");
        assert!(booked + m.shared_peak >= m.peak.total, "{what}");
        let heap = m.process.as_ref().and_then(|p| p.heap_peak).expect("heap peak");
        assert!(heap >= booked, "{what}: heap {heap} below the ledger's heap bookings {booked}");
        assert_eq!(m.untracked(), Some(heap as i64 - booked as i64), "{what}");
    }
}
