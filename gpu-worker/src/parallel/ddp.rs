//! Distributed data parallel (DDP).
//!
//! Every rank holds the whole model and takes a disjoint slice of each step's global
//! batch. After backward every rank must hold the SUM of all ranks' gradients (each
//! token's loss is already weighted by 1 / tokens in the global batch), then every rank
//! takes the same optimizer step, so the replicas stay identical.
//!
//! Gradients are grouped into buckets of about `bucket_bytes`, in the order backward
//! finishes them (the LM head first, the embeddings last). As soon as every gradient of a
//! bucket is final, the bucket is copied into its own buffer and handed to a
//! communication thread, which all-reduces it over the ring while backward goes on with
//! earlier layers. The optimizer waits only for what is still in flight at the end.
//! Bucket buffers live in memory every rank maps (`Communicator::alloc_shared`), so the
//! ring moves each chunk with a single copy, straight from the neighbour's bucket.
//!
//! ZeRO-1 (Rajbhandari et al.) is DDP with the optimizer state sharded: gradients are
//! all-reduced the same way, but each rank keeps Adam's m and v for its own shard only
//! (`shard.rs`), updates only that shard of the parameters, and the ranks then all-gather
//! the updated parameters unit by unit.

use std::ops::Range;
use std::sync::{mpsc, Arc, Mutex};
use std::thread::JoinHandle;

use distlab_common::compression::Compressor as Settings;
use distlab_common::trace::{lane, Span, SpanKind};
use distlab_common::{ExperimentSpec, GradCompression, Precision, Sharding};

use super::compression::{BucketTensor, Compressor, COMPRESSION_Q, COMPRESSION_RESIDUAL};
use super::shard::ShardLayout;
use super::{collective, load_params, params_f32, DpGroup, SavedState, StateView, Strategy, TrainBackend};
use crate::backend::Stored;
use crate::comm::{sum_scalar, CommError, Communicator, InPlace, ReduceOp, SharedBuffer};
use crate::error::TrainError;
use crate::memory::{Category, MemoryTracker, Receipt};
use crate::model::{FlatState, ModelState, OpenUnit, ParamLayout, Pass, Stage, Unit};
use crate::offload::{OffloadError, OffloadTo};
use crate::optim::{Indexing, OptimGroup, OptimGroups, Optimizer};
use crate::trace::{blocking_comm_span, now_us};

/// Every parameter and gradient whole on this rank: one process alone, DDP, or ZeRO-1.
pub struct Replicated<B: TrainBackend> {
    state: FlatState<B>,
    optimizer: Optimizer<B>,
    /// None: this process is the whole run.
    dp: Option<Synced>,
    /// ZeRO-1: this rank's shard, the only part its optimizer updates.
    zero1: Option<ShardLayout>,
    /// The format of ZeRO-1's parameter gather on the wire (`parallel.comm_dtype`).
    wire: Precision,
    /// Whether the micro-batch running now hands its gradients to the synchroniser.
    syncing: bool,
    /// The stage's units in buffer order.
    units: Vec<Unit>,
    layout: ParamLayout,
    /// Where the stage's buffers start in the layout.
    base: usize,
    step: u64,
    record: bool,
    spans: Vec<Span>,
    memory: Arc<MemoryTracker>,
    _receipts: [Receipt; 2],
}

struct Synced {
    grads: GradientSum,
    scalars: Box<dyn Communicator>,
    /// Expert parallelism with dp > ep: the experts' gradients, summed over the ranks
    /// holding the same experts after backward.
    experts: Option<ExpertSync>,
}

impl Synced {
    /// The group's communicator for what follows the gradients' sum (ZeRO-1's layer-wise
    /// norms and all-gather): the gradients' own while the compute thread has it.
    fn after_sum(&mut self) -> &mut dyn Communicator {
        match &mut self.grads {
            GradientSum::InPlace(sync) => sync.comm.as_mut(),
            GradientSum::Thread(_) => self.scalars.as_mut(),
        }
    }
}

/// The experts' gradients' sum over their replicas: the communicator and the experts'
/// ranges of the stage's buffer.
struct ExpertSync {
    comm: Box<dyn Communicator>,
    ranges: Vec<Range<usize>>,
}

