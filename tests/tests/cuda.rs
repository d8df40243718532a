//! The cuda backend runs the same engine as the CPU: every strategy and technique on the
//! GPU follows the CPU backend step by step in loss and gradient norm, with a GPU per rank
//! (the groups over NCCL) and with all ranks on one GPU (over the ranks' ring through host
//! memory); its memory ledger is the planner's; a killed cuda run resumes bit-identically,
//! an elastic resume continues as a straight run does, and the exported model is the CPU's.
//!
//! They need a GPU, real or emulated, and are `#[ignore]`d without one. `cargo xtask test`
//! runs them on the emulated device (8 emulated GPUs; the model is tiny for its sake) after
//! the other tests; `cargo xtask test --gpu` on a real one, where a machine with fewer GPUs
//! than ranks makes the ranks share (the log says which carried each group, checked here).

use std::collections::BTreeMap;

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

/// One rank, every strategy of the CPU's equivalence tests, and the techniques that change
/// what runs on the GPU.
const LAYOUTS: [(&str, Layout); 37] = [
    ("one rank", |_| {}),
    ("ddp", |s| s.parallel.dp = 2),
    ("zero1", |s| (s.parallel.dp, s.parallel.sharding) = (2, Sharding::Zero1)),
    // (3 ranks: buffers that do not split evenly take NCCL's padded path)
    ("zero2 dp3", |s| (s.parallel.dp, s.parallel.sharding) = (3, Sharding::Zero2)),
    ("fsdp", |s| (s.parallel.dp, s.parallel.sharding) = (2, Sharding::Fsdp)),
    ("fsdp prefetch dp3", |s| (s.parallel.dp, s.parallel.sharding, s.parallel.prefetch) = (3, Sharding::Fsdp, true)),
    ("tp2", |s| s.parallel.tp = 2),
    ("tp2 sequence parallel", |s| (s.parallel.tp, s.parallel.sequence_parallel) = (2, true)),
    ("pp2 1f1b", |s| s.parallel.pp = 2),
    ("pp2 gpipe", |s| (s.parallel.pp, s.parallel.pp_schedule) = (2, PpSchedule::Gpipe)),
    ("pp2 interleaved v2", |s| {
        (s.parallel.pp, s.parallel.pp_schedule, s.parallel.virtual_stages) = (2, PpSchedule::Interleaved, 2);
        s.model.layers = 4;
    }),
    ("pp2 zb-h1", |s| (s.parallel.pp, s.parallel.pp_schedule) = (2, PpSchedule::ZbH1)),
    // (a block per chunk of the V; the turn on stage 1, the head on stage 0)
    ("pp2 zbv", |s| {
        (s.parallel.pp, s.parallel.pp_schedule, s.train.micro_batches) = (2, PpSchedule::Zbv, 4);
        s.model.layers = 4;
    }),
    // (DualPipeV's whole and split backwards; each unit's gradient waiting for its W)
    ("dp2 x pp2 dualpipev zero2", |s| {
        (s.parallel.dp, s.parallel.pp, s.parallel.pp_schedule, s.parallel.sharding) =
            (2, 2, PpSchedule::DualPipeV, Sharding::Zero2);
        (s.train.micro_batches, s.model.layers) = (4, 4);
    }),
    ("dp2 x tp2 x pp2 fsdp", |s| {
        (s.parallel.dp, s.parallel.tp, s.parallel.pp, s.parallel.sharding) = (2, 2, 2, Sharding::Fsdp)
    }),
    ("ddp checkpointing", |s| (s.parallel.dp, s.train.checkpointing) = (2, Checkpointing::Every)),
    ("pp2 zb-h1 selective recompute", |s| {
        (s.parallel.pp, s.parallel.pp_schedule, s.train.checkpointing) = (2, PpSchedule::ZbH1, Checkpointing::Selective)
    }),
    ("ddp flash attention", |s| (s.parallel.dp, s.train.attention) = (2, Attention::Flash)),
    ("cp2 ulysses", |s| (s.parallel.dp, s.parallel.cp) = (2, 2)),
    ("cp2 ring", |s| {
        (s.parallel.dp, s.parallel.cp, s.parallel.cp_kind, s.train.attention) =
            (2, 2, ContextParallel::Ring, Attention::Flash)
    }),
    ("llama cp4 ring-unbalanced", |s| {
        s.model = ModelSpec::llama(2, 64, 4, 2, 176, 32, 256);
        (s.parallel.dp, s.parallel.cp, s.parallel.cp_kind, s.train.attention) =
            (4, 4, ContextParallel::RingUnbalanced, Attention::Flash)
    }),
    // (8 query heads on 4 K/V heads: heads/(tp cp) of each)
    ("llama cp2 x tp2 ulysses flash attention", |s| {
        s.model = ModelSpec::llama(2, 64, 8, 4, 176, 32, 256);
        (s.parallel.dp, s.parallel.cp, s.parallel.tp, s.train.attention) = (2, 2, 2, Attention::Flash);
    }),
    ("moe ep2", |s| {
        s.model = ModelSpec { experts: 4, expert_top_k: 2, capacity_factor: 1.0, ..s.model.clone() };
        (s.parallel.dp, s.parallel.ep) = (2, 2);
    }),
    ("ddp int8 compression", |s| (s.parallel.dp, s.parallel.grad_compression) = (2, GradCompression::Int8)),
    // (2 replicas meeting every 2 steps: 4 outer steps in the run)
    ("diloco dp2 every 2 steps", |s| {
        (s.parallel.dp, s.parallel.sync, s.parallel.outer_steps_every) = (2, DataSync::Diloco, 2)
    }),
    // LAMB (LARS where the optimizer is SGD), the norms of tensors cut over 3 shards summed.
    ("zero2 dp3 layer-wise", |s| {
        let sgd = s.train.optimizer == Optimizer::Sgd;
        s.train.optimizer = if sgd { Optimizer::Lars } else { Optimizer::Lamb };
        (s.parallel.dp, s.parallel.sharding, s.train.lr) = (3, Sharding::Zero2, 0.01);
    }),
    // Hybrid sharding: FSDP in 2 groups of 2, each shard all-reduced across them.
    ("hsdp dp4 in groups of 2", |s| {
        (s.parallel.dp, s.parallel.sharding, s.parallel.shard_group) = (4, Sharding::Hsdp, 2);
    }),
    ("zero1 host offload", |s| {
        (s.parallel.dp, s.parallel.sharding, s.parallel.offload) = (2, Sharding::Zero1, Offload::Host)
    }),
    ("fsdp activations offloaded to the host", |s| {
        (s.parallel.dp, s.parallel.sharding, s.train.activation_offload) = (2, Sharding::Fsdp, Offload::Host)
    }),
    ("pp2 1f1b activations offloaded to disk", |s| {
        (s.parallel.pp, s.train.activation_offload) = (2, Offload::Disk);
        s.model.layers = 4;
    }),
    ("fp8 delayed scaling", |s| s.train.fp8 = Fp8Recipe::Delayed),
    ("fsdp fp8 current scaling", |s| {
        (s.parallel.dp, s.parallel.sharding, s.train.fp8) = (2, Sharding::Fsdp, Fp8Recipe::Current)
    }),
    ("fsdp fp8 all-gathers, delayed scaling", |s| {
        (s.parallel.dp, s.parallel.sharding, s.train.fp8) = (2, Sharding::Fsdp, Fp8Recipe::Delayed);
        s.parallel.fp8_all_gather = true
    }),
    // Llama blocks: RMSNorm, rotary positions, 4 query heads on 2 K/V heads, SwiGLU.
    ("llama", |s| s.model = ModelSpec::llama(2, 64, 4, 2, 176, 32, 256)),
    ("llama tp2 sequence parallel", |s| {
        s.model = ModelSpec::llama(2, 64, 4, 2, 176, 32, 256);
        (s.parallel.tp, s.parallel.sequence_parallel) = (2, true);
    }),
    ("llama fsdp pp2 flash attention", |s| {
        s.model = ModelSpec::llama(2, 64, 4, 2, 176, 32, 256);
        (s.parallel.dp, s.parallel.pp, s.parallel.sharding, s.train.attention) =
            (2, 2, Sharding::Fsdp, Attention::Flash);
    }),
    ("llama swiglu experts ep2", |s| {
        s.model = ModelSpec {
            experts: 4,
            expert_top_k: 2,
            capacity_factor: 1.0,
            ..ModelSpec::llama(2, 64, 4, 2, 176, 32, 256)
        };
        (s.parallel.dp, s.parallel.ep) = (2, 2);
    }),
];

