//! What a run's devices could do at best, the denominator of its MFU (model FLOP
//! utilisation: the model's FLOPs per second over this peak).
//!
//! - CPU: one thread's FMA peak, measured once per worker process (`machine_limits`:
//!   fused multiply-adds on independent registers in the widest vectors the CPU has, sampled
//!   briefly (`Sampling::QUICK`): a small run's own time is not spent on its yardstick), times
//!   the threads the run's ranks use here, at most the machine's cores.
//! - GPU: the datasheet's dense peak of the run's precision (FP32 without tensor cores,
//!   BF16/FP16 on them) for the GPUs named below, times the GPUs the ranks use; for
//!   another GPU the run reports no peak and no MFU rather than a guess.

use std::sync::OnceLock;

use distlab_common::{BackendKind, DevicePeak, ExperimentSpec, Precision};
use distlab_worker::machine_limits::{fma_peak, FmaPeak, Sampling};

/// One thread's FMA peak on this machine, measured on first use (`Sampling::QUICK`).
pub fn cpu_thread_peak() -> FmaPeak {
    static PEAK: OnceLock<FmaPeak> = OnceLock::new();
    *PEAK.get_or_init(|| fma_peak(1, Sampling::QUICK))
}

/// This machine's cores.
fn cores() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

/// The peak of what a run of `spec` used: `ranks_here` ranks of `threads_per_rank` kernel
/// threads on this machine, and `hosts` machines like it.
pub fn run_peak(spec: &ExperimentSpec, ranks_here: usize, threads_per_rank: usize, hosts: usize) -> Option<DevicePeak> {
    let (per_host, basis) = match spec.backend {
        BackendKind::Cpu => cpu_peak(ranks_here * threads_per_rank.max(1)),
        BackendKind::Cuda => gpu_peak(spec.train.precision, ranks_here)?,
    };
    let hosts = hosts.max(1);
    let basis = if hosts > 1 { format!("{basis}, x {hosts} hosts (each taken to be like this one)") } else { basis };
    Some(DevicePeak { flops_per_s: per_host * hosts as f64, basis })
}

/// `threads` threads' FMA peak (at most one per core) on this machine, and how it was found.
fn cpu_peak(threads: usize) -> (f64, String) {
    let one = cpu_thread_peak();
    let used = threads.clamp(1, cores());
    let basis = format!(
        "{} FMA peak measured when the worker started: {:.1} GFLOP/s per thread x {used} thread{}",
        one.isa,
        one.gflops_per_s,
        if used == 1 { "" } else { "s" }
    );
    (one.gflops_per_s * 1e9 * used as f64, basis)
}

/// The dense peak, in TFLOP/s, of a GPU named `name` for `precision` (NVIDIA's datasheets:
/// FP32 on the CUDA cores, BF16/FP16 on the tensor cores without sparsity); None for a GPU
/// not in this list.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub fn gpu_datasheet_tflops(name: &str, precision: Precision) -> Option<f64> {
    let (fp32, half) = if name.contains("H200") || (name.contains("H100") && !name.contains("PCIe")) {
        (67.0, 989.4)
    } else if name.contains("H100") {
        (51.0, 756.0)
    } else if name.contains("A100") {
        (19.5, 312.0)
    } else {
        return None;
    };
    Some(if precision == Precision::Fp32 { fp32 } else { half })
}

/// The peak of the GPUs `ranks` ranks use on this machine (one each, shared when there are
/// more ranks than GPUs); None when the GPU is not one the datasheet table knows.
#[cfg(feature = "cuda")]
fn gpu_peak(precision: Precision, ranks: usize) -> Option<(f64, String)> {
    let gpus = distlab_worker::backend::cuda::devices().ok()?;
    let first = gpus.first()?;
    let tflops = gpu_datasheet_tflops(&first.label, precision)?;
    let used = ranks.clamp(1, gpus.len());
    let basis = format!("datasheet dense {precision:?} peak of {}: {tflops} TFLOP/s x {used} GPU(s)", first.label);
    Some((tflops * 1e12 * used as f64, basis))
}

#[cfg(not(feature = "cuda"))]
fn gpu_peak(_precision: Precision, _ranks: usize) -> Option<(f64, String)> {
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_cpu_run_counts_its_threads_up_to_the_cores() {
        let spec = ExperimentSpec::default();
        let one = cpu_thread_peak().gflops_per_s * 1e9;
        assert!(one > 0.0);
        let peak = run_peak(&spec, 1, 1, 1).unwrap();
        assert_eq!(peak.flops_per_s, one);
        assert!(peak.basis.contains("x 1 thread"), "{}", peak.basis);
        let many = run_peak(&spec, 64, 64, 1).unwrap();
        assert_eq!(many.flops_per_s, one * cores() as f64, "more threads than cores count the cores");
        assert_eq!(run_peak(&spec, 1, 1, 3).unwrap().flops_per_s, 3.0 * one);
    }

    #[test]
    fn the_datasheet_knows_its_gpus_and_no_others() {
        assert_eq!(gpu_datasheet_tflops("cuda:0 NVIDIA H100 80GB HBM3 (79 GiB)", Precision::Bf16), Some(989.4));
        assert_eq!(gpu_datasheet_tflops("cuda:0 NVIDIA H100 PCIe (80 GiB)", Precision::Fp32), Some(51.0));
        assert_eq!(gpu_datasheet_tflops("cuda:0 NVIDIA H200 (140 GiB)", Precision::Fp16), Some(989.4));
        assert_eq!(gpu_datasheet_tflops("cuda:0 NVIDIA A100-SXM4-80GB (79 GiB)", Precision::Fp32), Some(19.5));
        assert_eq!(gpu_datasheet_tflops("cuda:0 emulated", Precision::Bf16), None);
    }
}
