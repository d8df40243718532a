//! `cargo xtask`: build orchestration for distlab.
//!
//! - `build-frontend`: the Leptos app for wasm32, split into a main module and one chunk per
//!   lazily loaded page, with its JS glue, index.html and style.css in target/site/ (`frontend.rs`)
//! - `run`: build everything (release) and start the server with one local worker
//! - `test`: install what a fresh machine lacks (NVRTC and ptxas among it, `cuda_tools.rs`),
//!   build, `cargo test --workspace` (with the worker's `cuda` feature, so the CUDA backend
//!   compiles, NVIDIA's compilers compile its kernels, and its GPU tests run or skip), then
//!   the server's tests again on a throwaway PostgreSQL cluster
//! - `bench`: the training step and the ring as shares of the machine's FMA peak and memcpy
//!   bandwidth, next to PyTorch when torch is installed (`bench.rs`)
//! - `mutants`: break the engine on purpose (`mutants.rs`) and check the tests notice

mod abuse;
mod bench;
mod cuda_tools;
mod docs_site;
mod emulated_gpu;
mod failures;
mod frontend;
mod gpu_check;
#[cfg(test)]
mod imports;
mod load;
mod load_client;
mod load_server;
mod mutants;
mod postgres;
#[cfg(test)]
mod test_targets;

use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode};

