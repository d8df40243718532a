//! Bytes one rank of a stage sends per optimizer step, by collective: the data-parallel
//! group's gradients and parameters (by sharding, all-reduce algorithm, wire format and
//! compression), tensor parallelism's activations, the pipeline's sends and expert
//! parallelism's all-to-alls (the list is `stage_comm`'s doc).

use super::CommVolume;
use crate::plan::ring::{ring_all_reduce_bytes, ring_reduce_scatter_bytes};
use crate::spec::{AllReduce, Precision, Sharding};

/// Bytes per element on the wire: the engine's collectives carry f32, the data-parallel
/// ones `parallel.comm_dtype` (2 bytes for bf16/fp16).
const WIRE_BYTES: u64 = 4;

pub fn wire_bytes(format: Precision) -> u64 {
    match format {
        Precision::Fp32 => 4,
        Precision::Bf16 | Precision::Fp16 => 2,
    }
}

pub(super) struct StageCommInput {
    pub(super) params_per_rank: u64,
    /// Embedding parameters on this stage (the first), which backward gathers no more.
    pub(super) embedding: u64,
    pub(super) layers: u64,
    pub(super) first: bool,
    pub(super) last: bool,
    pub(super) sharding: Sharding,
    pub(super) dp: u64,
    /// Ranks each unit is cut over (dp, or HSDP's shard group).
    pub(super) shard_ways: u64,
    /// HSDP: the bytes of the shard's all-reduce across the replicas per step.
    pub(super) replica_all_reduce: u64,
    pub(super) tp: u64,
    /// micro_batches * grad_accum: forward + backward passes per optimizer step.
    pub(super) micro_steps: u64,
    /// Elements of one activation tensor between blocks: micro_batch * seq_len * d_model.
    pub(super) rows_d: u64,
    /// Of it, what a TP rank holds of the residual stream (rows_d / tp with sequence parallelism).
    pub(super) res_d: u64,
    /// Parameters of one norm (LayerNorm 2d, RMSNorm d): sequence parallelism sums their
    /// gradients over the group.
    pub(super) norm: u64,
    /// Sequence parallelism.
    pub(super) sp: bool,
    pub(super) recomputing: bool,
    /// FSDP: parameters gathered once more per micro-batch, for blocks recomputed before
    /// their own backward opens them (see
    /// [`recomputed_before_backward`](super::activations::recomputed_before_backward)).
    pub(super) regathered: u64,
    /// Activations and gradients the stage sends other stages per micro-batch
    /// ([`Pipeline::messages_per_micro_batch`](crate::plan::schedule::Pipeline::messages_per_micro_batch)).
    pub(super) pp_messages: u64,
    /// Bytes per element of the data-parallel collectives (`parallel.comm_dtype`).
    pub(super) dp_wire_bytes: u64,
    /// FSDP with `parallel.fp8_all_gather`: what one rank sends to gather a block, its
    /// linear weights in FP8 ([`sent_per_gather`](crate::plan::fp8_gather::sent_per_gather)).
    pub(super) fp8_block_gather: Option<u64>,
    /// Parameters of one block (all of them on this tensor-parallel rank: FP8 runs at tp 1).
    pub(super) block_params: u64,
    /// The gradient all-reduce's algorithm and `hierarchical`'s node size.
    pub(super) allreduce: AllReduce,
    pub(super) ranks_per_node: usize,
    /// With gradient compression: the bytes its messages take, in place of the all-reduce.
    pub(super) compressed: Option<u64>,
    /// DiLoCo: the steps between two outer steps (H), whose all-reduce of the parameter
    /// changes takes the place of the gradients' every step.
    pub(super) outer_every: Option<u64>,
    /// Asynchronous SGD: each step's gradient pushed whole to the parameter server.
    pub(super) async_ps: bool,
    /// Expert parallelism.
    pub(super) experts: Option<ExpertComm>,
    /// Context parallelism (Ulysses).
    pub(super) context: Option<ContextComm>,
}

/// What context parallelism moves on one rank of a stage.
#[derive(Clone, Copy)]
pub(super) struct ContextComm {
    pub(super) cp: u64,
    /// The ring (else Ulysses).
    pub(super) ring: bool,
    /// Elements of one block's q, k and v and of its attention output on this rank, for a
    /// micro-batch (this rank's tokens): what Ulysses' all-to-alls exchange; the ring sends
    /// the k and v of them (qkv - out).
    pub(super) qkv: u64,
    pub(super) out: u64,
}

