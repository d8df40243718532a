//! A throwaway PostgreSQL cluster for the store tests: Debian's `postgresql` (installed
//! when missing), `initdb` into a temporary directory, a server on 127.0.0.1 and a free
//! port whose one user has a random password, stopped and deleted when dropped. Root
//! cannot run PostgreSQL, so as root the cluster belongs to the `postgres` user the
//! package creates.

use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{bail, Context, Result};

pub struct Cluster {
    dir: PathBuf,
    pg_ctl: PathBuf,
    as_postgres: bool,
    /// `postgres://postgres:PASSWORD@127.0.0.1:PORT/postgres`: the cluster's first
    /// database, where a test creates its own.
    pub url: String,
}

/// Starts a cluster, or says why there is none.
pub fn start() -> Result<Cluster> {
    let bin = match binaries() {
        Some(bin) => bin,
        None => {
            install()?;
            binaries().context("postgresql is installed, but no /usr/lib/postgresql/*/bin/initdb was found")?
        }
    };
    let as_postgres = is_root();
    let dir = std::env::temp_dir().join(format!("distlab-pg-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).with_context(|| format!("cannot create {}", dir.display()))?;
    if as_postgres {
        run(Command::new("chown").args(["postgres:postgres"]).arg(&dir))?;
    }
    let port = TcpListener::bind("127.0.0.1:0")?.local_addr()?.port();
    let password = random_hex()?;
    let pwfile = dir.join("password");
    std::fs::write(&pwfile, &password)?;
    if as_postgres {
        run(Command::new("chown").args(["postgres:postgres"]).arg(&pwfile))?;
    }
    let cluster = Cluster {
        dir: dir.clone(),
        pg_ctl: bin.join("pg_ctl"),
        as_postgres,
        url: format!("postgres://postgres:{password}@127.0.0.1:{port}/postgres"),
    };
    let data = dir.join("data");
    let mut initdb = cluster.command(&bin.join("initdb"));
    initdb.args(["--auth=scram-sha-256", "--username=postgres", "--encoding=UTF8", "--no-sync", "--pwfile"]);
    initdb.arg(&pwfile).arg("-D").arg(&data);
    run(initdb.stdout(std::process::Stdio::null()))?;
    let options =
        format!("-p {port} -k {} -c listen_addresses=127.0.0.1 -c fsync=off -c max_connections=200", dir.display());
    let mut start = cluster.command(&cluster.pg_ctl);
    start.args(["-D"]).arg(&data).args(["-l"]).arg(dir.join("log")).args(["-o", &options, "-w", "start"]);
    run(start.stdout(std::process::Stdio::null()))?;
    Ok(cluster)
}

impl Cluster {
    /// `program` run as the cluster's owner.
    fn command(&self, program: &Path) -> Command {
        if self.as_postgres {
            let mut c = Command::new("runuser");
            c.args(["-u", "postgres", "--"]).arg(program);
            c
        } else {
            Command::new(program)
        }
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        let mut stop = self.command(&self.pg_ctl);
        stop.arg("-D").arg(self.dir.join("data")).args(["-m", "immediate", "stop"]);
        let _ = stop.stdout(std::process::Stdio::null()).status();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// Empties the database of `url` (a cluster of ours): its tables and migrations dropped.
pub fn recreate(url: &str) -> Result<()> {
    let sql = "DROP SCHEMA public CASCADE; CREATE SCHEMA public;";
    run(Command::new("psql").args(["-q", "-d", url, "-c", sql]).stdout(std::process::Stdio::null()))
        .context("psql (postgresql-client) empties the database")
}

/// The newest `/usr/lib/postgresql/N/bin` with an initdb.
fn binaries() -> Option<PathBuf> {
    let mut versions: Vec<(u32, PathBuf)> = std::fs::read_dir("/usr/lib/postgresql")
        .ok()?
        .flatten()
        .filter_map(|e| Some((e.file_name().to_str()?.parse().ok()?, e.path().join("bin"))))
        .filter(|(_, bin): &(u32, PathBuf)| bin.join("initdb").exists())
        .collect();
    versions.sort();
    versions.pop().map(|(_, bin)| bin)
}

fn install() -> Result<()> {
    println!("xtask: installing postgresql with apt-get (for the store tests on Postgres)");
    let script = "apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y postgresql";
    run(Command::new("sh").args(["-c", script])).context("apt-get could not install postgresql")
}

/// 16 random bytes as hex.
fn random_hex() -> Result<String> {
    use std::io::Read;
    let mut bytes = [0u8; 16];
    std::fs::File::open("/dev/urandom")?.read_exact(&mut bytes)?;
    Ok(bytes.iter().map(|b| format!("{b:02x}")).collect())
}

fn is_root() -> bool {
    Command::new("id").arg("-u").output().is_ok_and(|o| String::from_utf8_lossy(&o.stdout).trim() == "0")
}

fn run(cmd: &mut Command) -> Result<()> {
    let status = cmd.status().with_context(|| format!("cannot start {cmd:?}"))?;
    if !status.success() {
        bail!("{cmd:?} failed ({status})");
    }
    Ok(())
}
