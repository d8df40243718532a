//! End to end: the real server and worker binaries on 127.0.0.1, over HTTP.

use std::time::{Duration, Instant};

use distlab_common::*;
use distlab_tests::*;

#[test]
fn submitted_experiment_trains_and_its_metrics_are_stored() {
    let lab = Lab::start();
    let health: Health = lab.get_as("/api/health");
    assert_eq!(health.status, "ok");

    let spec = quick_spec("e2e-quick", 40);
    let id = lab.submit(&spec);
    let exp = lab.wait_finished(id, Duration::from_secs(120));
    assert_eq!(exp.status, ExperimentStatus::Succeeded, "{exp:?}");
    assert_eq!(exp.attempt, 1);
    assert_eq!(exp.steps_done, 40);
    assert!(exp.started_at.is_some() && exp.finished_at.is_some());

    let metrics: Metrics = lab.get_as(&format!("/api/experiments/{id}/metrics"));
    let steps: Vec<u64> = metrics.steps.iter().map(|m| m.step).collect();
    assert_eq!(steps, (0..40).collect::<Vec<_>>());
    let first = metrics.steps[0].loss;
    let last = metrics.steps[39].loss;
    assert!(last < first - 0.3, "the loss should fall: {first} -> {last}");

    let summary = exp.summary.expect("a succeeded experiment has a summary");
    assert_eq!(summary.steps, 40);
    assert_eq!(summary.final_loss, last);
    assert!(summary.tokens_per_s > 0.0);

    let list: ExperimentList = lab.get_as("/api/experiments?status=succeeded");
    assert_eq!(list.total, 1);
    assert_eq!(list.experiments[0].id, id);
    let health: Health = lab.get_as("/api/health");
    assert!(health.workers >= 1, "the local worker is counted: {health:?}");

    // The trained model, handed over by the worker: GPT-2's tensors and config.
    let (status, bytes) = lab.get_bytes(&format!("/api/experiments/{id}/model"));
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&bytes));
    let model = safetensors::SafeTensors::deserialize(&bytes).expect("a safetensors file");
    assert_eq!(model.tensors().len(), 2 + 12 * spec.model.layers + 3);
    assert_eq!(model.tensor("lm_head.weight").expect("the head").shape(), [spec.model.vocab, spec.model.d_model]);
    let config: serde_json::Value = lab.get_as(&format!("/api/experiments/{id}/model/config"));
    assert_eq!(config["n_embd"], spec.model.d_model);
    let (status, body) = lab.get_bytes(&format!("/api/experiments/{id}/model/tokenizer"));
    assert_eq!(status, 409, "a run without BPE has no tokenizer.json");
    assert!(String::from_utf8_lossy(&body).contains("data.tokenizer=bytes"));

    // Sampling from it: greedy is the same every time, a seed repeats its draw, and a text
    // prompt outside this Markov-chain model's 64 tokens is refused with the reason.
    let generate = |body: serde_json::Value| lab.post(&format!("/api/experiments/{id}/generate"), &body);
    let greedy = serde_json::json!({"prompt_tokens": [1, 2, 3], "max_new_tokens": 20, "temperature": 0});
    let (status, first) = generate(greedy.clone());
    assert_eq!(status, 200, "{first}");
    let first: Generated = serde_json::from_value(first).expect("Generated");
    assert_eq!(first.tokens.len(), 20);
    assert!(first.tokens.iter().all(|&t| (t as usize) < spec.model.vocab));
    assert_eq!(serde_json::from_value::<Generated>(generate(greedy).1).unwrap().tokens, first.tokens);
    let drawn =
        serde_json::json!({"prompt_tokens": [5], "max_new_tokens": 30, "temperature": 1.0, "top_k": 8, "seed": 7});
    let (a, b) = (generate(drawn.clone()).1, generate(drawn).1);
    assert_eq!(a["tokens"], b["tokens"], "the same seed draws the same tokens");
    let (status, e) = generate(serde_json::json!({"prompt": "hello"}));
    assert_eq!(status, 422, "{e}");
    assert!(e["error"].as_str().unwrap_or("").contains("vocabulary has 64 tokens"), "{e}");
    let (status, e) = generate(serde_json::json!({"prompt_tokens": [1], "max_new_tokens": 0}));
    assert_eq!(status, 422, "{e}");
    // A model GPT-2's format cannot hold has nothing to sample from, and says why.
    let mut moe = quick_spec("experts", 10);
    moe.model = ModelSpec { experts: 2, expert_top_k: 1, ..moe.model };
    let moe = lab.submit(&moe);
    assert_eq!(lab.wait_finished(moe, Duration::from_secs(120)).status, ExperimentStatus::Succeeded);
    let (status, e) = lab.post(&format!("/api/experiments/{moe}/generate"), &serde_json::json!({"prompt_tokens": [1]}));
    assert_eq!(status, 409, "{e}");
    assert!(e["error"].as_str().unwrap_or("").contains("Mixture-of-Experts"), "{e}");
}

