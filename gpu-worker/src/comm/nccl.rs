//! NCCL behind the same `Communicator` trait as the hand-written ring (cargo feature
//! `cuda`): the collectives a GPU cluster actually runs, with the same trace events at
//! collective granularity (NCCL's own ring or tree steps happen inside the library, so
//! there are no per-step records; `bytes_sent` counts what a ring would send, the
//! nccl-tests "bus bandwidth" accounting: 2(W-1)/W x D for all-reduce, (W-1)/W x D for
//! reduce-scatter and all-gather).
//!
//! Two ways in. [`NcclCommunicator::in_place`] works on GPU memory itself: the CUDA
//! backend hands it its buffers (`Backend::device_collective`), NCCL's stream waits for
//! the kernels queued before and the backend's stream for the collective, and nothing
//! passes through the host. The `Communicator` trait hands over host slices: those are
//! copied into GPU memory, reduced, and copied back (the path for host buffers). NCCL wants
//! every rank's chunk the same size, so uneven chunks (`chunk_range`) travel through a
//! buffer padded to the largest.
//!
//! The ranks of a group agree on an NCCL unique id before they start: the group's first
//! rank asks NCCL for one and broadcasts its 128 bytes over the launcher's rendezvous
//! (the ring communicator every rank already has), see [`share_unique_id`].

use std::sync::Arc;

use cudarc::driver::{CudaContext, CudaSlice, CudaStream, DevicePtr, DevicePtrMut, DeviceSlice, SyncOnDrop};
use cudarc::nccl::{Comm, Id, ReduceOp as NcclOp};
use distlab_common::trace::{CollectiveOp, CollectiveRecord};

use crate::comm::{chunk_range, CommError, Communicator, InPlace, ReduceOp, SharedBuffer};
use crate::trace::{now_us, CommTracer};

/// Bytes of an NCCL unique id.
pub const UNIQUE_ID_BYTES: usize = 128;

