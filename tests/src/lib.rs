//! Test harness: starts the real `distlab-server` (and workers) on 127.0.0.1 with a free
//! port and a temporary data directory, and talks to it over HTTP.
//!
//! The binaries must be built first (`cargo xtask test` does it):
//! `cargo build -p distlab-server -p distlab-worker`.

pub mod netns;

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use distlab_common::*;
use serde::de::DeserializeOwned;
use serde_json::Value;

pub const WORKER_TOKEN: &str = "test-worker-token";

/// The repository root (this crate lives in `tests/`).
pub fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().expect("tests/ has a parent").to_path_buf()
}

/// Where the binaries under test are: `DISTLAB_BIN_DIR`, else the cargo target dir of this
/// test build's profile (target/debug for `cargo test`).
pub fn bin_path(name: &str) -> PathBuf {
    let dir = match std::env::var_os("DISTLAB_BIN_DIR") {
        Some(dir) => PathBuf::from(dir),
        None => {
            // target/<profile>/deps/<test-binary> -> target/<profile>
            let exe = std::env::current_exe().expect("current exe");
            exe.parent().and_then(Path::parent).expect("target/<profile>").to_path_buf()
        }
    };
    let path = dir.join(name);
    assert!(
        path.exists(),
        "{} is not built. Build the binaries first: `cargo build -p distlab-server -p distlab-worker` \
         (or run the whole suite with `cargo xtask test`)",
        path.display()
    );
    path
}

pub struct LabOptions {
    pub local_workers: usize,
    pub lease_seconds: f64,
    pub heartbeat_seconds: f64,
    /// Extra environment for the server (inherited by its local workers and their ranks).
    pub env: Vec<(String, String)>,
    /// Extra command-line flags for the server.
    pub args: Vec<String>,
    /// The built frontend the server serves (default: the repository's target/site).
    pub static_dir: Option<PathBuf>,
}

impl Default for LabOptions {
    fn default() -> Self {
        Self {
            local_workers: 1,
            lease_seconds: 30.0,
            heartbeat_seconds: 1.0,
            env: Vec::new(),
            args: Vec::new(),
            static_dir: None,
        }
    }
}

/// A running server (with its local workers). Everything is stopped on drop.
pub struct Lab {
    pub base: String,
    pub data_dir: tempfile::TempDir,
    opts: LabOptions,
    server: Child,
    workers: Vec<Child>,
    agent: ureq::Agent,
}

/// An HTTP client for the test server: error statuses are answers, not errors; 30 s at most.
pub fn http_agent() -> ureq::Agent {
    ureq::Agent::config_builder()
        .http_status_as_error(false)
        .timeout_global(Some(Duration::from_secs(30)))
        .build()
        .into()
}

/// Starts `distlab-server` on 127.0.0.1 with a free port and `data_dir`; the process and the
/// URL it printed once ready.
fn start_server(data_dir: &Path, opts: &LabOptions) -> (Child, String) {
    let mut server = Command::new(bin_path("distlab-server"))
        .args(["--addr", "127.0.0.1:0"])
        .env("DISTLAB_WORKER_TOKEN", WORKER_TOKEN)
        .arg("--data-dir")
        .arg(data_dir)
        .arg("--static-dir")
        .arg(opts.static_dir.clone().unwrap_or_else(|| repo_root().join("target/site")))
        .args(["--local-workers", &opts.local_workers.to_string()])
        .args(["--lease-seconds", &opts.lease_seconds.to_string()])
        .args(["--heartbeat-seconds", &opts.heartbeat_seconds.to_string()])
        .arg("--worker-bin")
        .arg(bin_path("distlab-worker"))
        .args(&opts.args)
        .env("RUST_LOG", "info")
        .envs(opts.env.iter().map(|(k, v)| (k, v)))
        .stdout(Stdio::piped())
        .spawn()
        .expect("start distlab-server");

    // The server prints "distlab is ready at http://127.0.0.1:PORT/" once it listens.
    let stdout = server.stdout.take().expect("piped stdout");
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            eprintln!("[server] {line}");
            if let Some(rest) = line.split("ready at ").nth(1) {
                let _ = tx.send(rest.trim().trim_end_matches('/').to_string());
            }
        }
    });
    match rx.recv_timeout(Duration::from_secs(30)) {
        Ok(base) => (server, base),
        Err(_) => {
            let _ = server.kill();
            panic!("distlab-server did not print its URL within 30 s");
        }
    }
}

