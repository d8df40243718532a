//! ZeRO-2 and FSDP (ZeRO-3): each rank keeps only its shard (`shard.rs`) of the gradients
//! and the optimizer state, and with FSDP of the parameters too.
//!
//! ZeRO-2, per micro-batch: backward writes one unit's gradient into a unit-sized buffer;
//! when the unit is done it is reduce-scattered across the group, this rank adds its
//! chunk of the sum into its gradient shard, and the buffer is freed. The full gradient
//! never exists on a rank. After the last micro-batch each rank updates its shard of the
//! parameters (its optimizer state covers only that shard) and the ranks all-gather the
//! parameters unit by unit, so that every rank again holds all of them.
//!
//! FSDP goes one step further: a rank keeps only its shard of the parameters as well.
//! Just before a unit's forward (and again before its backward) the ranks all-gather the
//! unit's parameters into a temporary buffer, use them, and free it. Gradients are handled
//! as in ZeRO-2. Memory: shard + one gathered unit, instead of the whole model; price: the
//! gathers, 1.5x DDP's communication volume.
//!
//! Under a schedule that splits the backward (ZB-H1, ZBV, DualPipeV) a unit's gradient is
//! complete only at its W: its B (the LayerNorms' gradients) leaves the unit's buffer
//! waiting, the W adds the weights' and reduce-scatters it. A B of a later micro-batch
//! that comes first adds into the waiting buffer, and that W sends both: the sum is the
//! same. So between a chunk's B and its W the whole chunk's gradient waits, the price of
//! sharding gradients under those schedules.
//!
//! Both run their collectives on the training thread, so the gathers and reduce-scatters
//! appear on the timeline between the compute spans, and the compute waits for each.
//! FSDP with `parallel.prefetch` gathers the unit the model opens next on a communication
//! thread while the current one computes (`prefetch.rs`): two units gathered at a time,
//! the waits mostly gone. With FP8 products and `parallel.fp8_all_gather`, each rank casts
//! its shard of a block's linear weights to FP8 before the gather (`fp8_gather.rs`), so
//! they cross the wire in one byte, and the model takes them as they arrive.

use std::sync::Arc;

use distlab_common::plan::fp8_gather::{message_bytes, FP8_WEIGHTS};
use distlab_common::plan::planner::wire_bytes;
use distlab_common::trace::Span;
use distlab_common::{ExperimentSpec, Fp8Recipe, Precision};

use super::fp8_gather::BlockRuns;
use super::prefetch::{Prefetched, Prefetcher};
use super::shard::ShardLayout;
use super::{
    collective, load_params, params_f32, DpGroup, HybridGroups, SavedState, StateView, Strategy, TrainBackend,
};
use crate::backend::Stored;
use crate::comm::{sum_scalar, Alone, CommError, Communicator, InPlace, ReduceOp::Sum};
use crate::error::TrainError;
use crate::memory::{Category, MemoryTracker, Receipt};
use crate::model::fp8_linear::Fp8Block;
use crate::model::{ModelState, OpenUnit, ParamLayout, Pass, Stage, Unit};
use crate::offload::{OffloadError, OffloadTo};
use crate::optim::{Indexing, OptimGroups, Optimizer};
use crate::trace::{blocking_comm_span, now_us};

/// A buffer that exists only for a while, with its entry in the memory ledger.
struct Temporary<Buf> {
    data: Buf,
    _receipt: Receipt,
}

pub struct Sharded<B: TrainBackend> {
    /// FSDP (parameters sharded) rather than ZeRO-2 (parameters whole).
    fsdp: bool,
    shard: ShardLayout,
    /// For the gradient norm (tensor-parallel ranks count replicated tensors 1/tp).
    layout: ParamLayout,
    /// ZeRO-2: every parameter, flat. FSDP: this rank's shard.
    params: B::Buf,
    grad_shard: B::Buf,
    /// FSDP: the open unit's full parameters.
    gathered: Option<Temporary<B::Buf>>,
    /// FSDP with prefetch: the next unit's gather, under way on its own thread.
    prefetch: Option<Prefetcher>,
    /// What the model opens after the unit it opens next (`announce_next`).
    announced: Option<(Unit, Pass)>,
    /// The format of the group's collectives on the wire (`parallel.comm_dtype`).
    wire: Precision,
    /// FSDP with `parallel.fp8_all_gather`: the FP8 recipe the blocks' weights are cast by
    /// before they are gathered.
    fp8_gather: Option<Fp8Recipe>,
    /// The open unit's gradient, before it is reduce-scattered.
    unit_grads: Option<Temporary<B::Buf>>,
    /// Units whose B ran and whose W has not: their gradients so far.
    waiting_for_weights: Vec<(Unit, Temporary<B::Buf>)>,
    optimizer: Optimizer<B>,
    /// The ranks a unit is cut over: the data-parallel group, or HSDP's shard group.
    comm: Box<dyn Communicator>,
    /// HSDP: the whole data-parallel group, for the loop's scalars (None: `comm` is it).
    scalars: Option<Box<dyn Communicator>>,
    /// HSDP: the ranks holding this rank's shard in the other groups.
    replicas: Option<Box<dyn Communicator>>,
    memory: Arc<MemoryTracker>,
    step: u64,
    record: bool,
    spans: Vec<Span>,
    _receipts: [Receipt; 2],
}

