//! The cards' claim checks on real runs of their presets: each measures the quantity its
//! card states, and agrees. (The unit tests in `common/src/study/claims/` show each check
//! disagreeing with a broken engine's numbers; these show the engine's own numbers agree.)

use distlab_common::cards::ClaimCheck;
use distlab_common::claims::{is_partner, measure, Measurement, RunEvidence};
use distlab_common::presets::presets;
use distlab_common::*;
use distlab_tests::*;

fn preset(key: &str) -> ExperimentSpec {
    presets().into_iter().find(|p| p.key == key).map(|p| p.spec).unwrap_or_else(|| panic!("no preset {key}"))
}

fn view(id: i64, spec: &ExperimentSpec) -> ExperimentView {
    ExperimentView {
        id,
        name: spec.name.clone(),
        owner: "local".into(),
        status: ExperimentStatus::Succeeded,
        spec: spec.clone(),
        created_at: String::new(),
        started_at: None,
        finished_at: None,
        error: None,
        summary: None,
        attempt: 1,
        steps_done: spec.train.steps,
    }
}

/// Runs `spec` (and `partner`, the run the check sets it against) and measures `check`.
fn check(check: ClaimCheck, spec: &ExperimentSpec, partner: Option<&ExperimentSpec>) -> Measurement {
    let (points, trace) = run_points_with_trace(spec);
    let v = view(1, spec);
    let run = RunEvidence { view: &v, metrics: &points, ranks: &trace.ranks, traced_steps: spec.train.steps };
    let partner_run = partner.map(|p| {
        assert_eq!(is_partner(check, spec, p), Some(true), "{check:?}: the partner");
        let (points, trace) = run_points_with_trace(p);
        (view(2, p), points, trace)
    });
    let partner_evidence = partner_run.as_ref().map(|(v, points, trace)| RunEvidence {
        view: v,
        metrics: points,
        ranks: &trace.ranks,
        traced_steps: v.spec.train.steps,
    });
    let got = measure(check, &run, partner_evidence.as_ref()).unwrap_or_else(|e| panic!("{check:?}: {e}"));
    println!("{check:?} on {}:\n  predicted: {}\n  measured:  {}", spec.name, got.predicted, got.measured);
    got
}

#[test]
fn zero1_and_zero2_presets_measure_the_sharded_master_count() {
    let _serial = one_at_a_time();
    for key in ["zero1", "zero2"] {
        let mut spec = preset(key);
        (spec.train.steps, spec.train.warmup_steps) = (2, 1);
        let got = check(ClaimCheck::ZeroMemory, &spec, None);
        assert!(got.agrees, "{key}: {got:?}");
        assert!(got.measured.contains("the chapter, the ZeRO paper"), "{key}: {}", got.measured);
    }
}

#[test]
fn checkpointing_costs_about_one_more_forward() {
    let _serial = one_at_a_time();
    let got = check(ClaimCheck::CheckpointingRecomputeTime, &preset("checkpointing"), None);
    assert!(got.agrees, "{got:?}");
}

#[test]
fn selective_recompute_drops_the_probabilities_for_a_small_share_of_the_step() {
    let _serial = one_at_a_time();
    let spec = preset("selective");
    let mut plain = spec.clone();
    plain.train.checkpointing = Checkpointing::None;
    let got = check(ClaimCheck::SelectiveRecompute, &spec, Some(&plain));
    assert!(got.agrees, "{got:?}");
}

#[test]
fn ulysses_halves_each_ranks_activations_for_the_planners_all_to_alls() {
    let _serial = one_at_a_time();
    let spec = preset("ulysses");
    let mut whole = spec.clone();
    (whole.parallel.dp, whole.parallel.cp) = (1, 1);
    let got = check(ClaimCheck::ContextParallel, &spec, Some(&whole));
    assert!(got.agrees, "{got:?}");
}

#[test]
fn the_ring_halves_each_ranks_activations_for_the_planners_passes() {
    let _serial = one_at_a_time();
    let spec = preset("ring");
    let mut whole = spec.clone();
    (whole.parallel.dp, whole.parallel.cp) = (1, 1);
    let got = check(ClaimCheck::ContextParallel, &spec, Some(&whole));
    assert!(got.agrees, "{got:?}");
}