impl Lab {
    pub fn start() -> Lab {
        Lab::start_with(LabOptions::default())
    }

    pub fn start_with(opts: LabOptions) -> Lab {
        let data_dir = tempfile::tempdir().expect("temp dir");
        let (server, base) = start_server(data_dir.path(), &opts);
        Lab { base, data_dir, opts, server, workers: Vec::new(), agent: http_agent() }
    }

    /// SIGKILLs the server (it gets no chance to finish anything) and starts it again on the
    /// same data directory, at a new port (`base` follows).
    pub fn kill_server_and_restart(&mut self) {
        let _ = self.server.kill();
        let _ = self.server.wait();
        let (server, base) = start_server(self.data_dir.path(), &self.opts);
        (self.server, self.base) = (server, base);
    }

    pub fn checkpoint_dir(&self) -> PathBuf {
        self.data_dir.path().join("checkpoints")
    }

    /// Experiment `id`'s checkpoint directory under the local workers' (its name carries
    /// the database's id: `experiment-<id>-<store>`), once a worker has made it.
    pub fn experiment_checkpoints(&self, id: i64) -> Option<PathBuf> {
        let prefix = format!("experiment-{id}-");
        std::fs::read_dir(self.checkpoint_dir())
            .ok()?
            .flatten()
            .find(|e| e.file_name().to_string_lossy().starts_with(&prefix))
            .map(|e| e.path())
    }

    /// SIGKILLs the server and starts it on the same data directory with a new, empty
    /// database (the old one's files deleted; checkpoints and datasets stay).
    pub fn kill_server_and_start_afresh(&mut self) {
        let _ = self.server.kill();
        let _ = self.server.wait();
        for file in ["distlab.db", "distlab.db-wal", "distlab.db-shm"] {
            let _ = std::fs::remove_file(self.data_dir.path().join(file));
        }
        let (server, base) = start_server(self.data_dir.path(), &self.opts);
        (self.server, self.base) = (server, base);
    }

    pub fn url(&self, path: &str) -> String {
        format!("{}{}", self.base, path)
    }

    /// Starts an extra worker process against this server (killed on drop, or by the test).
    pub fn spawn_worker(&mut self, name: &str) -> usize {
        self.spawn_worker_with_env(name, &[])
    }

    /// A worker with extra environment (inherited by its rank processes). Every worker of a
    /// lab shares the local workers' checkpoint and offload directories under DATA_DIR.
    pub fn spawn_worker_with_env(&mut self, name: &str, env: &[(&str, &str)]) -> usize {
        let child = Command::new(bin_path("distlab-worker"))
            .args(["--server", &self.base, "--name", name, "--give-up-seconds", "10"])
            .env("DISTLAB_WORKER_TOKEN", WORKER_TOKEN)
            .arg("--checkpoint-dir")
            .arg(self.checkpoint_dir())
            .arg("--offload-dir")
            .arg(self.data_dir.path().join("offload"))
            .envs(env.iter().copied())
            .spawn()
            .expect("start distlab-worker");
        self.workers.push(child);
        self.workers.len() - 1
    }

    /// Whether a worker started with `spawn_worker` is still running.
    pub fn worker_alive(&mut self, index: usize) -> bool {
        matches!(self.workers[index].try_wait(), Ok(None))
    }

    /// SIGKILLs a worker started with `spawn_worker` (it gets no chance to report anything).
    pub fn kill_worker(&mut self, index: usize) {
        let _ = self.workers[index].kill();
        let _ = self.workers[index].wait();
    }

    pub fn get(&self, path: &str) -> (u16, Value) {
        let resp = self.agent.get(&self.url(path)).call();
        read(resp)
    }

    pub fn post(&self, path: &str, body: &Value) -> (u16, Value) {
        let resp = self.agent.post(&self.url(path)).send_json(body);
        read(resp)
    }