/// How the data-parallel group sums the gradients.
enum GradientSum {
    /// Bucket copies on the host, all-reduced on a communication thread (the ring).
    Thread(GradSync),
    /// In place in the gradient buffer, where the backend keeps it (NCCL between GPUs).
    InPlace(InPlaceSync),
}

impl<B: TrainBackend> Replicated<B> {
    pub fn new(
        spec: &ExperimentSpec,
        be: &B,
        layout: &ParamLayout,
        stage: &Stage,
        memory: &Arc<MemoryTracker>,
        dp: Option<DpGroup>,
        offload: &OffloadTo,
    ) -> Result<Self, TrainError> {
        let range = stage.range(layout);
        let units = stage.units();
        let state = FlatState::for_range(be, layout, range.clone(), spec.train.seed);
        let receipts = [
            memory.alloc_of::<B::Elem>(Category::Parameters, range.len()),
            memory.alloc_of::<B::Elem>(Category::Gradients, range.len()),
        ];
        let zero1 = match &dp {
            Some(g) if spec.parallel.sharding == Sharding::Zero1 => {
                Some(ShardLayout::new(layout, &units, g.rank, g.world))
            }
            _ => None,
        };
        // Mixed precision: the optimizer's fp32 master weights start from the fp32 init.
        let seed = spec.train.seed;
        let (per_tensor, tensors) = (spec.train.optimizer.layer_wise(), layout.tensors.len());
        let optimizer = match &zero1 {
            Some(shard) => {
                let initial = || shard.init_mine(layout, seed);
                let groups = OptimGroups { runs: shard.optim_groups(&layout.param_groups(per_tensor)), tensors };
                Optimizer::new(be, &spec.train, groups, shard.len, initial, memory, offload)?
            }
            None => {
                let runs = OptimGroup::unsharded(&layout.param_groups_in(&range, per_tensor));
                let initial = || layout.init_params_range::<f32>(seed, range.clone());
                Optimizer::new(be, &spec.train, OptimGroups { runs, tensors }, range.len(), initial, memory, offload)?
            }
        };
        // Readiness units in the order backward finishes them, within the stage's buffer.
        // With expert parallelism a block's experts (the end of its range) are not summed
        // over the data-parallel group: the ranks hold different ones.
        let local = |r: Range<usize>| r.start - range.start..r.end - range.start;
        let experts_apart = layout.ep.size > 1;
        let summed_part = |u: &Unit| match u {
            Unit::Block(l) if experts_apart => layout.blocks[*l].ln1_g.start..layout.blocks[*l].fc_w.start,
            u => u.range(layout),
        };
        let backward_units: Vec<Range<usize>> = units.iter().rev().map(summed_part).map(local).collect();
        let expert_ranges: Vec<Range<usize>> = units
            .iter()
            .filter_map(|u| match u {
                Unit::Block(l) if experts_apart => Some(layout.blocks[*l].fc_w.start..layout.blocks[*l].fc_proj_b.end),
                _ => None,
            })
            .map(local)
            .collect();
        let bucket_bytes = spec.parallel.bucket_bytes;
        // NCCL sums the buckets in place on the GPU when every bucket is one plain range of
        // the gradient buffer; compressed buckets, and buckets that skip the experts, go
        // through host memory on the communication thread (over NCCL too).
        let in_place = spec.parallel.grad_compression == GradCompression::None && !experts_apart;
        let dp = match dp {
            Some(mut g) => Some(Synced {
                grads: if in_place && be.reaches(g.grads.as_mut()) {
                    GradientSum::InPlace(InPlaceSync::new(g.grads, &backward_units, bucket_bytes))
                } else {
                    // A bucket on the wire must not meet the compute thread's own collectives
                    // where they share links (expert parallelism's all-to-alls and context
                    // parallelism's exchanges go between ranks of this group: one pair of
                    // pipes each) or a GPU's NCCL (whose communicators must be called in the
                    // same order on every rank): there the whole gradient is one bucket, sent
                    // when backward is over.
                    let context_parallel = spec.parallel.cp > 1;
                    let shares_links = experts_apart || context_parallel || be.reaches(g.grads.as_mut());
                    let bucket_bytes = if shares_links { u64::MAX } else { bucket_bytes };
                    let wire = spec.parallel.comm_dtype;
                    let compression = match spec.parallel.grad_compression {
                        GradCompression::None => None,
                        method => {
                            let p = &spec.parallel;
                            let settings = Settings { method, ratio: p.compression_ratio, rank: p.compression_rank };
                            Some((settings, BucketTensor::of_range(layout, &range)))
                        }
                    };
                    let sync = GradSync::new(g.grads, &backward_units, bucket_bytes, wire, compression, memory)?;
                    GradientSum::Thread(sync)
                },
                scalars: g.scalars,
                experts: g.experts.map(|comm| ExpertSync { comm, ranges: expert_ranges }),
            }),
            None => None,
        };
        Ok(Replicated {
            state,
            optimizer,
            dp,
            zero1,
            wire: spec.parallel.comm_dtype,
            syncing: false,
            units,
            layout: layout.clone(),
            base: range.start,
            step: 0,
            record: false,
            spans: Vec::new(),
            memory: memory.clone(),
            _receipts: receipts,
        })
    }
}

