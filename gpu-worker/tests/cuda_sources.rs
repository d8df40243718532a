//! The CUDA backend's kernels (`backend::cuda::KERNELS`, compiled by NVRTC when a GPU
//! worker starts) read by g++ as C++, for each storage format, with a shim standing in for
//! CUDA's qualifiers and intrinsics (`cuda/shim.h`). On a machine without a GPU this is
//! what catches a kernel that would not compile, before a GPU worker fails to start on it.
//! It checks syntax and types, not what NVRTC alone knows (launch bounds, PTX); on a GPU
//! the op tests (`cargo xtask test --gpu`) compile and run them for real. NVIDIA's own
//! compilers, NVRTC and ptxas, also compile them here (the last test), without a GPU.
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

/// The f16 kernels' conversions (`load` / `store` in `cuda_prelude.cu`, plain C so that the
/// emulated GPU runs the same code as a GPU) against the `half` crate the CPU backend uses:
/// every one of the 65,536 halves to float, and floats to half (every 997th bit pattern,
/// and the edges: the largest half, the first float that rounds to infinity, the smallest
/// normal, the halfway points around the smallest subnormal, infinities, NaNs).
#[test]
fn the_f16_kernels_round_as_the_cpu_does() {
    let dir = tempfile::tempdir().expect("temp dir");
    let program = format!(
        "{}\n#define ELEM_F16\n{}\n{}",
        include_str!("cuda/shim.h"),
        distlab_worker::backend::cuda::KERNELS.split("#define WARP").next().expect("the prelude"),
        r#"#include <stdio.h>
        int main() {
            for (unsigned h = 0; h < 65536; h++) { float f = load((elem)h); fwrite(&f, 4, 1, stdout); }
            unsigned edges[] = {0x477fe000u, 0x477fefffu, 0x477ff000u, 0x38800000u, 0x387fffffu, 0x33000000u,
                                0x33000001u, 0x32ffffffu, 0x7f800000u, 0xff800000u, 0x7fc00000u, 0x7f800001u};
            for (unsigned u : edges) { elem h = store(__uint_as_float(u)); fwrite(&h, 2, 1, stdout); }
            for (unsigned long long b = 0; b < (1ull << 32); b += 997) {
                elem h = store(__uint_as_float((unsigned)b)); fwrite(&h, 2, 1, stdout);
            }
        }"#
    );
    let source = dir.path().join("f16.cpp");
    std::fs::write(&source, program).expect("write");
    let binary = dir.path().join("f16");
    let built = Command::new("g++").args(["-std=c++17", "-O2", "-o"]).arg(&binary).arg(&source).output().expect("g++");
    assert!(built.status.success(), "g++: {}", String::from_utf8_lossy(&built.stderr));
    let out = Command::new(&binary).output().expect("run the conversions").stdout;
    let (loads, stores) = out.split_at(65536 * 4);
    for (h, bytes) in loads.chunks_exact(4).enumerate() {
        let got = f32::from_le_bytes(bytes.try_into().unwrap());
        let want = half::f16::from_bits(h as u16).to_f32();
        assert!(got.to_bits() == want.to_bits() || (got.is_nan() && want.is_nan()), "load({h:#06x}): {got} vs {want}");
    }
    let edges = [
        0x477fe000u32,
        0x477fefff,
        0x477ff000,
        0x38800000,
        0x387fffff,
        0x33000000,
        0x33000001,
        0x32ffffff,
        0x7f800000,
        0xff800000,
        0x7fc00000,
        0x7f800001,
    ];
    let inputs = edges.into_iter().chain((0..1u64 << 32).step_by(997).map(|b| b as u32));
    let mut checked = 0;
    for (bits, got) in inputs.zip(stores.chunks_exact(2)) {
        let got = u16::from_le_bytes(got.try_into().unwrap());
        let want = half::f16::from_f32(f32::from_bits(bits)).to_bits();
        assert_eq!(got, want, "store({bits:#010x} = {})", f32::from_bits(bits));
        checked += 1;
    }
    assert_eq!(checked, edges.len() + (1usize << 32).div_ceil(997));
}

/// Compute capabilities the kernels are compiled for here: the A100's and the H100/H200's.
const ARCHITECTURES: [(i32, i32); 2] = [(8, 0), (9, 0)];

/// Kernels allowed to spill registers to local memory, each with the reason it is worth it.
const SPILLS_ALLOWED: [(&str, &str); 0] = [];

/// What ptxas reports of one compiled kernel.
#[derive(Debug, Default)]
struct KernelReport {
    name: String,
    registers: u32,
    spill_stores: u32,
    spill_loads: u32,
    stack: u32,
    shared: u32,
}

