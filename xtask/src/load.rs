//! `cargo xtask load`: a small load generator against a release server it starts on
//! 127.0.0.1 (temporary data directory, no workers, one person with a large quota).
//!
//! In one run: requests per second and latency percentiles at N connections for the
//! experiment list, one experiment, the planner and submissions; then S live streams
//! (SSE) held at once, from several loopback source addresses as a class's machines would
//! be, every one of them receiving the event that ends it; the two reads again on a server
//! with accounts, each request carrying a session; then what one stranger tries
//! (`abuse.rs`): slow clients, and a sign-in flood against a server with accounts. Each
//! loop is bounded in time and in count. The generator shares the machine with the server: the figures are the
//! two together.
//!
//! `--stores`: submissions and worker leases on the embedded SQLite, then on a throwaway
//! PostgreSQL cluster (`postgres.rs`), the same phases one after the other in one run.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{Ipv4Addr, TcpStream};
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use serde_json::{json, Value};

use crate::load_server::{connect_from, Server};

pub struct LoadOptions {
    pub seconds: f64,
    pub connections: usize,
    pub streams: usize,
    /// Instead: submissions and leases on SQLite, then on a throwaway PostgreSQL cluster.
    pub stores: bool,
}

/// Each connection makes at most this many requests per phase, whatever the time left.
const MAX_REQUESTS_PER_CONNECTION: usize = 100_000;
/// Streams opened from one source address (a class's machines; the server counts streams
/// by account, and the load's one user is allowed as many as it opens).
const STREAMS_PER_SOURCE: usize = 25;

pub fn run(opts: &LoadOptions) -> Result<()> {
    if opts.connections == 0 || opts.streams == 0 || !(opts.seconds > 0.0 && opts.seconds <= 600.0) {
        bail!("--connections and --streams must be at least 1, --seconds above 0 and at most 600");
    }
    crate::status(crate::cargo().args(["build", "--release", "-p", "distlab-server"]))?;
    if opts.stores {
        return stores(opts);
    }
    let data = std::env::temp_dir().join(format!("distlab-load-{}", std::process::id()));
    let server = Server::start(&data, None)?;
    let result = drive(&server, opts);
    drop(server);
    let _ = std::fs::remove_dir_all(&data);
    result?;
    signed_in_reads(opts)?;
    let server = Server::start(&data, None)?;
    let result = crate::abuse::slow_clients(&server);
    drop(server);
    let _ = std::fs::remove_dir_all(&data);
    result?;
    let data = std::env::temp_dir().join(format!("distlab-load-{}-accounts", std::process::id()));
    let result = crate::abuse::sign_in_flood(&data);
    let _ = std::fs::remove_dir_all(&data);
    result
}

/// Workers leasing at once in the lease phase, and the queue they lease from.
const LEASING_WORKERS: usize = 8;
const QUEUED_FOR_LEASES: usize = 600;

/// Submissions and leases, on the embedded SQLite and on PostgreSQL, in one run.
fn stores(opts: &LoadOptions) -> Result<()> {
    let cluster = crate::postgres::start().context("a PostgreSQL cluster for the comparison")?;
    println!(
        "xtask load --stores: {} connections submitting, {LEASING_WORKERS} workers leasing, {:.0} s per phase ({} cores \
         here, shared with the generator and the database)",
        opts.connections,
        opts.seconds,
        std::thread::available_parallelism().map_or(1, |n| n.get())
    );
    println!("(leases from a queue of {QUEUED_FOR_LEASES} experiments on a fresh store, until it is empty)");
    println!(
        "{:<10} {:<24} {:>9} {:>9} {:>9} {:>9} {:>7}",
        "store", "", "requests", "per s", "p50 ms", "p99 ms", "failed"
    );
    for (store, url) in [("sqlite", None), ("postgres", Some(cluster.url.as_str()))] {
        let data = std::env::temp_dir().join(format!("distlab-load-{}-{store}", std::process::id()));
        let server = Server::start(&data, url)?;
        let spec = json!({"name": "load", "train": {"steps": 10}});
        let submitted = hammer(&server, &Request::Post("/api/experiments".into(), spec.clone()), opts)?;
        drop(server);
        let _ = std::fs::remove_dir_all(&data);
        // Leases from a class's full queue (30 people x 20 experiments), on a fresh store.
        if let Some(url) = url {
            crate::postgres::recreate(url)?;
        }
        let server = Server::start(&data, url)?;
        for _ in 0..QUEUED_FOR_LEASES {
            submit(&server, &spec)?;
        }
        let leased = leases(&server.base, opts)?;
        for (what, m) in [("POST /api/experiments", &submitted), ("POST /api/workers/lease", &leased)] {
            println!(
                "{store:<10} {what:<24} {:>9} {:>9.0} {:>9.2} {:>9.2} {:>7}",
                m.latencies.len(),
                m.per_second(),
                m.percentile_ms(0.50),
                m.percentile_ms(0.99),
                m.failed
            );
        }
        drop(server);
        let _ = std::fs::remove_dir_all(&data);
    }
    Ok(())
}