#[test]
fn fp16_without_scaling_stores_most_logit_gradients_as_zero() {
    let _serial = one_at_a_time();
    let plain = preset("fp16-plain");
    let got = check(ClaimCheck::LossScalingUnderflow, &plain, Some(&preset("fp16-scaled")));
    assert!(got.agrees, "{got:?}");
    // bf16 keeps them: its share of zeros is far below fp16's.
    let (points, _) = run_points_with_trace(&preset("bf16"));
    let share = points.iter().filter_map(|p| p.logit_grad_zero_share).sum::<f64>() / points.len() as f64;
    println!("bf16: {:.2}% of the logit gradients stored as 0", 100.0 * share);
    assert!(share < 0.05, "bf16 stores {share} of them as 0");
}

/// The replay is made of measured pass times, which other processes on this machine can
/// stretch unevenly (a stage slower than the rest sets the pace): held here within 12
/// points of (P-1)/(M+P-1) and below the whole step's idle share; the unit tests in
/// `common/src/study/claims/` hold the check itself to agreeing with even stages and not
/// with uneven ones.
#[test]
fn the_pipeline_presets_bubble_replayed_is_near_the_decks_formula() {
    let _serial = one_at_a_time();
    let percent = |text: &str, after: &str| -> f64 {
        let from = text.find(after).map_or(0, |i| i + after.len());
        let digits: String = text[from..].chars().take_while(|c| c.is_ascii_digit() || *c == '.').collect();
        digits.parse().unwrap_or_else(|_| panic!("no number after {after:?} in {text}"))
    };
    let mut gpipe = preset("pipeline");
    gpipe.parallel.pp_schedule = PpSchedule::Gpipe;
    // GPipe has the same formula: its activations differ, not its idle time.
    for spec in [preset("pipeline"), gpipe] {
        let got = check(ClaimCheck::BubbleFraction, &spec, None);
        let replayed = percent(&got.measured, "");
        let idle = percent(&got.measured, " ms; ");
        assert!((replayed - 27.3).abs() <= 12.0 && replayed < idle, "{got:?}");
    }
}

/// ZBV against ZB-H1 on the same model: the replay idles less, and every stage's
/// activation peak in both runs is the planner's.
#[test]
fn the_zbv_presets_bubble_is_under_zb_h1s_and_its_peaks_are_the_planners() {
    let _serial = one_at_a_time();
    let mut v = preset("zbv");
    (v.train.steps, v.train.warmup_steps) = (4, 1);
    let mut h1 = v.clone();
    h1.parallel.pp_schedule = PpSchedule::ZbH1;
    let got = check(ClaimCheck::ZbvBubble, &v, Some(&h1));
    assert!(got.agrees, "{got:?}");
    println!("  {}\n  {}", got.predicted, got.measured);
}

/// DualPipeV against ZBV on the same V: the replay idles less than 1F1B's formula, the
/// highest stage holds less than ZBV's, and every peak in both runs is the planner's.
#[test]
fn the_dualpipev_preset_idles_under_1f1b_and_its_highest_stage_holds_less_than_zbvs() {
    let _serial = one_at_a_time();
    let mut d = preset("dualpipev");
    (d.train.steps, d.train.warmup_steps) = (4, 1);
    let mut v = d.clone();
    v.parallel.pp_schedule = PpSchedule::Zbv;
    let got = check(ClaimCheck::DualPipeVAgainstZbv, &d, Some(&v));
    assert!(got.agrees, "{got:?}");
    println!("  {}\n  {}", got.predicted, got.measured);
}

/// DiLoCo against DDP on the same replicas: 1/H of the all-reduce bytes per step, both
/// runs' the planner's.
#[test]
fn the_diloco_presets_bytes_are_ddps_over_h() {
    let _serial = one_at_a_time();
    let diloco = preset("diloco");
    let mut ddp = diloco.clone();
    ddp.parallel.sync = DataSync::EveryStep;
    let got = check(ClaimCheck::DilocoBytes, &diloco, Some(&ddp));
    assert!(got.agrees, "{got:?}");
    println!("  {}\n  {}", got.predicted, got.measured);
}