    /// GET `path` as bytes (a download): the status and the body.
    pub fn get_bytes(&self, path: &str) -> (u16, Vec<u8>) {
        let mut resp = self.agent.get(&self.url(path)).call().unwrap_or_else(|e| panic!("GET {path}: {e}"));
        let status = resp.status().as_u16();
        let body = resp.body_mut().with_config().limit(1 << 30).read_to_vec().expect("the body");
        (status, body)
    }

    /// DELETE `path`: the status.
    pub fn delete(&self, path: &str) -> u16 {
        read(self.agent.delete(&self.url(path)).call()).0
    }

    pub fn get_as<T: DeserializeOwned>(&self, path: &str) -> T {
        let (status, body) = self.get(path);
        assert_eq!(status, 200, "GET {path}: {body}");
        serde_json::from_value(body).unwrap_or_else(|e| panic!("GET {path}: {e}"))
    }

    /// Submits a spec and returns the new experiment's id.
    pub fn submit(&self, spec: &ExperimentSpec) -> i64 {
        let (status, body) = self.post("/api/experiments", &serde_json::to_value(spec).unwrap());
        assert_eq!(status, 201, "submit: {body}");
        body["id"].as_i64().expect("id")
    }

    pub fn experiment(&self, id: i64) -> ExperimentView {
        self.get_as(&format!("/api/experiments/{id}"))
    }

    /// Polls until `done(experiment)` holds, panicking after `timeout` with the last view.
    pub fn wait_for(&self, id: i64, timeout: Duration, done: impl Fn(&ExperimentView) -> bool) -> ExperimentView {
        let start = Instant::now();
        loop {
            let exp = self.experiment(id);
            if done(&exp) {
                return exp;
            }
            assert!(start.elapsed() < timeout, "timed out after {timeout:?} waiting on experiment {id}: {exp:?}");
            std::thread::sleep(Duration::from_millis(200));
        }
    }

    pub fn wait_finished(&self, id: i64, timeout: Duration) -> ExperimentView {
        self.wait_for(id, timeout, |e| e.status.is_finished())
    }
}

fn read(resp: Result<ureq::http::Response<ureq::Body>, ureq::Error>) -> (u16, Value) {
    let mut resp = resp.expect("HTTP request to the test server");
    let status = resp.status().as_u16();
    let text = resp.body_mut().read_to_string().unwrap_or_default();
    let body =
        if text.trim().is_empty() { Value::Null } else { serde_json::from_str(&text).unwrap_or(Value::String(text)) };
    (status, body)
}

impl Drop for Lab {
    fn drop(&mut self) {
        for w in &mut self.workers {
            let _ = w.kill();
            let _ = w.wait();
        }
        // SIGTERM lets the server stop its local workers; SIGKILL if it does not exit.
        unsafe {
            libc::kill(self.server.id() as i32, libc::SIGTERM);
        }
        let deadline = Instant::now() + Duration::from_secs(5);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.server.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let _ = self.server.kill();
        let _ = self.server.wait();
    }
}

/// Runs a multi-rank `spec` on a worker whose rank 0 hangs after step `hang_after` (before
/// reporting it), SIGKILLs that worker once the steps before are stored, checks that its
/// rank processes died with it, and lets a second worker ("second") resume the run; returns
/// the experiment's id once it has finished. The lab needs no local workers and a short lease.
pub fn kill_and_resume(lab: &mut Lab, spec: &ExperimentSpec, hang_after: u64) -> (i64, ExperimentView) {
    let marker = format!("kill-and-resume-{}-{}", std::process::id(), spec.name);
    let fault = format!("0:{hang_after}:hang");
    let first = lab.spawn_worker_with_env("first", &[("DISTLAB_FAULT", &fault), ("DISTLAB_TEST_MARKER", &marker)]);
    // A cuda experiment is refused until a worker offering cuda has registered.
    let registered = Instant::now() + Duration::from_secs(60);
    while lab.get_as::<distlab_common::Health>("/api/health").workers == 0 {
        assert!(Instant::now() < registered, "the worker did not register within a minute");
        std::thread::sleep(Duration::from_millis(100));
    }
    let id = lab.submit(spec);
    lab.wait_for(id, Duration::from_secs(120), |e| e.steps_done >= hang_after);
    lab.kill_worker(first);
    // The kernel kills the ranks with their worker: none is left to write checkpoints.
    let deadline = Instant::now() + Duration::from_secs(10);
    while !processes_with(&marker, "rank").is_empty() {
        assert!(Instant::now() < deadline, "rank processes outlived their SIGKILLed worker");
        std::thread::sleep(Duration::from_millis(100));
    }
    let requeued = lab.wait_for(id, Duration::from_secs(20), |e| e.status == ExperimentStatus::Queued);
    assert_eq!(requeued.attempt, 1);
    lab.spawn_worker("second");
    (id, lab.wait_finished(id, Duration::from_secs(120)))
}