/// The GPUs the runs may use: every GPU of the machine (8 on the emulated one), or only
/// the first, so that every rank shares it. Where the machine's lender narrowed them
/// (`CUDA_VISIBLE_DEVICES` already set), those, or the first of those.
fn gpus(only_the_first: bool) -> Vec<(&'static str, String)> {
    let all = std::env::var("CUDA_VISIBLE_DEVICES").unwrap_or_else(|_| "0,1,2,3,4,5,6,7".into());
    let chosen = if only_the_first { all.split(',').next().unwrap_or("0").to_string() } else { all };
    vec![("CUDA_VISIBLE_DEVICES", chosen)]
}

/// A cuda run of `spec` with `env`, checking what its log says carried each group: NCCL
/// when the machine has a GPU for every rank, the ranks' ring when they share.
fn run_cuda(spec: &ExperimentSpec, only_the_first_gpu: bool, what: &str) -> Vec<MetricPoint> {
    let env = gpus(only_the_first_gpu);
    let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (*k, v.as_str())).collect();
    let (points, log) = run_steps_with_env(&on_cuda(spec), &env);
    let gpus: usize = log
        .lines()
        .find_map(|l| l.split(" of ").nth(1)?.split(" (CUDA backend").next()?.parse().ok())
        .unwrap_or_else(|| panic!("{what}: no device line in the log:\n{log}"));
    let own = gpus >= spec.world_size();
    let groups = ["data parallel:", "tensor parallel:", "expert parallel:"];
    let lines: Vec<&str> = log.lines().filter(|l| groups.iter().any(|g| l.contains(g))).collect();
    let p = &spec.parallel;
    assert_eq!(lines.is_empty(), p.dp == 1 && p.tp == 1, "{what}: the groups' log lines:\n{log}");
    for line in lines {
        let carrier = if own { "NCCL on the GPUs' memory" } else { "the ranks' ring" };
        assert!(line.contains(carrier), "{what} ({gpus} GPUs for {} ranks): {line}", spec.world_size());
    }
    points
}