/// What expert parallelism moves on one rank of a stage.
pub(super) struct ExpertComm {
    /// The stage's expert parameters on this rank (summed over its dp/ep replicas only).
    pub(super) params: u64,
    pub(super) ep: u64,
    /// Elements of a micro-batch's slots in one block, E x C x d: what each all-to-all
    /// exchanges.
    pub(super) slots_d: u64,
}

/// Bytes one rank of a stage sends per optimizer step (N = params_per_rank, W = dp,
/// n = micro_batches * grad_accum, A = one b*s*d activation tensor, all ring collectives):
///
/// - asynchronous SGD (`sync: async_ps`): a worker pushes its fp32 gradient and a 24-byte
///   header, 4N + 24, and gets θ back (the server's sends: `parameter_server.rs`);
/// - DiLoCo (`sync: diloco`, sharding none): no gradient crosses the wire; every H steps
///   the replicas all-reduce their fp32 parameter changes, 2(W-1)/W * N * 4: counted per
///   step as that over H (rounded down);
/// - none (DDP): one gradient all-reduce per step (accumulation runs without sync):
///   2(W-1)/W * N * grad bytes round the ring; with `allreduce` naive, tree or hierarchical
///   the busiest rank's bytes (`all_reduce.rs`: rank 0's (W-1) * N for naive); with
///   `grad_compression` its messages instead (`compression.rs`);
/// - zero1: DDP's gradient all-reduce (2(W-1)/W * N; every rank keeps the full gradient),
///   then each rank updates its shard and the ranks all-gather the parameters:
///   (W-1)/W * N;
/// - zero2: only a gradient shard is kept, so every micro-batch's gradients are
///   reduce-scattered as they are made: n * (W-1)/W * N, plus the parameter all-gather;
/// - fsdp: every micro-batch gathers the parameters before forward and again before
///   backward (except the embeddings, whose gradient needs no parameters) and
///   reduce-scatters the gradients: n * (W-1)/W * (3N - E); nothing after the update
///   (parameters stay sharded); sqrt checkpointing gathers the blocks it recomputes
///   ahead of their backward once more; with `fp8_all_gather` each block's two gathers
///   are FP8 messages (`fp8_gather.rs`: its weights in a byte, padded to the longest
///   chunk) and only the embeddings and the head gather in the wire format;
/// - TP: per block and micro-batch, 2 all-reduces of A forward (after the attention and
///   MLP row-parallel layers) and 2 backward (the gradients of their inputs), plus 2 more
///   when checkpointing recomputes the forward: 2(T-1)/T * A each;
/// - TP with sequence parallelism: all-gathers and reduce-scatters of A, (T-1)/T * A each:
///   per block and micro-batch 2 + 2 forward (the LayerNorm outputs gathered, the
///   row-parallel outputs reduce-scattered), 6 backward (the output gradients gathered, the
///   LayerNorm outputs gathered again for the weight gradients, the LayerNorm output
///   gradients reduce-scattered), 4 more when checkpointing recomputes the forward, and an
///   all-reduce of the block's norm parameter gradients (4d, Llama's RMSNorm gains 2d); the
///   last stage gathers the final norm's output (and all-reduces its parameter gradients), the first
///   gathers the embedding output's gradient;
/// - CP (Ulysses, C ranks): per block and micro-batch an all-to-all of q, k and v and one
///   of attention's output forward, of their gradients backward (two more when
///   checkpointing recomputes the forward), (C-1)/C of each; the ring: the block of k and
///   v (KV) passed on C-1 times forward, C-1 times backward with its gradient passed on C
///   times (the last brings it home), (3C-2) x KV per block and micro-batch, C-1 more KV
///   when checkpointing recomputes the forward;
/// - PP: per micro-batch, A forward to the next stage (all but the last) and its gradient
///   back to the previous one (all but the first); with sequence parallelism A / T.
///
/// By default everything crosses the wire in fp32, in every precision: bf16/fp16 gradients
/// are summed across ranks in fp32 (Megatron-LM does the same for bf16), and parameters
/// and activations are widened (exactly) for the ring. With `comm_dtype` bf16/fp16 the
/// data-parallel collectives (gradients, ZeRO/FSDP's parameters) carry 2 bytes per
/// element, half the DP bytes below; TP and PP stay fp32.
///
/// Not counted: the engine's one-float all-reduces of the step's loss (and, when sharded,
/// of the squared gradient norm), and with LAMB or LARS under ZeRO/FSDP the all-reduce of
/// two floats per tensor (the squares its trust ratio is made of).
pub(super) fn stage_comm(c: StageCommInput) -> CommVolume {
    let mut v = match &c.experts {
        None => dp_and_tp_comm(&c),
        Some(e) => {
            // The shared tensors over the data-parallel group, the experts over their replicas.
            let shared = StageCommInput { params_per_rank: c.params_per_rank - e.params, experts: None, ..c };
            let mut v = dp_and_tp_comm(&shared);
            let replicas = c.dp / e.ep;
            v.dp_all_reduce =
                v.dp_all_reduce.saturating_add(ring_all_reduce_bytes(e.params, replicas, c.dp_wire_bytes));
            // Four all-to-alls per block and micro-batch (the slots there and back, their
            // gradients there and back), two more for a recomputed forward.
            let per_block = if c.recomputing { 6 } else { 4 };
            let one = ring_reduce_scatter_bytes(e.slots_d, e.ep, WIRE_BYTES);
            v.ep_all_to_all = one.saturating_mul(per_block).saturating_mul(c.layers).saturating_mul(c.micro_steps);
            v
        }
    };
    if let Some(x) = &c.context {
        let forwards = if c.recomputing { 2 } else { 1 };
        let per_block = match x.ring {
            false => ring_reduce_scatter_bytes(x.qkv, x.cp, WIRE_BYTES)
                .saturating_add(ring_reduce_scatter_bytes(x.out, x.cp, WIRE_BYTES))
                .saturating_mul(forwards + 1),
            true => {
                let kv = (x.qkv - x.out).saturating_mul(WIRE_BYTES);
                kv.saturating_mul((x.cp - 1) * forwards + (x.cp - 1) + x.cp)
            }
        };
        v.cp_all_to_all = per_block.saturating_mul(c.layers).saturating_mul(c.micro_steps);
    }
    v.total = [v.dp_all_reduce, v.dp_reduce_scatter, v.dp_all_gather, v.tp_all_reduce, v.pp_send, v.dp_compressed]
        .into_iter()
        .chain([v.ep_all_to_all, v.cp_all_to_all, v.ps_push_pull])
        .fold(0u64, u64::saturating_add);
    v
}

