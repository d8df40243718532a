// TEMPORARY profiling aid (to be deleted).
use std::time::Instant;
use distlab_worker::backend::gemm::{matmul, Mat, MatMut, Parallelism};

fn time<F: FnMut()>(name: &str, flops: f64, mut f: F) {
    for _ in 0..3 { f(); }
    let n = 20;
    let t0 = Instant::now();
    for _ in 0..n { f(); }
    let dt = t0.elapsed().as_secs_f64() / n as f64;
    eprintln!("{name:40} {:8.3} ms {:7.1} GFLOP/s", dt * 1e3, flops / dt / 1e9);
}

#[test]
#[ignore]
fn gemm_shapes() {
    let threads: usize = std::env::var("T").ok().and_then(|s| s.parse().ok()).unwrap_or(1);
    let par = if threads > 1 { Parallelism::Rayon(threads) } else { Parallelism::None };
    let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().unwrap();
    pool.install(|| {
    let rows = 2048;
    for (ci, co) in [(256, 768), (256, 256), (256, 1024), (1024, 256)] {
        let x = vec![0.5f32; rows * ci];
        let w = vec![0.25f32; ci * co];
        let dy = vec![0.1f32; rows * co];
        let mut y = vec![0.0f32; rows * co];
        let mut dx = vec![0.0f32; rows * ci];
        let mut dw = vec![0.0f32; ci * co];
        let fl = 2.0 * (rows * ci * co) as f64;
        time(&format!("fwd {rows}x{ci} . {ci}x{co}"), fl, || matmul(MatMut::row_major(&mut y, rows, co), true, Mat::row_major(&x, rows, ci), Mat::row_major(&w, ci, co), 1.0, par));
        time(&format!("dinp {rows}x{co} . ({ci}x{co})T"), fl, || matmul(MatMut::row_major(&mut dx, rows, ci), false, Mat::row_major(&dy, rows, co), Mat::row_major(&w, ci, co).t(), 1.0, par));
        time(&format!("dw ({rows}x{ci})T . {rows}x{co}"), fl, || matmul(MatMut::row_major(&mut dw, ci, co), true, Mat::row_major(&x, rows, ci).t(), Mat::row_major(&dy, rows, co), 1.0, par));
    }
    let (t, hs, c) = (128, 64, 256);
    let qkv = vec![0.3f32; t * 3 * c];
    let mut s = vec![0.0f32; t * t];
    let mut out = vec![0.0f32; t * c];
    let fl = 2.0 * (t * t * hs) as f64;
    time("att QK^T 128x64.64x128 (x64)", 64.0 * fl, || for _ in 0..64 { matmul(MatMut::row_major(&mut s, t, t), false, Mat::new(&qkv, t, hs, 3 * c, 1), Mat::new(&qkv[c..], t, hs, 3 * c, 1).t(), 0.125, Parallelism::None) });
    let p = s.clone();
    time("att PV 128x128.128x64 (x64)", 64.0 * fl, || for _ in 0..64 { matmul(MatMut::new(&mut out, t, hs, c, 1), false, Mat::row_major(&p, t, t), Mat::new(&qkv[2 * c..], t, hs, 3 * c, 1), 1.0, Parallelism::None) });
    let mut dqkv = vec![0.0f32; t * 3 * c];
    time("att P^T dY (x64)", 64.0 * fl, || for _ in 0..64 { matmul(MatMut::new(&mut dqkv[2*c..], t, hs, 3*c, 1), false, Mat::row_major(&p, t, t).t(), Mat::new(&out, t, hs, c, 1), 1.0, Parallelism::None) });
    time("att dS^T Q (x64)", 64.0 * fl, || for _ in 0..64 { matmul(MatMut::new(&mut dqkv[c..], t, hs, 3*c, 1), false, Mat::row_major(&p, t, t).t(), Mat::new(&qkv, t, hs, 3*c, 1), 1.0, Parallelism::None) });
    let n = 2048 * 1024;
    let x: Vec<f32> = (0..n).map(|i| (i as f32 * 1e-4).sin()).collect();
    let mut y = vec![0.0f32; n];
    time("gelu fwd 2M", 0.0, || distlab_worker::model::mlp::gelu_forward(&mut y, &x));
    time("gelu bwd 2M", 0.0, || distlab_worker::model::mlp::gelu_backward(&mut y, &x));
    });
}

