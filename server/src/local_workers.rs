//! Local worker processes: `distlab-worker --server URL --name local-N
//! --checkpoint-dir DATA_DIR/checkpoints --offload-dir DATA_DIR/offload`, started
//! after the listener is bound, with stdout/stderr inherited, restarted when one exits
//! (after a pause that grows while it keeps exiting), and stopped with the server
//! (SIGTERM, then SIGKILL after a grace period; on Linux they also get SIGTERM if the
//! server dies without cleaning up).

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use tokio::process::{Child, Command};
use tokio::sync::watch;
use tokio::task::JoinHandle;

const GRACE: Duration = Duration::from_secs(3);
/// The first pause before a worker that exited is started again, and the longest.
const FIRST_RESTART: Duration = Duration::from_secs(1);
const LONGEST_RESTART: Duration = Duration::from_secs(30);
/// A worker that ran this long before exiting is restarted after the first pause again.
const RAN_WELL: Duration = Duration::from_secs(60);

/// `distlab-worker` next to the running executable.
pub fn default_worker_bin() -> Option<PathBuf> {
    let exe = std::env::current_exe().ok()?;
    Some(exe.with_file_name(format!("distlab-worker{}", std::env::consts::EXE_SUFFIX)))
}

/// The running local workers; `stop` ends them.
pub struct LocalWorkers {
    stop: watch::Sender<bool>,
    tasks: Vec<JoinHandle<()>>,
}

impl LocalWorkers {
    pub fn none() -> Self {
        Self { stop: watch::Sender::new(false), tasks: Vec::new() }
    }

    /// Starts `count` workers; a worker that cannot start is logged and skipped (the server
    /// still serves, and remote workers can still join).
    pub fn spawn(bin: &Path, count: usize, server_url: &str, token: &str, data_dir: &Path) -> Self {
        let mut workers = Self::none();
        if count == 0 {
            return workers;
        }
        if !bin.is_file() {
            tracing::error!(
                "cannot start local workers: {} does not exist; build it with `cargo build -p distlab-worker` \
                 or pass --worker-bin (DISTLAB_WORKER_BIN)",
                bin.display()
            );
            return workers;
        }
        for n in 1..=count {
            let launch = Launch {
                bin: bin.to_path_buf(),
                server_url: server_url.to_string(),
                token: token.to_string(),
                name: format!("local-{n}"),
                checkpoints: data_dir.join("checkpoints"),
                offload: data_dir.join("offload"),
            };
            match launch.start() {
                Ok(child) => {
                    tracing::info!(worker = %launch.name, pid = child.id(), "started a local worker");
                    let stop = workers.stop.subscribe();
                    workers.tasks.push(tokio::spawn(supervise(child, launch, stop)));
                }
                Err(e) => tracing::error!("cannot start local worker {} ({}): {e}", launch.name, bin.display()),
            }
        }
        workers
    }

    pub fn len(&self) -> usize {
        self.tasks.len()
    }

    pub fn is_empty(&self) -> bool {
        self.tasks.is_empty()
    }

    /// Stops every worker and waits for them to exit.
    pub async fn stop(self) {
        self.stop.send_replace(true);
        for task in self.tasks {
            let _ = task.await;
        }
    }
}

/// How one local worker is started (again).
struct Launch {
    bin: PathBuf,
    server_url: String,
    token: String,
    name: String,
    checkpoints: PathBuf,
    offload: PathBuf,
}

impl Launch {
    fn start(&self) -> std::io::Result<Child> {
        let mut cmd = Command::new(&self.bin);
        // The token goes in the environment, not argv: `ps` shows every process's arguments.
        cmd.env("DISTLAB_WORKER_TOKEN", &self.token)
            .arg("--server")
            .arg(&self.server_url)
            .arg("--name")
            .arg(&self.name)
            .arg("--checkpoint-dir")
            .arg(&self.checkpoints)
            .arg("--offload-dir")
            .arg(&self.offload)
            .stdin(Stdio::null())
            .stdout(Stdio::inherit())
            .stderr(Stdio::inherit())
            .kill_on_drop(true);
        #[cfg(target_os = "linux")]
        // SAFETY: prctl is async-signal-safe and touches no memory of the parent.
        // The signal is tied to the spawning thread: `serve` spawns from the thread that
        // runs it, restarts from a runtime worker thread; both live as long as the server.
        unsafe {
            cmd.pre_exec(|| {
                if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGTERM) == -1 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
        cmd.spawn()
    }
}

/// Starts the worker again whenever it exits (after a pause that doubles while it keeps
/// exiting soon after starting); on stop, asks it to exit and kills it after GRACE.
async fn supervise(mut child: Child, launch: Launch, mut stop: watch::Receiver<bool>) {
    let name = &launch.name;
    let mut pause = FIRST_RESTART;
    let mut started = Instant::now();
    loop {
        tokio::select! {
            status = child.wait() => match status {
                Ok(s) => tracing::error!(worker = %name, "local worker exited ({s}); starting it again in {pause:?}"),
                Err(e) => tracing::error!(worker = %name, "lost track of local worker ({e}); starting it again in {pause:?}"),
            },
            _ = async { stop.wait_for(|stop| *stop).await.is_ok() } => return terminate(&mut child, name).await,
        }
        if started.elapsed() >= RAN_WELL {
            pause = FIRST_RESTART;
        }
        tokio::select! {
            _ = tokio::time::sleep(pause) => {}
            _ = async { stop.wait_for(|stop| *stop).await.is_ok() } => return,
        }
        pause = (pause * 2).min(LONGEST_RESTART);
        loop {
            match launch.start() {
                Ok(again) => {
                    tracing::info!(worker = %name, pid = again.id(), "started the local worker again");
                    child = again;
                    started = Instant::now();
                    break;
                }
                Err(e) => {
                    tracing::error!(worker = %name, "cannot start the local worker again ({e}); trying in {pause:?}");
                    tokio::select! {
                        _ = tokio::time::sleep(pause) => {}
                        _ = async { stop.wait_for(|stop| *stop).await.is_ok() } => return,
                    }
                    pause = (pause * 2).min(LONGEST_RESTART);
                }
            }
        }
    }
}

async fn terminate(child: &mut Child, name: &str) {
    #[cfg(unix)]
    if let Some(pid) = child.id().and_then(|pid| i32::try_from(pid).ok()) {
        // SAFETY: sending a signal to our own child process.
        unsafe {
            libc::kill(pid, libc::SIGTERM);
        }
        if tokio::time::timeout(GRACE, child.wait()).await.is_ok() {
            tracing::info!(worker = %name, "local worker stopped");
            return;
        }
    }
    if let Err(e) = child.kill().await {
        tracing::warn!(worker = %name, "could not kill local worker: {e}");
    } else {
        tracing::info!(worker = %name, "local worker killed");
    }
}