/// fp32: the GPU sums in other orders (cuBLAS, its reductions, NCCL), nothing else
/// differs; held to the CPU equivalence tests' bounds (loss 1e-5, gradient norm 2e-5
/// relative), under AdamW with clipping and under SGD with weight decay (a test each, so
/// that the two run side by side), each rank on a GPU of its own; and under AdamW with
/// every rank on one GPU.
#[test]
#[ignore = "needs a GPU: cargo xtask test runs it on the emulated one"]
fn every_strategy_on_cuda_follows_the_cpu_in_fp32_under_adamw() {
    every_strategy_follows_the_cpu_in_fp32(TestOptimizer::AdamwClipped);
}

#[test]
#[ignore = "needs a GPU: cargo xtask test runs it on the emulated one"]
fn every_strategy_on_cuda_follows_the_cpu_in_fp32_under_sgd() {
    every_strategy_follows_the_cpu_in_fp32(TestOptimizer::SgdWeightDecay);
}

fn every_strategy_follows_the_cpu_in_fp32(optimizer: TestOptimizer) {
    for (name, layout) in LAYOUTS {
        if name.contains("offload") && optimizer == TestOptimizer::SgdWeightDecay {
            continue; // (SGD in fp32 keeps no state to offload: refused by validation)
        }
        let mut s = optimizer.on(spec(name));
        layout(&mut s);
        let cpu = run_steps(&cpu_equivalent(&s));
        let compare = |cuda: &[MetricPoint], what: &str| {
            if s.train.fp8 != Fp8Recipe::None {
                // A last-bit difference in a product moves an element across an FP8
                // rounding boundary now and then, a whole quantum (an eighth of an E4M3
                // value, a quarter of an E5M2 one), which AdamW carries into the weights.
                assert_within(&cpu, cuda, (2e-3, 2e-2), what);
            } else if s.parallel.grad_compression == GradCompression::None {
                assert_same_training(&cpu, cuda, what);
            } else {
                // int8's rounding turns a last-bit difference into a whole quantum now
                // and then (error feedback carries it on): a looser bound.
                assert_within(&cpu, cuda, (1e-4, 1e-3), what);
            }
        };
        let what = format!("{name} {optimizer:?} cuda vs cpu");
        compare(&run_cuda(&s, false, &what), &what);
        if optimizer == TestOptimizer::AdamwClipped && s.world_size() > 1 {
            let what = format!("{name} ranks sharing one GPU vs cpu");
            compare(&run_cuda(&s, true, &what), &what);
        }
    }
}