/// [`stage_comm`] without expert parallelism.
fn dp_and_tp_comm(c: &StageCommInput) -> CommVolume {
    let (g, w, ways) = (c.dp_wire_bytes, c.dp_wire_bytes, c.shard_ways);
    let grads_rs = ring_reduce_scatter_bytes(c.params_per_rank, ways, g);
    let params_ag = ring_reduce_scatter_bytes(c.params_per_rank, ways, w);
    let mut v = CommVolume::default();
    // The ring sends as much from every rank; the others are counted at their busiest rank.
    let all_reduce = match c.allreduce {
        AllReduce::Ring => ring_all_reduce_bytes(c.params_per_rank, c.dp, g),
        other => {
            let (n, w) = (c.params_per_rank as usize, c.dp as usize);
            (crate::plan::all_reduce::busiest_elements_sent(other, n, w, c.ranks_per_node) as u64).saturating_mul(g)
        }
    };
    match c.sharding {
        Sharding::None if c.async_ps => v.ps_push_pull = super::parameter_server::worker_push_bytes(c.params_per_rank),
        Sharding::None => match (c.compressed, c.outer_every) {
            (Some(bytes), _) => v.dp_compressed = bytes,
            // (fp32 changes round the ring once every H steps: per step, a share of it)
            (None, Some(h)) => v.dp_all_reduce = ring_all_reduce_bytes(c.params_per_rank, c.dp, 4) / h.max(1),
            (None, None) => v.dp_all_reduce = all_reduce,
        },
        Sharding::Zero1 => {
            v.dp_all_reduce = all_reduce;
            v.dp_all_gather = params_ag;
        }
        Sharding::Zero2 => {
            v.dp_reduce_scatter = c.micro_steps.saturating_mul(grads_rs);
            v.dp_all_gather = params_ag;
        }
        Sharding::Fsdp | Sharding::Hsdp => {
            v.dp_reduce_scatter = c.micro_steps.saturating_mul(grads_rs);
            v.dp_all_reduce = c.replica_all_reduce;
            let per_micro_step =
                match c.fp8_block_gather {
                    None => {
                        let backward_ag = ring_reduce_scatter_bytes(c.params_per_rank - c.embedding, ways, w);
                        let recompute_ag = ring_reduce_scatter_bytes(c.regathered, ways, w);
                        params_ag.saturating_add(backward_ag).saturating_add(recompute_ag)
                    }
                    // (FP8 refuses the checkpointing that regathers)
                    Some(block) => {
                        let rest = c.params_per_rank.saturating_sub(c.layers.saturating_mul(c.block_params));
                        let rest_ag = ring_reduce_scatter_bytes(rest, ways, w)
                            .saturating_add(ring_reduce_scatter_bytes(rest.saturating_sub(c.embedding), ways, w));
                        rest_ag.saturating_add(block.saturating_mul(2).saturating_mul(c.layers))
                    }
                };
            v.dp_all_gather = c.micro_steps.saturating_mul(per_micro_step);
        }
    }
    let half = ring_reduce_scatter_bytes(c.rows_d, c.tp, WIRE_BYTES);
    let per_micro_batch = if c.sp {
        let halves_per_block = if c.recomputing { 14 } else { 10 };
        let block =
            half.saturating_mul(halves_per_block).saturating_add(ring_all_reduce_bytes(2 * c.norm, c.tp, WIRE_BYTES));
        let head = if c.last { half.saturating_add(ring_all_reduce_bytes(c.norm, c.tp, WIRE_BYTES)) } else { 0 };
        let embeddings = if c.first { half } else { 0 };
        block.saturating_mul(c.layers).saturating_add(head).saturating_add(embeddings)
    } else {
        let all_reduces_per_block = if c.recomputing { 6 } else { 4 };
        half.saturating_mul(2 * all_reduces_per_block).saturating_mul(c.layers)
    };
    v.tp_all_reduce = if c.tp > 1 { per_micro_batch.saturating_mul(c.micro_steps) } else { 0 };
    v.pp_send = c.res_d.saturating_mul(WIRE_BYTES).saturating_mul(c.pp_messages).saturating_mul(c.micro_steps);
    v
}

