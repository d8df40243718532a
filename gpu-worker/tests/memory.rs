//! The memory ledger: it agrees with the buffers the engine actually holds, and with the
//! planner on model state (exactly) and activations.

use distlab_common::memory::RankMemoryReport;
use distlab_common::planner::plan;
use distlab_common::{ExperimentSpec, ModelSpec, Offload, Optimizer, Precision, Sharding, ValidSpec};
use distlab_worker::backend::Stored;
use distlab_worker::CpuTrainer;
use half::{bf16, f16};

/// `spec` as the engine takes it. Unchecked: one process holding a ZeRO/FSDP shard of a
/// group of one is what no user can submit, and what tells each strategy's ledger apart here.
fn valid(spec: ExperimentSpec) -> ValidSpec {
    ValidSpec::assume_valid(spec)
}

fn spec(sharding: Sharding, optimizer: Optimizer) -> ExperimentSpec {
    spec_of(ModelSpec::dense(2, 32, 4, 16, 64), sharding, optimizer)
}

fn spec_of(model: ModelSpec, sharding: Sharding, optimizer: Optimizer) -> ExperimentSpec {
    let mut spec = ExperimentSpec { model, ..ExperimentSpec::default() };
    spec.train.micro_batch = 3;
    spec.train.steps = 3;
    spec.parallel.sharding = sharding;
    spec.train.optimizer = optimizer;
    spec
}

const ALL: [Sharding; 4] = [Sharding::None, Sharding::Zero1, Sharding::Zero2, Sharding::Fsdp];

/// Runs `check` on a trainer of every sharding and optimizer, for every precision (the
/// trainer's buffers stored as f32, bf16 or fp16).
fn for_every_config(check: impl Fn(&ExperimentSpec, &str, &mut dyn FnMut(u64) -> (RankMemoryReport, u64))) {
    for_every_config_of(ModelSpec::dense(2, 32, 4, 16, 64), check)
}

/// [`for_every_config`] for `model`.
fn for_every_config_of(
    model: ModelSpec,
    check: impl Fn(&ExperimentSpec, &str, &mut dyn FnMut(u64) -> (RankMemoryReport, u64)),
) {
    for sharding in ALL {
        for optimizer in [Optimizer::Adamw, Optimizer::Sgd] {
            for precision in [Precision::Fp32, Precision::Bf16, Precision::Fp16] {
                let mut spec = spec_of(model.clone(), sharding, optimizer);
                spec.train.precision = precision;
                let what = format!("{sharding:?} {optimizer:?} {}", precision.as_str());
                drive_in_its_precision(spec, &what, &check);
            }
        }
    }
}

/// [`drive`] on a trainer storing the spec's precision.
fn drive_in_its_precision(
    spec: ExperimentSpec,
    what: &str,
    check: &impl Fn(&ExperimentSpec, &str, &mut dyn FnMut(u64) -> (RankMemoryReport, u64)),
) {
    let spec = valid(spec);
    match spec.train.precision {
        Precision::Fp32 => drive(CpuTrainer::<f32>::new(&spec, 1).unwrap(), &spec, what, check),
        Precision::Bf16 => drive(CpuTrainer::<bf16>::new(&spec, 1).unwrap(), &spec, what, check),
        Precision::Fp16 => drive(CpuTrainer::<f16>::new(&spec, 1).unwrap(), &spec, what, check),
    }
}

/// Hands `check` a function that takes `steps` steps and returns the ledger's report and
/// the bytes the trainer holds.
fn drive<S: Stored<Acc = f32>>(
    mut trainer: CpuTrainer<S>,
    spec: &ExperimentSpec,
    what: &str,
    check: &impl Fn(&ExperimentSpec, &str, &mut dyn FnMut(u64) -> (RankMemoryReport, u64)),
) {
    let mut taken = 0;
    let mut advance = |steps: u64| {
        for _ in 0..steps {
            trainer.step(taken).unwrap();
            taken += 1;
        }
        (trainer.memory_report(), trainer.held_bytes())
    };
    check(spec, what, &mut advance);
}

#[test]
fn the_ledger_equals_the_bytes_of_the_buffers_held() {
    for_every_config(|_, what, advance| {
        let (report, held) = advance(0);
        assert_eq!(report.current.total, held, "{what} before a step");
        let (report, held) = advance(2);
        // Between steps no temporary (gathered unit, unit gradient) is alive.
        assert_eq!(report.current.total, held, "{what} after steps");
        assert_eq!((report.current.gathered_parameters, report.current.comm_buffers), (0, 0), "{what}");
        assert!(!report.timeline.is_empty(), "{what}: the first steps are sampled");
    });
}