/// Why an NCCL communicator cannot be made here.
#[derive(Debug, thiserror::Error)]
pub enum NcclUnavailable {
    #[error("the CUDA driver library (libcuda.so) is not installed on this machine")]
    NoDriver,
    #[error("NCCL (libnccl.so.2) is not installed on this machine")]
    NoLibrary,
    #[error("CUDA: {0}")]
    Driver(#[from] cudarc::driver::DriverError),
    #[error("NCCL: {}", nccl_message(.0))]
    Nccl(cudarc::nccl::result::NcclError),
    #[error("sharing the NCCL unique id: {0}")]
    Rendezvous(#[from] CommError),
    #[error("rank {root} of the group could not make an NCCL unique id")]
    NoId { root: usize },
}

/// NCCL's name for what went wrong (cudarc's error prints only "NcclError").
fn nccl_message(e: &cudarc::nccl::result::NcclError) -> String {
    format!("{:?}", e.0)
}

/// Whether this machine has the CUDA driver and NCCL.
pub fn libraries_present() -> Result<(), NcclUnavailable> {
    if !unsafe { cudarc::driver::sys::is_culib_present() } {
        return Err(NcclUnavailable::NoDriver);
    }
    if !unsafe { cudarc::nccl::sys::is_culib_present() } {
        return Err(NcclUnavailable::NoLibrary);
    }
    Ok(())
}

/// A fresh NCCL unique id, as bytes (what the group's first rank sends to the others).
pub fn new_unique_id() -> Result<[u8; UNIQUE_ID_BYTES], NcclUnavailable> {
    libraries_present()?;
    let id = Id::new().map_err(NcclUnavailable::Nccl)?;
    Ok(id.internal().map(|c| c as u8))
}

/// Every rank of `group` gets the id that rank `root` passes in (the others pass None): one
/// byte per float, broadcast over the group, so every byte arrives exactly. When the root
/// could not make one, every rank gets an error (the root's, or one naming the root).
pub fn share_unique_id(
    group: &mut dyn Communicator,
    root: usize,
    id: Option<Result<[u8; UNIQUE_ID_BYTES], NcclUnavailable>>,
) -> Result<[u8; UNIQUE_ID_BYTES], NcclUnavailable> {
    /// What the root sends instead of an id it could not make (no byte is negative).
    const NO_ID: f32 = -1.0;
    let (mut carrier, failure) = match id {
        Some(Ok(bytes)) => (bytes.iter().map(|&b| b as f32).collect(), None),
        Some(Err(e)) => (vec![NO_ID; UNIQUE_ID_BYTES], Some(e)),
        None => (vec![0.0; UNIQUE_ID_BYTES], None),
    };
    group.broadcast(&mut carrier, root)?;
    if let Some(e) = failure {
        return Err(e);
    }
    if carrier[0] == NO_ID {
        return Err(NcclUnavailable::NoId { root });
    }
    Ok(std::array::from_fn(|i| carrier[i] as u8))
}

/// One group of ranks talking through NCCL on one GPU each.
pub struct NcclCommunicator {
    comm: Comm,
    stream: Arc<CudaStream>,
    /// Device copies of the host buffers: input and output of a collective.
    send: CudaSlice<f32>,
    recv: CudaSlice<f32>,
    name: String,
    /// Global ranks of the group, in NCCL rank order.
    members: Vec<usize>,
    me: usize,
    tracer: Option<Arc<CommTracer>>,
    seq: u64,
    bytes_sent: u64,
}

// SAFETY: an NCCL communicator may move between threads; it must not be used by two at
// once, which `&mut self` on every collective rules out. Each call first makes the GPU's
// context current on the calling thread (`upload`).
unsafe impl Send for NcclCommunicator {}

impl NcclCommunicator {
    /// Joins the NCCL group `unique_id` as rank `me` of `members.len()`, on GPU `ordinal`.
    /// Every member must call it (NCCL's init waits for all of them).
    pub fn new(
        ordinal: usize,
        unique_id: [u8; UNIQUE_ID_BYTES],
        me: usize,
        members: Vec<usize>,
        name: &str,
        tracer: Option<Arc<CommTracer>>,
    ) -> Result<Self, NcclUnavailable> {
        libraries_present()?;
        let ctx = CudaContext::new(ordinal)?;
        let stream = ctx.new_stream()?;
        let id = Id::uninit(unique_id.map(|b| b as ::core::ffi::c_char));
        let comm = Comm::from_rank(stream.clone(), me, members.len(), id).map_err(NcclUnavailable::Nccl)?;
        Ok(Self {
            comm,
            send: stream.alloc_zeros::<f32>(1)?,
            recv: stream.alloc_zeros::<f32>(1)?,
            stream,
            name: name.into(),
            members,
            me,
            tracer,
            seq: 0,
            bytes_sent: 0,
        })
    }

    fn device_error(&self, op: CollectiveOp, what: impl std::fmt::Display) -> CommError {
        CommError::Device { collective: format!("{} {}", self.name, op.as_str()), detail: what.to_string() }
    }

    fn nccl_error(&self, op: CollectiveOp, e: cudarc::nccl::result::NcclError) -> CommError {
        self.device_error(op, format!("NCCL: {}", nccl_message(&e)))
    }

    /// Grows the device buffers to hold `send_len` and `recv_len` floats.
    fn reserve(&mut self, op: CollectiveOp, send_len: usize, recv_len: usize) -> Result<(), CommError> {
        for (buf, len) in [(&mut self.send, send_len), (&mut self.recv, recv_len)] {
            if buf.len() < len {
                *buf = self.stream.alloc_zeros::<f32>(len).map_err(|e| CommError::Device {
                    collective: format!("{} {}", self.name, op.as_str()),
                    detail: e.to_string(),
                })?;
            }
        }
        Ok(())
    }

    fn upload(&mut self, op: CollectiveOp, host: &[f32], at: usize) -> Result<(), CommError> {
        self.stream.context().bind_to_thread().map_err(|e| self.device_error(op, e))?;
        if host.is_empty() {
            return Ok(());
        }
        let mut view = self.send.slice_mut(at..at + host.len());
        self.stream.memcpy_htod(host, &mut view).map_err(|e| self.device_error(op, e))
    }

    fn download(&self, op: CollectiveOp, from_recv: bool, at: usize, host: &mut [f32]) -> Result<(), CommError> {
        if host.is_empty() {
            return Ok(());
        }
        let buf = if from_recv { &self.recv } else { &self.send };
        self.stream.memcpy_dtoh(&buf.slice(at..at + host.len()), host).map_err(|e| self.device_error(op, e))?;
        self.stream.synchronize().map_err(|e| self.device_error(op, e))
    }

    fn nccl_op(op: ReduceOp) -> NcclOp {
        match op {
            ReduceOp::Sum => NcclOp::Sum,
            ReduceOp::Avg => NcclOp::Avg,
        }
    }

    fn record(&mut self, op: CollectiveOp, elements: usize, sent: u64, start_us: u64) {
        self.bytes_sent += sent;
        let id = self.seq;
        self.seq += 1;
        if let Some(tracer) = &self.tracer {
            let record = CollectiveRecord {
                id,
                op,
                group: self.name.clone(),
                ranks: self.members.iter().map(|&r| r as u32).collect(),
                elements: elements as u64,
                bytes_sent: sent,
                bytes_from_formula: true,
                start_us,
                end_us: now_us(),
                input: None,
                output: None,
            };
            tracer.record(record, Vec::new());
        }
    }

    /// The largest chunk when `len` is cut into one chunk per rank (NCCL's chunk size).
    fn padded_chunk(&self, len: usize) -> usize {
        len.div_ceil(self.members.len())
    }

    /// What a ring sends per rank for a reduce-scatter or all-gather of `len` floats.
    fn ring_half_bytes(&self, len: usize) -> u64 {
        let w = self.members.len() as u64;
        (len as u64 * 4) * (w - 1) / w
    }
}

/// A range of GPU memory the caller owns, as cudarc's NCCL calls take it: f32 at `ptr`,
/// `len` of them, ordered on `stream`.
struct Raw<'a> {
    ptr: u64,
    len: usize,
    stream: &'a Arc<CudaStream>,
}

impl DeviceSlice<f32> for Raw<'_> {
    fn len(&self) -> usize {
        self.len
    }
    fn stream(&self) -> &Arc<CudaStream> {
        self.stream
    }
}