/// bf16 and fp16 (with loss scaling): the two backends round different partial sums to
/// 2 bytes, so the runs part slowly; bounds: loss 2e-2 relative, gradient norm 1e-1.
#[test]
#[ignore = "needs a GPU: cargo xtask test runs it on the emulated one"]
fn every_strategy_on_cuda_follows_the_cpu_in_bf16_and_fp16() {
    for precision in [Precision::Bf16, Precision::Fp16] {
        for (name, layout) in LAYOUTS {
            let mut s = spec(name);
            s.train.precision = precision;
            layout(&mut s);
            if precision == Precision::Fp16 && s.train.fp8 != Fp8Recipe::None {
                continue; // (validation: fp16 cannot hold FP8's scaled-back values)
            }
            if s.parallel.sync == DataSync::Diloco {
                continue; // (validation: DiLoCo's outer step runs in fp32)
            }
            if precision == Precision::Fp16 && s.parallel.grad_compression == GradCompression::None {
                s.train.loss_scaling = LossScaling::Dynamic;
            }
            let what = format!("{} {name}", precision.as_str());
            let (cpu, cuda) = (run_steps(&cpu_equivalent(&s)), run_cuda(&s, false, &what));
            assert_within(&cpu, &cuda, (2e-2, 1e-1), &what);
        }
    }
}

/// The spec the CPU runs to compare with `spec` on cuda: the same, but where the GPU
/// offloads the optimizer to the host, the CPU keeps it where it is, and the activations
/// it offloads to the host go to disk (its host is its device; the arithmetic is the same).
fn cpu_equivalent(spec: &ExperimentSpec) -> ExperimentSpec {
    let mut s = spec.clone();
    if s.parallel.offload == Offload::Host {
        s.parallel.offload = Offload::None;
    }
    if s.train.activation_offload == Offload::Host {
        s.train.activation_offload = Offload::Disk;
    }
    s
}

/// Every step's loss and gradient norm of `b` within `(loss, norm)` of `a`'s, relative.
fn assert_within(a: &[MetricPoint], b: &[MetricPoint], (loss, norm): (f64, f64), what: &str) {
    assert!(!a.is_empty() && a.len() == b.len(), "{what}: {} and {} steps", a.len(), b.len());
    for (x, y) in a.iter().zip(b) {
        let dl = (x.loss - y.loss).abs() / x.loss;
        let dn = (x.grad_norm - y.grad_norm).abs() / x.grad_norm;
        assert!(dl < loss && dn < norm, "{what} step {}: cpu {x:?}\ncuda {y:?}", x.step);
    }
}

