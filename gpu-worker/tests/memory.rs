//! The memory ledger: it agrees with the buffers the engine actually holds, and with the
//! planner on model state (exactly) and activations.

use distlab_common::planner::plan;
use distlab_common::{ExperimentSpec, ModelSpec, Optimizer, Sharding};
use distlab_worker::Trainer;

fn spec(sharding: Sharding, optimizer: Optimizer) -> ExperimentSpec {
    let mut spec = ExperimentSpec {
        model: ModelSpec { layers: 2, d_model: 32, heads: 4, seq_len: 16, vocab: 64 },
        ..ExperimentSpec::default()
    };
    spec.train.micro_batch = 3;
    spec.train.steps = 3;
    spec.parallel.sharding = sharding;
    spec.train.optimizer = optimizer;
    spec
}

const ALL: [Sharding; 4] = [Sharding::None, Sharding::Zero1, Sharding::Zero2, Sharding::Fsdp];

#[test]
fn the_ledger_equals_the_bytes_of_the_buffers_held() {
    for sharding in ALL {
        for optimizer in [Optimizer::Adamw, Optimizer::Sgd] {
            let spec = spec(sharding, optimizer);
            let mut trainer = Trainer::new(&spec, 1).unwrap();
            let what = format!("{sharding:?} {optimizer:?}");
            assert_eq!(trainer.memory_report().current.total, trainer.held_bytes(), "{what} before a step");
            trainer.step(0).unwrap();
            trainer.step(1).unwrap();
            // Between steps no temporary (gathered unit, unit gradient) is alive.
            let report = trainer.memory_report();
            assert_eq!(report.current.total, trainer.held_bytes(), "{what} after steps");
            assert_eq!((report.current.gathered_parameters, report.current.comm_buffers), (0, 0), "{what}");
            assert!(!report.timeline.is_empty(), "{what}: the first steps are sampled");
        }
    }
}

#[test]
fn one_rank_measures_what_the_planner_predicts() {
    for sharding in ALL {
        for optimizer in [Optimizer::Adamw, Optimizer::Sgd] {
            let spec = spec(sharding, optimizer);
            let predicted = plan(&spec).unwrap().stages[0].memory.clone();
            let mut trainer = Trainer::new(&spec, 1).unwrap();
            trainer.step(0).unwrap();
            let measured = trainer.memory_report().peak;
            let what = format!("{sharding:?} {optimizer:?}");
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
}

#[test]
fn fsdp_gathers_and_frees_one_unit_at_a_time() {
    let spec = spec(Sharding::Fsdp, Optimizer::Adamw);
    let mut trainer = Trainer::new(&spec, 1).unwrap();
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
