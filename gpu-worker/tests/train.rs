//! The training entry point: it learns, it is deterministic, accumulation equals a
//! bigger batch, it refuses what it cannot do, and it reports what the contract says.

use std::sync::atomic::AtomicBool;

use distlab_common::{
    BackendKind, CheckpointWrite, CollectiveDemo, Dataset, ExperimentSpec, Limits, LossScaling, LrSchedule,
    MetricPoint, Optimizer, Precision, RunEvent, RunSummary,
};
use distlab_worker::checkpoint::{CheckpointDir, RankPlace};
use distlab_worker::train::CheckpointOptions;
use distlab_worker::{train, CpuTrainer, TrainError, TrainOptions};

struct Run {
    metrics: Vec<MetricPoint>,
    logs: Vec<String>,
    summary: RunSummary,
}

fn run(spec: &ExperimentSpec, threads: usize) -> Result<Run, TrainError> {
    run_with(spec, &TrainOptions { threads, ..TrainOptions::default() })
}

fn run_with(spec: &ExperimentSpec, opts: &TrainOptions) -> Result<Run, TrainError> {
    let mut metrics = Vec::new();
    let mut logs = Vec::new();
    let cancel = AtomicBool::new(false);
    // Checked as the worker checks a spec when it enters.
    let spec = spec.clone().validated(&Limits::default()).map_err(TrainError::Invalid)?;
    let summary = train(
        &spec,
        opts,
        &mut |e| match e {
            RunEvent::Metric(m) => metrics.push(m),
            RunEvent::Log(l) => logs.push(l.message),
            _ => {}
        },
        &cancel,
    )?;
    Ok(Run { metrics, logs, summary })
}

fn losses(r: &Run) -> Vec<f64> {
    r.metrics.iter().map(|m| m.loss).collect()
}

#[test]
fn default_spec_learns_the_markov_chain() {
    let spec = ExperimentSpec::default();
    let r = run(&spec, 2).unwrap();
    let s = &r.summary;
    let uniform = (spec.model.vocab as f64).ln();
    let floor = s.loss_floor.expect("markov has a known floor");
    eprintln!(
        "default spec: first loss {:.4}, final {:.4}, floor {floor:.4}, uniform {uniform:.4}, {:.0} tokens/s",
        r.metrics[0].loss, s.final_loss, s.tokens_per_s
    );
    assert!((r.metrics[0].loss - uniform).abs() < 0.1, "starts near uniform: {}", r.metrics[0].loss);
    assert!(floor < 0.5 * uniform, "the chain is peaked: floor {floor} vs {uniform}");
    // Within 100 steps the model gets most of the way from uniform guessing to the floor.
    assert!(s.final_loss < 0.6 * uniform, "final loss {} not below 0.6 ln V = {}", s.final_loss, 0.6 * uniform);
    assert!(s.final_loss < floor + 0.35 * (uniform - floor), "final loss {} vs floor {floor}", s.final_loss);
    assert!(s.final_loss > floor - 0.05, "below the entropy rate? {} vs {floor}", s.final_loss);
}

#[test]
fn events_and_summary_follow_the_contract() {
    let mut spec = ExperimentSpec::default();
    spec.train.steps = 6;
    spec.train.warmup_steps = 2;
    let r = run(&spec, 1).unwrap();
    assert_eq!(r.metrics.len(), 6);
    for (i, m) in r.metrics.iter().enumerate() {
        assert_eq!(m.step, i as u64);
        assert!(m.loss.is_finite() && m.grad_norm > 0.0 && m.tokens_per_s > 0.0 && m.step_ms > 0.0);
    }
    assert!((r.metrics[0].lr - spec.train.lr / 2.0).abs() < 1e-12, "warmup starts at lr / warmup_steps");
    assert!(r.logs.iter().any(|l| l.contains(&spec.model.param_count().to_string())), "{:?}", r.logs);
    let s = &r.summary;
    assert_eq!(s.steps, 6);
    assert_eq!(s.params, spec.model.param_count());
    assert_eq!(s.tokens, 6 * spec.tokens_per_step() as u64);
    assert_eq!((s.world_size, s.threads), (1, 1));
    assert_eq!(s.final_loss, r.metrics[5].loss);
    assert_eq!(s.min_loss, losses(&r).into_iter().fold(f64::INFINITY, f64::min));
    assert!((s.uniform_loss - (spec.model.vocab as f64).ln()).abs() < 1e-12);
    assert!(s.tokens_per_s > 0.0 && s.mean_step_ms > 0.0 && s.wall_s > 0.0);
}

