//! `cargo xtask emulated-gpu [--devices N] -- COMMAND ...`: runs a command against the
//! emulated CUDA device (`emulated-gpu/`): the stand-in library is built, linked as
//! libcuda.so, libnvrtc.so, libcublas.so and libnccl.so into target/emulated-gpu/lib, and
//! that folder goes first on the command's `LD_LIBRARY_PATH`, where cudarc looks for them.

use std::path::PathBuf;
use std::process::{Command, ExitCode};

use anyhow::{bail, Context, Result};

/// The names cudarc loads the libraries by, each a link to the stand-in.
const NAMES: [&str; 4] = ["libcuda.so", "libnvrtc.so", "libcublas.so", "libnccl.so"];

/// Builds the stand-in and links it under the libraries' names: the folder to put first on
/// `LD_LIBRARY_PATH`.
pub fn prepare() -> Result<PathBuf> {
    crate::status(crate::cargo().args(["build", "-p", "distlab-emulated-gpu"]))?;
    let library = crate::root().join("target/debug/libdistlab_emulated_gpu.so");
    if !library.exists() {
        bail!("the build made no {}", library.display());
    }
    let dir = crate::root().join("target/emulated-gpu/lib");
    std::fs::create_dir_all(&dir).with_context(|| format!("cannot make {}", dir.display()))?;
    for name in NAMES {
        let link = dir.join(name);
        let _ = std::fs::remove_file(&link);
        std::os::unix::fs::symlink(&library, &link).with_context(|| format!("cannot link {}", link.display()))?;
    }
    Ok(dir)
}

/// `command` with the emulated devices in place of any real ones.
pub fn command(lib_dir: &std::path::Path, devices: usize, program: &str) -> Result<Command> {
    let mut cmd = Command::new(program);
    let paths = std::env::var_os("LD_LIBRARY_PATH").unwrap_or_default();
    let paths = std::iter::once(lib_dir.to_path_buf()).chain(std::env::split_paths(&paths));
    cmd.env("LD_LIBRARY_PATH", std::env::join_paths(paths).context("LD_LIBRARY_PATH")?);
    cmd.env("DISTLAB_EMULATED_GPU_DEVICES", devices.to_string());
    // (The emulator narrows its devices by CUDA_VISIBLE_DEVICES as a driver does: a value
    // set for this machine's real GPUs must not narrow the emulated ones.)
    cmd.env_remove("CUDA_VISIBLE_DEVICES");
    Ok(cmd)
}

/// `cargo` in the repository root against `devices` emulated devices (the stand-in built).
pub fn cargo(devices: usize) -> Result<Command> {
    let lib_dir = prepare()?;
    let program = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let mut cmd = command(&lib_dir, devices, &program)?;
    cmd.current_dir(crate::root());
    Ok(cmd)
}

pub fn run(devices: usize, args: &[String]) -> Result<ExitCode> {
    let Some((program, rest)) = args.split_first() else {
        bail!("usage: cargo xtask emulated-gpu [--devices N] -- COMMAND [ARGS...]");
    };
    if !(1..=8).contains(&devices) {
        bail!("--devices must be 1 to 8");
    }
    let dir = prepare()?;
    let status =
        command(&dir, devices, program)?.args(rest).status().with_context(|| format!("cannot run {program}"))?;
    Ok(crate::exit_code(status))
}