#[test]
fn one_rank_measures_what_the_planner_predicts() {
    // bf16/fp16: 2 bytes for parameters, gradients and activations, 12 (master, m, v)
    // for AdamW's state, 4 (the master copy) for SGD's.
    for_every_config(planner_agrees);
}

/// A Mixture-of-Experts model: its router's and slots' buffers, its E MLPs.
fn experts() -> ModelSpec {
    ModelSpec { experts: 4, expert_top_k: 2, capacity_factor: 1.5, ..ModelSpec::dense(2, 32, 4, 16, 64) }
}

#[test]
fn a_mixture_of_experts_rank_measures_what_the_planner_predicts() {
    for_every_config_of(experts(), planner_agrees);
}

#[test]
fn a_mixture_of_experts_ledger_equals_the_bytes_of_the_buffers_held() {
    for_every_config_of(experts(), |_, what, advance| {
        let (report, held) = advance(2);
        assert_eq!(report.current.total, held, "{what} after steps");
    });
}

/// Activation offload to disk (its thread): the peaks are the planner's, offloaded bytes
/// included, and between steps nothing is on its way or off the device, the ledger the
/// buffers held, in every precision and sharding.
#[test]
fn offloaded_activations_are_booked_as_planned_and_as_held() {
    for sharding in [Sharding::None, Sharding::Fsdp] {
        for precision in [Precision::Fp32, Precision::Bf16, Precision::Fp16] {
            let mut spec = spec_of(ModelSpec::dense(4, 32, 4, 16, 64), sharding, Optimizer::Adamw);
            (spec.train.precision, spec.train.activation_offload) = (precision, Offload::Disk);
            let check = |spec: &ExperimentSpec, what: &str, advance: &mut dyn FnMut(u64) -> (RankMemoryReport, u64)| {
                planner_agrees(spec, what, advance);
                let (report, held) = advance(1);
                assert!(report.peak.offloaded > 0, "{what}: nothing left the device");
                assert_eq!(report.peak.offloaded, plan(spec).unwrap().stages[0].memory.offloaded, "{what}");
                assert_eq!(report.current.total, held, "{what} after steps");
                assert_eq!((report.current.activations, report.current.offloaded), (0, 0), "{what}");
            };
            drive_in_its_precision(spec, &format!("offloaded {sharding:?} {}", precision.as_str()), &check);
        }
    }
}

fn planner_agrees(spec: &ExperimentSpec, what: &str, advance: &mut dyn FnMut(u64) -> (RankMemoryReport, u64)) {
    {
        let predicted = plan(spec).unwrap().stages[0].memory.clone();
        let measured = advance(1).0.peak;
        assert_eq!(measured.parameters, predicted.parameters, "{what}");
        assert_eq!(measured.gradients, predicted.gradients, "{what}");
        assert_eq!(measured.optimizer_state, predicted.optimizer_state, "{what}");
        assert_eq!(measured.gathered_parameters, predicted.gathered_parameters, "{what}");
        assert_eq!(measured.comm_buffers, predicted.comm_buffers, "{what}");
        // The planner's activation formula is derived from what the engine stores.
        assert_eq!(measured.activations, predicted.activations, "{what}");
        assert_eq!(measured.activation_grads, predicted.activation_grads, "{what}");
    }
}

#[test]
fn fsdp_gathers_and_frees_one_unit_at_a_time() {
    let spec = valid(spec(Sharding::Fsdp, Optimizer::Adamw));
    let mut trainer = CpuTrainer::<f32>::new(&spec, 1).unwrap();
    trainer.step(0).unwrap();
    let timeline = trainer.memory_report().timeline;
    let gathered: Vec<u64> = timeline.iter().map(|s| s.bytes.gathered_parameters).collect();
    // Forward: embeddings, 2 blocks, head opened then closed; backward: head, 2 blocks (the
    // embeddings' backward needs no parameters).
    let opens = timeline.iter().filter(|s| s.event.ends_with(": open") && s.bytes.gathered_parameters > 0).count();
    assert_eq!(opens, 4 + 3, "{:?}", timeline.iter().map(|s| &s.event).collect::<Vec<_>>());
    assert!(timeline.iter().filter(|s| s.event.ends_with(": close")).all(|s| s.bytes.gathered_parameters == 0));
    assert!(gathered.iter().any(|&g| g > 0));
}