#[test]
fn same_seed_gives_bit_identical_losses() {
    let mut spec = ExperimentSpec::default();
    spec.train.steps = 12;
    let a = run(&spec, 2).unwrap();
    let b = run(&spec, 2).unwrap();
    assert_eq!(losses(&a), losses(&b));
    let grad_norms = |r: &Run| r.metrics.iter().map(|m| m.grad_norm).collect::<Vec<_>>();
    assert_eq!(grad_norms(&a), grad_norms(&b));
    // another init seed gives another run; so does another data seed
    spec.train.seed += 1;
    assert_ne!(losses(&a), losses(&run(&spec, 2).unwrap()));
}

#[test]
fn thread_count_does_not_change_the_run() {
    // Row kernels compute rows alone, reductions are split by columns and summed in
    // a fixed order, and the GEMMs split only the output: so the thread count
    // changes nothing, bit for bit.
    let mut spec = ExperimentSpec::default();
    spec.train.steps = 10;
    let one = run(&spec, 1).unwrap();
    for threads in [2, 3] {
        let other = run(&spec, threads).unwrap();
        assert_eq!(losses(&one), losses(&other), "1 thread vs {threads} threads");
        assert_eq!(other.summary.threads, threads);
    }
}

fn assert_close_per_step(a: &[f64], b: &[f64], what: &str) {
    assert_eq!(a.len(), b.len());
    let mut worst = 0.0f64;
    for (step, (x, y)) in a.iter().zip(b).enumerate() {
        let rel = (x - y).abs() / x.abs();
        worst = worst.max(rel);
        assert!(rel < 1e-5, "{what}: step {step}: {x} vs {y} (relative {rel:.2e})");
    }
    eprintln!("{what}: worst relative difference over {} steps {worst:.2e}", a.len());
}

#[test]
fn gradient_accumulation_equals_the_bigger_batch() {
    let mut big = ExperimentSpec::default();
    big.train.steps = 20;
    big.train.micro_batch = 8;
    let mut accum = big.clone();
    accum.train.micro_batch = 4;
    accum.train.grad_accum = 2;
    let mut micro = big.clone();
    micro.train.micro_batch = 4;
    micro.train.micro_batches = 2;
    let reference = losses(&run(&big, 2).unwrap());
    assert_close_per_step(&reference, &losses(&run(&accum, 2).unwrap()), "grad_accum=2 x 4 vs 1 x 8");
    assert_close_per_step(&reference, &losses(&run(&micro, 2).unwrap()), "micro_batches=2 x 4 vs 1 x 8");
}

#[test]
fn sgd_and_constant_schedule_and_text_train() {
    let mut spec = ExperimentSpec::default();
    spec.train.steps = 30;
    spec.train.optimizer = Optimizer::Sgd;
    spec.train.lr = 0.5;
    spec.train.lr_schedule = distlab_common::LrSchedule::Constant;
    let r = run(&spec, 1).unwrap();
    assert!(r.summary.final_loss < r.metrics[0].loss - 0.2, "SGD learns: {:?}", losses(&r));
    assert!(r.metrics.iter().skip(spec.train.warmup_steps as usize).all(|m| m.lr == 0.5));

    let mut text = ExperimentSpec::default();
    text.data.dataset = Dataset::Text;
    text.model.vocab = 256;
    text.train.steps = 30;
    let r = run(&text, 2).unwrap();
    assert!(r.summary.loss_floor.is_none());
    assert!(r.summary.final_loss < 0.8 * r.summary.uniform_loss, "text: {:?}", losses(&r));
}

/// SGD at lr 10 blows up; the run stops at the first step whose loss or gradient norm is
/// not finite, and says which. (A constant learning rate, so a shorter run of the same
/// spec takes the very same steps.)
#[test]
fn divergence_is_reported_at_the_first_non_finite_step() {
    let mut spec = ExperimentSpec::default();
    spec.train.steps = 40;
    spec.train.optimizer = Optimizer::Sgd;
    spec.train.lr = 10.0;
    spec.train.grad_clip = 0.0;
    spec.train.warmup_steps = 0;
    spec.train.lr_schedule = LrSchedule::Constant;
    let (step, loss, grad_norm) = match run(&spec, 1) {
        Err(TrainError::Diverged { step, loss, grad_norm }) => (step, loss, grad_norm),
        Err(e) => panic!("expected Diverged, got {e}"),
        Ok(r) => panic!("lr 10 should diverge within 40 steps: {:?}", losses(&r)),
    };
    assert!(!loss.is_finite() || !grad_norm.is_finite(), "step {step}: loss {loss}, gradient norm {grad_norm}");
    eprintln!("diverged at step {step}: loss {loss}, gradient norm {grad_norm}");
    assert_eq!(step, DIVERGES_AT, "the step this seeded run diverges at");
    // Every step before it was finite: the same spec stopped just before runs to the end.
    spec.train.steps = step;
    let before = run(&spec, 1).expect("the steps before the reported one are finite");
    assert_eq!(before.metrics.len() as u64, step);
    assert!(before.metrics.iter().all(|m| m.loss.is_finite() && m.grad_norm.is_finite()));
}

