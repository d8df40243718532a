//! The cuda backend runs the same engine as the CPU: every strategy, mesh and precision on
//! the GPU follows the CPU backend step by step, its memory ledger is the planner's, and a
//! killed cuda run resumes bit-identically. They need a GPU, real or emulated: `cargo xtask
//! test --gpu` runs them on a real one (on a machine with one GPU, the ranks of a multi-rank
//! run share it and their collectives go over the ring, staged through the host); `cargo
//! xtask emulated-gpu --devices 8 -- cargo test -p distlab-tests --features
//! distlab-worker/cuda --test cuda -- --include-ignored` on the emulated one (the model is
//! tiny for its sake); `cargo xtask test` reports them as ignored.

use distlab_common::planner::plan;
use distlab_common::*;
use distlab_tests::*;

/// 8 steps of a tiny model (2 blocks, d_model 64): small enough for the emulated GPU.
fn spec(name: &str) -> ExperimentSpec {
    let mut spec = quick_spec(name, 8);
    spec.model = ModelSpec::dense(2, 64, 4, 32, 256);
    spec.train.micro_batch = 2;
    spec.train.micro_batches = 2;
    spec
}

fn on_cuda(spec: &ExperimentSpec) -> ExperimentSpec {
    ExperimentSpec { backend: BackendKind::Cuda, ..spec.clone() }
}

type Layout = fn(&mut ExperimentSpec);

/// One rank and every strategy of the CPU's equivalence tests.
const LAYOUTS: [(&str, Layout); 9] = [
    ("one rank", |_| {}),
    ("ddp", |s| s.parallel.dp = 2),
    ("zero1", |s| (s.parallel.dp, s.parallel.sharding) = (2, Sharding::Zero1)),
    ("zero2", |s| (s.parallel.dp, s.parallel.sharding) = (2, Sharding::Zero2)),
    ("fsdp", |s| (s.parallel.dp, s.parallel.sharding) = (2, Sharding::Fsdp)),
    ("tp2", |s| s.parallel.tp = 2),
    ("pp2 1f1b", |s| s.parallel.pp = 2),
    ("pp2 gpipe", |s| (s.parallel.pp, s.parallel.pp_schedule) = (2, PpSchedule::Gpipe)),
    ("dp2 x tp2 x pp2 fsdp", |s| {
        (s.parallel.dp, s.parallel.tp, s.parallel.pp, s.parallel.sharding) = (2, 2, 2, Sharding::Fsdp)
    }),
];

/// fp32: the GPU sums in other orders (cuBLAS, its reductions), nothing else differs; held
/// to the CPU equivalence tests' bounds (loss 1e-5, gradient norm 2e-5 relative), under
/// AdamW with clipping and under SGD with weight decay.
#[test]
#[ignore = "needs a GPU: cargo xtask test --gpu"]
fn every_strategy_on_cuda_follows_the_cpu_in_fp32() {
    for (name, layout) in LAYOUTS {
        for optimizer in OPTIMIZERS {
            let mut s = optimizer.on(spec(name));
            layout(&mut s);
            let what = format!("{name} {optimizer:?} cuda vs cpu");
            assert_same_training(&run_steps(&s), &run_steps(&on_cuda(&s)), &what);
        }
    }
}

/// bf16 and fp16 (with loss scaling): the two backends round different partial sums to
/// 2 bytes, so the runs part slowly; bounds: loss 2e-2 relative, gradient norm 1e-1.
#[test]
#[ignore = "needs a GPU: cargo xtask test --gpu"]
fn every_strategy_on_cuda_follows_the_cpu_in_bf16_and_fp16() {
    for precision in [Precision::Bf16, Precision::Fp16] {
        for (name, layout) in LAYOUTS {
            let mut s = spec(name);
            s.train.precision = precision;
            if precision == Precision::Fp16 {
                s.train.loss_scaling = LossScaling::Dynamic;
            }
            layout(&mut s);
            let (cpu, cuda) = (run_steps(&s), run_steps(&on_cuda(&s)));
            for (a, b) in cpu.iter().zip(&cuda) {
                let loss = (a.loss - b.loss).abs() / a.loss;
                let norm = (a.grad_norm - b.grad_norm).abs() / a.grad_norm;
                let what = format!("{} {name} step {}", precision.as_str(), a.step);
                assert!(loss < 2e-2 && norm < 1e-1, "{what}: cpu {a:?}\ncuda {b:?}");
            }
        }
    }
}

/// A GPU rank books the same categories as a CPU rank: parameters, gradients, optimizer
/// state, gathered units and activations equal the planner's; the driver's count of the
/// device memory the run took is reported beside them, and no host heap figures.
#[test]
#[ignore = "needs a GPU: cargo xtask test --gpu"]
fn a_cuda_rank_books_what_the_planner_predicts() {
    for (name, layout) in LAYOUTS {
        let mut s = on_cuda(&spec(name));
        (s.train.steps, s.train.warmup_steps) = (2, 1);
        layout(&mut s);
        let predicted = plan(&s).unwrap();
        let (_, trace) = run_with_trace(&s);
        for rank in &trace.ranks {
            let memory = rank.memory.as_ref().expect("a memory report");
            // (With pp > 1 which stage a rank holds is the mesh's business: checked on the CPU.)
            let (want, got) = (&predicted.stages[0].memory, &memory.peak);
            let what = format!("{name} rank {}", rank.rank);
            if s.parallel.pp == 1 {
                assert_eq!(got.parameters, want.parameters, "{what}");
                assert_eq!(got.gradients, want.gradients, "{what}");
                assert_eq!(got.optimizer_state, want.optimizer_state, "{what}");
                assert_eq!(got.gathered_parameters, want.gathered_parameters, "{what}");
                assert_eq!(got.activations, want.activations, "{what}");
            }
            let process = memory.process.as_ref().expect("process figures");
            assert!(process.device_used.is_some_and(|b| b > 0), "{what}: {process:?}");
            assert_eq!(process.heap_peak, None, "{what}");
        }
    }
}

/// A cuda run whose worker is killed after step 7 resumes from the checkpoint of step 5
/// with the losses of a run never interrupted, bit for bit (fp32, FSDP on 2 ranks).
#[test]
#[ignore = "needs a GPU: cargo xtask test --gpu"]
fn a_killed_cuda_run_resumes_bit_identically() {
    let mut s = on_cuda(&spec("resume-cuda"));
    s.train.steps = 12;
    (s.parallel.dp, s.parallel.sharding) = (2, Sharding::Fsdp);
    s.train.checkpoint_every = 5;
    let straight = run_losses(&s);
    let mut lab = Lab::start_with(LabOptions {
        local_workers: 0,
        lease_seconds: 2.0,
        heartbeat_seconds: 0.5,
        ..LabOptions::default()
    });
    let (id, exp) = kill_and_resume(&mut lab, &s, 7);
    assert_eq!(exp.status, ExperimentStatus::Succeeded, "{exp:?}");
    let metrics: Metrics = lab.get_as(&format!("/api/experiments/{id}/metrics"));
    let resumed: Vec<f64> = metrics.steps.iter().map(|m| m.loss).collect();
    assert_eq!(resumed.len(), straight.len());
    for (step, (a, b)) in straight.iter().zip(&resumed).enumerate() {
        assert_eq!(a.to_bits(), b.to_bits(), "step {step}: straight {a} vs resumed {b}");
    }
}