/// Asynchronous SGD against DDP on the same 4 ranks: the parameter server sends W/2 = 2
/// times a ring rank's bytes per step, both runs' the planner's.
#[test]
fn the_async_ps_presets_server_sends_w_over_2_times_a_ring_ranks_bytes() {
    let _serial = one_at_a_time();
    let mut ps = preset("async-ps");
    (ps.train.steps, ps.train.warmup_steps) = (3, 1);
    let mut ddp = ps.clone();
    ddp.parallel.sync = DataSync::EveryStep;
    let got = check(ClaimCheck::ParameterServerBottleneck, &ps, Some(&ddp));
    assert!(got.agrees, "{got:?}");
    println!("  {}\n  {}", got.predicted, got.measured);
}

/// The lost-replica preset (shortened, its drill after step 5 kept): no step lost, the
/// replacement's copy the planner's bytes and its parameters the source's.
#[test]
fn the_lost_replica_presets_rejoin_copies_the_planners_bytes() {
    let _serial = one_at_a_time();
    let mut spec = preset("lost-replica");
    (spec.train.steps, spec.train.warmup_steps) = (100, 2);
    let got = check(ClaimCheck::ReplicaRejoin, &spec, None);
    assert!(got.agrees, "{got:?}");
}

/// LAMB against AdamW at 8x the batch and lr: AdamW's loss climbs above its start, LAMB's
/// does not, and LAMB ends lower (the preset's whole 96 steps: the climb is early, the end
/// is the claim).
#[test]
fn the_lamb_preset_holds_the_scaled_learning_rate_where_adamw_climbs() {
    let _serial = one_at_a_time();
    let lamb = preset("lamb-large-batch");
    let mut adamw = lamb.clone();
    adamw.train.optimizer = Optimizer::Adamw;
    let got = check(ClaimCheck::LambLargeBatch, &lamb, Some(&adamw));
    assert!(got.agrees, "{got:?}");
    println!("  {}\n  {}", got.predicted, got.measured);
}

/// HSDP against FSDP on the same 4 ranks: across the groups only the shards' all-reduce
/// (the planner's), FSDP's ring far more.
#[test]
fn the_hsdp_preset_sends_only_its_shards_across_the_groups() {
    let _serial = one_at_a_time();
    let mut hsdp = preset("hsdp");
    (hsdp.train.steps, hsdp.train.warmup_steps) = (3, 1);
    let mut fsdp = hsdp.clone();
    fsdp.parallel.sharding = Sharding::Fsdp;
    let got = check(ClaimCheck::HsdpAcrossGroups, &hsdp, Some(&fsdp));
    assert!(got.agrees, "{got:?}");
    println!("  {}\n  {}", got.predicted, got.measured);
}

#[test]
fn the_zero2_and_fsdp_presets_send_their_multiples_of_d() {
    let _serial = one_at_a_time();
    for (key, check_) in [("zero2", ClaimCheck::Zero2Traffic), ("fsdp", ClaimCheck::FsdpTraffic)] {
        let mut spec = preset(key);
        (spec.train.steps, spec.train.warmup_steps) = (3, 1);
        let got = check(check_, &spec, None);
        assert!(got.agrees, "{key}: {got:?}");
    }
}

#[test]
fn the_zero1_preset_sends_ddps_all_reduce_and_an_all_gather() {
    let _serial = one_at_a_time();
    let mut spec = preset("zero1");
    (spec.train.steps, spec.train.warmup_steps) = (3, 1);
    let got = check(ClaimCheck::Zero1Traffic, &spec, None);
    assert!(got.agrees, "{got:?}");
}

#[test]
fn the_experts_preset_sends_four_all_to_alls_per_block_and_holds_half_the_experts() {
    let _serial = one_at_a_time();
    let mut spec = preset("experts");
    (spec.train.steps, spec.train.warmup_steps) = (3, 1);
    for claim in [ClaimCheck::ExpertAllToAll, ClaimCheck::ExpertParameters] {
        let got = check(claim, &spec, None);
        assert!(got.agrees, "{got:?}");
    }
    let got = check(ClaimCheck::ExpertParameters, &spec, None);
    assert!(got.predicted.ends_with("and 431.0 KiB (441344 B) for the dense model"), "{}", got.predicted);
}

