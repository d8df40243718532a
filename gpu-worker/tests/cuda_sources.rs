//! The CUDA backend's kernels (`backend::cuda::KERNELS`, compiled by NVRTC when a GPU
//! worker starts) read by g++ as C++, for each storage format, with a shim standing in for
//! CUDA's qualifiers and intrinsics (`cuda/shim.h`). On a machine without a GPU this is
//! what catches a kernel that would not compile, before a GPU worker fails to start on it.
//! It checks syntax and types, not what NVRTC alone knows (launch bounds, PTX); on a GPU
//! the op tests (`cargo xtask test --gpu`) compile and run them for real.
#![cfg(feature = "cuda")]

use std::io::Write;
use std::process::{Command, Stdio};

use distlab_worker::backend::cuda::KERNELS;

#[test]
fn the_kernels_compile_as_cpp_for_every_storage_format() {
    let shim = include_str!("cuda/shim.h");
    for format in ["ELEM_F32", "ELEM_BF16", "ELEM_F16"] {
        let mut gxx = Command::new("g++")
            .args(["-std=c++17", "-fsyntax-only", "-Wno-unknown-pragmas", "-x", "c++", "-"])
            .arg(format!("-D{format}"))
            .stdin(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("g++ (Debian's g++ package; it comes with the machine's C toolchain)");
        let source = format!("{shim}\n{KERNELS}");
        gxx.stdin.take().expect("stdin").write_all(source.as_bytes()).expect("write the source");
        let out = gxx.wait_with_output().expect("g++ runs");
        assert!(out.status.success(), "{format}: g++ rejects the kernels:\n{}", String::from_utf8_lossy(&out.stderr));
    }
}