/// Where `divergence_is_reported_at_the_first_non_finite_step`'s run diverges (measured).
const DIVERGES_AT: u64 = 8;

#[test]
fn unsupported_features_are_refused_naming_the_field() {
    type Change = Box<dyn Fn(&mut ExperimentSpec)>;
    // A collective demo on cuda: refused with or without a GPU (the demos run on the CPU;
    // a worker without the cuda feature refuses the backend itself).
    let cases: Vec<(&str, Change)> = vec![(
        "backend=cuda",
        Box::new(|s| {
            s.backend = BackendKind::Cuda;
            s.demo = Some(CollectiveDemo::default());
        }),
    )];
    for (field, change) in cases {
        let mut spec = ExperimentSpec::default();
        change(&mut spec);
        match run(&spec, 1) {
            Err(TrainError::Unsupported(msg)) => assert!(msg.contains(field), "{field}: {msg}"),
            Err(e) => panic!("{field}: expected Unsupported, got {e}"),
            Ok(_) => panic!("{field}: ran something it does not support"),
        }
    }
    let mut spec = ExperimentSpec::default();
    spec.parallel.dp = 2;
    let msg = run(&spec, 1).err().unwrap().to_string();
    assert!(msg.contains("parallel.dp=2") && msg.contains("one process per rank"), "{msg}");
}

#[test]
fn a_run_resumed_from_its_checkpoint_continues_with_the_same_losses() {
    // Mixed precision keeps the fp32 master weights (and fp16 the loss scaler) in the
    // checkpoint too: the resumed losses are still bit-identical.
    for (write, precision, scaling) in [
        (CheckpointWrite::Sync, Precision::Fp32, LossScaling::None),
        (CheckpointWrite::Async, Precision::Fp32, LossScaling::None),
        (CheckpointWrite::Async, Precision::Bf16, LossScaling::None),
        (CheckpointWrite::Sync, Precision::Fp16, LossScaling::Dynamic),
    ] {
        let mut spec = ExperimentSpec::default();
        spec.train.precision = precision;
        spec.train.loss_scaling = scaling;
        spec.train.steps = 8;
        spec.train.checkpoint_every = 3;
        spec.train.checkpoint_write = write;
        let root = tempfile::tempdir().unwrap();
        let dir = CheckpointDir::new(root.path().join("run"), 1);
        assert_eq!(dir.prepare(&spec, None).unwrap().step, None);
        let checkpoints = |resume_from| CheckpointOptions { dir: dir.root.clone(), resume_from };
        let opts = |resume_from| TrainOptions {
            threads: 1,
            checkpoints: Some(checkpoints(resume_from)),
            ..TrainOptions::default()
        };
        let whole = run_with(&spec, &opts(None)).unwrap();
        let saves = whole.logs.iter().filter(|l| l.starts_with("checkpoint of step")).count();
        assert_eq!(saves, 2, "steps 3 and 6: {:?}", whole.logs);
        // While a run goes on, rank 0 keeps the two latest complete checkpoints (a resume may
        // have to go back to the older one: `CheckpointDir::prune_while_running`).
        assert_eq!(dir.prepare(&spec, None).unwrap().step, Some(6));
        assert!(dir.file(3, RankPlace { dp: 0, tp: 0, pp: 0 }).exists());

        let resumed = run_with(&spec, &opts(Some(6))).unwrap();
        assert_eq!(resumed.metrics.iter().map(|m| m.step).collect::<Vec<_>>(), vec![6, 7]);
        assert_eq!(losses(&resumed), losses(&whole)[6..], "{write:?} {}", precision.as_str());
        let numbers =
            |m: &[MetricPoint]| -> Vec<_> { m.iter().map(|m| (m.grad_norm, m.loss_scale, m.skipped_steps)).collect() };
        assert_eq!(numbers(&resumed.metrics), numbers(&whole.metrics[6..]), "the gradients and the loss scaler too");
        assert_eq!(resumed.summary.min_loss, whole.summary.min_loss, "the lowest loss comes from before the resume");
    }
}

#[test]
fn invalid_specs_are_refused_with_field_errors() {
    let mut spec = ExperimentSpec::default();
    spec.model.heads = 3; // does not divide d_model = 64
    spec.train.steps = 0;
    match run(&spec, 1) {
        Err(TrainError::Invalid(errors)) => {
            let fields: Vec<&str> = errors.iter().map(|e| e.field.as_str()).collect();
            assert!(fields.contains(&"model.heads") && fields.contains(&"train.steps"), "{fields:?}");
        }
        other => panic!("expected Invalid, got {:?}", other.err()),
    }
}