/// Held by a test that starts rank processes, so that the tests of one file (which cargo
/// runs on parallel threads) start theirs one at a time on this 2-core machine (and a
/// timing, like a pipeline's bubble, is not disturbed by another test's ranks).
pub fn one_at_a_time() -> std::sync::MutexGuard<'static, ()> {
    static ONE_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());
    ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner())
}

/// A spec small enough to train in a few seconds on this machine.
pub fn quick_spec(name: &str, steps: u64) -> ExperimentSpec {
    let mut spec = ExperimentSpec { name: name.into(), ..ExperimentSpec::default() };
    spec.train.steps = steps;
    spec.train.warmup_steps = spec.train.warmup_steps.min(steps);
    spec
}

/// Processes whose environment holds `marker` (a value unique to one test) and whose
/// command line contains `needle`: what a test checks is gone after a run.
pub fn processes_with(marker: &str, needle: &str) -> Vec<u32> {
    let Ok(entries) = std::fs::read_dir("/proc") else { return Vec::new() };
    entries
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse::<u32>().ok())
        .filter(|pid| {
            let environ = std::fs::read(format!("/proc/{pid}/environ")).unwrap_or_default();
            let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
            let has = |hay: &[u8], what: &str| hay.windows(what.len()).any(|w| w == what.as_bytes());
            has(&environ, marker) && has(&cmdline, needle)
        })
        .collect()
}

/// Runs `distlab-worker run` on a spec: one metric point per optimizer step, in order.
/// Fails on anything unexpected in the output (see [`parse_run_output`]).
pub fn run_steps(spec: &ExperimentSpec) -> Vec<MetricPoint> {
    worker_run(spec, None)
}

/// The per-step losses of [`run_steps`].
pub fn run_losses(spec: &ExperimentSpec) -> Vec<f64> {
    run_steps(spec).iter().map(|m| m.loss).collect()
}

/// Runs `distlab-worker run --out DIR` on a spec: the per-step losses and every rank's trace.
pub fn run_with_trace(spec: &ExperimentSpec) -> (Vec<f64>, distlab_common::trace::ExperimentTrace) {
    let (steps, trace) = run_points_with_trace(spec);
    (steps.iter().map(|m| m.loss).collect(), trace)
}

/// [`run_with_trace`] with every step's metric point.
pub fn run_points_with_trace(spec: &ExperimentSpec) -> (Vec<MetricPoint>, distlab_common::trace::ExperimentTrace) {
    let out = tempfile::tempdir().expect("temp dir");
    let steps = worker_run(spec, Some(out.path()));
    let trace = std::fs::read_to_string(out.path().join("trace.json")).expect("trace.json");
    (steps, serde_json::from_str(&trace).expect("trace JSON"))
}

/// Runs `distlab-worker run --out DIR` on a spec, keeping what it writes in `dir` (the
/// trained model among it): one metric point per step.
pub fn run_into(spec: &ExperimentSpec, dir: &Path) -> Vec<MetricPoint> {
    worker_run(spec, Some(dir))
}

/// Runs a collective demo (`spec.demo`) with `distlab-worker run --out DIR`: its summary
/// (the demo's byte counts) and every rank's trace.
pub fn run_demo(spec: &ExperimentSpec) -> (distlab_common::RunSummary, distlab_common::trace::ExperimentTrace) {
    assert!(spec.demo.is_some(), "not a collective demo");
    let out = tempfile::tempdir().expect("temp dir");
    run_worker(spec, Some(out.path()), None);
    let read = |name: &str| std::fs::read_to_string(out.path().join(name)).unwrap_or_else(|e| panic!("{name}: {e}"));
    (
        serde_json::from_str(&read("summary.json")).expect("a run summary"),
        serde_json::from_str(&read("trace.json")).expect("trace JSON"),
    )
}