#[test]
#[ignore]
fn dump_for_torch() {
    use distlab_common::ModelSpec;
    use distlab_worker::backend::CpuBackend;
    use distlab_worker::model::Gpt;
    let spec = ModelSpec { layers: 2, d_model: 16, heads: 4, seq_len: 70, vocab: 19 };
    let be = CpuBackend::<f64>::new(1);
    let batch = 3;
    let mut m = Gpt::new(&be, &spec, batch, 5);
    let mut rng = distlab_worker::rng::Rng::new(3);
    // bigger weights than init so the comparison is not trivially near-uniform
    for p in m.params.iter_mut() { *p = *p * 5.0 + 0.01 * rng.normal(); }
    let n = batch * spec.seq_len;
    let inputs: Vec<u32> = (0..n).map(|_| rng.below(19) as u32).collect();
    let targets: Vec<u32> = (0..n).map(|_| rng.below(19) as u32).collect();
    m.zero_grads(&be);
    let loss = m.forward(&be, &inputs, &targets) / n as f64;
    m.backward(&be, &inputs, &targets, 1.0 / n as f64);
    let tensors: Vec<serde_json::Value> = m.layout.tensors.iter().map(|t| serde_json::json!({"name": t.name, "start": t.range.start, "shape": t.shape})).collect();
    let out = serde_json::json!({"params": m.params, "grads": m.grads, "inputs": inputs, "targets": targets, "loss": loss, "tensors": tensors, "batch": batch,
        "layers": spec.layers, "d": spec.d_model, "heads": spec.heads, "t": spec.seq_len, "v": spec.vocab});
    std::fs::write("/tmp/gpt_dump.json", out.to_string()).unwrap();
}

#[test]
#[ignore]
fn split_vs_rayon() {
    use rayon::prelude::*;
    let pool = rayon::ThreadPoolBuilder::new().num_threads(2).build().unwrap();
    pool.install(|| {
        let rows = 2048;
        for (ci, co) in [(256, 768), (256, 256), (256, 1024), (1024, 256)] {
            let x = vec![0.5f32; rows * ci];
            let w = vec![0.25f32; ci * co];
            let dy = vec![0.1f32; rows * co];
            let mut y = vec![0.0f32; rows * co];
            let mut dx = vec![0.0f32; rows * ci];
            let mut dw = vec![0.0f32; ci * co];
            let fl = 2.0 * (rows * ci * co) as f64;
            time(&format!("rayon fwd {ci}x{co}"), fl, || matmul(MatMut::row_major(&mut y, rows, co), true, Mat::row_major(&x, rows, ci), Mat::row_major(&w, ci, co), 1.0, Parallelism::Rayon(2)));
            time(&format!("split fwd {ci}x{co}"), fl, || {
                y.par_chunks_mut(rows / 2 * co).zip(x.par_chunks(rows / 2 * ci)).for_each(|(yy, xx)| matmul(MatMut::row_major(yy, rows / 2, co), true, Mat::row_major(xx, rows / 2, ci), Mat::row_major(&w, ci, co), 1.0, Parallelism::None))
            });
            time(&format!("rayon dinp {ci}x{co}"), fl, || matmul(MatMut::row_major(&mut dx, rows, ci), false, Mat::row_major(&dy, rows, co), Mat::row_major(&w, ci, co).t(), 1.0, Parallelism::Rayon(2)));
            time(&format!("split dinp {ci}x{co}"), fl, || {
                dx.par_chunks_mut(rows / 2 * ci).zip(dy.par_chunks(rows / 2 * co)).for_each(|(dd, gg)| matmul(MatMut::row_major(dd, rows / 2, ci), false, Mat::row_major(gg, rows / 2, co), Mat::row_major(&w, ci, co).t(), 1.0, Parallelism::None))
            });
            time(&format!("rayon dw {ci}x{co}"), fl, || matmul(MatMut::row_major(&mut dw, ci, co), true, Mat::row_major(&x, rows, ci).t(), Mat::row_major(&dy, rows, co), 1.0, Parallelism::Rayon(2)));
            // split dW by rows of dW (input features): dW[i0..i1, :] = X[:, i0..i1]ᵀ dY
            time(&format!("split dw(rows) {ci}x{co}"), fl, || {
                dw.par_chunks_mut(ci / 2 * co).enumerate().for_each(|(i, d)| matmul(MatMut::row_major(d, ci / 2, co), true, Mat::new(&x[i * ci / 2..], rows, ci / 2, ci, 1).t(), Mat::row_major(&dy, rows, co), 1.0, Parallelism::None))
            });
        }
    });
}