#[test]
fn a_run_too_big_for_memory_is_refused_before_allocating() {
    // Valid under the default limits (38M parameters, 128 x 1024 tokens per step),
    // but about 64 GiB of activations.
    let mut spec =
        ExperimentSpec { model: distlab_common::ModelSpec::dense(3, 1024, 16, 1024, 256), ..ExperimentSpec::default() };
    spec.train.micro_batch = 128;
    assert!(distlab_worker::train::memory_bytes(&spec) > 40 << 30);
    match run(&spec, 1) {
        Err(TrainError::OutOfMemory { needed_mib, .. }) => assert!(needed_mib > 40 << 10),
        Err(e) => panic!("expected OutOfMemory, got {e}"),
        Ok(_) => panic!("allocated a run bigger than the machine"),
    }
}

#[test]
fn cancel_stops_between_steps() {
    let spec = ExperimentSpec::default().validated(&Limits::default()).unwrap();
    let cancel = AtomicBool::new(false);
    let mut steps = 0;
    let result = train(
        &spec,
        &TrainOptions { threads: 1, ..TrainOptions::default() },
        &mut |e| {
            if let RunEvent::Metric(_) = e {
                steps += 1;
                if steps == 3 {
                    cancel.store(true, std::sync::atomic::Ordering::Relaxed);
                }
            }
        },
        &cancel,
    );
    assert!(matches!(result, Err(TrainError::Cancelled)), "{:?}", result.err());
    assert_eq!(steps, 3);
}

/// The losses of `spec` in `precision` (with dynamic loss scaling when asked).
fn losses_in(spec: &ExperimentSpec, precision: Precision, scaling: LossScaling) -> Run {
    let mut spec = spec.clone();
    spec.train.precision = precision;
    spec.train.loss_scaling = scaling;
    run(&spec, 2).unwrap()
}

#[test]
fn bf16_and_fp16_runs_follow_the_fp32_run() {
    let mut spec = ExperimentSpec::default();
    spec.train.steps = 12;
    let fp32 = losses(&run(&spec, 2).unwrap());
    // Relative tolerance per step: bf16 keeps 8 significant bits, fp16 11.
    for (precision, scaling, tolerance) in [
        (Precision::Bf16, LossScaling::None, 2e-2),
        (Precision::Fp16, LossScaling::None, 5e-3),
        (Precision::Fp16, LossScaling::Dynamic, 5e-3),
    ] {
        let r = losses_in(&spec, precision, scaling);
        let worst = losses(&r).iter().zip(&fp32).map(|(a, b)| ((a - b) / b).abs()).fold(0.0, f64::max);
        eprintln!("{} {scaling:?}: worst relative loss difference from fp32 {worst:.2e}", precision.as_str());
        assert!(worst < tolerance, "{} {scaling:?}: {worst}", precision.as_str());
        let scaled = scaling == LossScaling::Dynamic;
        assert!(r.metrics.iter().all(|m| m.loss_scale.is_some() == scaled && m.skipped_steps.is_some() == scaled));
        assert!(r.logs.iter().any(|l| l.contains(&format!("MiB in {}", precision.as_str()))), "{:?}", r.logs);
    }
}

#[test]
fn an_overflowing_fp16_step_is_skipped_and_the_scale_halves() {
    let mut spec = ExperimentSpec::default();
    spec.train.precision = Precision::Fp16;
    spec.train.loss_scaling = LossScaling::Dynamic;
    let pool = rayon::ThreadPoolBuilder::new().num_threads(1).build().unwrap();
    pool.install(|| {
        let spec = spec.clone().validated(&Limits::default()).unwrap();
        let mut trainer = CpuTrainer::<half::f16>::new(&spec, 1).unwrap();
        // 2^40 times any gradient is far beyond fp16's 65504.
        trainer.start_loss_scale(2f64.powi(40));
        let params = |t: &CpuTrainer<half::f16>| {
            t.checkpoint(0, 0.0, Default::default()).unwrap().section("params").unwrap().to_vec()
        };
        let before = params(&trainer);
        let mut step = 0;
        let mut skipped = 0;
        loop {
            let stats = trainer.step(step).unwrap();
            let (scale, skipped_so_far) = stats.loss_scale.unwrap();
            assert_eq!(scale, 2f64.powi(40 - skipped as i32), "the scale halves on each overflow");
            step += 1;
            if stats.updated {
                break;
            }
            skipped += 1;
            assert_eq!(skipped_so_far, skipped);
            assert!(stats.loss.is_finite() && !stats.grad_norm.is_finite());
            assert_eq!(params(&trainer), before, "a skipped step changes nothing");
            assert!(skipped < 40, "the scale comes down until the gradient fits");
        }
        assert!(skipped >= 20, "from 2^40 down to a scale fp16 holds: {skipped} halvings");
        assert_ne!(params(&trainer), before, "the first finite step updates");
    });
}
