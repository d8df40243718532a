//! NVIDIA's compilers for the CUDA kernels, without a GPU: NVRTC (the library the CUDA
//! backend compiles its kernels with) and ptxas (PTX to machine code, reporting registers,
//! spills and shared memory), from NVIDIA's packages on the Python package index, installed
//! once into target/cuda-tools. The test `cuda_sources::nvrtc_and_ptxas_...` uses both.

use std::path::PathBuf;
use std::process::Command;

use anyhow::{bail, Context, Result};

/// The packages, pinned: NVRTC's library and the compiler package that carries ptxas.
const PACKAGES: [&str; 2] = ["nvidia-cuda-nvrtc==13.5.37", "nvidia-cuda-nvcc==13.5.37"];
const INSTALLED_INTO: &str = "target/cuda-tools";

/// Where the installed tools are.
pub struct CudaTools {
    /// The folder holding libnvrtc.so.13 (for LD_LIBRARY_PATH: cudarc loads it by name).
    pub lib_dir: PathBuf,
    pub ptxas: PathBuf,
}

/// The tools, installed first where they are not yet.
pub fn ensure() -> Result<CudaTools> {
    let root = crate::root().join(INSTALLED_INTO);
    let cuda = root.join("nvidia/cu13");
    let tools = CudaTools { lib_dir: cuda.join("lib"), ptxas: cuda.join("bin/ptxas") };
    if tools.lib_dir.join("libnvrtc.so.13").exists() && tools.ptxas.exists() {
        return Ok(tools);
    }
    println!("xtask: installing NVRTC and ptxas ({}) into {INSTALLED_INTO}", PACKAGES.join(", "));
    let status = Command::new("python3")
        .args(["-m", "pip", "install", "--quiet", "--disable-pip-version-check", "--no-deps", "--upgrade"])
        .arg("--target")
        .arg(&root)
        .args(PACKAGES)
        .status()
        .context("cannot start python3 -m pip")?;
    if !status.success() {
        bail!("pip could not install {} ({status})", PACKAGES.join(", "));
    }
    if !tools.lib_dir.join("libnvrtc.so.13").exists() || !tools.ptxas.exists() {
        bail!("the packages installed, but {} or {} is not there", tools.lib_dir.display(), tools.ptxas.display());
    }
    Ok(tools)
}
