//! The `distlab-server` binary: the ready line with the bound port, and a readable bind error.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::process::{Command, Stdio};
use std::time::Duration;

const BIN: &str = env!("CARGO_BIN_EXE_distlab-server");

/// Kills the child when the test ends, whatever happens.
struct Running(std::process::Child);

impl Drop for Running {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn http_get(addr: &str, path: &str) -> String {
    let mut s = TcpStream::connect(addr).expect("connect");
    s.set_read_timeout(Some(Duration::from_secs(10))).expect("timeout");
    write!(s, "GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n").expect("write");
    let mut out = String::new();
    s.read_to_string(&mut out).expect("read");
    out
}

#[test]
fn prints_the_bound_port_and_serves() {
    let dir = tempfile::tempdir().expect("temp dir");
    let child = Command::new(BIN)
        .args(["--addr", "127.0.0.1:0", "--local-workers", "0"])
        .env("DISTLAB_WORKER_TOKEN", "t")
        .arg("--data-dir")
        .arg(dir.path().join("data"))
        .arg("--static-dir")
        .arg(dir.path().join("site"))
        .env_remove("DISTLAB_ADDR")
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("start the server");
    let mut child = Running(child);
    let stdout = child.0.stdout.take().expect("stdout");
    let mut line = String::new();
    BufReader::new(stdout).read_line(&mut line).expect("ready line");
    let url = line.trim().strip_prefix("distlab is ready at ").unwrap_or_else(|| panic!("unexpected line {line:?}"));
    let addr = url.strip_prefix("http://").and_then(|a| a.strip_suffix('/')).expect("http://ADDR/");
    assert!(!addr.ends_with(":0"), "the actual port is printed: {addr}");

    let health = http_get(addr, "/api/health");
    assert!(health.starts_with("HTTP/1.1 200"), "{health}");
    assert!(health.contains(r#""status":"ok""#), "{health}");
    assert!(dir.path().join("data").join("distlab.db").exists());
}

#[test]
fn bind_failure_is_a_readable_error_with_exit_code_1() {
    let dir = tempfile::tempdir().expect("temp dir");
    let taken = TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = taken.local_addr().expect("addr").to_string();
    let out = Command::new(BIN)
        .args(["--addr", &addr, "--local-workers", "0"])
        .arg("--data-dir")
        .arg(dir.path().join("data"))
        .output()
        .expect("run the server");
    assert_eq!(out.status.code(), Some(1));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains(&format!("cannot listen on {addr}")), "{stderr}");
}

#[test]
fn without_accounts_the_server_listens_on_loopback_only() {
    let dir = tempfile::tempdir().expect("temp dir");
    let out = Command::new(BIN)
        .args(["--addr", "0.0.0.0:0", "--local-workers", "0"])
        .arg("--data-dir")
        .arg(dir.path().join("data"))
        .env_remove("DISTLAB_AUTH")
        .output()
        .expect("run the server");
    assert_eq!(out.status.code(), Some(1));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("--auth none") && stderr.contains("--auth accounts"), "{stderr}");
}

/// `distlab-server user add NAME [--admin]` reads the password from standard input; the
/// account then signs in to a server started with `--auth accounts`.
/// The server with accounts on `data`, and the address it printed.
fn serve_with_accounts(data: &std::path::Path, site: &std::path::Path) -> (Running, String) {
    let child = Command::new(BIN)
        .args(["--addr", "127.0.0.1:0", "--local-workers", "0", "--auth", "accounts"])
        .arg("--data-dir")
        .arg(data)
        .arg("--static-dir")
        .arg(site)
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("start the server");
    let mut child = Running(child);
    let mut line = String::new();
    BufReader::new(child.0.stdout.take().expect("stdout")).read_line(&mut line).expect("ready line");
    let addr = line.trim().trim_start_matches("distlab is ready at http://").trim_end_matches('/').to_string();
    (child, addr)
}

#[test]
fn accounts_are_added_from_the_command_line_and_sign_in() {
    let dir = tempfile::tempdir().expect("temp dir");
    let data = dir.path().join("data");
    let add = |name: &str, password: &str, admin: bool| {
        let mut cmd = Command::new(BIN);
        cmd.args(["user", "add", name]).arg("--data-dir").arg(&data);
        if admin {
            cmd.arg("--admin");
        }
        let mut child = cmd.stdin(Stdio::piped()).stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().expect("run");
        writeln!(child.stdin.take().expect("stdin"), "{password}").expect("write the password");
        child.wait_with_output().expect("output")
    };
    let out = add("teach", "correct horse", true);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "created admin account teach");
    let again = add("teach", "another password", false);
    assert_eq!(again.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&again.stderr).contains("already exists"));
    let short = add("ada", "short", false);
    assert_eq!(short.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&short.stderr).contains("a password is 8 to"));

    let (_child, addr) = serve_with_accounts(&data, &dir.path().join("site"));
    assert!(http_get(&addr, "/api/experiments").starts_with("HTTP/1.1 401"), "anonymous");
    let body = r#"{"name": "teach", "password": "correct horse"}"#;
    let mut s = TcpStream::connect(&addr).expect("connect");
    s.set_read_timeout(Some(Duration::from_secs(10))).expect("timeout");
    write!(
        s,
        "POST /api/session HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\
         Connection: close\r\n\r\n{body}",
        body.len()
    )
    .expect("write");
    let mut answer = String::new();
    s.read_to_string(&mut answer).expect("read");
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    assert!(answer.to_ascii_lowercase().contains("set-cookie: distlab_session="), "{answer}");
}