/// Checks measured on two runs that differ in one setting: FlashAttention against naive
/// attention, FSDP without prefetch against with it, TP without sequence parallelism
/// against with it, an fp32 wire against a 2-byte one.
#[test]
fn one_setting_apart_each_pair_of_runs_agrees_with_its_card() {
    let _serial = one_at_a_time();
    let short = |key: &str| {
        let mut spec = preset(key);
        (spec.train.steps, spec.train.warmup_steps) = (2, 1);
        spec
    };
    let (flash, fsdp, megatron) = (short("flash"), short("fsdp"), short("megatron"));
    let mut naive = flash.clone();
    naive.train.attention = Attention::Naive;
    let mut prefetch = fsdp.clone();
    prefetch.parallel.prefetch = true;
    let mut sp = megatron.clone();
    sp.parallel.sequence_parallel = true;
    let zero2 = short("zero2");
    let mut two_byte = zero2.clone();
    two_byte.parallel.comm_dtype = Precision::Bf16;
    for (claim, spec, partner) in [
        (ClaimCheck::FlashAttentionMemory, &flash, &naive),
        (ClaimCheck::PrefetchGatheredPeak, &fsdp, &prefetch),
        (ClaimCheck::SequenceParallelActivations, &megatron, &sp),
        (ClaimCheck::TwoByteWire, &zero2, &two_byte),
    ] {
        let got = check(claim, spec, Some(partner));
        assert!(got.agrees, "{got:?}");
    }
}

/// The tree and hierarchical all-reduce demos, measured on their replays.
#[test]
fn the_tree_and_hierarchical_demos_send_what_their_cards_say() {
    let _serial = one_at_a_time();
    for (key, claim) in
        [("allreduce-tree", ClaimCheck::TreeAllreduce), ("allreduce-hierarchical", ClaimCheck::HierarchicalAllreduce)]
    {
        let spec = preset(key);
        let (summary, trace) = run_demo(&spec);
        let v = ExperimentView { summary: Some(summary), ..view(1, &spec) };
        let run = RunEvidence { view: &v, metrics: &[], ranks: &trace.ranks, traced_steps: 1 };
        let got = measure(claim, &run, None).unwrap_or_else(|e| panic!("{claim:?}: {e}"));
        println!("{claim:?} on {key}:\n  predicted: {}\n  measured:  {}", got.predicted, got.measured);
        assert!(got.agrees, "{key}: {got:?}");
    }
}

/// Top-k compression's bytes, one all-reduce per step with accumulation, expert
/// capacity's drops and the optimizer's state on disk, each on its preset.
#[test]
fn compression_accumulation_capacity_and_offload_agree_with_their_cards() {
    let _serial = one_at_a_time();
    let got = check(ClaimCheck::CompressedGradients, &preset("topk"), None);
    assert!(got.agrees, "{got:?}");

    let ddp = preset("ddp2");
    let mut accumulating = ddp.clone();
    accumulating.train.grad_accum = 4;
    let got = check(ClaimCheck::AccumulationAllreduces, &ddp, Some(&accumulating));
    assert!(got.agrees, "{got:?}");

    let experts = preset("experts");
    let mut roomy = experts.clone();
    roomy.model.capacity_factor = 2.0;
    let got = check(ClaimCheck::ExpertCapacity, &experts, Some(&roomy));
    assert!(got.agrees, "{got:?}");

    let mut offload = preset("offload-disk");
    offload.train.steps = 5;
    let mut in_memory = offload.clone();
    in_memory.parallel.offload = Offload::None;
    let got = check(ClaimCheck::DiskOffloadMemory, &offload, Some(&in_memory));
    assert!(got.agrees, "{got:?}");
    println!("  {}", got.note.unwrap_or_default());

    let fp8 = preset("fp8");
    let plain = ExperimentSpec { train: TrainSpec { fp8: Fp8Recipe::None, ..fp8.train.clone() }, ..fp8.clone() };
    let got = check(ClaimCheck::Fp8DelayedScaling, &fp8, Some(&plain));
    assert!(got.agrees, "{got:?}");
    println!("  {}", got.measured);

    let mut gathered_fp8 = preset("fp8-all-gather");
    (gathered_fp8.train.steps, gathered_fp8.train.warmup_steps) = (4, 1);
    let mut gathered_bf16 = gathered_fp8.clone();
    gathered_bf16.parallel.fp8_all_gather = false;
    let got = check(ClaimCheck::Fp8AllGather, &gathered_fp8, Some(&gathered_bf16));
    assert!(got.agrees, "{got:?}");
    println!("  {}", got.measured);

    let mut offloaded = preset("offload-activations");
    (offloaded.train.steps, offloaded.train.warmup_steps) = (3, 1);
    let mut kept = offloaded.clone();
    kept.train.activation_offload = Offload::None;
    let got = check(ClaimCheck::ActivationOffloadMemory, &offloaded, Some(&kept));
    assert!(got.agrees, "{got:?}");
    println!("  {}", got.note.unwrap_or_default());
}