/// A text of one's own: uploaded, trained on by two rank processes the worker hands it
/// to, with a validation loss on its held-out end, and a model that continues it.
#[test]
fn an_uploaded_text_trains_a_model() {
    let lab = Lab::start();
    let text = "Shall I compare thee to a summer's day? Thou art more lovely and more temperate.\n".repeat(200);
    let mut resp = http_agent()
        .post(lab.url("/api/datasets?name=sonnet"))
        .header("Content-Type", "text/plain; charset=utf-8")
        .send(text.as_bytes())
        .expect("upload");
    assert_eq!(resp.status().as_u16(), 201);
    let dataset: DatasetView = serde_json::from_str(&resp.body_mut().read_to_string().expect("body")).expect("view");
    assert_eq!(dataset.bytes, text.len() as u64);

    let mut spec = quick_spec("own text", 30);
    spec.data = DataSpec { dataset: Dataset::Upload, upload_id: Some(dataset.id), ..DataSpec::default() };
    (spec.model.vocab, spec.model.seq_len, spec.parallel.dp) = (256, 32, 2);
    (spec.train.eval_every, spec.train.lr) = (10, 1e-2);
    let id = lab.submit(&spec);
    let exp = lab.wait_finished(id, Duration::from_secs(120));
    assert_eq!(exp.status, ExperimentStatus::Succeeded, "{:?}", exp.error);
    let metrics: Metrics = lab.get_as(&format!("/api/experiments/{id}/metrics"));
    let val: Vec<f64> = metrics.steps.iter().filter_map(|p| p.val_loss).collect();
    assert_eq!(val.len(), 3, "after steps 10, 20 and 30");
    assert!(val[2] < val[0] && val[0] < (256f64).ln(), "{val:?}");
    // The model continues the text in its own words.
    let (status, made) = lab.post(
        &format!("/api/experiments/{id}/generate"),
        &serde_json::json!({"prompt": "Shall I", "max_new_tokens": 16, "temperature": 0}),
    );
    assert_eq!(status, 200, "{made}");
    assert_eq!(made["tokens"].as_array().map(Vec::len), Some(16));
}

/// A byte-level BPE run (Llama blocks on Shakespeare, two ranks): every rank cuts the text
/// with the BPE learned from its training part, the server keeps that tokenizer.json with
/// the model, "Try the model" takes and gives text through it, and the summary gives the
/// held-out text's bytes per token for the loss per byte.
#[test]
fn a_bpe_run_keeps_its_tokenizer_and_samples_text() {
    let lab = Lab::start();
    let mut spec = quick_spec("bpe", 20);
    spec.data = DataSpec { dataset: Dataset::Text, tokenizer: TokenizerKind::Bpe, ..DataSpec::default() };
    spec.model = ModelSpec::llama(1, 32, 2, 1, 64, 32, 320);
    (spec.parallel.dp, spec.train.eval_every, spec.train.lr) = (2, 10, 1e-2);
    let id = lab.submit(&spec);
    let exp = lab.wait_finished(id, Duration::from_secs(180));
    assert_eq!(exp.status, ExperimentStatus::Succeeded, "{:?}", exp.error);
    let summary = exp.summary.expect("a summary");
    let per_token = summary.held_out_bytes_per_token.expect("a text run's bytes per token");
    assert!((1.4..2.5).contains(&per_token), "{per_token} bytes per token at 320 tokens");
    assert!(summary.final_val_loss.is_some_and(|v| v < (320f64).ln()), "{summary:?}");

    let learned = distlab_worker::data::Data::new(&spec.data, &spec.model, spec.global_batch()).expect("data");
    let tokenizer = learned.tokenizer().expect("a text's tokenizer");
    let (status, json) = lab.get_bytes(&format!("/api/experiments/{id}/model/tokenizer"));
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&json));
    assert_eq!(Some(String::from_utf8(json).expect("JSON")), tokenizer.to_json(), "the one the ranks learned");

    let (status, made) = lab.post(
        &format!("/api/experiments/{id}/generate"),
        &serde_json::json!({"prompt": "ROMEO:", "max_new_tokens": 12, "temperature": 0}),
    );
    assert_eq!(status, 200, "{made}");
    let made: Generated = serde_json::from_value(made).expect("Generated");
    assert_eq!(made.tokens.len(), 12);
    assert_eq!(Some(made.text), tokenizer.decode(&made.tokens), "the text is the BPE tokens' text");
}