/// A GPU rank books the same categories as a CPU rank: parameters, gradients, optimizer
/// state, gathered units and activations equal the planner's; the driver's count of the
/// device memory the run took is reported beside them, and no host heap figures.
#[test]
#[ignore = "needs a GPU: cargo xtask test runs it on the emulated one"]
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
                // The planner books the largest shard, rank 0's: where a unit does not
                // split evenly (dp 3), the others hold one element less of it.
                let shard = |got: u64, want: u64, category: &str| {
                    if rank.rank == 0 {
                        assert_eq!(got, want, "{what} {category}");
                    } else {
                        assert!(got <= want && want - got < 64, "{what} {category}: {got} vs planned {want}");
                    }
                };
                shard(got.parameters, want.parameters, "parameters");
                shard(got.gradients, want.gradients, "gradients");
                shard(got.optimizer_state, want.optimizer_state, "optimizer state");
                assert_eq!(got.gathered_parameters, want.gathered_parameters, "{what}");
                assert_eq!(got.activations, want.activations, "{what}");
            }
            let process = memory.process.as_ref().expect("process figures");
            assert!(process.device_used.is_some_and(|b| b > 0), "{what}: {process:?}");
            assert_eq!(process.heap_peak, None, "{what}");
        }
    }
}

/// Asynchronous SGD on GPUs (a GPU per rank; its gradients and parameters pass through
/// host memory to the server's threads): the server applies every worker's gradient, the
/// loss falls, and each rank books the planner's memory for it, the server's state and
/// the host copies off the device.
#[test]
#[ignore = "needs a GPU: cargo xtask test runs it on the emulated one"]
fn an_asynchronous_cuda_run_applies_every_gradient_with_the_planners_memory() {
    let mut s = on_cuda(&spec("async-ps-cuda"));
    (s.parallel.dp, s.parallel.sync) = (2, DataSync::AsyncPs);
    let predicted = plan(&s).unwrap();
    let env = gpus(false);
    let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (*k, v.as_str())).collect();
    let (points, log) = run_steps_with_env(&s, &env);
    assert!(log.contains("the server applied 16 gradients from 2 workers"), "{log}");
    assert!(points.last().unwrap().loss < points[0].loss, "{points:?}");
    let (_, trace) = run_with_trace(&s);
    assert_eq!(trace.ranks.iter().map(|r| r.applied_gradients.len()).sum::<usize>(), 16);
    for rank in &trace.ranks {
        let got = &rank.memory.as_ref().expect("a memory report").peak;
        let want = predicted.rank_memory(&s, rank.rank as usize);
        let what = format!("async rank {}", rank.rank);
        assert_eq!(
            (got.parameters, got.gradients, got.optimizer_state, got.offloaded),
            (want.parameters, want.gradients, want.optimizer_state, want.offloaded),
            "{what}"
        );
    }
}

/// Fault-tolerant replicas on GPUs (their quorum's rings carry the gradients through host
/// memory): a drill kills rank 1 after step 2, a replacement rejoins with rank 0's state,
/// every step has its point, every replica ends with the same parameters, and each books
/// the planner's memory, its host copies off the device.
#[test]
#[ignore = "needs a GPU: cargo xtask test runs it on the emulated one"]
fn a_fault_tolerant_cuda_run_survives_a_lost_replica() {
    let mut s = on_cuda(&spec("replicas-cuda"));
    s.train.steps = 40;
    (s.parallel.dp, s.parallel.fault_tolerance) = (2, FaultTolerance::Replicas);
    s.parallel.fault_drill = Some(FaultDrill { rank: 1, after_step: 2 });
    let env = gpus(false);
    let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (*k, v.as_str())).collect();
    let (points, log) = run_steps_with_env(&s, &env);
    assert_eq!(points.len(), 40);
    assert!(log.contains("replica rank 1 rejoined at step"), "{log}");
    let ends: Vec<&str> = log.lines().filter_map(|l| l.split("ends with parameters ").nth(1)).collect();
    assert_eq!(ends.len(), 2, "{log}");
    assert_eq!(ends[0], ends[1], "the replicas' parameters differ");
    let predicted = plan(&s).unwrap();
    let (_, trace) = run_with_trace(&s);
    for rank in &trace.ranks {
        let got = &rank.memory.as_ref().expect("a memory report").peak;
        let want = predicted.rank_memory(&s, rank.rank as usize);
        assert_eq!(
            (got.parameters, got.gradients, got.optimizer_state, got.comm_buffers, got.offloaded),
            (want.parameters, want.gradients, want.optimizer_state, want.comm_buffers, want.offloaded),
            "replica rank {}",
            rank.rank
        );
    }
}

