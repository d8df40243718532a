//! The kernels' module: every `.cu` file as one CUDA C source ([`KERNELS`]), compiled by
//! NVRTC for a storage format and a GPU ([`compile_kernels`], once per process), and every
//! kernel in it ([`kernel_names`]) loaded into a context by name ([`load_kernels`]).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use cudarc::driver::{CudaContext, CudaFunction};
use cudarc::nvrtc::{compile_ptx_with_opts, CompileOptions, Ptx};

use super::CudaUnavailable;

/// The kernels' CUDA C: what they share, then every op's kernels from the file beside its
/// CPU kernel and its launch (`ops/<op>.cu`, listed in `ops/mod.rs`), as one source for NVRTC.
pub const KERNELS: &str =
    concat!(include_str!("cuda_prelude.cu"), include_str!("cuda_reductions.cu"), crate::ops::cuda_sources!());

/// How each kernel of [`KERNELS`] is declared, its name and parameters following.
const DECLARATION: &str = "extern \"C\" __global__ void ";

/// Every kernel of [`KERNELS`], by name (each `extern "C" __global__` function), in source
/// order: what the backend loads, so a new op's `.cu` needs no list of its own.
pub fn kernel_names() -> Vec<&'static str> {
    KERNELS.split(DECLARATION).skip(1).map(|rest| &rest[..rest.find('(').expect("a kernel's parameters")]).collect()
}

/// [`KERNELS`] compiled by NVRTC into PTX for storage format `define` (a
/// [`DeviceElem::DEFINE`](crate::ops::cuda::DeviceElem::DEFINE)) and compute capability `major`.`minor`: what every backend of
/// this process on such a GPU loads, compiled once (each rank, each op test, asks again).
pub fn compile_kernels(define: &str, major: i32, minor: i32) -> Result<Ptx, CudaUnavailable> {
    /// (format, major, minor): what a compile is for.
    type Target = (String, i32, i32);
    static COMPILED: Mutex<Vec<(Target, Ptx)>> = Mutex::new(Vec::new());
    let key = (define.to_string(), major, minor);
    let mut compiled = COMPILED.lock().unwrap_or_else(|e| e.into_inner());
    if let Some((_, ptx)) = compiled.iter().find(|(k, _)| *k == key) {
        return Ok(ptx.clone());
    }
    if !unsafe { cudarc::nvrtc::sys::is_culib_present() } {
        return Err(CudaUnavailable::NoLibrary("NVRTC (libnvrtc.so)"));
    }
    let options = CompileOptions {
        // No contraction of a * b + c into one rounding: the CPU's kernels round each step.
        options: vec![
            format!("-D{define}"),
            format!("--gpu-architecture=compute_{major}{minor}"),
            "--fmad=false".to_string(),
        ],
        ..Default::default()
    };
    let ptx = compile_ptx_with_opts(KERNELS, options).map_err(|e| CudaUnavailable::Compile(e.to_string()))?;
    compiled.push((key, ptx.clone()));
    Ok(ptx)
}

/// The kernels of [`KERNELS`] compiled for format `define` (a
/// [`DeviceElem::DEFINE`](crate::ops::cuda::DeviceElem::DEFINE)) and `ctx`'s GPU, compute
/// capability `major`.`minor`, loaded into `ctx`.
pub(super) fn load_kernels(
    ctx: &Arc<CudaContext>,
    define: &str,
    (major, minor): (i32, i32),
) -> Result<HashMap<&'static str, CudaFunction>, CudaUnavailable> {
    let module = ctx.load_module(compile_kernels(define, major, minor)?)?;
    let mut kernels = HashMap::new();
    for name in kernel_names() {
        kernels.insert(name, module.load_function(name)?);
    }
    Ok(kernels)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every `__global__` function is found by its declaration, once, by a plain name.
    #[test]
    fn every_kernel_of_the_source_is_named_once() {
        let names = kernel_names();
        assert_eq!(names.len(), KERNELS.matches("__global__").count(), "a kernel declared otherwise: {names:?}");
        for name in &names {
            assert!(
                !name.is_empty() && name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_'),
                "a kernel named {name:?}"
            );
        }
        let mut distinct = names.clone();
        distinct.sort_unstable();
        distinct.dedup();
        assert_eq!(distinct.len(), names.len(), "a kernel declared twice: {names:?}");
        assert!(names.contains(&"layernorm_forward") && names.contains(&"adamw"), "{names:?}");
    }
}
