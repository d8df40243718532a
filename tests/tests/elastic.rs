//! Elastic resume (`train.resume_from`): a dp=4 ZeRO-2 run's checkpoint, re-cut for 2 ranks
//! (ZeRO-2, FSDP or plain DDP) by the worker, continues as an uninterrupted dp=2 run of the
//! same global batch does; through the server, the resumed experiment's grad_accum keeps
//! the global batch, and what cannot fit (another tp, a checkpoint no longer kept, a
//! missing experiment) is refused field by field.

use distlab_common::*;
use distlab_tests::*;

/// 8 steps of 16 sequences: dp 4 x micro_batch 4, or dp 2 x micro_batch 4 x grad_accum 2.
fn spec(name: &str, dp: usize, sharding: Sharding) -> ExperimentSpec {
    let mut spec = quick_spec(name, 8);
    spec.model = ModelSpec::dense(2, 64, 4, 32, 64);
    (spec.parallel.dp, spec.parallel.sharding) = (dp, sharding);
    (spec.train.micro_batch, spec.train.grad_accum) = (4, 4 / dp);
    spec
}

#[test]
fn a_dp4_zero2_checkpoint_continues_at_dp2_like_an_uninterrupted_dp2_run() {
    let _serial = one_at_a_time();
    let straight = run_losses(&spec("dp2 straight", 2, Sharding::Zero2));
    let root = tempfile::tempdir().unwrap();
    let mut source = spec("dp4 zero2", 4, Sharding::Zero2);
    source.train.checkpoint_every = 4;
    let first_half = run_in_checkpoint_dir(&source, &root.path().join("experiment-1"));
    let losses = |points: &[MetricPoint]| points.iter().map(|p| p.loss).collect::<Vec<_>>();
    assert_same_losses(&straight[..4], &losses(&first_half)[..4], "dp4 before the checkpoint");
    for (id, sharding) in [(2, Sharding::Zero2), (3, Sharding::Fsdp), (4, Sharding::None)] {
        let mut resumed = spec("dp2 resumed", 2, sharding);
        resumed.train.resume_from = Some(ResumeFrom { experiment: 1, step: 4 });
        let second_half = run_in_checkpoint_dir(&resumed, &root.path().join(format!("experiment-{id}")));
        assert_eq!(second_half.first().map(|p| p.step), Some(4));
        assert_same_losses(&straight[4..], &losses(&second_half), &format!("dp2 {sharding:?} from dp4's step 4"));
    }
}

#[test]
fn the_server_keeps_the_global_batch_and_refuses_what_a_checkpoint_fixes() {
    let _serial = one_at_a_time();
    let lab = Lab::start();
    let mut source = spec("dp4 zero2 source", 4, Sharding::Zero2);
    source.train.checkpoint_every = 4;
    let source_id = lab.submit(&source);
    let done = lab.wait_finished(source_id, std::time::Duration::from_secs(120));
    assert_eq!(done.status, ExperimentStatus::Succeeded, "{done:?}");

    // dp 2 with grad_accum 1 would halve the global batch: the server makes it 2.
    let mut resumed = spec("dp2 resumed", 2, Sharding::Fsdp);
    resumed.train.grad_accum = 1;
    resumed.train.resume_from = Some(ResumeFrom { experiment: source_id, step: 4 });
    let id = lab.submit(&resumed);
    let exp = lab.wait_finished(id, std::time::Duration::from_secs(120));
    assert_eq!(exp.status, ExperimentStatus::Succeeded, "{exp:?}");
    assert_eq!((exp.spec.train.grad_accum, exp.spec.global_batch()), (2, source.global_batch()));
    let metrics: Metrics = lab.get_as(&format!("/api/experiments/{id}/metrics"));
    assert_eq!(metrics.steps.iter().map(|m| m.step).collect::<Vec<_>>(), (4..8).collect::<Vec<_>>());
    let attempts: Attempts = lab.get_as(&format!("/api/experiments/{id}/attempts"));
    assert_eq!(attempts.attempts[0].from_step, Some(4), "it began at the checkpoint's step");

    // The source saved steps 2, 4 and 6, and keeps only the latest.
    let mut older = source.clone();
    (older.name, older.train.checkpoint_every) = ("every 2".into(), 2);
    let older_id = lab.submit(&older);
    assert_eq!(lab.wait_finished(older_id, std::time::Duration::from_secs(120)).status, ExperimentStatus::Succeeded);
    let mut wrong = resumed.clone();
    (wrong.parallel.tp, wrong.train.resume_from) = (2, Some(ResumeFrom { experiment: older_id, step: 4 }));
    let (status, body) = lab.post("/api/experiments", &serde_json::to_value(&wrong).unwrap());
    assert_eq!(status, 422, "{body}");
    let text = body.to_string();
    assert!(text.contains("parallel.tp") && text.contains("only its latest checkpoint, of step 6"), "{body}");
    let mut missing = resumed;
    missing.train.resume_from = Some(ResumeFrom { experiment: 999, step: 4 });
    let (status, body) = lab.post("/api/experiments", &serde_json::to_value(&missing).unwrap());
    assert!(status == 422 && body.to_string().contains("there is no experiment 999"), "{status} {body}");
}
