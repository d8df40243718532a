//! The CUDA backend's optimizer state: AdamW's moments and the master weights in GPU
//! memory ([`DeviceOptimizerBuffers`], made and read here), updated by the optimizer op's
//! kernels (`ops/optimizer.rs` launches them).

use std::ops::Range;

use cudarc::driver::CudaSlice;

use super::CudaBackend;
use crate::backend::OptimizerKernels;
use crate::ops::cuda::{DeviceElem, DeviceView, DeviceViewMut};
use crate::ops::optimizer::cuda::DeviceOptimizerBuffers;
use crate::ops::optimizer::{self, needs_master, OptimizerSlices, OptimizerState, TrustPass, Update};

impl<S: DeviceElem> CudaBackend<S> {
    fn download_f32(&self, buf: &CudaSlice<f32>) -> Vec<f32> {
        let mut host = vec![0.0; buf.len()];
        if !host.is_empty() {
            self.launcher.stream.memcpy_dtoh(buf, &mut host).expect("CUDA download");
            self.launcher.stream.synchronize().expect("CUDA stream synchronize");
        }
        host
    }
}

impl<S: DeviceElem> OptimizerKernels for CudaBackend<S> {
    type OptimizerBuffers = DeviceOptimizerBuffers;

    /// The optimizer's state in GPU memory for `len` parameters: AdamW's moments (with
    /// `moments`), and the master weights of a bf16/fp16 model, starting from `initial`, the
    /// parameters' fp32 values (as the CPU optimizer does).
    fn optimizer_buffers(
        &self,
        len: usize,
        moments: bool,
        initial: impl FnOnce() -> Vec<f32>,
    ) -> DeviceOptimizerBuffers {
        let master = needs_master::<S>().then(|| {
            let values = initial();
            assert_eq!(values.len(), len, "master weights for every parameter");
            self.launcher.stream.clone_htod(&values).expect("CUDA upload")
        });
        let moments = moments.then(|| (self.launcher.scratch::<f32>(len), self.launcher.scratch::<f32>(len)));
        DeviceOptimizerBuffers { len, moments, master }
    }

    fn optimizer_update(
        &self,
        params: DeviceViewMut<'_, S>,
        grads: DeviceView<'_, S>,
        state: &mut DeviceOptimizerBuffers,
        range: Range<usize>,
        update: &Update,
    ) {
        optimizer::cuda::optimizer_update(&self.launcher, params, grads, state, range, update);
    }

    fn trust_squares(
        &self,
        params: DeviceView<'_, S>,
        grads: DeviceView<'_, S>,
        state: &DeviceOptimizerBuffers,
        range: Range<usize>,
        pass: &TrustPass,
    ) -> (f64, f64) {
        optimizer::cuda::trust_squares(&self.launcher, params, grads, state, range, pass)
    }

    fn read_optimizer_buffers<R>(
        &self,
        buffers: &DeviceOptimizerBuffers,
        f: impl FnOnce(OptimizerSlices<'_>) -> R,
    ) -> R {
        let len = buffers.len;
        let (m, v) = match &buffers.moments {
            Some((m, v)) => (self.download_f32(m), self.download_f32(v)),
            None => (Vec::new(), Vec::new()),
        };
        let master = buffers.master.as_ref().map(|w| self.download_f32(w));
        let (m, v) = (&m[..m.len().min(len)], &v[..v.len().min(len)]);
        f(OptimizerSlices { m, v, master: master.as_deref() })
    }

    fn load_optimizer_buffers(
        &self,
        buffers: &mut DeviceOptimizerBuffers,
        saved: &OptimizerState,
    ) -> Result<(), String> {
        let len = buffers.len;
        let moments = if buffers.moments.is_some() { len } else { 0 };
        let master = if buffers.master.is_some() { len } else { 0 };
        saved.check_lengths(moments, master)?;
        let saved_master = saved.master.as_deref().unwrap_or_default();
        let put = |buf: &mut CudaSlice<f32>, values: &[f32]| {
            if !values.is_empty() {
                self.launcher.stream.memcpy_htod(values, &mut buf.slice_mut(0..values.len())).expect("CUDA upload");
            }
        };
        if let Some((m, v)) = &mut buffers.moments {
            put(m, &saved.m);
            put(v, &saved.v);
        }
        if let Some(w) = &mut buffers.master {
            put(w, saved_master);
        }
        self.launcher.stream.synchronize().expect("CUDA stream synchronize");
        Ok(())
    }
}
