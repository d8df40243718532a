//! Llama blocks (RMSNorm, rotary positions, grouped-query attention, SwiGLU, no biases)
//! across rank processes: every strategy that runs them against one rank (losses and
//! gradient norms to float rounding), the memory every rank measures against the planner,
//! and a run resumed from its checkpoint against one never interrupted.

use distlab_common::planner::plan;
use distlab_common::*;
use distlab_tests::*;

/// A 4-block Llama: d_model 64, 4 query heads on 2 key/value heads, a SwiGLU 176 wide.
fn llama(name: &str, steps: u64) -> ExperimentSpec {
    let mut spec = quick_spec(name, steps);
    spec.model = ModelSpec::llama(4, 64, 4, 2, 176, 32, spec.model.vocab);
    spec.train.micro_batch = 2;
    spec
}

/// It learns: the Markov chain's loss falls well below the uniform guess's ln(64) = 4.16.
#[test]
fn a_llama_learns_the_markov_chain() {
    let losses = run_losses(&llama("llama", 40));
    let (first, last) = (losses[0], losses[losses.len() - 1]);
    println!("llama: loss {first:.4} at step 0, {last:.4} at step 39");
    assert!((first - 64f64.ln()).abs() < 0.1, "starts near ln(64): {first}");
    assert!(last < first - 0.8, "learns: {first} -> {last}");
}

/// DDP, ZeRO-1, ZeRO-2 and FSDP (gathering on demand and prefetching) over 2 ranks against
/// one rank with the whole batch, under AdamW and SGD.
#[test]
fn data_parallel_and_sharded_llamas_train_like_one_rank() {
    for optimizer in OPTIMIZERS {
        let mut single = llama("one rank", 12);
        single.train.micro_batch = 4;
        let single = run_steps(&optimizer.on(single));
        for (sharding, prefetch) in [
            (Sharding::None, false),
            (Sharding::Zero1, false),
            (Sharding::Zero2, false),
            (Sharding::Fsdp, false),
            (Sharding::Fsdp, true),
        ] {
            let mut s = llama(sharding.as_str(), 12);
            (s.parallel.dp, s.parallel.sharding, s.parallel.prefetch) = (2, sharding, prefetch);
            let what = format!("llama dp=2 {sharding:?} prefetch={prefetch} {optimizer:?}");
            assert_same_training(&single, &run_steps(&optimizer.on(s)), &what);
        }
    }
}

/// Every pipeline schedule over 2 stages (interleaved: 2 chunks each), and a dp2 x pp2
/// mesh with FSDP, against one rank with the same micro-batches.
#[test]
fn pipelined_llamas_train_like_one_rank() {
    let _serial = one_at_a_time();
    let piped = |schedule: PpSchedule| {
        let mut s = llama(schedule.as_str(), 10);
        (s.parallel.pp, s.parallel.pp_schedule, s.train.micro_batches) = (2, schedule, 4);
        if schedule == PpSchedule::Interleaved {
            s.parallel.virtual_stages = 2;
        }
        s
    };
    let mut one = llama("one rank", 10);
    one.train.micro_batches = 4;
    let single = run_steps(&one);
    for schedule in [PpSchedule::Gpipe, PpSchedule::OneFOneB, PpSchedule::Interleaved, PpSchedule::ZbH1] {
        assert_same_training(&single, &run_steps(&piped(schedule)), &format!("llama pp=2 {schedule:?}"));
    }
    let mut mesh = piped(PpSchedule::OneFOneB);
    (mesh.parallel.dp, mesh.parallel.sharding, mesh.train.micro_batches) = (2, Sharding::Fsdp, 2);
    one.train.micro_batch = 4;
    one.train.micro_batches = 2;
    assert_same_training(&run_steps(&one), &run_steps(&mesh), "llama dp2 x pp2 fsdp");
}

/// Tensor parallelism over 2 ranks (each with 2 of the 4 query heads, 1 of the 2 K/V
/// heads, its share of the SwiGLU's gate and up columns), with sequence parallelism, and a
/// dp2 x tp2 x pp2 mesh with FSDP, against one rank.
#[test]
fn tensor_parallel_llamas_train_like_one_rank() {
    let _serial = one_at_a_time();
    for optimizer in OPTIMIZERS {
        let single = run_steps(&optimizer.on(llama("one rank", 10)));
        for sequence_parallel in [false, true] {
            let mut s = llama("tp2", 10);
            (s.parallel.tp, s.parallel.sequence_parallel) = (2, sequence_parallel);
            let what = format!("llama tp=2 sequence_parallel={sequence_parallel} {optimizer:?}");
            assert_same_training(&single, &run_steps(&optimizer.on(s)), &what);
        }
    }
    let mut one = llama("one rank", 6);
    (one.train.micro_batch, one.train.micro_batches) = (4, 2);
    let mut mesh = llama("dp2 x tp2 x pp2", 6);
    (mesh.parallel.dp, mesh.parallel.tp, mesh.parallel.pp, mesh.parallel.sharding) = (2, 2, 2, Sharding::Fsdp);
    mesh.train.micro_batches = 2;
    assert_same_training(&run_steps(&one), &run_steps(&mesh), "llama dp2 x tp2 x pp2 fsdp");
}

