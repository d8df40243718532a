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

    let child = Command::new(BIN)
        .args(["--addr", "127.0.0.1:0", "--local-workers", "0", "--auth", "accounts"])
        .arg("--data-dir")
        .arg(&data)
        .arg("--static-dir")
        .arg(dir.path().join("site"))
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("start the server");
    let mut child = Running(child);
    let mut line = String::new();
    BufReader::new(child.0.stdout.take().expect("stdout")).read_line(&mut line).expect("ready line");
    let addr = line.trim().trim_start_matches("distlab is ready at http://").trim_end_matches('/').to_string();
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