/// The soft limit of open descriptors of this process, raised to its hard limit.
fn raise_own_descriptor_limit() -> u64 {
    let mut limit = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: the calls read and write only the struct they are given.
    unsafe {
        libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit);
        limit.rlim_cur = limit.rlim_max;
        libc::setrlimit(libc::RLIMIT_NOFILE, &limit);
        libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit);
    }
    limit.rlim_cur
}

/// 1,100 clients that send a request line and never finish their headers (started, as
/// servers often are, with the common soft limit of 1,024 descriptors) do not lock anyone
/// out: a normal request is answered at once, and each slow connection is closed after the
/// header timeout. (Before: `accept error: Too many open files`, and no answer for 88 s.)
#[test]
fn slow_clients_do_not_lock_out_a_normal_request() {
    const SLOW: usize = 1100;
    let own = raise_own_descriptor_limit();
    if own < 2 * SLOW as u64 + 256 {
        panic!("this test needs {} open descriptors; the hard limit here is {own}", 2 * SLOW + 256);
    }
    let dir = tempfile::tempdir().expect("temp dir");
    let mut command = Command::new(BIN);
    command
        .args(["--addr", "127.0.0.1:0", "--local-workers", "0", "--header-timeout-seconds", "2"])
        .env("DISTLAB_WORKER_TOKEN", "t")
        .arg("--data-dir")
        .arg(dir.path().join("data"))
        .arg("--static-dir")
        .arg(dir.path().join("site"))
        .stdout(Stdio::piped())
        .stderr(Stdio::null());
    // SAFETY: setrlimit is async-signal-safe; the child starts with a soft limit of 1,024.
    unsafe {
        use std::os::unix::process::CommandExt;
        command.pre_exec(|| {
            let mut limit = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
            libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit);
            limit.rlim_cur = limit.rlim_max.min(1024);
            libc::setrlimit(libc::RLIMIT_NOFILE, &limit);
            Ok(())
        });
    }
    let mut child = Running(command.spawn().expect("start the server"));
    let stdout = child.0.stdout.take().expect("stdout");
    let mut line = String::new();
    BufReader::new(stdout).read_line(&mut line).expect("ready line");
    let addr = line.trim().trim_start_matches("distlab is ready at http://").trim_end_matches('/').to_string();

    let slow: Vec<TcpStream> = (0..SLOW)
        .map(|_| {
            let mut s = TcpStream::connect(&addr).expect("connect");
            s.write_all(b"GET /api/health HTTP/1.1\r\nHost: x\r\n").expect("a request line");
            s
        })
        .collect();
    std::thread::sleep(Duration::from_millis(300));
    let started = std::time::Instant::now();
    let health = http_get(&addr, "/api/health");
    let took = started.elapsed();
    assert!(health.starts_with("HTTP/1.1 200"), "{health}");
    assert!(took < Duration::from_secs(1), "a normal request took {took:?} behind {SLOW} slow clients");

    // The header timeout closes every slow connection.
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    for mut s in slow {
        let left = deadline.saturating_duration_since(std::time::Instant::now()).max(Duration::from_millis(1));
        s.set_read_timeout(Some(left)).expect("timeout");
        let mut rest = Vec::new();
        let closed = s.read_to_end(&mut rest);
        let still_open = closed
            .as_ref()
            .is_err_and(|e| matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut));
        assert!(!still_open, "a slow connection was still open after 20 s: {closed:?}");
    }
}

