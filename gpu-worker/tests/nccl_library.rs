//! NCCL installed under its real name only (`libnccl.so.2`, as NVIDIA's Python wheels ship
//! it), which cudarc never asks the loader for: the launcher links it into the run's folder
//! and puts that first on the rank processes' `LD_LIBRARY_PATH`, and there cudarc finds it.
//! A stand-in `libnccl.so.2` (one function, built by gcc) plays NCCL; the loader's search
//! path is fixed when a process starts, so each step runs in a child process of this test.
#![cfg(feature = "cuda")]

use std::path::Path;
use std::process::Command;

use distlab_worker::comm::nccl_library::rank_library_path;

const STEP: &str = "DISTLAB_NCCL_LIBRARY_STEP";
const TEST: &str = "ranks_find_nccl_installed_under_its_real_name_only";

fn nccl_found_by_cudarc() -> bool {
    unsafe { cudarc::nccl::sys::is_culib_present() }
}

/// This test again, in a child process with `env`: its stdout.
fn step(name: &str, env: &[(&str, &str)]) -> String {
    let out = Command::new(std::env::current_exe().expect("this test's binary"))
        .args([TEST, "--exact", "--nocapture", "--test-threads=1"])
        .env(STEP, name)
        .envs(env.iter().copied())
        .output()
        .expect("run this test's binary");
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(out.status.success(), "step {name} failed:\n{stdout}\n{}", String::from_utf8_lossy(&out.stderr));
    stdout
}

#[test]
fn ranks_find_nccl_installed_under_its_real_name_only() {
    match std::env::var(STEP).as_deref() {
        // The worker, where the loader finds only libnccl.so.2: cudarc does not find it;
        // the launcher's path for the ranks names a link to it.
        Ok("worker") => {
            assert!(!nccl_found_by_cudarc(), "cudarc finds libnccl.so.2 by itself now: the link is not needed");
            let run_dir = std::env::var("RUN_DIR").expect("RUN_DIR");
            let (var, path) = rank_library_path(Path::new(&run_dir)).expect("a library path for the ranks");
            assert_eq!(var, "LD_LIBRARY_PATH");
            println!("\nRANK_PATH={path}");
            return;
        }
        // A rank started with that path: cudarc finds NCCL.
        Ok("rank") => {
            assert!(nccl_found_by_cudarc(), "a rank does not find NCCL through the link");
            return;
        }
        _ => {}
    }
    if nccl_found_by_cudarc() {
        println!("this machine has NCCL under a name cudarc finds: nothing to show here");
        return;
    }
    let dir = tempfile::tempdir().expect("temp dir");
    let (nccl_dir, run_dir) = (dir.path().join("site-packages/nvidia/nccl/lib"), dir.path().join("run"));
    std::fs::create_dir_all(&nccl_dir).expect("dir");
    let source = dir.path().join("nccl.c");
    std::fs::write(&source, "int ncclGetVersion(int *version) { *version = 22703; return 0; }\n").expect("write");
    let built = Command::new("gcc")
        .args(["-shared", "-fPIC", "-Wl,-soname,libnccl.so.2", "-o"])
        .arg(nccl_dir.join("libnccl.so.2"))
        .arg(&source)
        .status()
        .expect("gcc");
    assert!(built.success(), "gcc could not build the stand-in NCCL");
    let nccl_path = nccl_dir.to_string_lossy().into_owned();
    let printed = step("worker", &[("LD_LIBRARY_PATH", &nccl_path), ("RUN_DIR", &run_dir.to_string_lossy())]);
    let rank_path = printed
        .lines()
        .find_map(|l| l.split("RANK_PATH=").nth(1))
        .unwrap_or_else(|| panic!("no path printed:\n{printed}"));
    let link = run_dir.join("lib/libnccl.so");
    assert!(rank_path.starts_with(&*run_dir.join("lib").to_string_lossy()), "{rank_path}");
    assert_eq!(std::fs::read_link(&link).expect("a link"), nccl_dir.join("libnccl.so.2"));
    step("rank", &[("LD_LIBRARY_PATH", rank_path)]);
}