/// LEASING_WORKERS registered workers lease back to back for `opts.seconds`, or until the
/// queue is empty: each answer that hands over an experiment is timed (a worker may hold
/// many here: the run is never started).
fn leases(base: &str, opts: &LoadOptions) -> Result<Measured> {
    let credentials: Vec<(i64, String)> = (0..LEASING_WORKERS)
        .map(|i| {
            let body = json!({"name": format!("load-{i}"), "backends": ["cpu"], "devices": [], "version": "load"});
            let mut resp = agent()
                .post(format!("{base}/api/workers/register"))
                .header("Authorization", "Bearer load-test-token")
                .send_json(&body)?;
            let answer: Value = serde_json::from_str(&resp.body_mut().read_to_string()?)?;
            match (answer["worker_id"].as_i64(), answer["credential"].as_str()) {
                (Some(id), Some(credential)) => Ok((id, credential.to_string())),
                _ => bail!("registering a worker: {answer}"),
            }
        })
        .collect::<Result<_>>()?;
    timed(LEASING_WORKERS, Duration::from_secs_f64(opts.seconds), |worker, agent| {
        let (id, credential) = &credentials[worker];
        let answer = agent
            .post(format!("{base}/api/workers/lease"))
            .header("Authorization", &format!("Bearer {credential}"))
            .send_json(json!({"worker_id": id}));
        match answer.map(|r| r.status().as_u16()) {
            Ok(200) => Answer::Done,
            Ok(204) => Answer::Stop, // the queue is empty
            _ => Answer::Failed,
        }
    })
}

/// What one timed request came to.
enum Answer {
    Done,
    Failed,
    /// Failed, and this connection stops.
    Stop,
}

/// `connections` threads, each with its own kept-alive connection, call `request(i, agent)`
/// back to back for `duration` (the leases, each worker with its own credential) (at most MAX_REQUESTS_PER_CONNECTION times each); the
/// latency of every request that was done.
fn timed(
    connections: usize,
    duration: Duration,
    request: impl Fn(usize, &ureq::Agent) -> Answer + Sync,
) -> Result<Measured> {
    let start = Arc::new(Barrier::new(connections + 1));
    let request = &request;
    let (elapsed, results) = std::thread::scope(|scope| {
        let workers: Vec<_> = (0..connections)
            .map(|i| {
                let start = start.clone();
                scope.spawn(move || {
                    let agent = agent();
                    let (mut latencies, mut failed) = (Vec::new(), 0);
                    start.wait();
                    let until = Instant::now() + duration;
                    while Instant::now() < until && latencies.len() + failed < MAX_REQUESTS_PER_CONNECTION {
                        let sent = Instant::now();
                        match request(i, &agent) {
                            Answer::Done => latencies.push(sent.elapsed()),
                            Answer::Failed => failed += 1,
                            Answer::Stop => break,
                        }
                    }
                    (latencies, failed)
                })
            })
            .collect();
        start.wait();
        let began = Instant::now();
        let results: Vec<_> = workers.into_iter().map(|w| w.join()).collect();
        (began.elapsed(), results)
    });
    let mut measured = Measured { latencies: Vec::new(), failed: 0, elapsed };
    for result in results {
        let (latencies, failed) = result.map_err(|_| anyhow::anyhow!("a load thread panicked"))?;
        measured.latencies.extend(latencies);
        measured.failed += failed;
    }
    measured.latencies.sort();
    Ok(measured)
}