/// `run_with_trace`, saving the spec's checkpoints (`train.checkpoint_every`) as it goes.
pub fn run_with_checkpoints(spec: &ExperimentSpec) -> distlab_common::trace::ExperimentTrace {
    let (out, checkpoints) = (tempfile::tempdir().expect("temp dir"), tempfile::tempdir().expect("temp dir"));
    worker_run_with(spec, Some(out.path()), Some(checkpoints.path()));
    let trace = std::fs::read_to_string(out.path().join("trace.json")).expect("trace.json");
    serde_json::from_str(&trace).expect("trace JSON")
}

/// `run_into`, saving the spec's checkpoints in `checkpoints` (the latest stays after the run).
pub fn run_into_with_checkpoints(spec: &ExperimentSpec, dir: &Path, checkpoints: &Path) -> Vec<MetricPoint> {
    worker_run_with(spec, Some(dir), Some(checkpoints))
}

fn worker_run(spec: &ExperimentSpec, out_dir: Option<&Path>) -> Vec<MetricPoint> {
    worker_run_with(spec, out_dir, None)
}

fn worker_run_with(spec: &ExperimentSpec, out_dir: Option<&Path>, checkpoint_dir: Option<&Path>) -> Vec<MetricPoint> {
    let stdout = run_worker(spec, out_dir, checkpoint_dir);
    // A run resumed from another experiment's checkpoint starts at its step.
    let first = spec.train.resume_from.map_or(0, |from| from.step);
    parse_run_output_from(&stdout, first, spec.train.steps)
}

/// [`run_points_with_trace`] with the ranks spread over `hosts` simulated hosts
/// (`--simulated-hosts`): ranks of different hosts talk over TCP on 127.0.0.1.
pub fn run_on_hosts(spec: &ExperimentSpec, hosts: usize) -> (Vec<MetricPoint>, distlab_common::trace::ExperimentTrace) {
    let out = tempfile::tempdir().expect("temp dir");
    let stdout = run_worker_with_args(spec, Some(out.path()), None, &["--simulated-hosts", &hosts.to_string()]);
    let trace = std::fs::read_to_string(out.path().join("trace.json")).expect("trace.json");
    (parse_run_output_from(&stdout, 0, spec.train.steps), serde_json::from_str(&trace).expect("trace JSON"))
}

/// `distlab-worker run SPEC [--out DIR] [--checkpoint-dir DIR]`, which must succeed: its stdout.
fn run_worker(spec: &ExperimentSpec, out_dir: Option<&Path>, checkpoint_dir: Option<&Path>) -> String {
    run_worker_with_args(spec, out_dir, checkpoint_dir, &[])
}

fn run_worker_with_args(
    spec: &ExperimentSpec,
    out_dir: Option<&Path>,
    checkpoint_dir: Option<&Path>,
    extra: &[&str],
) -> String {
    run_worker_with_env(spec, out_dir, checkpoint_dir, extra, &[]).0
}

/// [`run_steps`] with `env` set for the worker and its rank processes: the metric points,
/// and what the run logged (its standard error).
pub fn run_steps_with_env(spec: &ExperimentSpec, env: &[(&str, &str)]) -> (Vec<MetricPoint>, String) {
    let (stdout, log) = run_worker_with_env(spec, None, None, &[], env);
    (parse_run_output_from(&stdout, 0, spec.train.steps), log)
}

fn run_worker_with_env(
    spec: &ExperimentSpec,
    out_dir: Option<&Path>,
    checkpoint_dir: Option<&Path>,
    extra: &[&str],
    env: &[(&str, &str)],
) -> (String, String) {
    let dir = tempfile::tempdir().expect("temp dir");
    let path = dir.path().join("spec.json");
    std::fs::write(&path, serde_json::to_string(spec).expect("spec JSON")).expect("write spec");
    let mut cmd = Command::new(bin_path("distlab-worker"));
    cmd.arg("run").arg(&path);
    if let Some(out_dir) = out_dir {
        cmd.arg("--out").arg(out_dir);
    }
    if let Some(dir) = checkpoint_dir {
        cmd.arg("--checkpoint-dir").arg(dir);
    }
    cmd.args(extra).envs(env.iter().copied());
    let out = cmd.output().expect("run distlab-worker");
    assert!(out.status.success(), "distlab-worker run failed: {}", String::from_utf8_lossy(&out.stderr));
    (String::from_utf8_lossy(&out.stdout).into_owned(), String::from_utf8_lossy(&out.stderr).into_owned())
}

