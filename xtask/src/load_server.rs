//! What the load and abuse phases share: the release server they start on 127.0.0.1 (a
//! free port, stopped on drop), and connections from a chosen loopback address.

use std::io::{BufRead, BufReader, Write};
use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4, TcpStream};
use std::process::{Child, Command, Stdio};

use anyhow::{bail, Context, Result};

/// A TCP connection to `to` from the loopback address `source`.
pub(crate) fn connect_from(source: Ipv4Addr, to: SocketAddr) -> Result<TcpStream> {
    let socket = socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None)?;
    socket.bind(&SocketAddr::V4(SocketAddrV4::new(source, 0)).into()).with_context(|| format!("bind {source}"))?;
    socket.connect(&to.into()).with_context(|| format!("connect to {to} from {source}"))?;
    Ok(socket.into())
}

/// Adds account `name` to the store in `data` (`distlab-server user add`).
pub(crate) fn add_account(data: &std::path::Path, name: &str, password: &str) -> Result<()> {
    let bin = crate::root().join("target/release/distlab-server");
    let mut add = Command::new(&bin)
        .args(["user", "add", name])
        .arg("--data-dir")
        .arg(data)
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .spawn()
        .context("distlab-server user add")?;
    writeln!(add.stdin.take().context("stdin")?, "{password}")?;
    if !add.wait()?.success() {
        bail!("could not add account {name}");
    }
    Ok(())
}

/// The release server on 127.0.0.1 (a free port), stopped on drop.
pub(crate) struct Server {
    pub(crate) process: Child,
    pub(crate) base: String,
    pub(crate) addr: SocketAddr,
    /// The `Cookie` header of the one account signed in, on a server with accounts.
    pub(crate) session: Option<String>,
}

impl Server {
    /// On SQLite in `data`, or on the Postgres database `database_url`.
    pub(crate) fn start(data: &std::path::Path, database_url: Option<&str>) -> Result<Self> {
        Self::start_with(data, database_url, &[])
    }

    /// With more flags.
    pub(crate) fn start_with(data: &std::path::Path, database_url: Option<&str>, flags: &[&str]) -> Result<Self> {
        let bin = crate::root().join("target/release/distlab-server");
        let mut process = Command::new(&bin)
            .args(["--addr", "127.0.0.1:0", "--local-workers", "0", "--max-queued-per-user", "10000000"])
            .args(["--max-streams-per-account", "1000000", "--max-disk-per-user-mb", "0"])
            .args(flags)
            .arg("--data-dir")
            .arg(data)
            .envs(database_url.map(|url| ("DISTLAB_DATABASE_URL", url)))
            .env("DISTLAB_WORKER_TOKEN", "load-test-token")
            .env("RUST_LOG", "warn")
            .stdout(Stdio::piped())
            .spawn()
            .with_context(|| format!("cannot start {}", bin.display()))?;
        let mut stdout = BufReader::new(process.stdout.take().context("piped stdout")?);
        let mut line = String::new();
        stdout.read_line(&mut line)?;
        // Whatever else it prints is read and dropped, so that it never writes to a closed pipe.
        std::thread::spawn(move || std::io::copy(&mut stdout, &mut std::io::sink()));
        let Some(url) = line.split("ready at ").nth(1) else {
            let _ = process.kill();
            bail!("the server did not say where it listens: {line:?}");
        };
        let base = url.trim().trim_end_matches('/').to_string();
        let addr: SocketAddr = base.trim_start_matches("http://").parse().context("the server's address")?;
        Ok(Self { process, base, addr, session: None })
    }

    /// On SQLite in `data`, with accounts (`--auth accounts`), one of them signed in.
    pub(crate) fn start_signed_in(data: &std::path::Path) -> Result<Self> {
        add_account(data, "load", "correct horse")?;
        let mut server = Self::start_with(data, None, &["--auth", "accounts"])?;
        let agent: ureq::Agent = ureq::Agent::config_builder().http_status_as_error(false).build().into();
        let resp = agent
            .post(format!("{}/api/session", server.base))
            .send_json(serde_json::json!({"name": "load", "password": "correct horse"}))?;
        let cookie = resp.headers().get("set-cookie").and_then(|v| v.to_str().ok()).and_then(|v| v.split(';').next());
        match (resp.status().as_u16(), cookie) {
            (200, Some(cookie)) => server.session = Some(cookie.to_string()),
            (status, _) => bail!("signing in to the load's server: {status}"),
        }
        Ok(server)
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.process.kill();
        let _ = self.process.wait();
    }
}