#[test]
fn invalid_spec_is_rejected_with_every_field_error() {
    let lab = Lab::start_with(LabOptions { local_workers: 0, ..LabOptions::default() });
    let body = serde_json::json!({"name": "bad", "model": {"heads": 3}, "parallel": {"tp": 2}});
    let (status, err) = lab.post("/api/experiments", &body);
    assert_eq!(status, 422, "{err}");
    let err: ApiError = serde_json::from_value(err).unwrap();
    let fields: Vec<&str> = err.fields.iter().map(|f| f.field.as_str()).collect();
    assert!(fields.contains(&"model.heads") && fields.contains(&"parallel.tp"), "{err:?}");
    let list: ExperimentList = lab.get_as("/api/experiments");
    assert_eq!(list.total, 0, "nothing is stored for a rejected spec");
}

/// A run long enough to be interrupted: a few hundred milliseconds per step would be too
/// slow for CI, so it uses many quick steps.
fn long_spec(name: &str) -> ExperimentSpec {
    let mut spec = quick_spec(name, 3000);
    spec.model.d_model = 128;
    spec.train.micro_batch = 16;
    spec
}

#[test]
fn killed_worker_lease_expires_and_a_second_worker_finishes_the_run() {
    let mut lab = Lab::start_with(LabOptions {
        local_workers: 0,
        lease_seconds: 2.0,
        heartbeat_seconds: 0.5,
        ..LabOptions::default()
    });
    let first = lab.spawn_worker("first");
    let mut spec = long_spec("survives-a-dead-worker");
    spec.train.steps = 300;
    let id = lab.submit(&spec);
    lab.wait_for(id, Duration::from_secs(60), |e| e.status == ExperimentStatus::Running && e.steps_done >= 3);
    lab.kill_worker(first);

    // The lease expires (2 s) and the experiment goes back to the queue with attempt 1 used.
    let requeued = lab.wait_for(id, Duration::from_secs(20), |e| e.status == ExperimentStatus::Queued);
    assert_eq!(requeued.attempt, 1);

    lab.spawn_worker("second");
    let exp = lab.wait_finished(id, Duration::from_secs(240));
    assert_eq!(exp.status, ExperimentStatus::Succeeded, "{exp:?}");
    assert_eq!(exp.attempt, 2, "the second worker's lease is the second attempt");
    let metrics: Metrics = lab.get_as(&format!("/api/experiments/{id}/metrics"));
    assert_eq!(metrics.steps.len(), 300, "every step is stored once");
}

#[test]
fn cancel_stops_a_running_experiment_and_frees_the_worker() {
    let lab = Lab::start_with(LabOptions {
        local_workers: 1,
        lease_seconds: 30.0,
        heartbeat_seconds: 0.5,
        ..LabOptions::default()
    });
    let long = lab.submit(&long_spec("to-be-cancelled"));
    lab.wait_for(long, Duration::from_secs(60), |e| e.status == ExperimentStatus::Running && e.steps_done >= 2);
    let (status, body) = lab.post(&format!("/api/experiments/{long}/cancel"), &serde_json::json!({}));
    assert_eq!(status, 200, "{body}");
    assert_eq!(lab.experiment(long).status, ExperimentStatus::Cancelled);

    // The only worker must stop the cancelled run within seconds to pick up the next one.
    let next = lab.submit(&quick_spec("after-cancel", 5));
    let exp = lab.wait_finished(next, Duration::from_secs(30));
    assert_eq!(exp.status, ExperimentStatus::Succeeded, "{exp:?}");
    let cancelled = lab.experiment(long);
    assert_eq!(cancelled.status, ExperimentStatus::Cancelled);
    assert!(cancelled.steps_done < 3000);

    // Cancelling a finished experiment is a state conflict.
    let (status, body) = lab.post(&format!("/api/experiments/{long}/cancel"), &serde_json::json!({}));
    assert_eq!(status, 409, "{body}");
}