impl<B: TrainBackend> Sharded<B> {
    pub fn new(
        spec: &ExperimentSpec,
        be: &B,
        layout: &ParamLayout,
        stage: &Stage,
        memory: &Arc<MemoryTracker>,
        dp: Option<DpGroup>,
        offload: &OffloadTo,
    ) -> Result<Self, TrainError> {
        let fsdp = spec.parallel.sharding.shards_params();
        // One rank alone is a group of one: it owns every shard.
        let DpGroup { scalars: whole, grads: second, hybrid, .. } = match dp {
            Some(g) => g,
            None => DpGroup {
                rank: 0,
                world: 1,
                grads: Box::new(Alone),
                scalars: Box::new(Alone),
                experts: None,
                hybrid: None,
                parameter_server: None,
                membership: None,
            },
        };
        // HSDP cuts the units over its shard group and keeps the whole group for the scalars.
        let (comm, scalars, replicas) = match hybrid {
            Some(HybridGroups { shard, replicas }) => (shard, Some(whole), Some(replicas)),
            None => (whole, None, None),
        };
        let (rank, world) = (comm.rank(), comm.size());
        let wire = spec.parallel.comm_dtype;
        let prefetch = (fsdp && spec.parallel.prefetch).then(|| Prefetcher::new(second, wire));
        let shard = ShardLayout::new(layout, &stage.units(), rank, world);
        // Each rank computes only the initial values it keeps (never the whole model's).
        let seed = spec.train.seed;
        let initial: Vec<B::Elem> = if fsdp {
            shard.init_mine(layout, seed).into_iter().map(B::Elem::store).collect()
        } else {
            layout.init_params_range::<f32>(seed, stage.range(layout)).into_iter().map(B::Elem::store).collect()
        };
        let mut params = be.alloc(initial.len());
        be.upload(&mut params, &initial);
        drop(initial);
        let receipts = [
            memory.alloc_of::<B::Elem>(Category::Parameters, be.buf_len(&params)),
            memory.alloc_of::<B::Elem>(Category::Gradients, shard.len),
        ];
        let runs = shard.optim_groups(&layout.param_groups(spec.train.optimizer.layer_wise()));
        let groups = OptimGroups { runs, tensors: layout.tensors.len() };
        let optimizer =
            Optimizer::new(be, &spec.train, groups, shard.len, || shard.init_mine(layout, seed), memory, offload)?;
        Ok(Sharded {
            fsdp,
            grad_shard: be.alloc(shard.len),
            shard,
            layout: layout.clone(),
            params,
            gathered: None,
            prefetch,
            announced: None,
            wire,
            fp8_gather: (fsdp && spec.parallel.fp8_all_gather).then_some(spec.train.fp8),
            unit_grads: None,
            waiting_for_weights: Vec::new(),
            optimizer,
            comm,
            scalars,
            replicas,
            memory: memory.clone(),
            step: 0,
            record: false,
            spans: Vec::new(),
            _receipts: receipts,
        })
    }

    fn temporary(&self, be: &B, category: Category, len: usize) -> Temporary<B::Buf> {
        Temporary { data: be.alloc(len), _receipt: self.memory.alloc_of::<B::Elem>(category, len) }
    }