impl<B: TrainBackend> Replicated<B> {
    /// The stage's parameters (DiLoCo's outer step reads and sets them).
    pub(super) fn params(&self) -> &B::Buf {
        &self.state.params
    }

    pub(super) fn params_mut(&mut self) -> &mut B::Buf {
        &mut self.state.params
    }

    /// The stage's gradients (fault-tolerant replicas sum them themselves).
    pub(super) fn grads(&self) -> &B::Buf {
        &self.state.grads
    }

    pub(super) fn grads_mut(&mut self) -> &mut B::Buf {
        &mut self.state.grads
    }
}

impl<B: TrainBackend> ModelState<B> for Replicated<B> {
    fn open(&mut self, be: &B, unit: Unit, pass: Pass) -> Result<OpenUnit<'_, B::Buf>, CommError> {
        self.state.open(be, unit, pass)
    }

    /// Every parameter is here: nothing to gather ahead.
    fn announce_next(&mut self, _next: Option<(Unit, Pass)>) {}

    fn close(&mut self, be: &B, unit: Unit, pass: Pass) -> Result<(), CommError> {
        if let (true, Some(dp), true) = (self.syncing, &mut self.dp, pass.completes_grads()) {
            let position = self.units.iter().position(|&u| u == unit).expect("a unit of this stage");
            let ready = self.units.len() - 1 - position;
            match &mut dp.grads {
                GradientSum::Thread(sync) => {
                    let grads = be.view(&self.state.grads, sync.unit_range(ready));
                    be.read_host(grads, |grads| sync.unit_ready(ready, grads));
                }
                GradientSum::InPlace(sync) => sync.unit_ready(be, &self.memory, &mut self.state.grads, ready)?,
            }
        }
        Ok(())
    }
}

impl<B: TrainBackend> Strategy<B> for Replicated<B> {
    fn begin_step(&mut self, be: &B, step: u64, record: bool) -> Result<(), TrainError> {
        self.state.zero_grads(be);
        self.step = step;
        self.record = record;
        if let Some(dp) = &mut self.dp {
            match &mut dp.grads {
                GradientSum::Thread(sync) => sync.begin_step(step, record),
                GradientSum::InPlace(sync) => sync.begin_step(step, record),
            }
        }
        Ok(())
    }

    fn state(&mut self, last: bool) -> &mut dyn ModelState<B> {
        // Gradients are summed across ranks once per step: only the last micro-batch's
        // backward hands finished buckets to the communication thread (no_sync before).
        self.syncing = last && self.dp.is_some();
        self
    }