/// A cuda run whose worker is killed after step 7 resumes from the checkpoint of step 5
/// with the losses of a run never interrupted, bit for bit (fp32, FSDP on 2 ranks).
#[test]
#[ignore = "needs a GPU: cargo xtask test runs it on the emulated one"]
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

/// Elastic resume on cuda: a dp=4 ZeRO-2 run's checkpoint of step 4, re-cut for 2 FSDP
/// ranks, continues as a straight dp=2 cuda run of the same global batch does.
#[test]
#[ignore = "needs a GPU: cargo xtask test runs it on the emulated one"]
fn a_cuda_checkpoint_continues_on_fewer_ranks_like_a_straight_run() {
    let elastic = |name: &str, dp: usize, sharding: Sharding| {
        let mut s = on_cuda(&spec(name));
        (s.parallel.dp, s.parallel.sharding) = (dp, sharding);
        (s.train.micro_batch, s.train.micro_batches, s.train.grad_accum) = (2, 1, 4 / dp);
        s
    };
    let straight = run_losses(&elastic("dp2 straight", 2, Sharding::Fsdp));
    let root = tempfile::tempdir().unwrap();
    let mut source = elastic("dp4 zero2", 4, Sharding::Zero2);
    source.train.checkpoint_every = 4;
    let first: Vec<f64> =
        run_in_checkpoint_dir(&source, &root.path().join("experiment-1")).iter().map(|p| p.loss).collect();
    assert_same_losses(&straight[..4], &first[..4], "dp4 zero2 before the checkpoint");
    let mut resumed = elastic("dp2 resumed", 2, Sharding::Fsdp);
    resumed.train.resume_from = Some(ResumeFrom { experiment: 1, step: 4 });
    let second: Vec<f64> =
        run_in_checkpoint_dir(&resumed, &root.path().join("experiment-2")).iter().map(|p| p.loss).collect();
    assert_same_losses(&straight[4..], &second, "dp2 fsdp from dp4's step 4");
}

/// What a cuda run exports is the model the CPU trains: dp2 x tp2 x pp2 with FSDP, every
/// tensor within 1e-4 of the CPU's.
#[test]
#[ignore = "needs a GPU: cargo xtask test runs it on the emulated one"]
fn a_cuda_run_exports_the_model_the_cpu_trains() {
    let mut s = spec("export 3d");
    (s.parallel.dp, s.parallel.tp, s.parallel.pp, s.parallel.sharding) = (2, 2, 2, Sharding::Fsdp);
    let (cpu, cuda) = (exported(&s), exported(&on_cuda(&s)));
    assert_eq!(cpu.keys().collect::<Vec<_>>(), cuda.keys().collect::<Vec<_>>());
    for (name, a) in &cpu {
        let b = &cuda[name];
        assert_eq!(a.len(), b.len(), "{name}");
        let worst = a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0f32, f32::max);
        assert!(worst < 1e-4, "{name}: largest difference {worst:e}");
    }
}

/// The tensors of the model.safetensors a run of `spec` writes, by name.
fn exported(spec: &ExperimentSpec) -> BTreeMap<String, Vec<f32>> {
    let dir = tempfile::tempdir().expect("temp dir");
    run_into(spec, dir.path());
    let bytes = std::fs::read(dir.path().join(export::WEIGHTS_FILE)).expect("model.safetensors");
    let file = safetensors::SafeTensors::deserialize(&bytes).expect("a safetensors file");
    let floats = |data: &[u8]| data.chunks(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect();
    file.tensors().into_iter().map(|(name, view)| (name, floats(view.data()))).collect()
}