/// A connection from `source` (a loopback address: each of a flood's clients has its own,
/// as a class's machines would).
fn connect_from(source: std::net::Ipv4Addr, to: &str) -> TcpStream {
    let to: std::net::SocketAddr = to.parse().expect("an address");
    let socket = socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None).expect("socket");
    socket.bind(&std::net::SocketAddr::from((source, 0)).into()).expect("bind a loopback address");
    socket.connect(&to.into()).expect("connect");
    socket.into()
}

/// `POST /api/session` with `body` from `source`; the status code (0: no answer).
fn sign_in_from(source: std::net::Ipv4Addr, addr: &str, body: &str) -> u16 {
    let mut s = connect_from(source, addr);
    s.set_read_timeout(Some(Duration::from_secs(30))).expect("timeout");
    let request = format!(
        "POST /api/session HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\
         Connection: close\r\n\r\n{body}",
        body.len()
    );
    if s.write_all(request.as_bytes()).is_err() {
        return 0;
    }
    let mut answer = String::new();
    let _ = s.read_to_string(&mut answer);
    answer.get(9..12).and_then(|code| code.parse().ok()).unwrap_or(0)
}

/// The peak resident memory of process `pid` (VmHWM), in bytes.
fn peak_resident_bytes(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("/proc status");
    let kib: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .expect("VmHWM");
    kib * 1024
}

/// A sign-in flood needs no account: 128 clients, each from its own address, try 4 names
/// that do not exist. Password checks run 2 at a time behind a bounded queue (503 beyond
/// it), each hashing thread in the argon2 memory it kept, so the server's peak memory
/// stays under 128 MiB (measured 63 MB; before: 14 GB in a release build, one 19 MiB
/// argon2id buffer per attempt at once, and 260-540 MB with the bound but a fresh buffer
/// per check), the health check is answered throughout, and the real account still signs
/// in after.
#[test]
fn a_sign_in_flood_stays_within_a_memory_bound() {
    const CLIENTS: u8 = 128;
    const TRIES: usize = 4;
    const BOUND: u64 = 128 << 20;
    let dir = tempfile::tempdir().expect("temp dir");
    let data = dir.path().join("data");
    let mut add = Command::new(BIN)
        .args(["user", "add", "ada"])
        .arg("--data-dir")
        .arg(&data)
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .spawn()
        .expect("user add");
    writeln!(add.stdin.take().expect("stdin"), "correct horse").expect("the password");
    assert!(add.wait().expect("user add").success());
    let (child, addr) = serve_with_accounts(&data, &dir.path().join("site"));
    let pid = child.0.id();
    let before = peak_resident_bytes(pid);

    let flooding = std::sync::atomic::AtomicBool::new(true);
    let (statuses, health) = std::thread::scope(|s| {
        let clients: Vec<_> = (0..CLIENTS)
            .map(|c| {
                let addr = &addr;
                s.spawn(move || {
                    let source = std::net::Ipv4Addr::new(127, 0, 1, c + 1);
                    (0..TRIES)
                        .map(|t| {
                            let body = format!(r#"{{"name": "stranger-{c}-{t}", "password": "a guess"}}"#);
                            sign_in_from(source, addr, &body)
                        })
                        .collect::<Vec<u16>>()
                })
            })
            .collect();
        let probe = s.spawn(|| {
            let mut slowest = Duration::ZERO;
            while flooding.load(std::sync::atomic::Ordering::Relaxed) {
                let started = std::time::Instant::now();
                assert!(http_get(&addr, "/api/health").starts_with("HTTP/1.1 200"), "health during the flood");
                slowest = slowest.max(started.elapsed());
                std::thread::sleep(Duration::from_millis(100));
            }
            slowest
        });
        let statuses: Vec<u16> = clients.into_iter().flat_map(|c| c.join().expect("a client")).collect();
        flooding.store(false, std::sync::atomic::Ordering::Relaxed);
        (statuses, probe.join().expect("the probe"))
    });
    let count = |code: u16| statuses.iter().filter(|&&s| s == code).count();
    let peak = peak_resident_bytes(pid);
    eprintln!(
        "sign-in flood: {} refused (401), {} told to wait (503), {} throttled (429); peak memory {:.0} MB \
         (before {:.0} MB); the slowest health check took {health:?}",
        count(401),
        count(503),
        count(429),
        peak as f64 / 1e6,
        before as f64 / 1e6
    );
    assert_eq!(count(401) + count(503) + count(429), statuses.len(), "{statuses:?}");
    assert!(count(503) > 0, "the queue of password checks filled up");
    assert!(peak < BOUND, "the server's memory peaked at {peak} bytes under the flood");
    let right = r#"{"name": "ada", "password": "correct horse"}"#;
    assert_eq!(sign_in_from(std::net::Ipv4Addr::new(127, 0, 2, 1), &addr, right), 200);
}