    fn reduce_gradients(&mut self, be: &B) -> Result<f64, CommError> {
        if let Some(Synced { grads: GradientSum::Thread(sync), .. }) = &mut self.dp {
            let grads = &mut self.state.grads;
            sync.finish(|range, sums| {
                be.on_host(be.view_mut(grads, range), |g| {
                    for (g, &sum) in g.iter_mut().zip(sums) {
                        *g = B::Elem::store(sum);
                    }
                })
            })?;
        }
        if let Some(Synced { experts: Some(ExpertSync { comm, ranges }), .. }) = &mut self.dp {
            if self.record {
                be.synchronize();
            }
            let (start, sent_before) = (now_us(), comm.bytes_sent());
            for range in ranges.iter() {
                let op = InPlace::AllReduce(ReduceOp::Sum);
                collective(be, &self.memory, comm.as_mut(), &mut self.state.grads, range.clone(), op, self.wire)?;
            }
            if self.record {
                be.synchronize();
                let sent = comm.bytes_sent() - sent_before;
                self.spans.push(blocking_comm_span("all_reduce experts' gradients (replicas)", self.step, start, sent));
            }
        }
        let grads = &self.state.grads;
        Ok(self.layout.grad_squares(be, grads, 0..be.buf_len(grads), self.base))
    }

    fn update(&mut self, be: &B, lr: f64, grad_scale: f64) -> Result<(), TrainError> {
        let (params, grads) = ((&mut self.state.params, Indexing::Global), (&self.state.grads, Indexing::Global));
        // Under ZeRO-1 a tensor's optimizer state is spread over the group.
        let shards = match (&self.zero1, &mut self.dp) {
            (Some(_), Some(dp)) => Some(dp.after_sum()),
            _ => None,
        };
        self.optimizer.step(be, params, grads, lr, grad_scale, shards)?;
        if let (Some(shard), Some(dp)) = (&self.zero1, &mut self.dp) {
            let comm = dp.after_sum();
            if self.record {
                be.synchronize();
            }
            let (start, sent_before) = (now_us(), comm.bytes_sent());
            for u in &shard.units {
                let params = &mut self.state.params;
                let range = shard.in_buffer(u);
                collective(be, &self.memory, &mut *comm, params, range, InPlace::AllGather, self.wire)?;
            }
            if self.record {
                be.synchronize();
                let sent = comm.bytes_sent() - sent_before;
                self.spans.push(blocking_comm_span("all_gather parameters (ZeRO-1)", self.step, start, sent));
            }
        }
        Ok(())
    }

    fn sum_scalar(&mut self, value: f64) -> Result<f64, CommError> {
        match &mut self.dp {
            Some(dp) => sum_scalar(dp.scalars.as_mut(), value),
            None => Ok(value),
        }
    }

    fn comm_spans(&self) -> Vec<Span> {
        let mut spans = self.spans.clone();
        match &self.dp {
            Some(Synced { grads: GradientSum::Thread(sync), .. }) => spans.extend(sync.spans.iter().cloned()),
            Some(Synced { grads: GradientSum::InPlace(sync), .. }) => spans.extend(sync.spans.iter().cloned()),
            None => {}
        }
        spans
    }

    fn held_bytes(&self, be: &B) -> u64 {
        let flat = (be.buf_len(&self.state.params) + be.buf_len(&self.state.grads)) * size_of::<B::Elem>();
        let buckets = match &self.dp {
            Some(Synced { grads: GradientSum::Thread(sync), .. }) => sync.held_bytes(),
            _ => 0,
        };
        flat as u64 + self.optimizer.held_bytes(be) + buckets
    }

