//! `distlab-worker run SPEC.json`: the command tests, benchmarks and demos build on.

use std::process::Command;

use distlab_common::*;
use distlab_tests::*;

fn run_spec(spec_json: &str, extra: &[&str]) -> std::process::Output {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("spec.json");
    std::fs::write(&path, spec_json).unwrap();
    Command::new(bin_path("distlab-worker")).arg("run").arg(&path).args(extra).output().expect("run distlab-worker")
}

#[test]
fn run_prints_one_json_line_per_step_then_the_summary() {
    let spec = quick_spec("cli", 12);
    let out_dir = tempfile::tempdir().unwrap();
    let out = run_spec(
        &serde_json::to_string(&spec).unwrap(),
        &["--threads", "1", "--out", out_dir.path().to_str().unwrap()],
    );
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let stdout = String::from_utf8(out.stdout).unwrap();
    let lines: Vec<serde_json::Value> = stdout.lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    assert_eq!(lines.len(), 13);
    for (i, line) in lines[..12].iter().enumerate() {
        let point: MetricPoint = serde_json::from_value(line.clone()).unwrap();
        assert_eq!(point.step, i as u64);
        assert!(point.loss.is_finite() && point.tokens_per_s > 0.0);
    }
    let summary: RunSummary = serde_json::from_value(lines[12]["summary"].clone()).unwrap();
    assert_eq!(summary.steps, 12);
    assert_eq!(summary.threads, 1);
    // --out keeps the same records on disk.
    let metrics = std::fs::read_to_string(out_dir.path().join("metrics.jsonl")).unwrap();
    assert_eq!(metrics.lines().count(), 12);
    assert!(out_dir.path().join("summary.json").exists());
}

#[test]
fn run_rejects_an_invalid_spec_with_a_readable_message() {
    let out = run_spec(r#"{"model": {"heads": 3}, "train": {"lr": -1}}"#, &[]);
    assert_eq!(out.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("model.heads: heads=3 does not divide d_model=64"), "{stderr}");
    assert!(stderr.contains("train.lr"), "{stderr}");

    let out = run_spec(r#"{"trian": {}}"#, &[]);
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("trian"));

    let out = run_spec("not json", &[]);
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("not valid JSON"));
}

#[test]
fn run_says_when_a_feature_is_not_supported_yet() {
    // A collective demo on cuda: refused with or without a GPU (this test holds on both).
    let mut spec = quick_spec("cuda", 3);
    spec.backend = BackendKind::Cuda;
    spec.parallel.dp = 2;
    spec.demo = Some(CollectiveDemo::default());
    let out = run_spec(&serde_json::to_string(&spec).unwrap(), &[]);
    assert_eq!(out.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&out.stderr);
    // Without the cuda feature the worker says it was built without it; with it, what the
    // cuda backend leaves to the cpu (the demo).
    assert!(stderr.contains("backend=cuda"), "{stderr}");
    let why = ["cuda feature", "demo"];
    assert!(why.iter().any(|w| stderr.contains(w)), "{stderr}");
}