impl DevicePtr<f32> for Raw<'_> {
    fn device_ptr<'a>(&'a self, _stream: &'a CudaStream) -> (u64, SyncOnDrop<'a>) {
        (self.ptr, SyncOnDrop::Sync(None))
    }
}

impl DevicePtrMut<f32> for Raw<'_> {
    fn device_ptr_mut<'a>(&'a mut self, _stream: &'a CudaStream) -> (u64, SyncOnDrop<'a>) {
        (self.ptr, SyncOnDrop::Sync(None))
    }
}

impl NcclCommunicator {
    /// The GPU this communicator's ranks talk from.
    pub fn ordinal(&self) -> usize {
        self.stream.context().ordinal()
    }

    /// Runs `op` on the `len` floats of GPU memory at `ptr` (on this communicator's GPU),
    /// ordered after everything queued on `caller`, and makes `caller` wait for it: the
    /// host does not wait, and the data never leaves the GPU. Chunks that NCCL cannot
    /// take in place (uneven ones) go through its padded buffers, device to device.
    ///
    /// # Safety
    /// `ptr..ptr + 4 * len` is live GPU memory of this communicator's GPU that nothing else
    /// writes until the collective is done on `caller`'s stream.
    pub unsafe fn in_place(
        &mut self,
        caller: &Arc<CudaStream>,
        ptr: u64,
        len: usize,
        op: InPlace,
    ) -> Result<(), CommError> {
        let kind = match op {
            InPlace::AllReduce(_) => CollectiveOp::AllReduce,
            InPlace::ReduceScatter(_) => CollectiveOp::ReduceScatter,
            InPlace::AllGather => CollectiveOp::AllGather,
        };
        let start = now_us();
        self.stream.context().bind_to_thread().map_err(|e| self.device_error(kind, e))?;
        self.stream.join(caller).map_err(|e| self.device_error(kind, e))?;
        let (w, chunk) = (self.members.len(), self.padded_chunk(len));
        if len.is_multiple_of(w) || matches!(op, InPlace::AllReduce(_)) {
            // NCCL works in place when the output (reduce-scatter) or the input (all-gather)
            // is this rank's own chunk of the buffer.
            let whole = Raw { ptr, len, stream: &self.stream };
            let mine = Raw { ptr: ptr + (self.me * chunk * 4) as u64, len: chunk, ..whole };
            match op {
                InPlace::AllReduce(r) => self.comm.all_reduce_in_place(&mut Raw { ..whole }, &Self::nccl_op(r)),
                InPlace::ReduceScatter(r) => self.comm.reduce_scatter(&whole, &mut Raw { ..mine }, &Self::nccl_op(r)),
                InPlace::AllGather => self.comm.all_gather(&mine, &mut Raw { ..whole }),
            }
            .map_err(|e| self.nccl_error(kind, e))?;
        } else {
            let at = |rank: usize| (rank * chunk * 4) as u64;
            let element = |i: usize| ptr + (i * 4) as u64;
            let mine = chunk_range(len, w, self.me);
            match op {
                InPlace::ReduceScatter(r) => {
                    self.reserve(kind, w * chunk, chunk)?;
                    for rank in 0..w {
                        let from = chunk_range(len, w, rank);
                        self.device_copy(kind, self.base(false) + at(rank), element(from.start), from.len())?;
                    }
                    let (send, mut recv) = (self.send.slice(0..w * chunk), self.recv.slice_mut(0..chunk));
                    self.comm
                        .reduce_scatter(&send, &mut recv, &Self::nccl_op(r))
                        .map_err(|e| self.nccl_error(kind, e))?;
                    self.device_copy(kind, element(mine.start), self.base(true), mine.len())?;
                }
                // (An all-reduce never comes here: NCCL runs it in place whatever its length.)
                InPlace::AllGather | InPlace::AllReduce(_) => {
                    self.reserve(kind, chunk, w * chunk)?;
                    self.device_copy(kind, self.base(false), element(mine.start), mine.len())?;
                    let (send, mut recv) = (self.send.slice(0..chunk), self.recv.slice_mut(0..w * chunk));
                    self.comm.all_gather(&send, &mut recv).map_err(|e| self.nccl_error(kind, e))?;
                    for rank in 0..w {
                        let to = chunk_range(len, w, rank);
                        self.device_copy(kind, element(to.start), self.base(true) + at(rank), to.len())?;
                    }
                }
            }
        }
        caller.join(&self.stream).map_err(|e| self.device_error(kind, e))?;
        let sent = match op {
            InPlace::AllReduce(_) => 2 * self.ring_half_bytes(len),
            _ => self.ring_half_bytes(len),
        };
        self.record(kind, len, sent, start);
        Ok(())
    }