    fn view_state(&self, be: &B, f: &mut dyn FnMut(StateView<'_>)) -> Result<(), OffloadError> {
        // With expert parallelism every rank holds its own experts: each writes its own state.
        let replicated = self.layout.ep.size <= 1;
        let optimizer_replicated = self.zero1.is_none() && replicated;
        // Gradient compression: what each rank has not sent yet is its own.
        let local = match &self.dp {
            Some(Synced { grads: GradientSum::Thread(sync), .. }) => sync.compression_state(),
            _ => None,
        };
        let local: Vec<(&'static str, Vec<f32>)> =
            local.map(|(residual, q)| vec![(COMPRESSION_RESIDUAL, residual), (COMPRESSION_Q, q)]).unwrap_or_default();
        be.read_host(be.all(&self.state.params), |params| {
            self.optimizer.read(be, |optimizer, optimizer_steps| {
                let params = params_f32(params);
                let local = local.clone();
                f(StateView {
                    params,
                    optimizer,
                    optimizer_steps,
                    params_replicated: replicated,
                    optimizer_replicated,
                    local,
                })
            })
        })
    }

    fn load(&mut self, be: &B, state: SavedState) -> Result<(), String> {
        be.on_host(be.all_mut(&mut self.state.params), |params| load_params(params, state.params))?;
        // A checkpoint re-cut for other ranks has no residual: it starts at zero.
        let section = |name: &str| state.local.iter().find(|(n, _)| n == name).map(|(_, v)| v.as_slice());
        if let (Some(Synced { grads: GradientSum::Thread(sync), .. }), Some(residual)) =
            (&mut self.dp, section(COMPRESSION_RESIDUAL))
        {
            sync.load_compression_state(residual, section(COMPRESSION_Q).unwrap_or_default())?;
        }
        self.optimizer.load_state(be, state.optimizer)
    }
}

/// Readiness units of the flat gradient buffer, all-reduced as one message.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Bucket {
    /// From its first unit's start to its last one's end: one contiguous range of the
    /// buffer, unless the units skip parts that are not summed here (expert parallelism's
    /// experts).
    pub range: Range<usize>,
    /// Its units' floats, one after another in buffer order: what crosses the wire.
    pub len: usize,
    /// Indices of the readiness units (see `plan_buckets`) it is made of.
    pub units: Range<usize>,
}

/// Groups readiness units into buckets of at least `bucket_bytes` (the last one may be
/// smaller). `units` are the ranges of the gradient buffer in the order backward makes
/// them final; each must sit before the previous one in the buffer (reverse layer order):
/// right before it, for every bucket to be one contiguous range.
pub fn plan_buckets(units: &[Range<usize>], bucket_bytes: u64) -> Vec<Bucket> {
    let target = (bucket_bytes / 4).max(1) as usize;
    let mut buckets: Vec<Bucket> = Vec::new();
    let mut open: Option<Bucket> = None;
    for (i, unit) in units.iter().enumerate() {
        let b = open.get_or_insert(Bucket { range: unit.clone(), len: 0, units: i..i });
        debug_assert!(b.units.is_empty() || unit.end <= b.range.start, "units must come in reverse order");
        b.range.start = unit.start;
        b.len += unit.len();
        b.units.end = i + 1;
        if b.len >= target {
            buckets.extend(open.take());
        }
    }
    buckets.extend(open);
    buckets
}

/// Which bucket each readiness unit belongs to, and which buckets backward has finished.
struct BucketPlan {
    buckets: Vec<Bucket>,
    /// Per readiness unit: its range of the gradient buffer, its bucket, and where it sits
    /// in the bucket's buffer.
    units: Vec<Range<usize>>,
    unit_bucket: Vec<usize>,
    offsets: Vec<usize>,
    /// Per bucket: how many of its units are final this step.
    ready_units: Vec<usize>,
}

impl BucketPlan {
    fn new(units: &[Range<usize>], bucket_bytes: u64) -> Self {
        let buckets = plan_buckets(units, bucket_bytes);
        let (mut unit_bucket, mut offsets) = (vec![0; units.len()], vec![0; units.len()]);
        for (b, bucket) in buckets.iter().enumerate() {
            let mut at = 0;
            for u in bucket.units.clone().rev() {
                (unit_bucket[u], offsets[u]) = (b, at);
                at += units[u].len();
            }
        }
        let ready_units = vec![0; buckets.len()];
        BucketPlan { buckets, units: units.to_vec(), unit_bucket, offsets, ready_units }
    }

    fn begin_step(&mut self) {
        self.ready_units.iter_mut().for_each(|n| *n = 0);
    }