#[cfg(test)]
mod tests {
    use crate::plan::planner::plan;
    use crate::plan::ring::{ring_all_reduce_bytes, ring_reduce_scatter_bytes};
    use crate::spec::{Checkpointing, ExperimentSpec, ModelSpec, Precision, Sharding};

    #[test]
    fn comm_per_sharding_relative_to_ddp() {
        // DDP 2D. ZeRO-2: reduce-scatter + all-gather = 2D as well (the ZeRO paper; the
        // flashcards' "ZeRO-2 sends half of DDP" forgets the all-gather of the updated
        // parameters). ZeRO-1 as the engine runs it (and as this project's issue defines it)
        // keeps DDP's all-reduce and adds the all-gather: 3D. FSDP: two gathers and a
        // reduce-scatter, 3D, less the embeddings' backward gather (no parameters needed).
        let spec_with = |sharding| {
            let mut spec = ExperimentSpec { model: ModelSpec::dense(4, 64, 4, 32, 64), ..ExperimentSpec::default() };
            spec.parallel.dp = 4;
            spec.parallel.sharding = sharding;
            spec
        };
        let total = |sharding| plan(&spec_with(sharding)).unwrap().stages[0].comm.clone();
        let ddp = total(Sharding::None);
        let m = spec_with(Sharding::None).model;
        let params = m.param_count();
        assert_eq!(ddp.dp_all_reduce, ring_all_reduce_bytes(params, 4, 4));
        assert_eq!(ddp.total, ddp.dp_all_reduce);
        let z1 = total(Sharding::Zero1);
        let z2 = total(Sharding::Zero2);
        let fsdp = total(Sharding::Fsdp);
        assert_eq!(z2.dp_reduce_scatter + z2.dp_all_gather, ddp.total);
        assert_eq!((z1.dp_all_reduce, z1.dp_all_gather), (ddp.dp_all_reduce, z2.dp_all_gather));
        let embedding = ((m.vocab + m.seq_len) * m.d_model) as u64;
        let backward_gathers = ring_reduce_scatter_bytes(params - embedding, 4, 4);
        assert_eq!(fsdp.dp_all_gather, fsdp.dp_reduce_scatter + backward_gathers);
        assert_eq!(fsdp.total, 2 * fsdp.dp_reduce_scatter + backward_gathers);
    }