/// The kernels' reports in `ptxas -v`'s output: "Function properties for NAME", its frame
/// line ("N bytes stack frame, N bytes spill stores, N bytes spill loads"), then "Used N
/// registers, ..., N bytes smem, ...".
fn parse_ptxas(report: &str) -> Vec<KernelReport> {
    let number_before = |line: &str, unit: &str| -> u32 {
        line.split(',')
            .find(|part| part.contains(unit))
            .and_then(|part| part.split_whitespace().find_map(|w| w.parse().ok()))
            .unwrap_or(0)
    };
    let mut kernels: Vec<KernelReport> = Vec::new();
    for line in report.lines() {
        if let Some(name) = line.split("Function properties for ").nth(1) {
            kernels.push(KernelReport { name: name.trim().to_string(), ..KernelReport::default() });
        } else if let Some(k) = kernels.last_mut() {
            if line.contains("bytes stack frame") {
                k.stack = number_before(line, "stack frame");
                k.spill_stores = number_before(line, "spill stores");
                k.spill_loads = number_before(line, "spill loads");
            } else if line.contains("Used") && line.contains("registers") {
                k.registers = number_before(line, "registers");
                k.shared = number_before(line, "smem");
            }
        }
    }
    kernels
}

/// NVIDIA's own compilers on every kernel, no GPU needed: NVRTC through the backend's own
/// `compile_kernels`, for each storage format and architecture, every kernel the backend
/// loads present in the PTX; then ptxas turns each PTX into machine code and reports each
/// kernel's registers, spills and shared memory (the table is written to
/// `target/tmp/cuda-kernels.md`). No kernel spills but those `SPILLS_ALLOWED` names.
/// `cargo xtask test` installs NVRTC and ptxas from the Python package index.
#[test]
fn nvrtc_and_ptxas_compile_every_kernel_for_every_format_and_architecture() {
    use distlab_worker::backend::cuda::{compile_kernels, kernel_names};
    let ptxas = std::env::var("DISTLAB_PTXAS").unwrap_or_else(|_| "ptxas".into());
    let dir = tempfile::tempdir().expect("temp dir");
    let mut table = String::from(
        "| format | arch | kernel | registers | spill stores (B) | spill loads (B) | stack (B) | shared (B) |\n\
         | --- | --- | --- | ---: | ---: | ---: | ---: | ---: |\n",
    );
    let mut spills = Vec::new();
    for format in ["ELEM_F32", "ELEM_BF16", "ELEM_F16"] {
        for (major, minor) in ARCHITECTURES {
            let ptx = compile_kernels(format, major, minor).unwrap_or_else(|e| {
                panic!(
                    "{format} sm_{major}{minor}: {e} (cargo xtask test installs NVRTC; by hand, put its lib \
                     folder on LD_LIBRARY_PATH)"
                )
            });
            let source = ptx.to_src();
            for name in kernel_names() {
                assert!(source.contains(&format!(".entry {name}(")), "{format} sm_{major}{minor}: no kernel {name}");
            }
            let file = dir.path().join(format!("{format}-sm_{major}{minor}.ptx"));
            std::fs::write(&file, &source).expect("write the PTX");
            let out = Command::new(&ptxas)
                .arg(format!("-arch=sm_{major}{minor}"))
                .arg("-v")
                .arg(&file)
                .arg("-o")
                .arg(file.with_extension("cubin"))
                .output()
                .unwrap_or_else(|e| panic!("{ptxas}: {e} (cargo xtask test installs it; or set DISTLAB_PTXAS)"));
            let report = String::from_utf8_lossy(&out.stderr);
            assert!(out.status.success(), "{format} sm_{major}{minor}: ptxas rejects the PTX:\n{report}");
            let kernels = parse_ptxas(&report);
            let mut names: Vec<&str> = kernels.iter().map(|k| k.name.as_str()).collect();
            names.sort_unstable();
            let mut expected = kernel_names();
            expected.sort_unstable();
            assert_eq!(names, expected, "{format} sm_{major}{minor}: ptxas's kernels\n{report}");
            for k in &kernels {
                table.push_str(&format!(
                    "| {} | sm_{major}{minor} | {} | {} | {} | {} | {} | {} |\n",
                    format.trim_start_matches("ELEM_").to_lowercase(),
                    k.name,
                    k.registers,
                    k.spill_stores,
                    k.spill_loads,
                    k.stack,
                    k.shared
                ));
                let allowed = SPILLS_ALLOWED.iter().any(|(name, _)| *name == k.name);
                if (k.spill_stores > 0 || k.spill_loads > 0) && !allowed {
                    spills.push(format!("{format} sm_{major}{minor} {}", k.name));
                }
            }
        }
    }
    let kept = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join("cuda-kernels.md");
    std::fs::write(&kept, &table).expect("write the table");
    println!("{table}\n(kept in {})", kept.display());
    assert!(spills.is_empty(), "kernels that spill registers, with no reason given in SPILLS_ALLOWED: {spills:?}");
}
