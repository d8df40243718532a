//! [`plan`]: a spec planned stage by stage. For each pipeline stage: its blocks and
//! parameters per TP rank, its model state sharded unit by unit, FSDP's gathered units, the
//! buffers waiting for a collective or a neighbour, the activations at the schedule's peak,
//! offloaded optimizer state and compression state; then its bytes by collective.

use super::activations::{
    activation_grad_elements, checkpointed, context_exchange_elements, expert_block_elements,
    layer_activation_elements, peak_held, recomputed_before_backward, Cut,
};
use super::comm::{stage_comm, wire_bytes, ContextComm, ExpertComm, StageCommInput};
use super::flops::step_flops;
use super::model_state::{activation_bytes, bytes_per_param, model_state_with_shard, OFFLOAD_PIECE_ELEMENTS};
use super::parameter_server::parameter_server;
use super::structure::check_structure;
use super::{Plan, RankMemory, RejoinPlan, StagePlan, REJOIN_HEADER_BYTES};
use crate::plan::compression::{self, Compressor};
use crate::plan::fp8_gather;
use crate::plan::ring::ring_all_reduce_bytes;
use crate::plan::schedule::{Action, Pipeline};
use crate::spec::field_error::FieldError;
use crate::spec::{
    BackendKind, DataSync, ExperimentSpec, FaultTolerance, Fp8Recipe, GradCompression, Offload, PpSchedule, Precision,
    Sharding,
};

/// ZeRO-2/FSDP under a split backward: the most gradient elements waiting for their W at
/// once on `stage` (`parallel/sharded.rs`): a chunk's units from its B to its next W, the
/// embeddings' own buffer on top at the end of the B of the model's first chunk.
/// `chunk_units`: the elements of each chunk's units (its blocks, and the head where it
/// ends the model).
fn waiting_for_weights(pipe: &Pipeline, stage: usize, chunk_units: &[u64], embeddings: u64) -> u64 {
    let mut waiting = vec![false; pipe.chunks];
    let mut most = 0u64;
    for action in pipe.actions(stage) {
        let c = action.chunk();
        let others: u64 = (0..pipe.chunks).filter(|&o| o != c && waiting[o]).map(|o| chunk_units[o]).sum();
        let held = match action {
            Action::Forward { .. } => continue,
            Action::Backward { .. } => {
                waiting[c] = true;
                let first = pipe.model_chunk(stage, c) == 0;
                chunk_units[c].saturating_add(if first { embeddings } else { 0 })
            }
            Action::Weights { .. } => {
                waiting[c] = false;
                chunk_units[c]
            }
        };
        most = most.max(others.saturating_add(held));
    }
    most
}

/// The most parameters two units opened one after the other hold: a block and the
/// embeddings, two blocks, or a block and the head (`units`: (block size, blocks),
/// (embeddings, 1), (head, 1), zero where the stage has none).
fn largest_adjacent_pair(units: &[(u64, u64); 3]) -> u64 {
    let [(block, blocks), (embedding, _), (head, _)] = *units;
    let two_blocks = if blocks >= 2 { block.saturating_mul(2) } else { block };
    two_blocks.max(block.saturating_add(embedding)).max(block.saturating_add(head))
}