/// One optimizer step of this run takes minutes (64 micro-batches of 16 x 128 tokens):
/// a cancel made during its first step must still stop it within seconds. The worker asks
/// the server every second whether it still holds the run, and the run's rank process is
/// killed; before, cancel was seen between steps only and the next run waited for the step.
#[test]
fn cancel_inside_a_long_step_frees_the_worker_within_seconds() {
    let marker = format!("long-step-{}", std::process::id());
    let env = vec![("DISTLAB_TEST_MARKER".to_string(), marker.clone())];
    let lab = Lab::start_with(LabOptions { local_workers: 1, heartbeat_seconds: 5.0, env, ..LabOptions::default() });
    let mut spec = quick_spec("one-long-step", 2);
    spec.model = ModelSpec::dense(4, 128, 4, 128, 256);
    (spec.train.micro_batch, spec.train.grad_accum) = (16, 64);
    let long = lab.submit(&spec);
    lab.wait_for(long, Duration::from_secs(60), |e| e.status == ExperimentStatus::Running);
    let deadline = Instant::now() + Duration::from_secs(30);
    let ranks = loop {
        let ranks = processes_with(&marker, "rank");
        if !ranks.is_empty() {
            break ranks;
        }
        assert!(Instant::now() < deadline, "the run's rank process did not start");
        std::thread::sleep(Duration::from_millis(100));
    };
    std::thread::sleep(Duration::from_secs(2));
    assert_eq!(lab.experiment(long).steps_done, 0, "still inside its first step");
    let cancelled = Instant::now();
    let (status, body) = lab.post(&format!("/api/experiments/{long}/cancel"), &serde_json::json!({}));
    assert_eq!(status, 200, "{body}");
    let next = lab.submit(&quick_spec("after-a-long-step", 2));
    lab.wait_for(next, Duration::from_secs(60), |e| e.status != ExperimentStatus::Queued);
    let freed = cancelled.elapsed();
    assert!(freed < Duration::from_secs(5), "the worker took {freed:?} to leave the cancelled run");
    let alive: Vec<u32> =
        ranks.into_iter().filter(|pid| std::path::Path::new(&format!("/proc/{pid}")).exists()).collect();
    assert!(alive.is_empty(), "the cancelled run's rank processes {alive:?} are still there");
    assert_eq!(lab.wait_finished(next, Duration::from_secs(60)).status, ExperimentStatus::Succeeded);
}

/// A local worker that dies is started again by the server, and trains what is submitted
/// next. No process of the lab shows the worker token in its command line (`ps` shows
/// every process's arguments to every user of the machine).
#[test]
fn a_local_worker_that_dies_is_started_again_and_no_argv_holds_the_token() {
    let marker = format!("restart-{}", std::process::id());
    let env = vec![("DISTLAB_TEST_MARKER".to_string(), marker.clone())];
    let lab = Lab::start_with(LabOptions { env, ..LabOptions::default() });
    let local_worker = |other_than: Option<u32>| {
        let deadline = std::time::Instant::now() + Duration::from_secs(20);
        loop {
            let found = processes_with(&marker, "local-1").into_iter().find(|&pid| Some(pid) != other_than);
            if let Some(pid) = found {
                return pid;
            }
            assert!(std::time::Instant::now() < deadline, "no local worker (other than {other_than:?}) within 20 s");
            std::thread::sleep(Duration::from_millis(100));
        }
    };
    let first = local_worker(None);
    for pid in processes_with(&marker, "distlab") {
        let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
        let token = WORKER_TOKEN.as_bytes();
        assert!(!cmdline.windows(token.len()).any(|w| w == token), "pid {pid} has the token in its argv");
    }
    // SAFETY: signalling a child process of this test's server.
    unsafe { libc::kill(first as i32, libc::SIGKILL) };
    let second = local_worker(Some(first));
    assert_ne!(first, second);
    let id = lab.submit(&quick_spec("after-restart", 5));
    let exp = lab.wait_finished(id, Duration::from_secs(120));
    assert_eq!(exp.status, ExperimentStatus::Succeeded, "{exp:?}");
}