    /// Where the padded send (or receive) buffer starts on the GPU.
    fn base(&self, recv: bool) -> u64 {
        let buf = if recv { &self.recv } else { &self.send };
        let (ptr, _sync) = buf.device_ptr(&self.stream);
        ptr
    }

    /// Copies `len` floats from `src` to `dst` on this communicator's stream.
    fn device_copy(&self, op: CollectiveOp, dst: u64, src: u64, len: usize) -> Result<(), CommError> {
        if len == 0 {
            return Ok(());
        }
        // SAFETY: both are ranges of `len` floats of live GPU memory (the caller's buffer,
        // or this communicator's, reserved for the call), ordered on this stream.
        unsafe { cudarc::driver::result::memcpy_dtod_async(dst, src, len * 4, self.stream.cu_stream()) }
            .map_err(|e| self.device_error(op, e))
    }
}

impl Communicator for NcclCommunicator {
    fn rank(&self) -> usize {
        self.me
    }

    /// NCCL carries f32 here: 2-byte communication is refused for cuda runs
    /// (`backends::unsupported_on_backend`) until NCCL's own bf16/fp16 path is used.
    fn set_wire(&mut self, _wire: distlab_common::Precision) {}

    fn size(&self) -> usize {
        self.members.len()
    }

    fn all_reduce(&mut self, buf: &mut [f32], op: ReduceOp) -> Result<(), CommError> {
        let (start, n, kind) = (now_us(), buf.len(), CollectiveOp::AllReduce);
        self.reserve(kind, n, 0)?;
        self.upload(kind, buf, 0)?;
        let done = self.comm.all_reduce_in_place(&mut self.send.slice_mut(0..n), &Self::nccl_op(op));
        done.map_err(|e| self.nccl_error(kind, e))?;
        self.download(kind, false, 0, buf)?;
        self.record(kind, n, 2 * self.ring_half_bytes(n), start);
        Ok(())
    }

