//! `cargo xtask gpu-check --prepare`: everything the one-call GPU check needs, built here on
//! a machine without a GPU, into target/gpu-check (ignored, under 50 MiB): `bin.tar.gz` with
//! the stripped binaries (the worker with cuda, the op, NCCL and cuda training test binaries,
//! the `cuda_train` example), `gpu-check.sh` (the check itself, `xtask/gpu-check.sh`) and
//! `gpt_step.py` (the PyTorch step it compares with). On the GPU machine, with no cargo:
//! `bash target/gpu-check/gpu-check.sh OUT_DIR` writes OUT_DIR/summary.md.

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{bail, Context, Result};

/// The most the folder may hold (what a lent GPU machine is sent is limited).
const LIMIT_BYTES: u64 = 50 << 20;

/// Builds and packs; the folder.
pub fn prepare() -> Result<PathBuf> {
    let root = crate::root();
    // The features of the test run, so that the test binaries are the ones it built.
    let features = crate::TEST_BUILD;
    crate::status(crate::cargo().args(["build"]).args(features).args(["--bins", "--example", "cuda_train"]))?;
    let tests = test_binaries(&features)?;
    let dir = root.join("target/gpu-check");
    let bin = dir.join("bin");
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&bin).with_context(|| format!("cannot make {}", bin.display()))?;
    let debug = root.join("target/debug");
    let mut files: Vec<(PathBuf, &str)> =
        vec![(debug.join("distlab-worker"), "distlab-worker"), (debug.join("examples/cuda_train"), "cuda_train")];
    files.extend(tests.iter().map(|(name, path)| (path.clone(), *name)));
    for (from, name) in &files {
        let to = bin.join(name);
        std::fs::copy(from, &to).with_context(|| format!("cannot copy {}", from.display()))?;
        crate::status(Command::new("strip").arg(&to))?;
    }
    let commit = Command::new("git").args(["describe", "--always", "--dirty"]).current_dir(&root).output()?;
    std::fs::write(bin.join("COMMIT"), commit.stdout)?;
    crate::status(Command::new("tar").arg("-czf").arg(dir.join("bin.tar.gz")).arg("-C").arg(&dir).arg("bin"))?;
    std::fs::remove_dir_all(&bin)?;
    for (from, to) in [("xtask/gpu-check.sh", "gpu-check.sh"), ("xtask/reference/gpt_step.py", "gpt_step.py")] {
        std::fs::copy(root.join(from), dir.join(to)).with_context(|| format!("cannot copy {from}"))?;
    }
    let bytes = folder_bytes(&dir)?;
    if bytes > LIMIT_BYTES {
        bail!("{} holds {} MiB, over the {} MiB a GPU machine is sent", dir.display(), bytes >> 20, LIMIT_BYTES >> 20);
    }
    println!("xtask: {} ready ({:.1} MiB). On a machine with an NVIDIA GPU:", dir.display(), bytes as f64 / 1048576.0);
    println!("  bash target/gpu-check/gpu-check.sh OUT_DIR    # writes OUT_DIR/summary.md, under 8 minutes");
    Ok(dir)
}

/// The test binaries the check runs, by the name it runs them under: the op and NCCL tests
/// of the worker, the cuda training tests; built with `features` (`cargo test --no-run`
/// names each executable in its JSON messages).
fn test_binaries(features: &[&str]) -> Result<Vec<(&'static str, PathBuf)>> {
    let out = crate::cargo()
        .args(["test", "--no-run", "--message-format=json"])
        .args(features)
        .args(["--test", "engine", "--test", "nccl", "--test", "cuda"])
        .output()
        .context("cannot start cargo test --no-run")?;
    if !out.status.success() {
        bail!("cargo test --no-run failed:\n{}", String::from_utf8_lossy(&out.stderr));
    }
    let wanted = [("distlab-worker", "engine"), ("distlab-worker", "nccl"), ("distlab-tests", "cuda")];
    let mut found = Vec::new();
    for line in String::from_utf8_lossy(&out.stdout).lines() {
        let Ok(message) = serde_json::from_str::<serde_json::Value>(line) else { continue };
        let (Some(exe), Some(name)) = (message["executable"].as_str(), message["target"]["name"].as_str()) else {
            continue;
        };
        let package = message["package_id"].as_str().unwrap_or_default();
        if let Some((_, test)) = wanted.iter().find(|(p, t)| *t == name && package_is(package, p)) {
            found.push((*test, PathBuf::from(exe)));
        }
    }
    if found.len() != wanted.len() {
        bail!("cargo test --no-run built {found:?}, not the {} test binaries the check runs", wanted.len());
    }
    Ok(found)
}

/// Whether a cargo package id (`path+file:///.../gpu-worker#distlab-worker@0.1.0`, or the
/// older `distlab-worker 0.1.0 (path+...)`) names package `name`.
fn package_is(id: &str, name: &str) -> bool {
    id.contains(&format!("#{name}@")) || id.starts_with(&format!("{name} "))
}

fn folder_bytes(dir: &Path) -> Result<u64> {
    let mut total = 0;
    for entry in std::fs::read_dir(dir)? {
        total += entry?.metadata()?.len();
    }
    Ok(total)
}

#[cfg(test)]
mod tests {
    use super::package_is;

    #[test]
    fn package_ids_of_both_cargo_formats_name_their_package() {
        assert!(package_is("path+file:///work/main/gpu-worker#distlab-worker@0.1.0", "distlab-worker"));
        assert!(package_is("distlab-tests 0.1.0 (path+file:///work/main/tests)", "distlab-tests"));
        assert!(!package_is("path+file:///work/main/gpu-worker#distlab-worker@0.1.0", "distlab-tests"));
    }
}