    /// FSDP: all-gathers `unit`'s parameters into a new buffer (or takes them from the
    /// prefetch that gathered them).
    fn gather(&mut self, be: &B, unit: Unit) -> Result<(), CommError> {
        let prefetched = match self.prefetch.as_mut() {
            Some(prefetch) => prefetch.take(unit, self.step, self.record)?,
            None => None,
        };
        if let Some(Prefetched { values, booked: _booked }) = prefetched {
            let mut full = self.temporary(be, Category::GatheredParameters, values.len());
            be.on_host(be.all_mut(&mut full.data), |host| {
                host.iter_mut().zip(&values).for_each(|(h, &v)| *h = B::Elem::store(v));
            });
            self.gathered = Some(full);
            return Ok(());
        }
        if self.record {
            be.synchronize();
        }
        let (start, sent_before) = (now_us(), self.comm.bytes_sent());
        let u = self.shard.unit(unit).clone();
        let mut full = self.temporary(be, Category::GatheredParameters, u.global.len());
        be.copy(be.view_mut(&mut full.data, u.mine.clone()), be.view(&self.params, u.local()));
        let everything = 0..u.global.len();
        collective(be, &self.memory, self.comm.as_mut(), &mut full.data, everything, InPlace::AllGather, self.wire)?;
        self.gathered = Some(full);
        if self.record {
            be.synchronize();
            let sent = self.comm.bytes_sent() - sent_before;
            self.spans.push(blocking_comm_span(&format!("all_gather {}", unit.name()), self.step, start, sent));
        }
        Ok(())
    }

    /// FSDP's FP8 gather of block `l` (`fp8_gather.rs`): this rank casts its shard of the
    /// block's four weights with their scales (current scaling: from the largest of the
    /// ranks' shard amaxes, all-gathered first), the messages are all-gathered, and the
    /// whole block is decoded, the weights as their casts, which `fp8` is told of (and
    /// counts when `record_casts`).
    fn gather_fp8(&mut self, be: &B, l: usize, fp8: &mut Fp8Block, record_casts: bool) -> Result<(), CommError> {
        if self.record {
            be.synchronize();
        }
        let (start, sent_before) = (now_us(), self.comm.bytes_sent());
        let u = self.shard.unit(Unit::Block(l)).clone();
        let block = BlockRuns::of(&self.layout.blocks[l], u.global.start);
        let (world, rank) = (self.comm.size(), self.comm.rank());
        let message_len = message_bytes(&block.runs, world, wire_bytes(self.wire) as usize);
        // The messages, four bytes to a float: the communicators move floats, bits unchanged.
        let mut words = vec![0.0f32; world * message_len / 4];
        let _booked = self.memory.alloc(Category::Transient, words.len());
        let (weights, wire) = (fp8.weights_mut(), self.wire);
        let (params, comm) = (&self.params, self.comm.as_mut());
        let scales = be.read_host(be.view(params, u.local()), |mine| {
            let amaxes = block.amaxes(u.mine.clone(), mine);
            let amaxes = match self.fp8_gather {
                Some(Fp8Recipe::Current) => {
                    let mut all = vec![0.0f32; world * FP8_WEIGHTS];
                    comm.all_gather(&amaxes, &mut all)?;
                    std::array::from_fn(|k| all.iter().skip(k).step_by(FP8_WEIGHTS).fold(0.0f32, |a, &b| a.max(b)))
                }
                _ => amaxes,
            };
            let scales: [f32; FP8_WEIGHTS] = std::array::from_fn(|k| weights[k].scale_for_cast(amaxes[k]));
            let mine_words = &mut words[rank * message_len / 4..(rank + 1) * message_len / 4];
            block.encode(u.mine.clone(), mine, scales, wire, bytemuck::cast_slice_mut(mine_words));
            Ok::<_, CommError>(scales)
        })?;
        self.comm.all_gather_in_place(&mut words)?;
        let mut full = self.temporary(be, Category::GatheredParameters, u.global.len());
        let bytes = bytemuck::cast_slice(&words);
        let seen = be
            .on_host(be.all_mut(&mut full.data), |out| block.decode(bytes, message_len, world, scales, self.wire, out));
        let elements = block.weight_lens();
        for (k, weight) in fp8.weights_mut().into_iter().enumerate() {
            weight.arrived_cast(scales[k], seen[k], elements[k], record_casts);
        }
        self.gathered = Some(full);
        if self.record {
            be.synchronize();
            let sent = self.comm.bytes_sent() - sent_before;
            let name = format!("all_gather {} (fp8)", Unit::Block(l).name());
            self.spans.push(blocking_comm_span(&name, self.step, start, sent));
        }
        Ok(())
    }

    /// FSDP with prefetch: starts gathering `unit` on the prefetch thread, from this
    /// rank's shard of it. Booked as a gathered unit (and, for a 2-byte model, its f32
    /// widening as transient) until it is opened.
    fn start_prefetch(&mut self, be: &B, unit: Unit) {
        let Some(prefetch) = self.prefetch.as_mut() else { return };
        let u = self.shard.unit(unit).clone();
        let mut values = vec![0.0f32; u.global.len()];
        be.read_host(be.view(&self.params, u.local()), |mine| {
            values[u.mine.clone()].iter_mut().zip(mine).for_each(|(v, m)| *v = m.load());
        });
        let mut booked = vec![self.memory.alloc_of::<B::Elem>(Category::GatheredParameters, values.len())];
        if size_of::<B::Elem>() != 4 {
            booked.push(self.memory.alloc(Category::Transient, values.len()));
        }
        prefetch.start(unit, values, booked, self.step, self.record);
    }