/// Recomputing every block (or, selective, its grouped attention's probabilities) in
/// backward gives the same bits; flash attention (grouped, no
/// K/V repeated per query head) follows plain attention to float rounding; bf16 and fp16
/// follow fp32 to their precision.
#[test]
fn checkpointed_flash_and_two_byte_llamas_train_like_the_plain_run() {
    let plain = run_steps(&llama("plain", 10));
    for checkpointing in [Checkpointing::Every, Checkpointing::Sqrt, Checkpointing::Selective] {
        let mut s = llama("checkpointed", 10);
        s.train.checkpointing = checkpointing;
        let recomputed = run_steps(&s);
        let bits = |m: &[MetricPoint]| m.iter().map(|p| (p.loss.to_bits(), p.grad_norm.to_bits())).collect::<Vec<_>>();
        assert_eq!(bits(&recomputed), bits(&plain), "checkpointing={checkpointing:?}");
    }
    let mut flash = llama("flash", 10);
    flash.train.attention = Attention::Flash;
    assert_same_training(&plain, &run_steps(&flash), "llama flash attention");
    for (precision, tolerance) in [(Precision::Bf16, 2e-2), (Precision::Fp16, 3e-3)] {
        let mut s = llama(precision.as_str(), 10);
        s.train.precision = precision;
        if precision == Precision::Fp16 {
            s.train.loss_scaling = LossScaling::Dynamic;
        }
        let two_byte = run_losses(&s);
        let worst = plain.iter().zip(&two_byte).map(|(a, b)| (a.loss - b).abs() / a.loss).fold(0.0, f64::max);
        println!("llama {}: largest relative loss difference from fp32 {worst:.1e}", precision.as_str());
        assert!(worst < tolerance, "{precision:?}: {worst}");
    }
}

/// The ledger's categories on every rank equal the planner's for a Llama (its RMSNorm
/// keeps one statistic per row, its SwiGLU gate, up and product, its K/V projections
/// narrower than Q): one rank, DDP and FSDP, a 2-stage ZB-H1 pipeline, and tensor
/// parallelism with sequence parallelism.
#[test]
fn every_rank_measures_the_llama_memory_the_planner_predicts() {
    let layouts: [(&str, fn(&mut ExperimentSpec)); 6] = [
        ("one rank", |_| {}),
        ("ddp", |s| s.parallel.dp = 2),
        ("fsdp", |s| (s.parallel.dp, s.parallel.sharding) = (2, Sharding::Fsdp)),
        ("pp2 1f1b", |s| (s.parallel.pp, s.train.micro_batches) = (2, 4)),
        ("pp2 zb-h1", |s| (s.parallel.pp, s.parallel.pp_schedule, s.train.micro_batches) = (2, PpSchedule::ZbH1, 4)),
        ("tp2 sequence parallel", |s| (s.parallel.tp, s.parallel.sequence_parallel) = (2, true)),
    ];
    for (name, layout) in layouts {
        let mut s = llama(name, 2);
        layout(&mut s);
        let predicted = plan(&s).unwrap();
        let (_, trace) = run_with_trace(&s);
        for rank in &trace.ranks {
            let want = &predicted.stages[s.stage_of(rank.rank as usize)].memory;
            let got = &rank.memory.as_ref().expect("ranks report their memory").peak;
            let what = format!("llama {name} rank {}", rank.rank);
            assert_eq!(got.parameters, want.parameters, "{what}: parameters");
            assert_eq!(got.gradients, want.gradients, "{what}: gradients");
            assert_eq!(got.optimizer_state, want.optimizer_state, "{what}: optimizer state");
            assert_eq!(got.gathered_parameters, want.gathered_parameters, "{what}: gathered parameters");
            assert_eq!(got.activations, want.activations, "{what}: activations");
            assert_eq!(got.activation_grads, want.activation_grads, "{what}: activation gradients");
        }
    }
}

/// A worker SIGKILLed mid-run: the second resumes from the latest checkpoint and the loss
/// curve is bit for bit the uninterrupted run's.
#[test]
fn a_llama_resumes_bit_identically_after_its_worker_is_killed() {
    let mut spec = llama("llama resume", 40);
    (spec.parallel.dp, spec.train.checkpoint_every) = (2, 10);
    let straight = run_losses(&spec);
    let mut lab = Lab::start_with(LabOptions {
        local_workers: 0,
        lease_seconds: 2.0,
        heartbeat_seconds: 0.5,
        ..LabOptions::default()
    });
    let (id, exp) = kill_and_resume(&mut lab, &spec, 24);
    assert_eq!(exp.status, ExperimentStatus::Succeeded, "{exp:?}");
    let metrics: Metrics = lab.get_as(&format!("/api/experiments/{id}/metrics"));
    let resumed: Vec<f64> = metrics.steps.iter().map(|m| m.loss).collect();
    assert_eq!(resumed.len(), 40);
    for (step, (a, b)) in straight.iter().zip(&resumed).enumerate() {
        assert_eq!(a.to_bits(), b.to_bits(), "step {step}: straight {a} vs resumed {b}");
    }
}