    /// Unit `unit` is final: the bucket it completes, if it is that bucket's last.
    fn unit_ready(&mut self, unit: usize) -> Option<usize> {
        let b = self.unit_bucket[unit];
        self.ready_units[b] += 1;
        (self.ready_units[b] == self.buckets[b].units.len()).then_some(b)
    }
}

/// A span on the data-parallel communication lane for bucket `bucket` (`len` floats),
/// summed by `how` (all_reduce, or a compressor's name).
fn bucket_span(how: &str, bucket: usize, len: usize, step: u64, start_us: u64, bytes_sent: u64) -> Span {
    Span {
        kind: SpanKind::Comm,
        name: format!("{how} bucket {bucket} ({:.2} MiB)", (len * 4) as f64 / (1 << 20) as f64),
        step,
        lane: lane::COMM.into(),
        start_us,
        end_us: now_us(),
        layer: None,
        bucket: Some(bucket as u32),
        bytes: Some(bytes_sent),
        micro: None,
        chunk: None,
    }
}

/// The DDP gradient sum where the backend keeps the gradients (NCCL between GPUs): each
/// bucket is all-reduced in place in the gradient buffer as soon as backward finishes it,
/// queued on the device behind the kernels that made it, so the host never waits for it.
pub struct InPlaceSync {
    comm: Box<dyn Communicator>,
    plan: BucketPlan,
    step: u64,
    record: bool,
    pub spans: Vec<Span>,
}

impl InPlaceSync {
    fn new(comm: Box<dyn Communicator>, units: &[Range<usize>], bucket_bytes: u64) -> Self {
        let plan = BucketPlan::new(units, bucket_bytes);
        debug_assert!(plan.buckets.iter().all(|b| b.len == b.range.len()), "in place, a bucket is one range");
        InPlaceSync { comm, plan, step: 0, record: false, spans: Vec::new() }
    }

    fn begin_step(&mut self, step: u64, record: bool) {
        (self.step, self.record) = (step, record);
        self.plan.begin_step();
    }

    /// Readiness unit `unit` of `grads` is final: all-reduce its bucket once all its
    /// units are (recorded steps wait for the device, so that the span times the sum).
    fn unit_ready<B: TrainBackend>(
        &mut self,
        be: &B,
        memory: &Arc<MemoryTracker>,
        grads: &mut B::Buf,
        unit: usize,
    ) -> Result<(), CommError> {
        let Some(b) = self.plan.unit_ready(unit) else { return Ok(()) };
        let range = self.plan.buckets[b].range.clone();
        if self.record {
            be.synchronize();
        }
        let (start, sent_before) = (now_us(), self.comm.bytes_sent());
        let op = InPlace::AllReduce(ReduceOp::Sum);
        collective(be, memory, self.comm.as_mut(), grads, range.clone(), op, Precision::Fp32)?;
        if self.record {
            be.synchronize();
            let sent = self.comm.bytes_sent() - sent_before;
            self.spans.push(bucket_span("all_reduce", b, range.len(), self.step, start, sent));
        }
        Ok(())
    }
}

/// One bucket on its way to the communication thread and back.
struct InFlight {
    bucket: usize,
    data: SharedBuffer,
}

/// What the communication thread sends back.
struct Reduced {
    bucket: usize,
    data: SharedBuffer,
    span: Span,
    result: Result<(), CommError>,
}

/// The DDP gradient synchroniser of one rank: bucket buffers and the communication thread.
pub struct GradSync {
    plan: BucketPlan,
    /// Per bucket: its buffer while it is here (None while in flight).
    buffers: Vec<Option<SharedBuffer>>,
    _receipts: Vec<Receipt>,
    to_comm: Option<mpsc::Sender<InFlight>>,
    from_comm: mpsc::Receiver<Reduced>,
    comm_thread: Option<JoinHandle<()>>,
    /// Gradient compression: the compressor, used by the communication thread while
    /// buckets are in flight and read or set between steps (checkpoints).
    compressor: Option<Arc<Mutex<Compressor>>>,
    in_flight: usize,
    step: u64,
    /// Comm spans of the steps recorded so far.
    pub spans: Vec<Span>,
    record_spans: bool,
}

impl GradSync {
    /// Allocates the bucket buffers (a collective: every rank of the group calls it) and
    /// moves `comm` (the data-parallel group) onto a new communication thread, where the
    /// buckets cross the wire as `wire` says, or compressed as `compression` says (its
    /// settings and the gradient's tensors).
    pub fn new(
        mut comm: Box<dyn Communicator>,
        units: &[Range<usize>],
        bucket_bytes: u64,
        wire: Precision,
        compression: Option<(Settings, Vec<BucketTensor>)>,
        memory: &Arc<MemoryTracker>,
    ) -> Result<Self, CommError> {
        comm.set_wire(wire);
        let plan = BucketPlan::new(units, bucket_bytes);
        let buckets = &plan.buckets;
        let compressor = compression.map(|(settings, tensors)| {
            debug_assert!(buckets.iter().all(|b| b.len == b.range.len()), "compressed buckets are one range each");
            let ranges: Vec<Range<usize>> = buckets.iter().map(|b| b.range.clone()).collect();
            Arc::new(Mutex::new(Compressor::new(settings, BucketTensor::per_bucket(&tensors, &ranges), memory)))
        });
        let on_thread = compressor.clone();
        let buffers = buckets.iter().map(|b| comm.alloc_shared(b.len).map(Some)).collect::<Result<_, _>>()?;
        let receipts = buckets.iter().map(|b| memory.alloc_shared(Category::CommBuffers, b.len)).collect();
        let (to_comm, comm_rx) = mpsc::channel::<InFlight>();
        let (comm_tx, from_comm) = mpsc::channel::<Reduced>();
        let sizes: Vec<usize> = buckets.iter().map(|b| b.len).collect();
        let comm_thread = std::thread::Builder::new()
            .name("ddp-comm".into())
            .spawn(move || communication_thread(comm, on_thread, comm_rx, comm_tx, sizes))
            .expect("spawn the DDP communication thread");
        Ok(Self {
            plan,
            buffers,
            _receipts: receipts,
            to_comm: Some(to_comm),
            from_comm,
            comm_thread: Some(comm_thread),
            compressor,
            in_flight: 0,
            step: 0,
            spans: Vec::new(),
            record_spans: false,
        })
    }