    /// Waits for the prefetch under way (if any) before the training thread runs a
    /// data-parallel collective itself: both would use the same pipes.
    fn settle_prefetch(&mut self) -> Result<(), CommError> {
        match self.prefetch.as_mut() {
            Some(prefetch) => prefetch.settle(self.step, self.record),
            None => Ok(()),
        }
    }

    /// Reduce-scatters the open unit's gradient and adds this rank's chunk to its shard.
    fn reduce_scatter(&mut self, be: &B, unit: Unit) -> Result<(), CommError> {
        let Some(mut grads) = self.unit_grads.take() else { return Ok(()) };
        self.settle_prefetch()?;
        if self.record {
            be.synchronize();
        }
        let (start, sent_before) = (now_us(), self.comm.bytes_sent());
        let u = self.shard.unit(unit);
        let everything = 0..u.global.len();
        let op = InPlace::ReduceScatter(Sum);
        collective(be, &self.memory, self.comm.as_mut(), &mut grads.data, everything, op, self.wire)?;
        be.add(be.view_mut(&mut self.grad_shard, u.local()), be.view(&grads.data, u.mine.clone()));
        if self.record {
            be.synchronize();
            let sent = self.comm.bytes_sent() - sent_before;
            self.spans.push(blocking_comm_span(&format!("reduce_scatter {}", unit.name()), self.step, start, sent));
        }
        Ok(())
    }

    /// [`ModelState::open`], gathering block `unit`'s weights in FP8 where `fp8` is given.
    fn open_with(
        &mut self,
        be: &B,
        unit: Unit,
        pass: Pass,
        fp8: Option<&mut Fp8Block>,
    ) -> Result<OpenUnit<'_, B::Buf>, CommError> {
        let want_params = pass.needs_params();
        let backward = pass.writes_grads();
        let global = self.shard.unit(unit).global.clone();
        match (fp8, unit) {
            (Some(fp8), Unit::Block(l)) if self.fsdp && want_params && self.fp8_gather.is_some() => {
                // (an evaluation's casts are forgotten by the model afterwards)
                self.gather_fp8(be, l, fp8, pass == Pass::Forward)?;
            }
            _ if self.fsdp && want_params => self.gather(be, unit)?,
            _ => {}
        }
        // The unit is in place: the next one's gather can start (a unit whose pass needs
        // no parameters, the embeddings' backward, needs no gather).
        if let Some((next, _)) = self.announced.take().filter(|(_, p)| p.needs_params()) {
            self.start_prefetch(be, next);
        }
        if backward {
            let waiting = self.waiting_for_weights.iter().position(|(u, _)| *u == unit);
            self.unit_grads = Some(match waiting {
                Some(i) => self.waiting_for_weights.swap_remove(i).1,
                None => self.temporary(be, Category::CommBuffers, global.len()),
            });
        }
        let params = match (want_params, &self.gathered) {
            (false, _) => None,
            (true, Some(full)) if self.fsdp => Some((&full.data, global.start)),
            (true, _) => Some((&self.params, self.shard.base)),
        };
        let grads = self.unit_grads.as_mut().map(|g| (&mut g.data, global.start));
        Ok(OpenUnit { params, grads })
    }
}

impl<B: TrainBackend> ModelState<B> for Sharded<B> {
    fn open(&mut self, be: &B, unit: Unit, pass: Pass) -> Result<OpenUnit<'_, B::Buf>, CommError> {
        self.open_with(be, unit, pass, None)
    }

    fn open_fp8(
        &mut self,
        be: &B,
        unit: Unit,
        pass: Pass,
        fp8: &mut Fp8Block,
    ) -> Result<OpenUnit<'_, B::Buf>, CommError> {
        self.open_with(be, unit, pass, Some(fp8))
    }

    fn announce_next(&mut self, next: Option<(Unit, Pass)>) {
        if self.prefetch.is_some() {
            self.announced = next;
        }
    }

    fn close(&mut self, be: &B, unit: Unit, pass: Pass) -> Result<(), CommError> {
        self.gathered = None;
        if pass.completes_grads() {
            self.reduce_scatter(be, unit)?;
        } else if pass == Pass::BackwardInput {
            if let Some(grads) = self.unit_grads.take() {
                self.waiting_for_weights.push((unit, grads));
            }
        }
        Ok(())
    }
}