use anyhow::{bail, Context, Result};
use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(name = "cargo xtask", about = "Build, run, test and benchmark distlab")]
struct Cli {
    #[command(subcommand)]
    command: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Build the browser app into target/site/ (index.html; wasm, its chunks, JS glue and
    /// style.css under assets/VERSION/).
    BuildFrontend,
    /// Build everything (release) and run the server with one local worker on 127.0.0.1:8080.
    /// Extra arguments go to distlab-server, e.g. `cargo xtask run -- --addr 127.0.0.1:9000`.
    Run {
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        server_args: Vec<String>,
    },
    /// Install missing tools (wasm32 target, chromium, chromedriver), build, run every test.
    /// Extra arguments go to `cargo test`, e.g. `cargo xtask test -- --nocapture`.
    Test {
        /// Also run the GPU tests (CUDA kernels, NCCL); fails when this machine has no GPU.
        /// Without it they are reported as ignored.
        #[arg(long)]
        gpu: bool,
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        test_args: Vec<String>,
    },
    /// The training step (fp32/bf16/fp16, 1 and 2 threads) as a share of this machine's FMA
    /// peak and all_reduce as a share of its memcpy bandwidth; PyTorch on the same shape
    /// in the same run when torch is installed.
    Bench {
        /// Rounds of the step benchmarks (ours and PyTorch's side by side in each); the
        /// table shows the median.
        #[arg(long, default_value_t = 3)]
        rounds: usize,
    },
    /// Break the engine on purpose, one hand-written mutant at a time, and run the tests
    /// that should notice; prints caught / missed (fails if any is missed).
    Mutants {
        /// Only the mutants whose name contains this.
        filter: Option<String>,
    },
    /// `--prepare`: build, here, the one-call check for a machine with a GPU into
    /// target/gpu-check (stripped binaries, under 50 MiB); there, with no cargo, `bash
    /// target/gpu-check/gpu-check.sh OUT_DIR` runs it and writes OUT_DIR/summary.md.
    GpuCheck {
        #[arg(long, required = true)]
        prepare: bool,
    },
    /// Run a command against emulated CUDA devices (the stand-in libcuda, NVRTC, cuBLAS and
    /// NCCL of emulated-gpu/, first on its LD_LIBRARY_PATH), e.g. `cargo xtask emulated-gpu
    /// -- target/debug/distlab-worker run spec.json` with `"backend": "cuda"`.
    EmulatedGpu {
        /// Devices the emulated machine has (1 to 8).
        #[arg(long, default_value_t = 1)]
        devices: usize,
        #[arg(trailing_var_arg = true, allow_hyphen_values = true, required = true)]
        command: Vec<String>,
    },
    /// Load a release server on 127.0.0.1: req/s and latency of the list, one experiment,
    /// the planner and submissions at N connections, then S live streams held at once.
    Load {
        /// Seconds each request phase runs.
        #[arg(long, default_value_t = 5.0)]
        seconds: f64,
        /// Connections (threads) making requests at once.
        #[arg(long, default_value_t = 64)]
        connections: usize,
        /// Live streams (SSE) held at once.
        #[arg(long, default_value_t = 500)]
        streams: usize,
        /// Only submissions and worker leases, on SQLite and then on a throwaway PostgreSQL
        /// cluster (Debian's postgresql, installed when missing).
        #[arg(long)]
        stores: bool,
    },
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        Cmd::BuildFrontend => frontend::build(),
        Cmd::Run { server_args } => run(&server_args),
        Cmd::Test { gpu, test_args } => test(gpu, &test_args),
        Cmd::Bench { rounds } => bench::run(rounds).map(|()| ExitCode::SUCCESS),
        Cmd::EmulatedGpu { devices, command } => emulated_gpu::run(devices, &command),
        Cmd::GpuCheck { prepare: _ } => gpu_check::prepare().map(|_| ExitCode::SUCCESS),
        Cmd::Mutants { filter } => {
            mutants::run(filter.as_deref()).map(|all| if all { ExitCode::SUCCESS } else { ExitCode::FAILURE })
        }
        Cmd::Load { seconds, connections, streams, stores } => {
            load::run(&load::LoadOptions { seconds, connections, streams, stores }).map(|()| ExitCode::SUCCESS)
        }
    };
    match result {
        Ok(code) => code,
        Err(e) => {
            eprintln!("xtask: error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

/// The workspace root (the parent of xtask/).
fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().expect("xtask lives in the workspace").to_path_buf()
}

/// The packages and features of every test build: the same each time, so that each reuses
/// what the one before built (a build that selects other packages unifies other features
/// and compiles their shared dependencies again). xtask is left out: its tests build on the
/// release build `cargo xtask` itself runs from, rather than on a second, debug copy of its
/// dependencies (wasm-bindgen's and the wasm tools, ~5 minutes of one core).
pub const TEST_BUILD: [&str; 5] = ["--workspace", "--exclude", "xtask", "--features", "distlab-worker/cuda"];

fn cargo() -> Command {
    let mut cmd = Command::new(std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into()));
    cmd.current_dir(root());
    cmd
}

/// Runs a command to completion with inherited stdio; an error unless it succeeds.
fn status(cmd: &mut Command) -> Result<()> {
    let status = cmd.status().with_context(|| format!("cannot start {cmd:?}"))?;
    if !status.success() {
        bail!("{cmd:?} failed ({status})");
    }
    Ok(())
}

fn run(extra: &[String]) -> Result<ExitCode> {
    // The two builds at once: the frontend's ends in one long link-time optimisation on one
    // core (115 s cold), which the native build's crates fill the other core beside; two
    // cargo builds of different profiles do not wait for each other's lock. Measured cold
    // on 2 cores: 7 m 6 s together, against 3 m 10 s + 8 m 24 s one after the other.
    let frontend = std::thread::spawn(frontend::build);
    let native = status(cargo().args(["build", "--release", "-p", "distlab-server", "-p", "distlab-worker"]));
    frontend.join().map_err(|_| anyhow::anyhow!("the frontend's build panicked"))??;
    native?;
    let defaults = [
        ("--addr", "127.0.0.1:8080"),
        ("--data-dir", "./data"),
        ("--local-workers", "1"),
        ("--static-dir", frontend::SITE_DIR),
    ];
    let mut args: Vec<String> = Vec::new();
    for (flag, value) in defaults {
        // A flag given on the command line replaces the default.
        let overridden = extra.iter().any(|a| a == flag || a.starts_with(&format!("{flag}=")));
        if !overridden {
            args.extend([flag.to_string(), value.to_string()]);
        }
    }
    args.extend(extra.iter().cloned());
    let server = root().join("target/release/distlab-server");
    println!("xtask: {} {}", server.display(), args.join(" "));
    let status = Command::new(&server)
        .args(&args)
        .current_dir(root())
        .status()
        .with_context(|| format!("cannot start {}", server.display()))?;
    Ok(exit_code(status))
}

fn exit_code(status: std::process::ExitStatus) -> ExitCode {
    match status.code() {
        Some(0) => ExitCode::SUCCESS,
        Some(code) => ExitCode::from(u8::try_from(code).unwrap_or(1)),
        None => ExitCode::FAILURE,
    }
}

fn test(gpu: bool, extra: &[String]) -> Result<ExitCode> {
    if gpu {
        let gpus = gpus_here();
        if gpus.is_empty() {
            bail!("--gpu: this machine has no GPU (`nvidia-smi -L` lists none), so the GPU tests cannot run");
        }
        println!("xtask: GPU tests on {}", gpus.join("; "));
    } else {
        println!("xtask: the GPU tests (CUDA kernels, NCCL, cuda training) run last, on the emulated GPU; `--gpu` runs them on this machine's");
    }
    frontend::ensure_wasm_target()?;
    ensure_browser();
    frontend::build()?;
    // The end-to-end tests start target/debug/distlab-server and distlab-worker: `cargo
    // test` builds both (their packages have integration tests) before it runs any test,
    // with the same features as everything else, so nothing is compiled twice.
    // With the worker's `cuda` feature: the CUDA backend is compiled and its op tests run
    // (on a machine without a GPU they print why they skip; cudarc loads CUDA at run time).
    let mut cmd = cargo();
    // --no-fail-fast: a failing test binary does not hide what the ones after it would say.
    cmd.args(["test", "--no-fail-fast"]).args(TEST_BUILD);
    // NVRTC and ptxas compile every kernel, GPU or not. On a GPU machine the system's NVRTC
    // (the one matching its driver) is used where there is one.
    let tools = cuda_tools::ensure()?;
    cmd.env("DISTLAB_PTXAS", &tools.ptxas);
    if !(gpu && system_has_nvrtc()) {
        let paths = std::env::var_os("LD_LIBRARY_PATH").unwrap_or_default();
        let paths = std::iter::once(tools.lib_dir.clone()).chain(std::env::split_paths(&paths));
        cmd.env("LD_LIBRARY_PATH", std::env::join_paths(paths).context("LD_LIBRARY_PATH")?);
    }
    let mut harness: Vec<&str> = extra.iter().map(String::as_str).collect();
    if gpu {
        // Only the GPU tests are #[ignore]d; this runs them with everything else.
        harness.push("--include-ignored");
    }
    if !harness.is_empty() {
        cmd.arg("--").args(&harness);
    }
    let status = failures::run(&mut cmd)?;
    // xtask's own tests, built on the release build `cargo xtask` runs from (`TEST_BUILD`).
    let mut xtask_tests = cargo();
    xtask_tests.args(["test", "--release", "-p", "xtask"]);
    if !harness.is_empty() {
        xtask_tests.arg("--").args(&harness);
    }
    let xtask_status = failures::run(&mut xtask_tests)?;
    for status in [status, xtask_status] {
        if !status.success() {
            return Ok(exit_code(status));
        }
    }
    if !gpu {
        let status = gpu_tests_on_the_emulated_device()?;
        if !status.success() {
            return Ok(exit_code(status));
        }
    }
    store_tests_on_postgres()
}

/// The GPU tests, on the emulated device (`emulated_gpu.rs`), built as the run above built
/// them: the CUDA backend's op tests (every kernel and GEMM against the f64 reference) on
/// one GPU; then on 8, the NCCL communicator's tests and the cuda training tests (every
/// strategy against the CPU, with a GPU per rank over the emulated NCCL and with ranks
/// sharing one GPU; ledgers, resume, elastic resume, export).
fn gpu_tests_on_the_emulated_device() -> Result<std::process::ExitStatus> {
    println!("xtask: the CUDA op tests on the emulated GPU");
    let mut cmd = emulated_gpu::cargo(1)?;
    cmd.arg("test").args(TEST_BUILD).args(["--test", "engine"]).args(["--", "--include-ignored", "cuda_"]);
    let status = failures::run(&mut cmd)?;
    if !status.success() {
        return Ok(status);
    }
    println!("xtask: the NCCL and cuda training tests on 8 emulated GPUs");
    let mut cmd = emulated_gpu::cargo(8)?;
    // (`--test nccl` also names the emulator's own NCCL test, which takes a second.)
    cmd.arg("test").args(TEST_BUILD).args(["--test", "nccl", "--test", "cuda"]).args(["--", "--include-ignored"]);
    failures::run(&mut cmd)
}

/// The server's tests again, on a throwaway PostgreSQL cluster (`postgres.rs`): every query
/// the store makes, on the other database it supports. Where no cluster can be started
/// here, says why and passes.
fn store_tests_on_postgres() -> Result<ExitCode> {
    let cluster = match postgres::start() {
        Ok(cluster) => cluster,
        Err(e) => {
            println!("xtask: the store tests on Postgres are skipped: no PostgreSQL cluster could be started ({e:#})");
            return Ok(ExitCode::SUCCESS);
        }
    };
    println!("xtask: the server's tests again, on a throwaway PostgreSQL cluster");
    // The server's test targets that open a store (server/tests/store), selected in the
    // whole workspace with the run above's features, so that nothing is built again.
    let status = failures::run(
        cargo()
            .arg("test")
            .args(TEST_BUILD)
            .args(["--test", "api", "--test", "accounts", "--test", "review", "--test", "fuzz"])
            .env("DISTLAB_TEST_POSTGRES_URL", &cluster.url),
    )?;
    Ok(exit_code(status))
}

/// Whether the dynamic loader knows an NVRTC of this machine's own.
fn system_has_nvrtc() -> bool {
    Command::new("ldconfig")
        .arg("-p")
        .output()
        .is_ok_and(|out| String::from_utf8_lossy(&out.stdout).contains("libnvrtc.so"))
}

/// The GPUs `nvidia-smi -L` lists (none where it is missing or fails).
fn gpus_here() -> Vec<String> {
    match Command::new("nvidia-smi").arg("-L").output() {
        Ok(out) if out.status.success() => {
            String::from_utf8_lossy(&out.stdout).lines().filter(|l| l.starts_with("GPU")).map(str::to_string).collect()
        }
        _ => Vec::new(),
    }
}

/// Headless Chromium and its WebDriver for the browser test; on failure the test
/// itself explains what is missing (or skips with DISTLAB_SKIP_BROWSER=1).
fn ensure_browser() {
    if Path::new("/usr/bin/chromium").exists() && Path::new("/usr/bin/chromedriver").exists() {
        return;
    }
    if std::env::var_os("DISTLAB_SKIP_BROWSER").is_some_and(|v| v == "1") {
        println!("xtask: chromium/chromedriver missing; DISTLAB_SKIP_BROWSER=1, so not installing them");
        return;
    }
    println!("xtask: installing chromium and chromium-driver with apt-get (for the browser test)");
    let installed = Command::new("sh")
        .args(["-c", "apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y chromium chromium-driver"])
        .status();
    match installed {
        Ok(s) if s.success() => {}
        Ok(s) => eprintln!(
            "xtask: apt-get could not install chromium/chromium-driver ({s}); are we root with network access to the \
             Debian mirrors? The browser test will fail unless DISTLAB_SKIP_BROWSER=1 is set."
        ),
        Err(e) => eprintln!("xtask: cannot run apt-get ({e}); install chromium and chromium-driver by hand."),
    }
}
