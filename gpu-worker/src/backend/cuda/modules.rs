//! The kernels' module: every `.cu` file as one CUDA C source ([`KERNELS`]), compiled by
//! NVRTC for a storage format and a GPU ([`compile_kernels`], once per process), and loaded
//! into a context by name ([`load_kernels`]).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use cudarc::driver::{CudaContext, CudaFunction};
use cudarc::nvrtc::{compile_ptx_with_opts, CompileOptions, Ptx};

use super::CudaUnavailable;

/// The kernels' CUDA C: what they share, then every op's kernels from the file beside its
/// CPU kernel, as one source for NVRTC.
pub const KERNELS: &str = concat!(
    include_str!("cuda_prelude.cu"),
    include_str!("cuda_reductions.cu"),
    include_str!("../../ops/embedding.cu"),
    include_str!("../../ops/layernorm.cu"),
    include_str!("../../ops/linear.cu"),
    include_str!("../../ops/mlp.cu"),
    include_str!("../../ops/attention.cu"),
    include_str!("../../ops/flash_attention.cu"),
    include_str!("../../ops/loss.cu"),
    include_str!("../../ops/optimizer.cu"),
);
/// Every kernel of [`KERNELS`] the backend calls.
pub const KERNEL_NAMES: [&str; 27] = [
    "fill",
    "add",
    "widen",
    "narrow",
    "partial_sums",
    "add_column_partials",
    "column_partials",
    "encoder_forward",
    "encoder_backward_wte",
    "encoder_backward_wpe",
    "layernorm_forward",
    "layernorm_backward_input",
    "layernorm_param_partials",
    "add_bias",
    "gelu_forward",
    "gelu_backward",
    "causal_softmax_forward",
    "causal_softmax_backward",
    "flash_attention_forward",
    "flash_attention_delta",
    "flash_attention_backward_query",
    "flash_attention_backward_key",
    "crossentropy_forward",
    "crossentropy_backward",
    "adamw",
    "head_pointers",
    "sgd",
];

/// [`KERNELS`] compiled by NVRTC into PTX for storage format `define` (a
/// [`DeviceElem::DEFINE`]) and compute capability `major`.`minor`: what every backend of
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

/// The kernels of [`KERNEL_NAMES`] compiled for format `define` (a
/// [`DeviceElem::DEFINE`](crate::ops::cuda::DeviceElem::DEFINE)) and `ctx`'s GPU, compute
/// capability `major`.`minor`, loaded into `ctx`.
pub(super) fn load_kernels(
    ctx: &Arc<CudaContext>,
    define: &str,
    (major, minor): (i32, i32),
) -> Result<HashMap<&'static str, CudaFunction>, CudaUnavailable> {
    let module = ctx.load_module(compile_kernels(define, major, minor)?)?;
    let mut kernels = HashMap::new();
    for name in KERNEL_NAMES {
        kernels.insert(name, module.load_function(name)?);
    }
    Ok(kernels)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_kernel_named_here_is_in_the_source() {
        for name in KERNEL_NAMES {
            let declaration = format!("extern \"C\" __global__ void {name}(");
            assert!(KERNELS.contains(&declaration), "{name} is not a kernel of the .cu files");
        }
    }
}