    fn reduce_scatter(&mut self, input: &mut [f32], output: &mut [f32], op: ReduceOp) -> Result<(), CommError> {
        let (start, n, kind) = (now_us(), input.len(), CollectiveOp::ReduceScatter);
        let (w, chunk) = (self.members.len(), self.padded_chunk(n));
        let mine = chunk_range(n, w, self.me);
        if output.len() != mine.len() {
            return Err(CommError::BadBuffer {
                collective: format!("{} reduce_scatter", self.name),
                detail: format!("output holds {} floats, this rank's chunk of {n} is {}", output.len(), mine.len()),
            });
        }
        self.reserve(kind, w * chunk, chunk)?;
        // Chunk r of the input goes to padded slot r (the padding is never read back).
        for r in 0..w {
            self.upload(kind, &input[chunk_range(n, w, r)], r * chunk)?;
        }
        let done = self.comm.reduce_scatter(
            &self.send.slice(0..w * chunk),
            &mut self.recv.slice_mut(0..chunk),
            &Self::nccl_op(op),
        );
        done.map_err(|e| self.nccl_error(kind, e))?;
        self.download(kind, true, 0, output)?;
        self.record(kind, n, self.ring_half_bytes(n), start);
        Ok(())
    }

    fn all_gather(&mut self, input: &[f32], output: &mut [f32]) -> Result<(), CommError> {
        let (start, n, kind) = (now_us(), output.len(), CollectiveOp::AllGather);
        let (w, chunk) = (self.members.len(), self.padded_chunk(n));
        let mine = chunk_range(n, w, self.me);
        if input.len() != mine.len() {
            return Err(CommError::BadBuffer {
                collective: format!("{} all_gather", self.name),
                detail: format!("input holds {} floats, this rank's chunk of {n} is {}", input.len(), mine.len()),
            });
        }
        self.reserve(kind, chunk, w * chunk)?;
        self.upload(kind, input, 0)?;
        let done = self.comm.all_gather(&self.send.slice(0..chunk), &mut self.recv.slice_mut(0..w * chunk));
        done.map_err(|e| self.nccl_error(kind, e))?;
        for r in 0..w {
            let range = chunk_range(n, w, r);
            self.download(kind, true, r * chunk, &mut output[range])?;
        }
        self.record(kind, n, self.ring_half_bytes(n), start);
        Ok(())
    }

    fn reduce_scatter_in_place(&mut self, buf: &mut [f32], op: ReduceOp) -> Result<(), CommError> {
        let mine = chunk_range(buf.len(), self.members.len(), self.me);
        let mut out = vec![0.0; mine.len()];
        self.reduce_scatter(buf, &mut out, op)?;
        buf[mine].copy_from_slice(&out);
        Ok(())
    }

    fn all_gather_in_place(&mut self, buf: &mut [f32]) -> Result<(), CommError> {
        let mine = buf[chunk_range(buf.len(), self.members.len(), self.me)].to_vec();
        self.all_gather(&mine, buf)
    }