fn drive(server: &Server, opts: &LoadOptions) -> Result<()> {
    let spec = json!({"name": "load", "train": {"steps": 10}});
    let seeded: Vec<i64> = (0..100).map(|_| submit(server, &spec)).collect::<Result<_>>()?;
    let one = format!("/api/experiments/{}", seeded[seeded.len() / 2]);
    let plan = json!({"name": "plan", "parallel": {"dp": 2, "tp": 2}, "model": {"layers": 8}});
    println!(
        "xtask load: {} connections, {:.0} s per phase, against {} ({} cores here, shared with the generator)",
        opts.connections,
        opts.seconds,
        server.base,
        std::thread::available_parallelism().map_or(1, |n| n.get())
    );
    println!(
        "{:<37} {:>9} {:>9} {:>9} {:>9} {:>9} {:>7}",
        "", "requests", "req/s", "p50 ms", "p99 ms", "max ms", "non-2xx"
    );
    let phases: [(&str, Request); 4] = [
        ("GET /api/experiments", Request::Get("/api/experiments".into())),
        ("GET /api/experiments/{id}", Request::Get(one)),
        ("POST /api/plan", Request::Post("/api/plan".into(), plan)),
        ("POST /api/experiments", Request::Post("/api/experiments".into(), spec)),
    ];
    for (name, request) in phases {
        print_row(name, &hammer(server, &request, opts)?);
    }
    streams(server, seeded[0], opts.streams)
}

/// The reads again on a server with accounts, as a class's is: every request carries a
/// session cookie, which the server looks up.
fn signed_in_reads(opts: &LoadOptions) -> Result<()> {
    let data = std::env::temp_dir().join(format!("distlab-load-{}-signed-in", std::process::id()));
    let result = (|| {
        let server = Server::start_signed_in(&data)?;
        let spec = json!({"name": "load", "train": {"steps": 10}});
        let seeded: Vec<i64> = (0..100).map(|_| submit(&server, &spec)).collect::<Result<_>>()?;
        let one = format!("/api/experiments/{}", seeded[seeded.len() / 2]);
        for (name, request) in [
            ("GET /api/experiments", Request::Get("/api/experiments".into())),
            ("GET /api/experiments/{id}", Request::Get(one)),
        ] {
            print_row(&format!("{name}, signed in"), &hammer(&server, &request, opts)?);
        }
        Ok(())
    })();
    let _ = std::fs::remove_dir_all(&data);
    result
}

fn print_row(name: &str, measured: &Measured) {
    println!(
        "{name:<37} {:>9} {:>9.0} {:>9.2} {:>9.2} {:>9.2} {:>7}",
        measured.latencies.len(),
        measured.per_second(),
        measured.percentile_ms(0.50),
        measured.percentile_ms(0.99),
        measured.percentile_ms(1.0),
        measured.failed
    );
}

enum Request {
    Get(String),
    Post(String, Value),
}

struct Measured {
    latencies: Vec<Duration>,
    failed: usize,
    elapsed: Duration,
}

impl Measured {
    fn per_second(&self) -> f64 {
        self.latencies.len() as f64 / self.elapsed.as_secs_f64()
    }

    fn percentile_ms(&self, q: f64) -> f64 {
        if self.latencies.is_empty() {
            return f64::NAN;
        }
        let i = ((self.latencies.len() - 1) as f64 * q).round() as usize;
        self.latencies[i].as_secs_f64() * 1e3
    }
}

/// `opts.connections` connections make `request` back to back for `opts.seconds` (with the
/// server's session, if it has one), all on one thread (`load_client.rs`).
fn hammer(server: &Server, request: &Request, opts: &LoadOptions) -> Result<Measured> {
    let cookie = server.session.as_ref().map(|c| format!("Cookie: {c}\r\n")).unwrap_or_default();
    let host = server.addr;
    let bytes = match request {
        Request::Get(path) => format!("GET {path} HTTP/1.1\r\nHost: {host}\r\n{cookie}\r\n"),
        Request::Post(path, body) => {
            let body = body.to_string();
            format!(
                "POST {path} HTTP/1.1\r\nHost: {host}\r\n{cookie}Content-Type: application/json\r\n\
                 Content-Length: {}\r\n\r\n{body}",
                body.len()
            )
        }
    };
    let duration = Duration::from_secs_f64(opts.seconds);
    let timed = crate::load_client::run(
        server.addr,
        bytes.as_bytes(),
        opts.connections,
        duration,
        MAX_REQUESTS_PER_CONNECTION,
    )?;
    Ok(Measured { latencies: timed.latencies, failed: timed.failed, elapsed: timed.elapsed })
}