    /// HSDP at dp = 8 in two groups of 4 (two simulated hosts of 4 ranks): inside a group
    /// FSDP's gathers and reduce-scatters at 4 ranks, and its memory; across, each unit's
    /// shard all-reduced over the 2 replicas, 2(2-1)/2 = 1 shard per step.
    #[test]
    fn hsdp_shards_inside_its_group_and_all_reduces_the_shard_across() {
        let spec_with = |dp, sharding| {
            let mut spec = ExperimentSpec { model: ModelSpec::dense(4, 64, 4, 32, 64), ..ExperimentSpec::default() };
            (spec.parallel.dp, spec.parallel.sharding, spec.parallel.ranks_per_node) = (dp, sharding, 4);
            spec
        };
        let hsdp_plan = plan(&spec_with(8, Sharding::Hsdp)).unwrap();
        let fsdp4_plan = plan(&spec_with(4, Sharding::Fsdp)).unwrap();
        let (hsdp, fsdp4) = (&hsdp_plan.stages[0], &fsdp4_plan.stages[0]);
        assert_eq!(hsdp.memory, fsdp4.memory);
        assert_eq!(
            (hsdp.comm.dp_reduce_scatter, hsdp.comm.dp_all_gather),
            (fsdp4.comm.dp_reduce_scatter, fsdp4.comm.dp_all_gather)
        );
        // The shard of each unit (embeddings, 4 blocks, head), once round a ring of 2, in fp32.
        let m = spec_with(8, Sharding::Hsdp).model;
        let embedding = ((m.vocab + m.seq_len) * m.d_model) as u64;
        let head = m.param_count() - embedding - 4 * m.block_params();
        let shard = |n: u64| ring_all_reduce_bytes(n.div_ceil(4), 2, 4);
        assert_eq!(hsdp.comm.dp_all_reduce, shard(embedding) + 4 * shard(m.block_params()) + shard(head));
        assert_eq!(fsdp4.comm.dp_all_reduce, 0);
    }

    #[test]
    fn zero2_and_fsdp_reduce_every_micro_batch() {
        let mut spec = ExperimentSpec::default();
        spec.parallel.dp = 2;
        spec.train.grad_accum = 3;
        spec.parallel.sharding = Sharding::Zero2;
        let c = plan(&spec).unwrap().stages[0].comm.clone();
        let rs = ring_reduce_scatter_bytes(spec.model.param_count(), 2, 4);
        assert_eq!((c.dp_reduce_scatter, c.dp_all_gather), (3 * rs, rs));
        spec.parallel.sharding = Sharding::None;
        assert_eq!(plan(&spec).unwrap().stages[0].comm.dp_all_reduce, 2 * rs);
    }

    /// A 2-byte wire halves every data-parallel byte and no other.
    #[test]
    fn a_two_byte_wire_halves_the_data_parallel_bytes() {
        for sharding in [Sharding::None, Sharding::Zero1, Sharding::Zero2, Sharding::Fsdp] {
            let mut spec = ExperimentSpec::default();
            (spec.parallel.dp, spec.parallel.tp, spec.parallel.sharding) = (2, 2, sharding);
            spec.train.precision = Precision::Bf16;
            let fp32 = plan(&spec).unwrap().stages[0].comm.clone();
            spec.parallel.comm_dtype = Precision::Bf16;
            let bf16 = plan(&spec).unwrap().stages[0].comm.clone();
            assert!(fp32.dp_all_reduce + fp32.dp_reduce_scatter > 0, "{sharding:?}");
            assert_eq!(2 * bf16.dp_all_reduce, fp32.dp_all_reduce, "{sharding:?}");
            assert_eq!(2 * bf16.dp_reduce_scatter, fp32.dp_reduce_scatter, "{sharding:?}");
            assert_eq!(2 * bf16.dp_all_gather, fp32.dp_all_gather, "{sharding:?}");
            assert_eq!(bf16.tp_all_reduce, fp32.tp_all_reduce, "{sharding:?}: tensor parallelism stays fp32");
        }
    }