/// Runs `distlab-worker run --checkpoint-dir DIR`: the spec's checkpoints are saved in DIR
/// (the latest stays after the run) and `train.resume_from` finds the other experiment's
/// next to it (`experiment-<id>`). One metric point per step it ran.
pub fn run_in_checkpoint_dir(spec: &ExperimentSpec, dir: &Path) -> Vec<MetricPoint> {
    worker_run_with(spec, None, Some(dir))
}

/// The metric points of `distlab-worker run`'s stdout, which must be exactly one point per
/// step (steps 0, 1, ... in order) and then one `{"summary": ...}` line: a line that is
/// neither, a missing or extra step, or a missing summary fails the test.
pub fn parse_run_output(stdout: &str, steps: u64) -> Vec<MetricPoint> {
    parse_run_output_from(stdout, 0, steps)
}

/// [`parse_run_output`] of a run that starts at step `first`: steps `first..steps`.
pub fn parse_run_output_from(stdout: &str, first: u64, steps: u64) -> Vec<MetricPoint> {
    let mut points = Vec::new();
    let mut summary = false;
    for line in stdout.lines().filter(|l| !l.trim().is_empty()) {
        assert!(!summary, "a line after the summary: {line}");
        let value: Value = serde_json::from_str(line).unwrap_or_else(|e| panic!("not JSON ({e}): {line}"));
        if value.get("summary").is_some() {
            summary = true;
            continue;
        }
        let point: MetricPoint =
            serde_json::from_value(value).unwrap_or_else(|e| panic!("not a metric point ({e}): {line}"));
        assert_eq!(point.step, first + points.len() as u64, "steps out of order: {line}");
        points.push(point);
    }
    assert!(summary, "no summary line in the output:\n{stdout}");
    assert_eq!(points.len() as u64, steps - first, "one metric point per step");
    points
}

/// Two runs' per-step losses agree within 1e-5 relative (strategies that sum in another
/// order, or carry the loss through an f32 all-reduce).
pub fn assert_same_losses(a: &[f64], b: &[f64], what: &str) {
    assert!(!a.is_empty(), "{what}: no steps");
    assert_eq!(a.len(), b.len(), "{what}: different numbers of steps");
    for (step, (x, y)) in a.iter().zip(b).enumerate() {
        let rel = (x - y).abs() / x.abs();
        assert!(rel < 1e-5, "{what} step {step}: loss {x} vs {y} ({rel:e})");
    }
}

/// Two runs are the same training: per step the same loss (1e-5 relative, as
/// [`assert_same_losses`]) AND the same gradient norm before clipping (2e-5 relative, seen up to 2.6e-6: the
/// norm is a sum of squares over every rank's shard, summed in f32 in another order, and
/// small norms late in a run lose more digits). The norm is what catches a gradient that is
/// off by a constant (a sum instead of a mean across ranks) which AdamW would all but hide.
pub fn assert_same_training(a: &[MetricPoint], b: &[MetricPoint], what: &str) {
    let losses = |m: &[MetricPoint]| m.iter().map(|p| p.loss).collect::<Vec<_>>();
    assert_same_losses(&losses(a), &losses(b), what);
    let mut worst = (0.0f64, 0.0f64);
    for (x, y) in a.iter().zip(b) {
        let rel = (x.grad_norm - y.grad_norm).abs() / x.grad_norm.abs();
        assert!(rel < 2e-5, "{what} step {}: gradient norm {} vs {} ({rel:e})", x.step, x.grad_norm, y.grad_norm);
        worst.0 = worst.0.max((x.loss - y.loss).abs() / x.loss.abs());
        worst.1 = worst.1.max(rel);
    }
    println!("{what}: largest relative difference {:.1e} in loss, {:.1e} in gradient norm", worst.0, worst.1);
}

