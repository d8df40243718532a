//! Runs across real hosts, played by network namespaces on this machine (`netns.rs`: one
//! veth each into a switch, addresses that exist only inside them). The server runs in host
//! 0 (with accounts: it listens on a network address), a worker in each host announces that
//! it runs 2 ranks, and a 4-rank run is placed on both: its ranks find each other through
//! the server's rendezvous and talk over TCP between the hosts, shared memory inside one.
//!
//! Skipped, saying why, where namespaces cannot be made (not root, no iproute2).

use std::io::{BufRead, BufReader, Write};
use std::path::PathBuf;
use std::process::{Child, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use distlab_common::trace::{link_uses, ExperimentTrace};
use distlab_common::*;
use distlab_tests::netns::Hosts;
use distlab_tests::*;
use serde_json::{json, Value};

const PASSWORD: &str = "a password for the test";

/// A server in host 0 of `hosts` and a worker per host; everything stopped on drop.
struct Cluster {
    hosts: Hosts,
    base: String,
    cookie: String,
    dir: tempfile::TempDir,
    server: Child,
    /// Each host's worker (None once killed).
    workers: Vec<Option<Child>>,
    marker: String,
}

impl Cluster {
    /// Two hosts (each worker with the extra environment `env[h]`), or why not.
    fn start(test: &str, env: [&[(&str, &str)]; 2]) -> Option<Cluster> {
        let hosts = match Hosts::new(2) {
            Ok(hosts) => hosts,
            Err(why) => {
                eprintln!("skipped: cannot make network namespaces for the hosts here ({why})");
                return None;
            }
        };
        let dir = tempfile::tempdir().expect("temp dir");
        let data = dir.path().join("data");
        let mut add = std::process::Command::new(bin_path("distlab-server"))
            .args(["user", "add", "admin", "--admin", "--data-dir"])
            .arg(&data)
            .stdin(Stdio::piped())
            .stdout(Stdio::null())
            .spawn()
            .expect("distlab-server user add");
        writeln!(add.stdin.take().expect("stdin"), "{PASSWORD}").expect("the password");
        assert!(add.wait().expect("user add").success());
        let mut server = hosts
            .command(0, &bin_path("distlab-server"))
            .args(["--addr", &format!("{}:0", hosts.ips[0]), "--auth", "accounts", "--local-workers", "0"])
            .args(["--lease-seconds", "10", "--heartbeat-seconds", "1", "--data-dir"])
            .arg(&data)
            .arg("--static-dir")
            .arg(repo_root().join("target/site"))
            .env("DISTLAB_WORKER_TOKEN", WORKER_TOKEN)
            .env("RUST_LOG", "info")
            .stdout(Stdio::piped())
            .spawn()
            .expect("start distlab-server in host 0");
        let (tx, rx) = mpsc::channel();
        let stdout = server.stdout.take().expect("stdout");
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                if let Some(rest) = line.split("ready at ").nth(1) {
                    let _ = tx.send(rest.trim().trim_end_matches('/').to_string());
                }
            }
        });
        let base = rx.recv_timeout(Duration::from_secs(30)).expect("the server's URL");
        let marker = format!("namespaces-{}-{test}", std::process::id());
        let mut cluster = Cluster { hosts, base, cookie: String::new(), dir, server, workers: Vec::new(), marker };
        cluster.sign_in();
        for (h, env) in env.iter().enumerate() {
            let worker = cluster.worker(h, env);
            cluster.workers.push(Some(worker));
        }
        cluster.wait_for_workers(2);
        Some(cluster)
    }

    /// Until the server has heard from `n` workers.
    fn wait_for_workers(&self, n: u64) {
        let deadline = Instant::now() + Duration::from_secs(30);
        while self.get::<Value>("/api/health")["workers"].as_u64() < Some(n) {
            assert!(Instant::now() < deadline, "the workers did not register");
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    fn checkpoints(&self) -> PathBuf {
        self.dir.path().join("checkpoints")
    }

    /// A worker in host `h` that runs 2 ranks; every worker shares one checkpoint
    /// directory (as workers on shared storage would).
    fn worker(&self, h: usize, env: &[(&str, &str)]) -> Child {
        self.hosts
            .command(h, &bin_path("distlab-worker"))
            .args(["--server", &self.base, "--name", &format!("host-{h}"), "--ranks", "2", "--give-up-seconds", "10"])
            .arg("--checkpoint-dir")
            .arg(self.checkpoints())
            .arg("--offload-dir")
            .arg(self.dir.path().join("offload"))
            .env("DISTLAB_WORKER_TOKEN", WORKER_TOKEN)
            .env("DISTLAB_TEST_MARKER", format!("{}-host-{h}", self.marker))
            .envs(env.iter().copied())
            .spawn()
            .expect("start distlab-worker")
    }

    fn restart_worker(&mut self, h: usize) {
        self.workers[h] = Some(self.worker(h, &[]));
    }

    fn kill_worker(&mut self, h: usize) {
        if let Some(mut w) = self.workers[h].take() {
            let _ = w.kill();
            let _ = w.wait();
        }
    }

    /// The rank processes still running in host `h`.
    fn ranks_in(&self, h: usize) -> Vec<u32> {
        processes_with(&format!("{}-host-{h}", self.marker), "rank\0--rank")
    }

    /// An HTTP call from inside host 0 (the server's address exists only there).
    fn call(&self, method: &str, path: &str, body: Option<&Value>) -> (u16, Value, Option<String>) {
        let url = format!("{}{path}", self.base);
        let cookie = self.cookie.clone();
        self.hosts.inside(0, move || {
            let agent = http_agent();
            let resp = match (method, body) {
                ("POST", Some(body)) => agent.post(&url).header("Cookie", &cookie).send_json(body),
                _ => agent.get(&url).header("Cookie", &cookie).call(),
            };
            let mut resp = resp.unwrap_or_else(|e| panic!("{method} {url}: {e}"));
            let status = resp.status().as_u16();
            let set_cookie = resp.headers().get("set-cookie").and_then(|v| v.to_str().ok()).map(str::to_string);
            let text = resp.body_mut().read_to_string().unwrap_or_default();
            (status, serde_json::from_str(&text).unwrap_or(Value::Null), set_cookie)
        })
    }

    fn sign_in(&mut self) {
        let (status, body, cookie) =
            self.call("POST", "/api/session", Some(&json!({"name": "admin", "password": PASSWORD})));
        assert_eq!(status, 200, "sign in: {body}");
        let cookie = cookie.expect("a session cookie");
        self.cookie = cookie.split(';').next().unwrap_or_default().to_string();
    }

    fn get<T: serde::de::DeserializeOwned>(&self, path: &str) -> T {
        let (status, body, _) = self.call("GET", path, None);
        assert_eq!(status, 200, "GET {path}: {body}");
        serde_json::from_value(body).unwrap_or_else(|e| panic!("GET {path}: {e}"))
    }

    fn submit(&self, spec: &ExperimentSpec) -> i64 {
        let (status, body, _) = self.call("POST", "/api/experiments", Some(&serde_json::to_value(spec).unwrap()));
        assert_eq!(status, 201, "submit: {body}");
        body["id"].as_i64().expect("id")
    }

    fn wait_for(&self, id: i64, timeout: Duration, done: impl Fn(&ExperimentView) -> bool) -> ExperimentView {
        let start = Instant::now();
        loop {
            let view: ExperimentView = self.get(&format!("/api/experiments/{id}"));
            if done(&view) {
                return view;
            }
            assert!(start.elapsed() < timeout, "waited {timeout:?} on experiment {id}: {view:?}");
            std::thread::sleep(Duration::from_millis(200));
        }
    }

    /// Runs `spec` to the end; its metric points and trace.
    fn run(&self, spec: &ExperimentSpec) -> (Vec<MetricPoint>, ExperimentTrace) {
        let id = self.submit(spec);
        let view = self.wait_for(id, Duration::from_secs(180), |e| e.status.is_finished());
        assert_eq!(view.status, ExperimentStatus::Succeeded, "{}: {:?}", spec.name, view.error);
        let metrics: Metrics = self.get(&format!("/api/experiments/{id}/metrics"));
        (metrics.steps, self.get(&format!("/api/experiments/{id}/trace")))
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        for h in 0..self.workers.len() {
            self.kill_worker(h);
        }
        let _ = self.server.kill();
        let _ = self.server.wait();
    }
}

fn losses(points: &[MetricPoint]) -> Vec<f64> {
    points.iter().map(|m| m.loss).collect()
}

/// A dp=4 run (2 + 2 ranks) and a tp=2 x pp=2 run (each TP pair in one host, the pipeline
/// between them) train across the two hosts exactly as on one.
#[test]
fn runs_across_two_namespace_hosts_train_as_on_one() {
    let _one = one_at_a_time();
    let Some(cluster) = Cluster::start("same-losses", [&[], &[]]) else { return };
    let mut dp4 = quick_spec("dp4 across hosts", 6);
    (dp4.parallel.dp, dp4.train.micro_batch) = (4, 2);
    let mut tp_pp = quick_spec("tp2 x pp2 across hosts", 6);
    (tp_pp.parallel.tp, tp_pp.parallel.pp, tp_pp.train.micro_batches) = (2, 2, 2);
    for spec in [dp4, tp_pp] {
        let (points, trace) = cluster.run(&spec);
        assert_eq!(losses(&points), losses(&run_steps(&spec)), "{}", spec.name);
        let hosts: Vec<Option<u32>> = trace.ranks.iter().map(|r| r.host).collect();
        assert_eq!(hosts, [Some(0), Some(0), Some(1), Some(1)], "{}", spec.name);
        if spec.parallel.dp > 1 {
            assert!(link_uses(&trace).iter().any(|l| l.crosses_hosts), "{}: no step crossed hosts", spec.name);
        }
    }
}

/// The worker of the run's second host is killed while its rank hangs in the middle of a
/// run: within seconds the first host's ranks see their peers gone, the run goes back to the
/// queue, and no rank process is left on either host. New workers then resume it from its
/// latest checkpoint, and it ends with the losses of an uninterrupted run.
#[test]
fn a_killed_hosts_worker_ends_the_attempt_on_both_and_the_run_resumes_from_its_checkpoint() {
    let _one = one_at_a_time();
    // Rank 2 hangs after step 7, so that the kill comes in the middle of the run. Whichever
    // worker asks first leases the run as its host 0: the other (the one with rank 2) is killed.
    let fault: &[(&str, &str)] = &[("DISTLAB_FAULT", "2:7:hang")];
    let Some(mut cluster) = Cluster::start("kill", [fault, fault]) else { return };
    let mut spec = quick_spec("dp4 across hosts, one killed", 12);
    (spec.parallel.dp, spec.train.micro_batch, spec.train.checkpoint_every) = (4, 2, 2);
    let id = cluster.submit(&spec);
    cluster.wait_for(id, Duration::from_secs(120), |e| e.steps_done >= 7);
    let attempts: Attempts = cluster.get(&format!("/api/experiments/{id}/attempts"));
    let leased_by = attempts.attempts[0].worker.clone().unwrap_or_default();
    let member = if leased_by == "host-0" { 1 } else { 0 };
    let killed = Instant::now();
    cluster.kill_worker(member);
    let requeued = cluster.wait_for(id, Duration::from_secs(30), |e| e.status != ExperimentStatus::Running);
    let ended_after = killed.elapsed();
    assert_eq!((requeued.status, requeued.attempt), (ExperimentStatus::Queued, 1), "{:?}", requeued.error);
    eprintln!("the attempt ended on both hosts {:.1} s after host 1's worker was killed", ended_after.as_secs_f64());
    let deadline = Instant::now() + Duration::from_secs(10);
    while !(cluster.ranks_in(0).is_empty() && cluster.ranks_in(1).is_empty()) {
        let describe = |pids: Vec<u32>| -> Vec<String> {
            pids.iter()
                .map(|p| {
                    String::from_utf8_lossy(&std::fs::read(format!("/proc/{p}/cmdline")).unwrap_or_default())
                        .replace('\0', " ")
                })
                .collect()
        };
        assert!(
            Instant::now() < deadline,
            "rank processes left: host 0 {:?}, host 1 {:?}",
            describe(cluster.ranks_in(0)),
            describe(cluster.ranks_in(1))
        );
        std::thread::sleep(Duration::from_millis(100));
    }

    // (the surviving worker would hang rank 2 again: it is replaced by one without the fault)
    cluster.kill_worker(1 - member);
    cluster.restart_worker(0);
    cluster.restart_worker(1);
    let view = cluster.wait_for(id, Duration::from_secs(180), |e| e.status.is_finished());
    assert_eq!(view.status, ExperimentStatus::Succeeded, "{:?}", view.error);
    let attempts: Attempts = cluster.get(&format!("/api/experiments/{id}/attempts"));
    let resumed = attempts.attempts.last().and_then(|a| a.from_step).unwrap_or(0);
    assert!(attempts.attempts.len() == 2 && (2..=8).contains(&resumed), "{attempts:?}");
    let metrics: Metrics = cluster.get(&format!("/api/experiments/{id}/metrics"));
    assert_eq!(losses(&metrics.steps), losses(&run_steps(&spec)), "resumed across hosts as if never stopped");
}