    /// FP8 all-gathers: each block's two gathers per micro-batch are FP8 messages, a bit more
    /// than half a bf16 gather's bytes (the norms and biases stay bf16, and the chunks are
    /// padded to the longest); the embeddings and the head gather as before, the
    /// reduce-scatters are untouched.
    #[test]
    fn fp8_all_gathers_send_the_blocks_weights_in_a_byte() {
        use crate::plan::fp8_gather::{block_runs, sent_per_gather};
        use crate::spec::Fp8Recipe;
        let mut spec = ExperimentSpec { model: ModelSpec::dense(4, 128, 4, 64, 256), ..Default::default() };
        (spec.parallel.dp, spec.parallel.sharding, spec.parallel.comm_dtype) = (4, Sharding::Fsdp, Precision::Bf16);
        (spec.train.precision, spec.train.fp8, spec.train.grad_accum) = (Precision::Bf16, Fp8Recipe::Current, 2);
        let bf16 = plan(&spec).unwrap().stages[0].comm.clone();
        spec.parallel.fp8_all_gather = true;
        let fp8 = plan(&spec).unwrap().stages[0].comm.clone();
        assert_eq!(fp8.dp_reduce_scatter, bf16.dp_reduce_scatter);
        let m = &spec.model;
        let block = m.block_params();
        let rest = m.param_count() - 4 * block;
        let embedding = ((m.vocab + m.seq_len) * m.d_model) as u64;
        let blocks_bf16 = 2 * 4 * ring_reduce_scatter_bytes(block, 4, 2);
        let rest_bf16 = ring_reduce_scatter_bytes(rest, 4, 2) + ring_reduce_scatter_bytes(rest - embedding, 4, 2);
        assert_eq!(bf16.dp_all_gather, 2 * (blocks_bf16 + rest_bf16));
        let blocks_fp8 = 2 * 4 * sent_per_gather(&block_runs(m), 4, 2, true);
        assert_eq!(fp8.dp_all_gather, 2 * (blocks_fp8 + rest_bf16));
        let share = blocks_fp8 as f64 / blocks_bf16 as f64;
        assert!((0.5..0.55).contains(&share), "the blocks' gathers: {share} of bf16's");
    }

    /// Sequence parallelism splits the LayerNorm/residual regions: the activations per rank
    /// drop by (4d + 4)(1 - 1/t) per token and block, less the two exchange buffers; the
    /// TP bytes are those of the all-reduces plus the re-gathers in backward, the
    /// LayerNorm gradients' sums, the head's gather and the embeddings' gradient gather.
    #[test]
    fn sequence_parallelism_splits_the_layernorm_regions() {
        let mut spec = ExperimentSpec::default();
        (spec.parallel.tp, spec.model.layers) = (2, 4);
        let tp = plan(&spec).unwrap().stages[0].clone();
        spec.parallel.sequence_parallel = true;
        let sp = plan(&spec).unwrap().stages[0].clone();
        let (b, s, d, l) = (8u64, 32u64, 64u64, 4u64);
        let (rows, rows_d) = (b * s, b * s * d);
        // per block (4d + 4) per token halved; the stage input and the lnf statistics halved;
        // two b*s*d exchange buffers added.
        let saved = l * rows * (4 * d + 4) / 2 + rows_d / 2 + rows;
        assert_eq!(tp.memory.activations - sp.memory.activations, 4 * (saved - 2 * rows_d));
        assert_eq!(tp.memory.activation_grads - sp.memory.activation_grads, 4 * (rows_d / 2 - 6 * d));
        let half = ring_reduce_scatter_bytes(rows_d, 2, 4);
        let sums = l * ring_all_reduce_bytes(4 * d, 2, 4) + ring_all_reduce_bytes(2 * d, 2, 4);
        assert_eq!(sp.comm.tp_all_reduce, l * 10 * half + half + half + sums);
        assert_eq!(tp.comm.tp_all_reduce, l * 8 * half);
    }

    #[test]
    fn tp_all_reduces_four_per_block_per_micro_batch() {
        let mut spec = ExperimentSpec::default();
        spec.parallel.tp = 2;
        spec.train.micro_batches = 2;
        let p = plan(&spec).unwrap();
        let one = ring_all_reduce_bytes(8 * 32 * 64, 2, 4);
        assert_eq!(p.stages[0].comm.tp_all_reduce, 4 * 2 * 2 * one);
        spec.train.checkpointing = Checkpointing::Every;
        assert_eq!(plan(&spec).unwrap().stages[0].comm.tp_all_reduce, 6 * 2 * 2 * one);
    }
}