/// Elastic resume: a dp=4 ZeRO-2 Llama's checkpoint, re-cut for 2 FSDP ranks, continues as
/// an uninterrupted dp=2 run of the same global batch does.
#[test]
fn a_dp4_llama_checkpoint_continues_at_dp2_like_an_uninterrupted_run() {
    let _serial = one_at_a_time();
    let spec = |name: &str, dp: usize, sharding: Sharding| {
        let mut s = llama(name, 8);
        (s.parallel.dp, s.parallel.sharding) = (dp, sharding);
        (s.train.micro_batch, s.train.grad_accum) = (4, 4 / dp);
        s
    };
    let straight = run_losses(&spec("dp2 straight", 2, Sharding::Fsdp));
    let root = tempfile::tempdir().unwrap();
    let mut source = spec("dp4 zero2", 4, Sharding::Zero2);
    source.train.checkpoint_every = 4;
    run_in_checkpoint_dir(&source, &root.path().join("experiment-1"));
    let mut resumed = spec("dp2 resumed", 2, Sharding::Fsdp);
    resumed.train.resume_from = Some(ResumeFrom { experiment: 1, step: 4 });
    let second_half = run_in_checkpoint_dir(&resumed, &root.path().join("experiment-2"));
    let losses: Vec<f64> = second_half.iter().map(|p| p.loss).collect();
    assert_eq!(second_half.first().map(|p| p.step), Some(4));
    assert_same_losses(&straight[4..], &losses, "llama dp2 fsdp from dp4 zero2's step 4");
}

/// SwiGLU experts: a Llama whose blocks route each token to 2 of 4 SwiGLU MLPs (no biases).
/// Spread over ep = 2 ranks of the data-parallel group it trains as every rank holding them
/// all, with the same drops; two data-parallel ranks train as one accumulating their two
/// micro-batches (the capacity is a micro-batch's, so the micro-batches match); a
/// pipeline of them as one stage; and every rank measures the planner's memory and
/// all-to-all bytes.
#[test]
fn swiglu_experts_train_like_every_expert_on_one_rank() {
    let _serial = one_at_a_time();
    let moe = |name: &str, dp: usize, ep: usize| {
        let mut s = llama(name, 6);
        s.model = ModelSpec { experts: 4, expert_top_k: 2, capacity_factor: 1.0, ..s.model };
        // Capacity is per micro-batch: 2 sequences each, 2 per step on one rank.
        (s.parallel.dp, s.parallel.ep, s.train.micro_batch, s.train.micro_batches) = (dp, ep, 2, 2 / dp);
        s
    };
    let single = run_steps(&moe("one rank", 1, 1));
    assert!(single.iter().any(|p| p.experts.is_some_and(|e| e.dropped > 0)), "capacity 1.0 drops some");
    assert_same_training(&single, &run_steps(&moe("dp2", 2, 1)), "llama experts dp=2");
    let spread = moe("dp2 ep2", 2, 2);
    let (points, trace) = run_points_with_trace(&spread);
    assert_same_training(&single, &points, "llama experts dp=2 ep=2");
    for (a, b) in single.iter().zip(&points) {
        let (a, b) = (a.experts.expect("routing"), b.experts.expect("routing"));
        assert_eq!((a.assignments, a.dropped), (b.assignments, b.dropped), "the same routing");
    }
    let planned = plan(&spread).unwrap();
    let stage = &planned.stages[0];
    let sent = sent_per_step(&trace, distlab_common::trace::CollectiveOp::AllToAll, spread.train.steps);
    assert_eq!(sent, stage.comm.ep_all_to_all, "all-to-all bytes");
    for rank in &trace.ranks {
        let got = &rank.memory.as_ref().expect("ranks report their memory").peak;
        let what = format!("llama experts ep=2 rank {}", rank.rank);
        assert_eq!(got.parameters, stage.memory.parameters, "{what}: parameters");
        assert_eq!(got.optimizer_state, stage.memory.optimizer_state, "{what}: optimizer state");
        assert_eq!(got.activations, stage.memory.activations, "{what}: activations");
        assert_eq!(got.activation_grads, stage.memory.activation_grads, "{what}: activation gradients");
    }
    let mut piped = moe("pp2", 1, 1);
    piped.parallel.pp = 2;
    assert_same_training(&single, &run_steps(&piped), "llama experts pp=2");
}
