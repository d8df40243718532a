//! The disk quota reserves for a run what `distlab_common::disk::DiskPlan` says its files
//! take. Here runs of each kind of state (replicated, sharded, split by tensor or pipeline
//! parallelism, 2-byte with master weights, with a compression residual) leave their
//! checkpoint and model, and the plan must cover the bytes measured on disk without
//! reserving much more: a strategy that wrote its replicated state once per replica, or
//! a plan that forgot a section, fails here.

use std::path::Path;

use distlab_common::disk::DiskPlan;
use distlab_common::*;
use distlab_tests::*;

/// Bytes of the files under `dir`, at any depth.
fn bytes_under(dir: &Path) -> u64 {
    std::fs::read_dir(dir)
        .expect("a directory")
        .flatten()
        .map(|e| {
            let meta = e.metadata().expect("metadata");
            if meta.is_dir() {
                bytes_under(&e.path())
            } else {
                meta.len()
            }
        })
        .sum()
}

/// What the plan reserves over what was measured, for `what`: at least all of it, at most
/// a tenth more.
fn assert_covers(planned: u64, measured: u64, what: &str) {
    assert!(measured > 0, "{what}: nothing on disk");
    let ratio = planned as f64 / measured as f64;
    println!("{what}: {measured} bytes on disk, {planned} planned ({ratio:.3})");
    assert!(
        (1.0..=1.10).contains(&ratio),
        "{what}: the plan reserves {planned} bytes for {measured} on disk (ratio {ratio:.3})"
    );
}

#[test]
fn a_runs_checkpoint_and_model_on_disk_are_what_its_plan_reserves() {
    let _serial = one_at_a_time();
    type Mesh = fn(&mut ExperimentSpec);
    let meshes: [(&str, Mesh); 6] = [
        ("dp=2 ddp adamw", |s| s.parallel.dp = 2),
        ("dp=2 zero-1 bf16", |s| {
            s.parallel.dp = 2;
            s.parallel.sharding = Sharding::Zero1;
            s.train.precision = Precision::Bf16;
        }),
        ("dp=2 fsdp", |s| {
            s.parallel.dp = 2;
            s.parallel.sharding = Sharding::Fsdp;
        }),
        ("tp=2", |s| s.parallel.tp = 2),
        ("pp=2 sgd", |s| {
            s.parallel.pp = 2;
            s.train.optimizer = Optimizer::Sgd;
        }),
        ("dp=2 int8 compression", |s| {
            s.parallel.dp = 2;
            s.parallel.grad_compression = GradCompression::Int8;
        }),
    ];
    for (what, mesh) in meshes {
        let mut spec = quick_spec(what, 4);
        spec.model = ModelSpec::dense(4, 128, 4, 32, 256);
        spec.train.checkpoint_every = 2;
        mesh(&mut spec);
        let (out, checkpoints) = (tempfile::tempdir().expect("temp dir"), tempfile::tempdir().expect("temp dir"));
        run_into_with_checkpoints(&spec, out.path(), checkpoints.path());
        let plan = DiskPlan::of(&spec);
        assert_covers(plan.checkpoint, bytes_under(checkpoints.path()), &format!("{what}: the checkpoint kept"));
        let model = std::fs::metadata(out.path().join(export::WEIGHTS_FILE)).expect("model.safetensors").len();
        assert_covers(plan.model, model, &format!("{what}: the model"));
    }
}