/// Plans `spec`: every structural problem at once as field errors (422), else the plan.
pub fn plan(spec: &ExperimentSpec) -> Result<Plan, Vec<FieldError>> {
    check_structure(spec)?;
    let (m, p, t) = (&spec.model, &spec.parallel, &spec.train);
    let u = |x: usize| x as u64;
    let (d, seq, vocab) = (u(m.d_model), u(m.seq_len), u(m.vocab));
    let (dp, tp, pp) = (u(p.dp), u(p.tp), u(p.pp));
    // Over how many ranks ZeRO/FSDP cut each unit: the data-parallel group, or HSDP's shard group.
    let ways = u(p.shard_ways().max(1));
    let (batch, micro_batches) = (u(t.micro_batch), u(t.micro_batches));
    let micro_steps = micro_batches.saturating_mul(u(t.grad_accum));

    let param_count = m.param_count();
    let per_param = bytes_per_param(t.precision, t.optimizer);
    let act_bytes = activation_bytes(t.precision);

    // The model's parts as the engine lays them out (ParamLayout): they add up to param_count.
    // A tied LM head split from its embedding by a pipeline is a second copy on the last
    // stage (Megatron's: the two copies' gradients are summed between the stages).
    let embedding = m.embedding_params();
    let head = m.head_params() + if m.tie_embeddings && pp > 1 { d * vocab } else { 0 };
    let ep = u(p.ep.max(1));
    // With experts (tp = 1) a rank of an expert-parallel group holds E/ep of each block's.
    let experts_per_block = u(m.experts) / ep * m.mlp_params();
    let block = m.block_params() - (u(m.experts) - u(m.experts) / ep) * m.mlp_params();
    // Split by TP: GPT-2's QKV (3d^2 + 3d), attention projection weight (d^2), MLP (4d^2 + 4d, 4d^2).
    let block_split = m.tp_split_block_params();
    let block_per_tp_rank = block_split / tp + (block - block_split);

    // (with context parallelism a rank holds seq/cp tokens of each sequence)
    let cp = u(p.cp.max(1));
    let rows = batch.saturating_mul(seq) / cp;
    let rows_d = rows.saturating_mul(d);
    let sp = p.splits_sequence();
    let cut = Cut { tp, cp, ring: p.cp_kind.is_ring() };
    let layer_acts = layer_activation_elements(m, batch, cut, t.attention, sp);
    let grad_acts = activation_grad_elements(m, batch, cut, t.attention, sp);
    let (layer_acts, grad_acts) = match m.is_moe() {
        true => expert_block_elements(m, rows, ep, layer_acts, grad_acts),
        false => (layer_acts, grad_acts),
    };
    // ZB-H1 (no sequence parallelism): the gradients of a block's matmul outputs (attention
    // projection, MLP out: b*s*d each; QKV and the MLP's first matmul's output, split over
    // TP: GPT-2 3d + 4d, Llama's q, k, v and gate and up 2f).
    let weight_stash_elements = rows.saturating_mul(d.saturating_mul(2) + (m.qkv_width() + m.mlp_input_width()) / tp);
    // The residual stream between blocks (a stage's input and output, checkpointed segment
    // outputs): whole on every TP rank, or with sequence parallelism this rank's tokens.
    let res_d = if sp { rows_d / tp } else { rows_d };
    let recomputing = t.checkpointing.recomputes_blocks();
    // (selective recompute drops attention's probabilities from what a block keeps)
    let layer = (layer_acts, cut.attention(m, batch, t.attention));
    // Activation offload: a block keeps its output on the device (the next block's input);
    // the rest of what it keeps leaves after its forward (see offloaded_block).
    let offloaded_block = match t.activation_offload {
        Offload::None => 0,
        Offload::Host | Offload::Disk => checkpointed(1, t.checkpointing, res_d, layer).0.saturating_sub(res_d),
    };

    // M is every micro-batch of the step (accumulated ones too): one schedule runs them.
    let pipe = Pipeline::of(spec);
    let mut stages = Vec::with_capacity(p.pp);
    for s in 0..p.pp {
        let chunks = pipe.blocks_of(m.layers, s);
        let layers = chunks.iter().map(|c| u(c.len())).sum::<u64>();
        let (first, last) = (pipe.holds_embeddings(s), pipe.holds_head(s));
        let params_per_rank =
            layers * block_per_tp_rank + if first { embedding } else { 0 } + if last { head } else { 0 };
        let in_flight = u(pipe.activations_in_flight(s));

        // Model state, sharded unit by unit as the engine does (see model_state_with_shard).
        let units = [
            (if layers > 0 { block_per_tp_rank } else { 0 }, layers),
            (if first { embedding } else { 0 }, 1),
            (if last { head } else { 0 }, 1),
        ];
        let shard =
            units.iter().map(|&(n, count)| n.div_ceil(ways).saturating_mul(count)).fold(0u64, u64::saturating_add);
        let state = model_state_with_shard(params_per_rank, shard, p.sharding, t.precision, t.optimizer);
        // FSDP gathers one whole unit at a time (even alone: the gather is then a copy);
        // with prefetch the next unit's gather is under way too: two units in the order
        // they are opened (embeddings, blocks, head, and back).
        let largest_unit = units.iter().map(|&(n, _)| n).max().unwrap_or(0);
        let gathered_units = if p.prefetch { largest_adjacent_pair(&units) } else { largest_unit };
        let gathered = if p.sharding.shards_params() { gathered_units.saturating_mul(per_param.parameters) } else { 0 };
        // What waits for a collective: DDP and ZeRO-1 copy every gradient bucket (the whole
        // gradient, when there is a group to reduce with; the buckets are fp32 in every
        // precision, as gradients are summed across ranks in fp32); ZeRO-2 and FSDP hold one
        // unit's gradient until it is reduce-scattered (under a split backward, until its W:
        // a chunk's gradient waits from its B).
        // (with expert parallelism the experts' gradients are summed apart, in place)
        let experts_here = if ep > 1 { layers.saturating_mul(experts_per_block) } else { 0 };
        let fault_tolerant = p.fault_tolerance == FaultTolerance::Replicas && dp > 1;
        let comm_buffers = match p.sharding {
            // (DiLoCo sends no gradient; fault-tolerant replicas copy theirs below)
            Sharding::None | Sharding::Zero1 if dp > 1 && p.sync == DataSync::EveryStep && !fault_tolerant => {
                (params_per_rank - experts_here).saturating_mul(4)
            }
            Sharding::None | Sharding::Zero1 => 0,
            Sharding::Zero2 | Sharding::Fsdp | Sharding::Hsdp if pipe.splits_backward() => {
                let chunk_units: Vec<u64> = chunks
                    .iter()
                    .enumerate()
                    .map(|(c, blocks)| {
                        let ends_model = pipe.model_chunk(s, c) + 1 == pipe.model_chunks();
                        u(blocks.len()).saturating_mul(block_per_tp_rank).saturating_add(if ends_model {
                            head
                        } else {
                            0
                        })
                    })
                    .collect();
                let embeddings = if first { embedding } else { 0 };
                waiting_for_weights(&pipe, s, &chunk_units, embeddings).saturating_mul(per_param.gradients)
            }
            Sharding::Zero2 | Sharding::Fsdp | Sharding::Hsdp => largest_unit.saturating_mul(per_param.gradients),
        };
        // A pipeline stage receives into one activation buffer (all but the first) and one
        // output-gradient buffer (all but the last; interleaved: every stage both), and in
        // a V keeps the messages that come before it needs them. Copies queued for sending
        // come on top, as many as the schedule runs ahead of the neighbour: not predicted.
        // (Gradients waiting for their W and messages held early are each at their most
        // here; in a V the two peaks need not meet, and the ledger's can be lower.)
        let (gets_activations, gets_gradients) = pipe.receives(s);
        let receive_buffers = u64::from(gets_activations) + u64::from(gets_gradients) + u(pipe.held_early(s));
        let comm_buffers = comm_buffers.saturating_add(receive_buffers.saturating_mul(res_d).saturating_mul(act_bytes));
        // Asynchronous SGD: a worker's gradient going out and θ coming back; fault-tolerant
        // replicas: the replica's own gradient (kept for a retry) and the quorum's sum. Both
        // fp32 in host memory (the device's own on the CPU backend).
        let async_ps = p.sync == DataSync::AsyncPs && dp > 1;
        let worker_host = if async_ps || fault_tolerant { params_per_rank.saturating_mul(2 * 4) } else { 0 };
        let (comm_buffers, worker_offloaded) = match spec.backend {
            BackendKind::Cpu => (comm_buffers.saturating_add(worker_host), 0),
            BackendKind::Cuda => (comm_buffers, worker_host),
        };

        // Activations (elements). Every stage keeps its input per micro-batch (the first
        // stage: the embedding output; the others: what the previous stage sent); the last
        // stage also the final norm's output and statistics, logits and token losses.
        // With sequence parallelism the final LayerNorm's statistics are this rank's tokens
        // only, its output gathered whole for the LM head.
        // Each of the stage's chunks keeps its own (interleaved: one set per chunk and
        // micro-batch, the head's only on the model's last chunk); the peak is the most
        // the schedule's order holds at once.
        // (a block's two norms keep norm_statistics() per token: LayerNorm 2 each, RMSNorm 1)
        let per_norm = m.norm_statistics() / 2;
        let lnf_stats = if sp { rows.saturating_mul(per_norm) / tp } else { rows.saturating_mul(per_norm) };
        let head_acts =
            rows_d.saturating_add(lnf_stats).saturating_add(rows).saturating_add(rows.saturating_mul(vocab));
        let per_chunk: Vec<u64> = (0..chunks.len())
            .map(|c| {
                let (kept_layers, _) = checkpointed(u(chunks[c].len()), t.checkpointing, res_d, layer);
                let kept_layers = kept_layers.saturating_sub(u(chunks[c].len()).saturating_mul(offloaded_block));
                let is_head = pipe.model_chunk(s, c) + 1 == pipe.model_chunks();
                res_d.saturating_add(kept_layers).saturating_add(if is_head { head_acts } else { 0 })
            })
            .collect();
        let offloaded_per_chunk: Vec<u64> = chunks.iter().map(|c| u(c.len()).saturating_mul(offloaded_block)).collect();
        let recompute_peak =
            chunks.iter().map(|c| checkpointed(u(c.len()), t.checkpointing, res_d, layer).1).max().unwrap_or(0);
        // ZB-H1's, ZBV's and DualPipeV's B leaves each block of its chunk four output gradients for the
        // W (the weight gradients' other operands are activations the W keeps anyway).
        let stash: Vec<u64> = chunks
            .iter()
            .map(|c| if pipe.splits_backward() { u(c.len()).saturating_mul(weight_stash_elements) } else { 0 })
            .collect();
        let held_at_peak = |per_chunk: &[u64]| match pipe.kind {
            // (the sets are alike: no need to follow the order pass by pass)
            PpSchedule::Gpipe | PpSchedule::OneFOneB => in_flight.saturating_mul(per_chunk[0]),
            PpSchedule::Interleaved | PpSchedule::ZbH1 | PpSchedule::Zbv | PpSchedule::DualPipeV => {
                peak_held(&pipe.actions(s), per_chunk, &stash)
            }
        };
        // Offloaded blocks come back one at a time: on the device the one running and (on
        // the CPU backend, whose host memory is the device) the copy on its way to or from
        // the disk, beside the sets' outputs; every block of the sets in flight off it.
        let offload_on_device = match spec.backend {
            BackendKind::Cpu => 2,
            BackendKind::Cuda => 1,
        };
        let moving = if layers > 0 { offloaded_block.saturating_mul(offload_on_device) } else { 0 };
        let offloaded_activations = held_at_peak(&offloaded_per_chunk);
        // Sequence parallelism's two exchange buffers (b*s*d each, shared by every block):
        // a LayerNorm output gathered whole, a row-parallel output before its reduce-scatter.
        let exchange = if sp { rows_d.saturating_mul(2) } else { 0 };
        // Ulysses' two exchange buffers, shared by the stage's blocks.
        let exchange = exchange + if cp > 1 && layers > 0 { context_exchange_elements(m, rows, cut) } else { 0 };
        let activations =
            held_at_peak(&per_chunk).saturating_add(moving).saturating_add(recompute_peak).saturating_add(exchange);

        // ZeRO-Offload: the optimizer's state leaves the device. Streamed from disk, one
        // piece of it at a time is in memory while it is updated.
        let optimizer_elements = if p.sharding == Sharding::None { params_per_rank } else { shard };
        let (optimizer_state, offloaded) = match p.offload {
            Offload::None => (state.optimizer_state, 0),
            Offload::Host => (0, state.optimizer_state),
            // (on a GPU the piece is host memory: not the device's)
            Offload::Disk if spec.backend == BackendKind::Cuda => (0, state.optimizer_state),
            Offload::Disk => (
                optimizer_elements.min(OFFLOAD_PIECE_ELEMENTS as u64).saturating_mul(per_param.optimizer_state),
                state.optimizer_state,
            ),
        };
        // DiLoCo's outer state, fp32 host memory (the device's own on the CPU backend): the
        // parameters of the last outer step, and its momentum.
        let outer = match p.sync {
            DataSync::Diloco => params_per_rank.saturating_mul(4 * (1 + u64::from(p.outer_momentum > 0.0))),
            DataSync::EveryStep | DataSync::AsyncPs => 0,
        };
        // (an asynchronous worker keeps no optimizer: the server does)
        let optimizer_state = if async_ps { 0 } else { optimizer_state };
        let offloaded = offloaded.saturating_add(worker_offloaded);
        let (optimizer_state, offloaded) = match spec.backend {
            BackendKind::Cpu => (optimizer_state.saturating_add(outer), offloaded),
            BackendKind::Cuda => (optimizer_state, offloaded.saturating_add(outer)),
        };
        // Gradient compression: its residual and PowerSGD's Q, fp32 (DDP only, dp > 1).
        let compressor =
            Compressor { method: p.grad_compression, ratio: p.compression_ratio, rank: p.compression_rank };
        let shapes = compression::stage_shapes(m, p.tp, layers as usize, first, last);
        let compressing = dp > 1 && p.grad_compression != GradCompression::None;
        let compression_state = if compressing { compressor.state_floats(&shapes) as u64 * 4 } else { 0 };
        let mut memory = RankMemory {
            parameters: state.parameters,
            gradients: state.gradients,
            optimizer_state,
            gathered_parameters: gathered,
            activations: activations.saturating_mul(act_bytes),
            // (with sequence parallelism the last stage's final norm's parameter gradients too:
            // LayerNorm 2d, RMSNorm d)
            activation_grads: grad_acts
                .saturating_add(if sp && last { m.norm_params() } else { 0 })
                .saturating_mul(act_bytes),
            comm_buffers,
            transient: 0,
            transport: 0,
            checkpoint: 0,
            compression_state,
            offloaded: offloaded.saturating_add(offloaded_activations.saturating_mul(act_bytes)),
            total: 0,
        };
        memory.total = [
            memory.compression_state,
            memory.parameters,
            memory.gradients,
            memory.optimizer_state,
            memory.gathered_parameters,
            memory.activations,
            memory.activation_grads,
            memory.comm_buffers,
        ]
        .into_iter()
        .fold(0u64, u64::saturating_add);

        let comm = stage_comm(StageCommInput {
            params_per_rank,
            embedding: if first { embedding } else { 0 },
            layers,
            first,
            last,
            sharding: p.sharding,
            dp,
            shard_ways: ways,
            // HSDP: each unit's shard all-reduced across the replicas (a ring of dp / S).
            replica_all_reduce: match p.sharding {
                Sharding::Hsdp => units
                    .iter()
                    .map(|&(n, count)| {
                        ring_all_reduce_bytes(n.div_ceil(ways), dp / ways, wire_bytes(p.comm_dtype))
                            .saturating_mul(count)
                    })
                    .fold(0u64, u64::saturating_add),
                _ => 0,
            },
            tp,
            micro_steps,
            rows_d,
            res_d,
            norm: m.norm_params(),
            sp,
            recomputing,
            regathered: chunks
                .iter()
                .map(|c| recomputed_before_backward(u(c.len()), t.checkpointing))
                .sum::<u64>()
                .saturating_mul(block_per_tp_rank),
            pp_messages: u(pipe.messages_per_micro_batch(s)),
            dp_wire_bytes: wire_bytes(p.comm_dtype),
            fp8_block_gather: (p.fp8_all_gather && p.sharding == Sharding::Fsdp).then(|| {
                let runs = fp8_gather::block_runs(m);
                let wire = wire_bytes(p.comm_dtype) as usize;
                fp8_gather::sent_per_gather(&runs, p.dp, wire, t.fp8 == Fp8Recipe::Current)
            }),
            block_params: m.block_params(),
            allreduce: p.allreduce,
            ranks_per_node: p.ranks_per_node,
            compressed: compressing.then(|| compressor.bytes_sent(&shapes, p.dp)),
            outer_every: (p.sync == DataSync::Diloco).then_some(p.outer_steps_every),
            async_ps,
            experts: (ep > 1).then(|| ExpertComm {
                params: experts_here,
                ep,
                slots_d: u(m.experts).saturating_mul(u(m.expert_capacity(rows as usize))).saturating_mul(d),
            }),
            context: (cp > 1).then(|| ContextComm {
                cp,
                ring: cut.ring,
                qkv: rows.saturating_mul(m.qkv_width() / tp),
                out: rows.saturating_mul(d / tp),
            }),
        });
        stages.push(StagePlan {
            stage: s,
            first_layer: chunks.first().map_or(0, |c| c.start),
            layers: layers as usize,
            embedding: first,
            head: last,
            params_per_rank,
            in_flight_micro_batches: in_flight,
            memory,
            comm,
        });
    }
    let peak_stage =
        stages.iter().enumerate().max_by_key(|(i, st)| (st.memory.total, usize::MAX - i)).map_or(0, |x| x.0);

    let world_size = dp.saturating_mul(tp).saturating_mul(pp);
    let flops = step_flops(spec, world_size);
    let parameter_server = match stages.first() {
        Some(worker) if p.sync == DataSync::AsyncPs && dp > 1 => Some(parameter_server(worker, spec)),
        _ => None,
    };
    let rejoin = match stages.first() {
        Some(replica) if p.fault_tolerance == FaultTolerance::Replicas && dp > 1 => {
            let n = replica.params_per_rank;
            let moments = 2 * u64::from(spec.train.optimizer.keeps_moments());
            let master = u64::from(spec.train.precision != Precision::Fp32);
            let floats = n.saturating_mul(1 + moments + master);
            Some(RejoinPlan { state_bytes: REJOIN_HEADER_BYTES.saturating_add(floats.saturating_mul(4)) })
        }
        _ => None,
    };
    Ok(Plan {
        param_count,
        world_size,
        bytes_per_param: per_param,
        activation_bytes: act_bytes,
        stages,
        peak_stage,
        bubble_fraction: pipe.formula_bubble(),
        // idle / busy = bubble / (1 - bubble): (P-1)/M, (P-1)/(vM), (P-1)/(3M).
        bubble_over_compute: pipe.formula_bubble() / (1.0 - pipe.formula_bubble()),
        flops,
        parameter_server,
        rejoin,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plan::planner::CommVolume;
    use crate::spec::{Attention, Checkpointing, ModelSpec, ParallelSpec, PpSchedule, Precision};

    #[test]
    fn the_stages_flops_add_up_to_the_models() {
        let mut spec = ExperimentSpec::default();
        spec.model = ModelSpec::dense(4, 64, 4, 32, 64);
        for (pp, chunks) in [(1, 1), (2, 1), (4, 1), (2, 2)] {
            spec.parallel.pp = pp;
            spec.parallel.virtual_stages = chunks;
            spec.parallel.pp_schedule = if chunks > 1 { PpSchedule::Interleaved } else { PpSchedule::OneFOneB };
            spec.train.micro_batches = 4;
            let per_stage = plan(&spec).unwrap().stage_flops_per_token(&spec);
            assert_eq!(per_stage.len(), pp);
            let sum: f64 = per_stage.iter().sum();
            let whole = spec.model.train_flops_per_token();
            assert!((sum - whole).abs() <= 1e-9 * whole, "pp {pp} x {chunks}: {per_stage:?} vs {whole}");
            if pp == 4 {
                // The first stage holds the embeddings, the middle ones a block each.
                assert!(per_stage[0] > per_stage[1] && per_stage[1] == per_stage[2], "{per_stage:?}");
            }
        }
    }

    #[test]
    fn tiny_spec_matches_the_engine_accounting() {
        // The default spec: 2 layers, d=64, 4 heads, seq 32, vocab 64, micro-batch 8, fp32, AdamW.
        let spec = ExperimentSpec::default();
        let plan = plan(&spec).unwrap();
        assert_eq!(plan.param_count, 110_336);
        assert_eq!(plan.world_size, 1);
        assert_eq!(plan.stages.len(), 1);
        let st = &plan.stages[0];
        assert_eq!((st.first_layer, st.layers, st.embedding, st.head), (0, 2, true, true));
        assert_eq!(st.params_per_rank, 110_336);
        let mem = &st.memory;
        assert_eq!((mem.parameters, mem.gradients, mem.optimizer_state), (441_344, 441_344, 882_688));
        assert_eq!((mem.gathered_parameters, mem.comm_buffers), (0, 0));
        // The engine's Gpt::activation_floats_for, by hand: rows = 8*32 = 256, rc = rows*64.
        let (rows, rc, att) = (256u64, 256 * 64u64, 8 * 4 * 32 * 32u64);
        let block = 16 * rc + 4 * rows + att;
        let top = 2 * rc + 3 * rows + rows * 64;
        let scratch = 10 * rc + att;
        assert_eq!(mem.activations, 4 * (2 * block + top));
        assert_eq!(mem.activation_grads, 4 * scratch);
        assert_eq!(mem.activations + mem.activation_grads, 4 * 838_400);
        assert_eq!(mem.total, 441_344 * 2 + 882_688 + 4 * 838_400);
        // One rank: nothing to send, no bubble.
        assert_eq!(st.comm, CommVolume::default());
        assert_eq!((plan.bubble_fraction, plan.bubble_over_compute), (0.0, 0.0));
        // 8 sequences of 32 tokens: 6 * 110336 * 256 + 12 * 2 * 32 * 64 * 256.
        assert_eq!(plan.flops.tokens_per_step, 256);
        assert_eq!(plan.flops.six_params_tokens, 6.0 * 110_336.0 * 256.0);
        assert_eq!(plan.flops.total, (6.0 * 110_336.0 + 12.0 * 2.0 * 32.0 * 64.0) * 256.0);
        assert_eq!(plan.flops.recompute, 0.0);
    }

    #[test]
    fn stages_and_tp_ranks_add_up_to_the_whole_model() {
        let mut spec = ExperimentSpec { model: ModelSpec::dense(7, 96, 6, 16, 50), ..ExperimentSpec::default() };
        spec.parallel.pp = 3;
        let p = plan(&spec).unwrap();
        let layers: Vec<(usize, usize)> = p.stages.iter().map(|s| (s.first_layer, s.layers)).collect();
        assert_eq!(layers, vec![(0, 3), (3, 2), (5, 2)]);
        let sum: u64 = p.stages.iter().map(|s| s.params_per_rank).sum();
        assert_eq!(sum, spec.model.param_count());
        // TP: the split part of each block divides by tp, the rest (6d) is on every rank.
        spec.parallel.pp = 1;
        spec.parallel.tp = 3;
        let d = 96u64;
        let block = spec.model.block_params();
        let expected = (block - 6 * d) / 3 + 6 * d;
        let one = plan(&spec).unwrap().stages[0].params_per_rank;
        let embed_head = spec.model.param_count() - 7 * block;
        assert_eq!(one, 7 * expected + embed_head);
    }

    #[test]
    fn pipeline_bubble_schedules_and_sends() {
        let mut spec = ExperimentSpec::default();
        spec.model.layers = 4;
        spec.parallel.pp = 4;
        spec.train.micro_batches = 16;
        let p = plan(&spec).unwrap();
        // P=4, M=16: 3/19 = 15.8% ("about 16%"); (P-1)/M = 18.75% of the compute time.
        assert!((p.bubble_fraction - 3.0 / 19.0).abs() < 1e-12);
        assert!((p.bubble_over_compute - 3.0 / 16.0).abs() < 1e-12);
        // 1F1B holds P - stage micro-batches; GPipe all 16.
        let in_flight: Vec<u64> = p.stages.iter().map(|s| s.in_flight_micro_batches).collect();
        assert_eq!(in_flight, vec![4, 3, 2, 1]);
        spec.parallel.pp_schedule = PpSchedule::Gpipe;
        let g = plan(&spec).unwrap();
        assert!(g.stages.iter().all(|s| s.in_flight_micro_batches == 16));
        assert!(g.stages[0].memory.activations > p.stages[0].memory.activations);
        // Accumulation runs in the same schedule: M = micro_batches x grad_accum = 32.
        spec.train.micro_batches = 8;
        spec.train.grad_accum = 4;
        assert_eq!(spec.pipeline_micro_batches(), 32);
        let accumulated = plan(&spec).unwrap();
        assert!((accumulated.bubble_fraction - 3.0 / 35.0).abs() < 1e-12);
        assert!(accumulated.stages.iter().all(|s| s.in_flight_micro_batches == 32));
        spec.train.micro_batches = 16;
        spec.train.grad_accum = 1;
        // Sends: an activation of 8*32*64 fp32 per micro-batch forward and/or backward.
        let a = 8 * 32 * 64 * 4 * 16u64;
        let sends: Vec<u64> = p.stages.iter().map(|s| s.comm.pp_send).collect();
        assert_eq!(sends, vec![a, 2 * a, 2 * a, a]);
        // Interleaved, v = 2 on 8 blocks: (P-1)/(vM+P-1) = 3/35, (P-1)/(vM) of the compute;
        // every chunk but the model's last sends on, every one but its first sends back;
        // warm-up 2(P-1-s) + (v-1)P chunk passes, one more in flight.
        spec.model.layers = 8;
        (spec.parallel.pp_schedule, spec.parallel.virtual_stages) = (PpSchedule::Interleaved, 2);
        let v = plan(&spec).unwrap();
        assert!((v.bubble_fraction - 3.0 / 35.0).abs() < 1e-12);
        assert!((v.bubble_over_compute - 3.0 / 32.0).abs() < 1e-12);
        let sends: Vec<u64> = v.stages.iter().map(|s| s.comm.pp_send).collect();
        assert_eq!(sends, vec![3 * a, 4 * a, 4 * a, 3 * a]);
        let in_flight: Vec<u64> = v.stages.iter().map(|s| s.in_flight_micro_batches).collect();
        assert_eq!(in_flight, vec![11, 9, 7, 5]);
        assert!(v.stages.iter().all(|s| s.layers == 2));
        spec.parallel.virtual_stages = 3;
        let refused = plan(&spec).unwrap_err();
        assert!(refused.iter().any(|e| e.message.contains("multiple of 12")), "{refused:?}");
        // ZB-H1: a third of 1F1B's idle time against its compute, (P-1)/(3M).
        (spec.parallel.pp_schedule, spec.parallel.virtual_stages) = (PpSchedule::ZbH1, 1);
        let zb = plan(&spec).unwrap();
        assert!((zb.bubble_over_compute - 3.0 / 48.0).abs() < 1e-12);
        // Schedules the planner follows pass by pass have a bound, not a hang.
        spec.train.micro_batches = usize::MAX;
        let refused = plan(&spec).unwrap_err();
        assert!(refused.iter().any(|e| e.message.contains("pass by pass")), "{refused:?}");
    }

    #[test]
    fn gpt3_on_3d_parallel_does_not_overflow() {
        // 175B-class: 96 layers, d=12288, 96 heads, seq 2048, on dp=1024 x tp=8 x pp=16.
        let mut spec =
            ExperimentSpec { model: ModelSpec::dense(96, 12288, 96, 2048, 50257), ..ExperimentSpec::default() };
        spec.parallel = ParallelSpec { dp: 1024, tp: 8, pp: 16, sharding: Sharding::Zero1, ..ParallelSpec::default() };
        spec.train.precision = Precision::Bf16;
        spec.train.micro_batch = 1;
        spec.train.micro_batches = 64;
        spec.train.checkpointing = Checkpointing::Every;
        let p = plan(&spec).unwrap();
        assert!((p.param_count as f64 - 175e9).abs() < 2e9, "{}", p.param_count);
        assert_eq!(p.world_size, 1024 * 8 * 16);
        assert_eq!(p.stages.len(), 16);
        assert!(p.stages.iter().all(|s| s.layers == 6));
        // ~175e9 / (8 * 16) = 1.4B parameters per middle rank, 2 bytes each.
        let mid = &p.stages[5];
        assert!((mid.params_per_rank as f64 / 1.36e9 - 1.0).abs() < 0.05, "{}", mid.params_per_rank);
        assert_eq!(mid.memory.parameters, 2 * mid.params_per_rank);
        assert!(p.stages.iter().all(|s| s.memory.total < 1 << 40 && s.comm.total > 0));
        assert!(p.flops.total.is_finite() && p.flops.total > 1e18);
        assert!((p.bubble_fraction - 15.0 / 79.0).abs() < 1e-12);
        // The plan round-trips through JSON (the browser renders it).
        let again: Plan = serde_json::from_str(&serde_json::to_string(&p).unwrap()).unwrap();
        assert_eq!(again, p);
    }

    /// A Llama-style model: RMSNorm, SwiGLU and grouped-query attention, each in the
    /// places a learner would look: parameters per stage and TP rank, the activations kept.
    #[test]
    fn llama_blocks_are_planned_by_their_own_shapes() {
        // 4 blocks of d = 256, 8 heads of 32 sharing 2 K/V heads, SwiGLU of 688, vocab 1000.
        let m = ModelSpec::llama(4, 256, 8, 2, 688, 64, 1000);
        let (d, f, v) = (256u64, 688u64, 1000u64);
        let kv = 2 * 32; // two K/V heads of 32
        let block = 2 * d + (d * (d + 2 * kv) + d * d) + 3 * d * f;
        assert_eq!(m.block_params(), block);
        assert_eq!(m.param_count(), v * d + 4 * block + d + d * v, "no position table, one RMSNorm gain");
        let mut spec = ExperimentSpec { model: m.clone(), ..ExperimentSpec::default() };
        (spec.parallel.tp, spec.parallel.pp) = (2, 2);
        let p = plan(&spec).unwrap();
        // Each TP rank holds half of every matrix and both norms whole.
        assert_eq!(p.stages[0].params_per_rank, v * d + 2 * ((block - 2 * d) / 2 + 2 * d));
        assert_eq!(p.stages[1].params_per_rank, 2 * ((block - 2 * d) / 2 + 2 * d) + d + d * v);
        // Tied: the head leaves the count, but a pipeline's last stage keeps its copy.
        spec.model.tie_embeddings = true;
        let tied = plan(&spec).unwrap();
        assert_eq!(tied.param_count, p.param_count - d * v);
        assert_eq!(tied.stages[1].params_per_rank, p.stages[1].params_per_rank);
        spec.parallel.pp = 1;
        spec.model.layers = 2;
        let one_stage = plan(&spec).unwrap();
        assert_eq!(one_stage.stages[0].params_per_rank, v * d + 2 * ((block - 2 * d) / 2 + 2 * d) + d);
        // Fewer K/V heads keep narrower K and V: (8 - 2) x 32 x 2 fewer values per token.
        let full = ModelSpec { kv_heads: 8, ..m.clone() };
        let (b, t) = (2u64, 64u64);
        let saved = layer_activation_elements(&full, b, Cut::WHOLE, Attention::Flash, false)
            - layer_activation_elements(&m, b, Cut::WHOLE, Attention::Flash, false);
        assert_eq!(saved, b * t * 2 * (8 - 2) * 32);
        // Whole K/V heads per TP rank, and an MLP width TP divides.
        spec.parallel.tp = 4;
        let errors = plan(&spec).unwrap_err();
        assert!(errors.iter().any(|e| e.field == "parallel.tp" && e.message.contains("kv_heads=2")), "{errors:?}");
        spec.parallel.tp = 2;
        spec.model.kv_heads = 3;
        let errors = plan(&spec).unwrap_err();
        assert!(errors.iter().any(|e| e.field == "model.kv_heads"), "{errors:?}");
        // Llama's default MLP width: 8/3 d rounded up to 256 (Llama-2 7B: 11008).
        assert_eq!(ModelSpec { ffn_hidden: 0, ..ModelSpec::llama(1, 4096, 32, 32, 0, 8, 8) }.d_ff(), 11008);
    }
}