/// MFU on a real run of two ranks: the worker measures its CPU's peak, the summary reports
/// model FLOP/s and MFU, and the card's check recomputes them from the run's step times.
#[test]
fn a_runs_mfu_is_its_model_flops_over_the_measured_peak() {
    let spec = preset("ddp2");
    let out = tempfile::tempdir().unwrap();
    let points = run_into(&spec, out.path());
    let summary: RunSummary =
        serde_json::from_str(&std::fs::read_to_string(out.path().join("summary.json")).unwrap()).unwrap();
    let peak = summary.peak.clone().expect("a CPU worker knows its peak");
    assert!(peak.basis.contains("FMA peak measured"), "{}", peak.basis);
    let expected_flops = spec.model.train_flops_per_token() * summary.tokens_per_s;
    assert!((summary.model_flops_per_s - expected_flops).abs() <= 1e-9 * expected_flops, "{summary:?}");
    let mfu = summary.mfu.expect("an MFU");
    assert!(mfu > 0.0 && mfu < 1.0, "MFU {mfu} of a CPU run");
    let mut v = view(1, &spec);
    v.summary = Some(summary);
    let run = RunEvidence { view: &v, metrics: &points, ranks: &[], traced_steps: spec.train.steps };
    let got = measure(ClaimCheck::ModelFlopUtilisation, &run, None).unwrap();
    println!("MFU on {}:\n  predicted: {}\n  measured:  {}\n  {:?}", spec.name, got.predicted, got.measured, got.note);
    assert!(got.agrees, "{got:?}");
}

/// A pipelined run reports each stage's MFU: the stages' parts of the model's FLOPs per token
/// at the run's pace, their mean the run's MFU; the first stage, holding the embeddings,
/// computes more of the model than a middle one.
#[test]
fn a_pipelined_run_reports_each_stages_mfu() {
    let spec = preset("pipeline");
    let out = tempfile::tempdir().unwrap();
    run_into(&spec, out.path());
    let summary: RunSummary =
        serde_json::from_str(&std::fs::read_to_string(out.path().join("summary.json")).unwrap()).unwrap();
    let mfu = summary.mfu.expect("an MFU");
    let stages = &summary.stage_mfu;
    assert_eq!(stages.len(), spec.parallel.pp, "{summary:?}");
    let mean = stages.iter().sum::<f64>() / stages.len() as f64;
    assert!((mean - mfu).abs() <= 1e-9 * mfu, "{stages:?} against {mfu}");
    assert!(stages[0] > stages[1], "{stages:?}");
    let plan = distlab_common::planner::plan(&spec).unwrap();
    let flops = plan.stage_flops_per_token(&spec);
    let expected = mfu * flops.len() as f64 * flops[2] / flops.iter().sum::<f64>();
    assert!((stages[2] - expected).abs() <= 1e-9 * expected, "{stages:?}");
}