impl<B: TrainBackend> Strategy<B> for Sharded<B> {
    fn begin_step(&mut self, be: &B, step: u64, record: bool) -> Result<(), TrainError> {
        be.fill(be.all_mut(&mut self.grad_shard), 0.0);
        self.step = step;
        self.record = record;
        Ok(())
    }

    fn state(&mut self, _last: bool) -> &mut dyn ModelState<B> {
        self
    }

    fn reduce_gradients(&mut self, be: &B) -> Result<f64, CommError> {
        self.settle_prefetch()?;
        debug_assert!(self.waiting_for_weights.is_empty(), "every B's unit met its W before the step's end");
        // HSDP: each unit's shard summed with its replicas' (every group's data).
        if let Some(replicas) = self.replicas.as_mut() {
            if self.record {
                be.synchronize();
            }
            let (start, sent_before) = (now_us(), replicas.bytes_sent());
            for u in &self.shard.units {
                let op = InPlace::AllReduce(Sum);
                collective(be, &self.memory, replicas.as_mut(), &mut self.grad_shard, u.local(), op, self.wire)?;
            }
            if self.record {
                be.synchronize();
                let sent = replicas.bytes_sent() - sent_before;
                self.spans.push(blocking_comm_span("all_reduce gradient shards (replicas)", self.step, start, sent));
            }
        }
        // Every element is in exactly one rank's shard of a group: the squares add up over it.
        let (shard, layout) = (&self.shard, &self.layout);
        let grads = &self.grad_shard;
        let mine = shard.units.iter().map(|u| layout.grad_squares(be, grads, u.local(), u.global_mine().start)).sum();
        sum_scalar(self.comm.as_mut(), mine)
    }

    fn update(&mut self, be: &B, lr: f64, grad_scale: f64) -> Result<(), TrainError> {
        let indexing = if self.fsdp { Indexing::Local } else { Indexing::Global };
        let (params, grads) = ((&mut self.params, indexing), (&self.grad_shard, Indexing::Local));
        self.optimizer.step(be, params, grads, lr, grad_scale, Some(self.comm.as_mut()))?;
        if !self.fsdp {
            if self.record {
                be.synchronize();
            }
            let (start, sent_before) = (now_us(), self.comm.bytes_sent());
            for u in &self.shard.units {
                let range = self.shard.in_buffer(u);
                collective(
                    be,
                    &self.memory,
                    self.comm.as_mut(),
                    &mut self.params,
                    range,
                    InPlace::AllGather,
                    self.wire,
                )?;
            }
            if self.record {
                be.synchronize();
                let sent = self.comm.bytes_sent() - sent_before;
                self.spans.push(blocking_comm_span("all_gather parameters (ZeRO-2)", self.step, start, sent));
            }
        }
        Ok(())
    }

    fn sum_scalar(&mut self, value: f64) -> Result<f64, CommError> {
        self.settle_prefetch()?;
        sum_scalar(self.scalars.as_mut().unwrap_or(&mut self.comm).as_mut(), value)
    }

    fn comm_spans(&self) -> Vec<Span> {
        let mut spans = self.spans.clone();
        if let Some(prefetch) = &self.prefetch {
            spans.extend(prefetch.spans.iter().cloned());
        }
        spans
    }

    fn held_bytes(&self, be: &B) -> u64 {
        let temporaries = [&self.gathered, &self.unit_grads]
            .iter()
            .flat_map(|t| t.as_ref())
            .map(|t| be.buf_len(&t.data))
            .sum::<usize>();
        ((be.buf_len(&self.params) + be.buf_len(&self.grad_shard) + temporaries) * size_of::<B::Elem>()) as u64
            + self.optimizer.held_bytes(be)
    }

    fn view_state(&self, be: &B, f: &mut dyn FnMut(StateView<'_>)) -> Result<(), OffloadError> {
        let params_replicated = !self.fsdp;
        be.read_host(be.all(&self.params), |params| {
            self.optimizer.read(be, |optimizer, optimizer_steps| {
                let params = params_f32(params);
                let local = Vec::new();
                f(StateView {
                    params,
                    optimizer,
                    optimizer_steps,
                    params_replicated,
                    optimizer_replicated: false,
                    local,
                })
            })
        })
    }

    fn load(&mut self, be: &B, state: SavedState) -> Result<(), String> {
        be.on_host(be.all_mut(&mut self.params), |params| load_params(params, state.params))?;
        self.optimizer.load_state(be, state.optimizer)
    }
}