/// Opens `count` live streams of a queued experiment (STREAMS_PER_SOURCE per loopback
/// source address), holds them until every one has its first event, cancels the experiment
/// and times how long until every stream has the event that ends it.
fn streams(server: &Server, experiment: i64, count: usize) -> Result<()> {
    let port = server.addr.port();
    let request = format!(
        "GET /api/experiments/{experiment}/stream HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nAccept: text/event-stream\r\n\r\n"
    );
    let opening = Instant::now();
    let opened: Vec<Result<TcpStream>> = (0..count)
        .map(|i| {
            let source = Ipv4Addr::new(127, 0, 0, 2 + (i / STREAMS_PER_SOURCE) as u8);
            let mut stream = connect_from(source, server.addr)?;
            stream.write_all(request.as_bytes())?;
            Ok(stream)
        })
        .collect();
    let streams: Vec<TcpStream> = opened.into_iter().collect::<Result<_>>()?;
    let (ready_tx, ready_rx) = std::sync::mpsc::channel::<Result<()>>();
    let (ended_tx, ended_rx) = std::sync::mpsc::channel::<Result<Instant>>();
    let readers: Vec<_> = streams
        .into_iter()
        .map(|stream| {
            let (ready, ended) = (ready_tx.clone(), ended_tx.clone());
            std::thread::Builder::new().stack_size(64 << 10).spawn(move || follow(stream, ready, ended))
        })
        .collect::<std::io::Result<_>>()
        .context("cannot start a stream reader")?;
    drop((ready_tx, ended_tx));
    for _ in 0..count {
        ready_rx.recv_timeout(Duration::from_secs(60)).context("a stream had no first event within 60 s")??;
    }
    let held_after = opening.elapsed();
    let sources = count.div_ceil(STREAMS_PER_SOURCE);
    std::thread::sleep(Duration::from_secs(2));
    let cancelled = Instant::now();
    let (status, body) = post(server, &format!("/api/experiments/{experiment}/cancel"), &json!({}))?;
    if status != 200 {
        bail!("cancelling the watched experiment: {status} {body}");
    }
    let mut slowest = Duration::ZERO;
    for _ in 0..count {
        let at = ended_rx.recv_timeout(Duration::from_secs(60)).context("a stream missed the cancel within 60 s")??;
        slowest = slowest.max(at.saturating_duration_since(cancelled));
    }
    for reader in readers {
        let _ = reader.join();
    }
    println!(
        "{count} live streams from {sources} loopback addresses: all open with their first event after {:.2} s, \
         held 2 s, all had the cancel {:.1} ms after it was made",
        held_after.as_secs_f64(),
        slowest.as_secs_f64() * 1e3
    );
    Ok(())
}

/// Reads one stream: says when its HTTP 200 and first event came, then when the event that
/// ends it ("cancelled") came.
fn follow(
    stream: TcpStream,
    ready: std::sync::mpsc::Sender<Result<()>>,
    ended: std::sync::mpsc::Sender<Result<Instant>>,
) {
    let _ = stream.set_read_timeout(Some(Duration::from_secs(90)));
    let mut reader = BufReader::new(stream);
    let mut status = String::new();
    if reader.read_line(&mut status).is_err() || !status.contains(" 200 ") {
        let _ = ready.send(Err(anyhow::anyhow!("a stream was answered {}", status.trim())));
        return;
    }
    let (mut line, mut said_ready) = (String::new(), false);
    loop {
        line.clear();
        match reader.read_line(&mut line) {
            Ok(0) | Err(_) => {
                let _ = ended.send(Err(anyhow::anyhow!("a stream closed before the cancel")));
                return;
            }
            Ok(_) => {}
        }
        if !said_ready && line.starts_with("event:") {
            said_ready = true;
            let _ = ready.send(Ok(()));
        } else if line.contains("cancelled") {
            let _ = ended.send(Ok(Instant::now()));
            return;
        }
    }
}

fn agent() -> ureq::Agent {
    ureq::Agent::config_builder()
        .http_status_as_error(false)
        .timeout_global(Some(Duration::from_secs(30)))
        .build()
        .into()
}

fn post(server: &Server, path: &str, body: &Value) -> Result<(u16, Value)> {
    let cookie = server.session.as_deref().unwrap_or("");
    let mut resp = agent().post(format!("{}{path}", server.base)).header("Cookie", cookie).send_json(body)?;
    let status = resp.status().as_u16();
    let mut text = String::new();
    resp.body_mut().as_reader().read_to_string(&mut text)?;
    Ok((status, serde_json::from_str(&text).unwrap_or(Value::String(text))))
}

fn submit(server: &Server, spec: &Value) -> Result<i64> {
    let (status, body) = post(server, "/api/experiments", spec)?;
    match (status, body["id"].as_i64()) {
        (201, Some(id)) => Ok(id),
        _ => bail!("seeding: a submission was answered {status} {body}"),
    }
}