    pub fn buckets(&self) -> &[Bucket] {
        &self.plan.buckets
    }

    /// Gradient compression's state for a checkpoint (between steps): the residual and
    /// PowerSGD's Q (see [`Compressor::state`]); None without compression.
    pub fn compression_state(&self) -> Option<(Vec<f32>, Vec<f32>)> {
        self.compressor.as_ref().map(|c| lock(c).state())
    }

    /// Puts back [`Self::compression_state`] of the same rank of the same run.
    pub fn load_compression_state(&mut self, residual: &[f32], q: &[f32]) -> Result<(), String> {
        match &self.compressor {
            Some(c) => lock(c).load(residual, q),
            None => Ok(()),
        }
    }

    /// Call before the backward pass whose gradients are to be synchronised.
    pub fn begin_step(&mut self, step: u64, record_spans: bool) {
        self.step = step;
        self.record_spans = record_spans;
        self.plan.begin_step();
    }

    /// Bytes of the bucket buffers (all of them, whether here or in flight).
    pub fn held_bytes(&self) -> u64 {
        self.plan.buckets.iter().map(|b| (b.len * 4) as u64).sum()
    }

    /// Where readiness unit `unit` lies in the flat gradient buffer.
    pub fn unit_range(&self, unit: usize) -> Range<usize> {
        self.plan.units[unit].clone()
    }

    /// Readiness unit `unit` is final, its gradients are `grads` (its `unit_range` of the
    /// flat gradient buffer): copy them into its bucket, and send the bucket once all its
    /// units are in.
    pub fn unit_ready<S: Stored<Acc = f32>>(&mut self, unit: usize, grads: &[S]) {
        let (b, at) = (self.plan.unit_bucket[unit], self.plan.offsets[unit]);
        let buffer = self.buffers[b].as_mut().expect("a bucket is sent once per step");
        for (b, g) in buffer[at..at + grads.len()].iter_mut().zip(grads) {
            *b = g.load();
        }
        if self.plan.unit_ready(unit).is_some() {
            let data = self.buffers[b].take().expect("bucket buffer present");
            if let Some(tx) = &self.to_comm {
                if tx.send(InFlight { bucket: b, data }).is_ok() {
                    self.in_flight += 1;
                }
            }
        }
    }