/// The optimizers every equivalence test trains under: the spec's AdamW with clipping, and
/// plain SGD with weight decay 0.1 and no clipping, whose update is proportional to the
/// gradient (AdamW's is nearly blind to a gradient scaled by a constant; clipping too).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TestOptimizer {
    AdamwClipped,
    SgdWeightDecay,
}

pub const OPTIMIZERS: [TestOptimizer; 2] = [TestOptimizer::AdamwClipped, TestOptimizer::SgdWeightDecay];

impl TestOptimizer {
    /// `spec` trained with this optimizer.
    pub fn on(self, mut spec: ExperimentSpec) -> ExperimentSpec {
        if self == TestOptimizer::SgdWeightDecay {
            spec.train.optimizer = Optimizer::Sgd;
            spec.train.lr = 0.2;
            spec.train.weight_decay = 0.1;
            spec.train.grad_clip = 0.0;
        }
        spec
    }
}

/// Bytes rank 0 sent per step in collective `op`, from its trace's counters.
pub fn sent_per_step(
    trace: &distlab_common::trace::ExperimentTrace,
    op: distlab_common::trace::CollectiveOp,
    steps: u64,
) -> u64 {
    let counters = &trace.ranks[0].comm.counters;
    counters.iter().filter(|c| c.op == op).map(|c| c.bytes_sent).sum::<u64>() / steps
}

#[cfg(test)]
mod tests {
    use super::*;

    const TWO_STEPS: &str = r#"{"step":0,"loss":4.1,"lr":0.001,"grad_norm":1.5,"tokens_per_s":10.0,"step_ms":2.0}
{"step":1,"loss":4.0,"lr":0.001,"grad_norm":1.4,"tokens_per_s":10.0,"step_ms":2.0}
{"summary":{}}
"#;

    #[test]
    fn run_output_parses_one_point_per_step() {
        let points = parse_run_output(TWO_STEPS, 2);
        assert_eq!(points.iter().map(|p| p.grad_norm).collect::<Vec<_>>(), vec![1.5, 1.4]);
    }

    #[test]
    #[should_panic(expected = "not a metric point")]
    fn a_line_that_is_not_a_metric_point_fails() {
        parse_run_output(&TWO_STEPS.replace(r#""loss":4.0,"#, ""), 2);
    }

    #[test]
    #[should_panic(expected = "not JSON")]
    fn a_line_that_is_not_json_fails() {
        parse_run_output(&format!("warning: something\n{TWO_STEPS}"), 2);
    }

    #[test]
    #[should_panic(expected = "one metric point per step")]
    fn a_missing_step_fails() {
        parse_run_output(TWO_STEPS, 3);
    }

    #[test]
    #[should_panic(expected = "no summary line")]
    fn a_run_without_its_summary_fails() {
        parse_run_output(&TWO_STEPS.replace("{\"summary\":{}}", ""), 2);
    }

    #[test]
    #[should_panic(expected = "gradient norm")]
    fn training_with_a_gradient_twice_as_large_is_not_the_same() {
        let a = parse_run_output(TWO_STEPS, 2);
        let mut b = a.clone();
        b[1].grad_norm *= 2.0;
        assert_same_training(&a, &b, "doubled");
    }
}

/// Every rank's measured model state and communication buffers (their peaks) equal the
/// planner's for that rank.
pub fn assert_rank_memory_is_planned(spec: &ExperimentSpec, trace: &distlab_common::trace::ExperimentTrace) {
    let planned = distlab_common::planner::plan(spec).expect("a plan");
    for rank in &trace.ranks {
        let measured = rank.memory.clone().expect("a memory report").peak;
        let predicted = planned.rank_memory(spec, rank.rank as usize);
        for (what, m, p) in [
            ("parameters", measured.parameters, predicted.parameters),
            ("gradients", measured.gradients, predicted.gradients),
            ("optimizer state", measured.optimizer_state, predicted.optimizer_state),
            ("communication buffers", measured.comm_buffers, predicted.comm_buffers),
        ] {
            assert_eq!(m, p, "rank {}: {what}", rank.rank);
        }
    }
}