    /// NCCL has no all-to-all of its own: every peer's chunk goes by `ncclSend` and comes
    /// by `ncclRecv`, all of them inside one group so that NCCL runs them together (one
    /// after another they would deadlock, each rank waiting in its first send). This rank's
    /// own chunk is copied on the device. (W-1)/W x D sent, as the ring's.
    fn all_to_all(&mut self, input: &[f32], output: &mut [f32]) -> Result<(), CommError> {
        let (start, n, kind) = (now_us(), input.len(), CollectiveOp::AllToAll);
        let w = self.members.len();
        if output.len() != n || !n.is_multiple_of(w) {
            return Err(CommError::BadBuffer {
                collective: format!("{} all_to_all", self.name),
                detail: format!(
                    "input and output must be as long and cut into {w} equal chunks: {n} and {} floats",
                    output.len()
                ),
            });
        }
        self.reserve(kind, n, n)?;
        self.upload(kind, input, 0)?;
        let chunk = n / w;
        let (sent, received) = (self.base(false), self.base(true));
        let at = |base: u64, rank: usize| base + (rank * chunk * 4) as u64;
        cudarc::nccl::group_start().map_err(|e| self.nccl_error(kind, e))?;
        let mut queued = Ok(());
        for peer in (0..w).filter(|&p| p != self.me) {
            let to = Raw { ptr: at(sent, peer), len: chunk, stream: &self.stream };
            let mut from = Raw { ptr: at(received, peer), len: chunk, stream: &self.stream };
            queued = self.comm.send(&to, peer as i32).and_then(|()| self.comm.recv(&mut from, peer as i32).map(|_| ()));
            if queued.is_err() {
                break;
            }
        }
        // (the group is closed whatever happened inside it)
        let ended = cudarc::nccl::group_end();
        queued.and(ended).map_err(|e| self.nccl_error(kind, e))?;
        self.device_copy(kind, at(received, self.me), at(sent, self.me), chunk)?;
        self.download(kind, true, 0, output)?;
        self.record(kind, n, self.ring_half_bytes(n), start);
        Ok(())
    }

    fn broadcast(&mut self, buf: &mut [f32], root: usize) -> Result<(), CommError> {
        let (start, n, kind) = (now_us(), buf.len(), CollectiveOp::Broadcast);
        self.reserve(kind, n, 0)?;
        self.upload(kind, buf, 0)?;
        let done = self.comm.broadcast_in_place(&mut self.send.slice_mut(0..n), root as i32);
        done.map_err(|e| self.nccl_error(kind, e))?;
        self.download(kind, false, 0, buf)?;
        // Down a chain from the root, every rank but the last forwards the whole buffer.
        let w = self.members.len();
        let last = w > 1 && (self.me + w - root) % w == w - 1;
        self.record(kind, n, if w > 1 && !last { n as u64 * 4 } else { 0 }, start);
        Ok(())
    }

    fn send(&mut self, buf: &[f32], to: usize) -> Result<(), CommError> {
        let (start, n, kind) = (now_us(), buf.len(), CollectiveOp::Send);
        self.reserve(kind, n, 0)?;
        self.upload(kind, buf, 0)?;
        let done = self.comm.send(&self.send.slice(0..n), to as i32);
        done.map_err(|e| self.nccl_error(kind, e))?;
        self.stream.synchronize().map_err(|e| self.device_error(kind, e))?;
        self.record(kind, n, n as u64 * 4, start);
        Ok(())
    }

    fn recv(&mut self, buf: &mut [f32], from: usize) -> Result<(), CommError> {
        let (start, n, kind) = (now_us(), buf.len(), CollectiveOp::Recv);
        self.stream.context().bind_to_thread().map_err(|e| self.device_error(kind, e))?;
        self.reserve(kind, 0, n)?;
        let done = self.comm.recv(&mut self.recv.slice_mut(0..n), from as i32);
        done.map_err(|e| self.nccl_error(kind, e))?;
        self.download(kind, true, 0, buf)?;
        self.record(kind, n, 0, start);
        Ok(())
    }

    fn barrier(&mut self) -> Result<(), CommError> {
        let mut token = [0.0f32];
        self.all_reduce(&mut token, ReduceOp::Sum)
    }

    fn bytes_sent(&self) -> u64 {
        self.bytes_sent
    }

    fn nccl(&mut self) -> Option<&mut NcclCommunicator> {
        Some(self)
    }

    /// NCCL moves device memory, so there is nothing to share on the host: plain memory.
    fn alloc_shared(&mut self, len: usize) -> Result<SharedBuffer, CommError> {
        SharedBuffer::create(len).map(|(b, _)| b).map_err(|cause| CommError::Device {
            collective: format!("{} alloc_shared", self.name),
            detail: cause.to_string(),
        })
    }
}