    /// Waits for every bucket of this step and hands each unit's sums to `store`, with the
    /// unit's range of the flat gradient buffer (where they belong). Returns the time spent
    /// waiting, in microseconds.
    pub fn finish(&mut self, mut store: impl FnMut(Range<usize>, &[f32])) -> Result<u64, CommError> {
        let wait_start = now_us();
        let mut first_error = None;
        while self.in_flight > 0 {
            let Ok(done) = self.from_comm.recv() else { break };
            self.in_flight -= 1;
            if done.result.is_ok() {
                for u in self.plan.buckets[done.bucket].units.clone() {
                    let (range, at) = (self.plan.units[u].clone(), self.plan.offsets[u]);
                    store(range.clone(), &done.data[at..at + range.len()]);
                }
            }
            if self.record_spans {
                let mut span = done.span;
                span.step = self.step;
                self.spans.push(span);
            }
            self.buffers[done.bucket] = Some(done.data);
            if let Err(e) = done.result {
                first_error.get_or_insert(e);
            }
        }
        if let Some(e) = first_error {
            return Err(e);
        }
        if self.buffers.iter().any(Option::is_none) {
            return Err(CommError::BadBuffer {
                collective: "ddp gradient sync".into(),
                detail: "the communication thread stopped before every bucket came back".into(),
            });
        }
        Ok(now_us() - wait_start)
    }
}

impl Drop for GradSync {
    fn drop(&mut self) {
        self.to_comm.take();
        if let Some(t) = self.comm_thread.take() {
            let _ = t.join();
        }
    }
}

/// The compressor, whether or not a thread holding it panicked (its buffers stay valid).
fn lock(c: &Mutex<Compressor>) -> std::sync::MutexGuard<'_, Compressor> {
    c.lock().unwrap_or_else(|p| p.into_inner())
}

fn communication_thread(
    mut comm: Box<dyn Communicator>,
    compressor: Option<Arc<Mutex<Compressor>>>,
    rx: mpsc::Receiver<InFlight>,
    tx: mpsc::Sender<Reduced>,
    sizes: Vec<usize>,
) {
    for InFlight { bucket, mut data } in rx {
        let (start_us, sent_before) = (now_us(), comm.bytes_sent());
        let (result, how) = match &compressor {
            Some(c) => {
                let mut c = lock(c);
                (c.exchange(comm.as_mut(), bucket, &mut data), c.name())
            }
            None => (comm.all_reduce(&mut data, ReduceOp::Sum), "all_reduce"),
        };
        let span = bucket_span(how, bucket, sizes[bucket], 0, start_us, comm.bytes_sent() - sent_before);
        let failed = result.is_err();
        if tx.send(Reduced { bucket, data, span, result }).is_err() || failed {
            break;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buckets_follow_backward_order_and_are_contiguous() {
        // Buffer: [0,10) [10,30) [30,60) [60,100); backward finishes them last to first.
        let units = vec![60..100, 30..60, 10..30, 0..10];
        let buckets = plan_buckets(&units, 4 * 50); // at least 50 floats each
        let bucket = |range: Range<usize>, units| Bucket { len: range.len(), range, units };
        assert_eq!(buckets, vec![bucket(30..100, 0..2), bucket(0..30, 2..4)]);
        // A huge bucket size gives one bucket; a tiny one, one bucket per unit.
        assert_eq!(plan_buckets(&units, 1 << 30).len(), 1);
        assert_eq!(plan_buckets(&units, 4).len(), 4);
    }

    #[test]
    fn units_with_gaps_between_them_pack_into_their_bucket() {
        // Expert parallelism: [90,100) [50,60) [0,20) are summed here, the rest is not.
        let units = vec![90..100, 50..60, 0..20];
        let plan = BucketPlan::new(&units, 4 * 15);
        assert_eq!(
            plan.buckets,
            vec![Bucket { range: 50..100, len: 20, units: 0..2 }, Bucket { range: 0..20, len: 20, units: 2..3 }]
        );
        // buffer order inside a bucket: [50,60) then [90,100)
        assert_eq!(plan.offsets, vec![10, 0, 0]);
    }
}
