//! `cargo xtask load`'s last phases: what one stranger on the network tries against a class
//! server, measured.
//!
//! - Slow clients: 1,100 connections that send a request line and never finish their
//!   headers; meanwhile a normal request is timed, then how long the server takes to close
//!   them all (its header timeout).
//! - A sign-in flood, which needs no account: 128 clients, each from its own loopback
//!   address, try 4 names that do not exist, against a server with `--auth accounts`; the
//!   answers, the server's peak memory and the health check's latency meanwhile.

use std::io::{BufRead, Read, Write};
use std::net::{Ipv4Addr, TcpStream};
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};

use crate::load_server::{add_account, connect_from, Server};

const SLOW_CLIENTS: usize = 1100;
const FLOOD_CLIENTS: u8 = 128;
const FLOOD_TRIES: usize = 4;

pub fn slow_clients(server: &Server) -> Result<()> {
    raise_descriptor_limit(2 * SLOW_CLIENTS as u64 + 512)?;
    let opened = Instant::now();
    let slow: Vec<TcpStream> = (0..SLOW_CLIENTS)
        .map(|_| {
            let mut s = TcpStream::connect(server.addr)?;
            s.write_all(b"GET /api/health HTTP/1.1\r\nHost: 127.0.0.1\r\n")?;
            Ok(s)
        })
        .collect::<Result<_>>()
        .context("opening the slow connections")?;
    let mut latencies: Vec<Duration> = (0..20)
        .map(|_| {
            let sent = Instant::now();
            let ok = health(&server.base);
            std::thread::sleep(Duration::from_millis(50));
            ok.map(|()| sent.elapsed())
        })
        .collect::<Result<_>>()?;
    latencies.sort();
    let mut closed_after = Duration::ZERO;
    for mut s in slow {
        s.set_read_timeout(Some(Duration::from_secs(60)))?;
        let mut rest = Vec::new();
        match s.read_to_end(&mut rest) {
            Err(e) if matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut) => {
                bail!("a slow connection was still open after 60 s")
            }
            _ => closed_after = closed_after.max(opened.elapsed()),
        }
    }
    println!(
        "slow clients: {SLOW_CLIENTS} connections that never finish their headers; GET /api/health meanwhile: p50 \
         {:.1} ms, max {:.1} ms (20 requests); the server closed all of them {:.1} s after they opened",
        latencies[latencies.len() / 2].as_secs_f64() * 1e3,
        latencies[latencies.len() - 1].as_secs_f64() * 1e3,
        closed_after.as_secs_f64()
    );
    Ok(())
}

pub fn sign_in_flood(data: &Path) -> Result<()> {
    add_account(data, "ada", "correct horse")?;
    let server = Server::start_with(data, None, &["--auth", "accounts"])?;
    let pid = server.process.id();
    let before = peak_resident_bytes(pid)?;
    let flooding = AtomicBool::new(true);
    let started = Instant::now();
    let (statuses, mut health_latencies) = std::thread::scope(|s| {
        let clients: Vec<_> = (0..FLOOD_CLIENTS)
            .map(|c| {
                s.spawn(move || {
                    let source = Ipv4Addr::new(127, 0, 1, c + 1);
                    (0..FLOOD_TRIES)
                        .map(|t| {
                            let body = format!(r#"{{"name": "stranger-{c}-{t}", "password": "a guess"}}"#);
                            sign_in_from(source, server.addr, &body)
                        })
                        .collect::<Vec<u16>>()
                })
            })
            .collect();
        let probe = s.spawn(|| {
            let mut latencies = Vec::new();
            while flooding.load(Ordering::Relaxed) {
                let sent = Instant::now();
                if health(&server.base).is_ok() {
                    latencies.push(sent.elapsed());
                }
                std::thread::sleep(Duration::from_millis(50));
            }
            latencies
        });
        let statuses: Vec<u16> = clients.into_iter().flat_map(|c| c.join().unwrap_or_default()).collect();
        flooding.store(false, Ordering::Relaxed);
        (statuses, probe.join().unwrap_or_default())
    });
    let took = started.elapsed();
    let peak = peak_resident_bytes(pid)?;
    health_latencies.sort();
    let count = |code: u16| statuses.iter().filter(|&&s| s == code).count();
    let other = statuses.len() - count(401) - count(429) - count(503);
    let ada = sign_in_from(Ipv4Addr::new(127, 0, 2, 1), server.addr, r#"{"name": "ada", "password": "correct horse"}"#);
    let ms = |d: Option<&Duration>| d.map_or(f64::NAN, |d| d.as_secs_f64() * 1e3);
    println!(
        "sign-in flood: {} attempts from {FLOOD_CLIENTS} addresses in {:.1} s: 401 wrong {}, 503 busy {}, 429 \
         throttled {}, other {other}; server peak memory {:.0} MB (before {:.0} MB); GET /api/health meanwhile: \
         p50 {:.1} ms, max {:.1} ms ({} requests); the real account then signs in: {ada}",
        statuses.len(),
        took.as_secs_f64(),
        count(401),
        count(503),
        count(429),
        peak as f64 / 1e6,
        before as f64 / 1e6,
        ms(health_latencies.get(health_latencies.len() / 2)),
        ms(health_latencies.last()),
        health_latencies.len()
    );
    Ok(())
}

/// `POST /api/session` with `body` from `source`; the status (0: no answer).
fn sign_in_from(source: Ipv4Addr, to: std::net::SocketAddr, body: &str) -> u16 {
    let Ok(mut s) = connect_from(source, to) else { return 0 };
    let _ = s.set_read_timeout(Some(Duration::from_secs(60)));
    let request = format!(
        "POST /api/session HTTP/1.1\r\nHost: {to}\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\
         Connection: close\r\n\r\n{body}",
        body.len()
    );
    if s.write_all(request.as_bytes()).is_err() {
        return 0;
    }
    let mut status_line = String::new();
    let _ = std::io::BufReader::new(s).read_line(&mut status_line);
    status_line.get(9..12).and_then(|code| code.parse().ok()).unwrap_or(0)
}

fn health(base: &str) -> Result<()> {
    let agent: ureq::Agent = ureq::Agent::config_builder().timeout_global(Some(Duration::from_secs(30))).build().into();
    agent.get(format!("{base}/api/health")).call().context("GET /api/health")?;
    Ok(())
}

/// The peak resident memory of process `pid` (VmHWM), in bytes.
fn peak_resident_bytes(pid: u32) -> Result<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
    let kib: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .context("no VmHWM")?;
    Ok(kib * 1024)
}

/// Raises this process's soft limit of open descriptors towards its hard limit; an error
/// when even the hard limit is below `needed`.
fn raise_descriptor_limit(needed: u64) -> Result<()> {
    let mut limit = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: the calls read and write only the struct they are given.
    unsafe {
        libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit);
        limit.rlim_cur = limit.rlim_max;
        libc::setrlimit(libc::RLIMIT_NOFILE, &limit);
    }
    if limit.rlim_max < needed {
        bail!("the slow-client phase needs {needed} open descriptors; the hard limit here is {}", limit.rlim_max);
    }
    Ok(())
}
