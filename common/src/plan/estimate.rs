//! From a [`Plan`] to a cluster: does the peak rank fit in a GPU, how long does one
//! optimizer step take, and what model FLOP utilization (MFU) would that be?
//!
//! The planner says what every rank holds and sends; this module adds the hardware
//! ([`Cluster`]: GPU memory, peak FLOP/s, NVLink and network bandwidth, per-message
//! latency) and turns the plan into seconds. It is a first-order model for the planner
//! page, shown beside measured runs, never instead of them:
//!
//! - every rate is a peak (tensor-core FLOP/s, link bandwidth), so compute and
//!   communication times are lower bounds;
//! - data-parallel communication is counted as fully exposed (not overlapped with
//!   backward), which errs the other way: DDP, ZeRO and FSDP hide most of it;
//! - every rank is credited with the average FLOPs (`plan.flops.per_rank`): the extra
//!   work of the embedding and LM-head stages is not modelled;
//! - the communicated bytes are the engine's ([`crate::plan::planner::CommVolume`]): fp32 on the
//!   wire in every precision, where Megatron-LM sends 16-bit activations.
//!
//! Pure functions of their inputs (the browser runs them compiled to wasm32).

use serde::{Deserialize, Serialize};

use crate::plan::planner::{Plan, StagePlan};
use crate::spec::*;

/// Decimal gigabyte: GPU memory is sold (and the seed texts count) in 1e9 bytes.
const GB: f64 = 1e9;

// ---------------------------------------------------------------------------------------
// Model presets
// ---------------------------------------------------------------------------------------

/// A well-known model and the parameter count its authors publish.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct ModelPreset {
    pub key: String,
    pub label: String,
    /// Parameters as published (a test holds [`ModelSpec::param_count`] within 1% of it).
    pub published_params: u64,
    pub model: ModelSpec,
}

/// Model shapes for the planner page, by family and size:
///
/// | preset         | family | layers | d_model | heads (kv) | MLP             | vocab  | published       |
/// |----------------|--------|-------:|--------:|-----------:|-----------------|-------:|-----------------|
/// | GPT-2 124M     | gpt2   | 12     | 768     | 12         | 3072, tied head | 50257  | 124,439,808     |
/// | Llama-2 7B     | llama  | 32     | 4096    | 32         | 11008           | 32000  | 6,738,415,616   |
/// | Llama-2 13B    | llama  | 40     | 5120    | 40         | 13824           | 32000  | 13,015,864,320  |
/// | Llama-3 8B     | llama  | 32     | 4096    | 32 (8)     | 14336           | 128256 | 8,030,261,248   |
/// | Mixtral 8x7B   | llama  | 32     | 4096    | 32 (8)     | 8 x 14336, top-2| 32000  | 46,702,792,704  |
/// | Llama-2 70B    | llama  | 80     | 8192    | 64 (8)     | 28672           | 32000  | 68,976,648,192  |
/// | Llama-3 70B    | llama  | 80     | 8192    | 64 (8)     | 28672           | 128256 | 70,553,706,496  |
/// | Megatron 145B  | gpt2   | 80     | 12288   | 96         | 49152, tied     | 51200  | 145.6B          |
/// | GPT-3 175B     | gpt2   | 96     | 12288   | 96         | 49152, tied     | 50257  | 175.0B          |
/// | Megatron 310B  | gpt2   | 96     | 16384   | 128        | 65536, tied     | 51200  | 310.1B          |
/// | Llama-3 405B   | llama  | 126    | 16384   | 128 (8)    | 53248           | 128256 | 405,853,388,800 |
/// | Megatron 1T    | gpt2   | 128    | 25600   | 160        | 102400, tied    | 51200  | 1008.0B         |
///
/// Exact counts are the released checkpoints'; the Megatron models are Narayanan et al.
/// 2021's Table 1 (sequence 2048); GPT-3's are the paper's.
pub fn model_presets() -> Vec<ModelPreset> {
    let preset = |key: &str, label: &str, published_params: u64, model: ModelSpec| ModelPreset {
        key: key.into(),
        label: label.into(),
        published_params,
        model,
    };
    let tied = |model: ModelSpec| ModelSpec { tie_embeddings: true, ..model };
    let gpt = |layers, d, heads, seq, vocab| tied(ModelSpec::dense(layers, d, heads, seq, vocab));
    let llama = ModelSpec::llama;
    let mixtral = ModelSpec { experts: 8, expert_top_k: 2, ..llama(32, 4096, 32, 8, 14336, 32768, 32000) };
    vec![
        preset("gpt2-124m", "GPT-2 124M", 124_439_808, gpt(12, 768, 12, 1024, 50257)),
        preset("llama-7b", "Llama-2 7B", 6_738_415_616, llama(32, 4096, 32, 32, 11008, 4096, 32000)),
        preset("llama-13b", "Llama-2 13B", 13_015_864_320, llama(40, 5120, 40, 40, 13824, 4096, 32000)),
        preset("llama3-8b", "Llama-3 8B", 8_030_261_248, llama(32, 4096, 32, 8, 14336, 8192, 128256)),
        preset("mixtral-8x7b", "Mixtral 8x7B", 46_702_792_704, mixtral),
        preset("llama-70b", "Llama-2 70B", 68_976_648_192, llama(80, 8192, 64, 8, 28672, 4096, 32000)),
        preset("llama3-70b", "Llama-3 70B", 70_553_706_496, llama(80, 8192, 64, 8, 28672, 8192, 128256)),
        preset("megatron-145b", "Megatron GPT 145B", 145_600_000_000, gpt(80, 12288, 96, 2048, 51200)),
        preset("gpt3-175b", "GPT-3 175B", 175_000_000_000, gpt(96, 12288, 96, 2048, 50257)),
        preset("megatron-310b", "Megatron GPT 310B", 310_100_000_000, gpt(96, 16384, 128, 2048, 51200)),
        preset("llama3-405b", "Llama-3 405B", 405_853_388_800, llama(126, 16384, 128, 8, 53248, 8192, 128256)),
        preset("megatron-1t", "Megatron GPT 1T", 1_008_000_000_000, gpt(128, 25600, 160, 2048, 51200)),
    ]
}

// ---------------------------------------------------------------------------------------
// Clusters
// ---------------------------------------------------------------------------------------

/// The hardware an experiment would run on. Rates are per GPU and per direction.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields, default)]
pub struct Cluster {
    /// GPUs in all; [`Cluster::for_spec`] sets it to the spec's world size.
    pub gpus: u64,
    pub gpus_per_node: u64,
    /// Memory a training process may use on one GPU.
    pub gpu_memory_bytes: u64,
    /// Dense (no structured sparsity) tensor-core peak in bf16, FLOP/s.
    pub peak_flops_bf16: f64,
    /// Dense tensor-core peak in fp16, FLOP/s.
    pub peak_flops_fp16: f64,
    /// Peak in plain fp32 (not TF32: the engine multiplies fp32 in fp32), FLOP/s.
    pub peak_flops_fp32: f64,
    /// What one GPU sends to the GPUs of its own node per second (NVLink).
    pub intra_node_bytes_per_s: f64,
    /// What one GPU sends to other nodes per second (its share of the node's network).
    pub inter_node_bytes_per_s: f64,
    /// Fixed cost of one message (one step of a ring collective, one send): alpha in the
    /// alpha-beta model.
    pub latency_s: f64,
}

impl Default for Cluster {
    fn default() -> Self {
        Cluster::a100_80gb_sxm()
    }
}

/// What one GPU moves over PCIe 4.0 x16 per second, each way: 31.5 GB/s raw, about 25 GB/s
/// in practice.
pub const PCIE4_BYTES_PER_S: f64 = 25e9;

/// Per-message latency of every preset: a round figure for one NCCL ring step or send
/// (link latency is 1-2 us; kernel launch and protocol overhead add a few more).
const LATENCY_S: f64 = 5e-6;

impl Cluster {
    /// One DGX A100 node (8 x A100 80GB SXM). A100 datasheet: 312 TFLOP/s dense bf16 and
    /// fp16 (624 with sparsity), 19.5 TFLOP/s fp32 (156 in TF32); NVLink 3: 12 links of 25
    /// GB/s each way = 300 GB/s per direction (the "600 GB/s" quoted is both directions
    /// together). Network: eight 200 Gb/s HDR InfiniBand adapters per node, one per GPU:
    /// 25 GB/s per GPU, 200 GB/s per node. Memory: 80 GiB (85.9e9 bytes) physically; 80e9
    /// usable leaves ~6 GB for the CUDA context, NCCL and allocator fragmentation, which
    /// the planner does not count.
    pub fn a100_80gb_sxm() -> Self {
        Cluster {
            gpus: 8,
            gpus_per_node: 8,
            gpu_memory_bytes: 80_000_000_000,
            peak_flops_bf16: 312e12,
            peak_flops_fp16: 312e12,
            peak_flops_fp32: 19.5e12,
            intra_node_bytes_per_s: 300e9,
            inter_node_bytes_per_s: 25e9,
            latency_s: LATENCY_S,
        }
    }

    /// DGX A100 with the 40GB part: the same compute, NVLink and network as
    /// [`Cluster::a100_80gb_sxm`], half the memory (40 GiB physically, 40e9 usable).
    pub fn a100_40gb_sxm() -> Self {
        Cluster { gpu_memory_bytes: 40_000_000_000, ..Cluster::a100_80gb_sxm() }
    }

    /// One DGX H100 node (8 x H100 80GB SXM). H100 SXM datasheet: 989 TFLOP/s dense bf16
    /// and fp16 (1979 with sparsity), 67 TFLOP/s fp32 (495 dense TF32); NVLink 4: 18 links,
    /// 900 GB/s both directions = 450 GB/s per direction. Network: eight 400 Gb/s NDR
    /// InfiniBand adapters per node, one per GPU: 50 GB/s per GPU. Memory as for the A100
    /// 80GB: 80e9 of the 80 GiB.
    pub fn h100_80gb_sxm() -> Self {
        Cluster {
            gpus: 8,
            gpus_per_node: 8,
            gpu_memory_bytes: 80_000_000_000,
            peak_flops_bf16: 989e12,
            peak_flops_fp16: 989e12,
            peak_flops_fp32: 67e12,
            intra_node_bytes_per_s: 450e9,
            inter_node_bytes_per_s: 50e9,
            latency_s: LATENCY_S,
        }
    }

    /// A workstation with 2 x GeForce RTX 3090 (24 GB each) on PCIe 4.0, no NVLink bridge.
    /// GA102 (Ampere): 71 TFLOP/s dense fp16/bf16 on the tensor cores with fp32
    /// accumulation (GeForce runs it at half the fp16-accumulate rate of 142), 35.6 TFLOP/s
    /// fp32; the GPUs talk over PCIe, about 25 GB/s each way in practice; one machine, so
    /// no network. Memory: 24e9 of the 24 GiB.
    pub fn rtx3090_pair() -> Self {
        Cluster {
            gpus: 2,
            gpus_per_node: 2,
            gpu_memory_bytes: 24_000_000_000,
            peak_flops_bf16: 71e12,
            peak_flops_fp16: 71e12,
            peak_flops_fp32: 35.6e12,
            intra_node_bytes_per_s: PCIE4_BYTES_PER_S,
            inter_node_bytes_per_s: PCIE4_BYTES_PER_S,
            latency_s: LATENCY_S,
        }
    }

    /// The same hardware with `gpus` GPUs in all.
    pub fn with_gpus(self, gpus: u64) -> Self {
        Cluster { gpus, ..self }
    }

    /// The same hardware with exactly the GPUs the spec needs (dp x tp x pp).
    pub fn for_spec(self, spec: &ExperimentSpec) -> Self {
        let world = [spec.parallel.dp, spec.parallel.tp, spec.parallel.pp]
            .into_iter()
            .fold(1u64, |acc, x| acc.saturating_mul(x as u64));
        self.with_gpus(world)
    }

    /// Peak FLOP/s of one GPU for the matmuls of a run in `precision`.
    pub fn peak_flops(&self, precision: Precision) -> f64 {
        match precision {
            Precision::Bf16 => self.peak_flops_bf16,
            Precision::Fp16 => self.peak_flops_fp16,
            Precision::Fp32 => self.peak_flops_fp32,
        }
    }

    /// Nodes needed for `gpus` GPUs: ceil(gpus / gpus_per_node).
    pub fn nodes_for(&self, gpus: u64) -> u64 {
        gpus.div_ceil(self.gpus_per_node.max(1))
    }
}

/// A named cluster for the planner page's picker.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct ClusterPreset {
    pub key: String,
    pub label: String,
    /// One node's worth of GPUs; [`Cluster::for_spec`] sizes it to a spec.
    pub cluster: Cluster,
}

/// The clusters the planner page offers (the first is the default).
pub fn cluster_presets() -> Vec<ClusterPreset> {
    let preset = |key: &str, label: &str, cluster| ClusterPreset { key: key.into(), label: label.into(), cluster };
    vec![
        preset("a100-80gb", "A100 80GB SXM (DGX A100, 200 Gb/s IB per GPU)", Cluster::a100_80gb_sxm()),
        preset("a100-40gb", "A100 40GB SXM (DGX A100, 200 Gb/s IB per GPU)", Cluster::a100_40gb_sxm()),
        preset("h100-80gb", "H100 80GB SXM (DGX H100, 400 Gb/s IB per GPU)", Cluster::h100_80gb_sxm()),
        preset("rtx3090", "2 x RTX 3090 24GB (one PCIe workstation)", Cluster::rtx3090_pair()),
    ]
}

// ---------------------------------------------------------------------------------------
// The estimate
// ---------------------------------------------------------------------------------------

/// What one step of the spec would cost on the cluster.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct Estimate {
    /// GPUs the spec uses: dp x tp x pp (the plan's world size).
    pub world_size: u64,
    /// Nodes those GPUs fill: ceil(world_size / gpus_per_node).
    pub nodes: u64,
    /// The pipeline stage whose ranks need the most memory (`plan.peak_stage`; its
    /// category split is `plan.stages[peak_stage].memory`).
    pub peak_stage: usize,
    /// Bytes one GPU of the peak stage needs (`plan.stages[peak_stage].memory.total`).
    pub memory_per_gpu_bytes: u64,
    pub gpu_memory_bytes: u64,
    /// memory_per_gpu_bytes <= gpu_memory_bytes.
    pub fits: bool,
    /// gpu_memory_bytes - memory_per_gpu_bytes: negative when it does not fit.
    pub headroom_bytes: i64,
    /// Peak FLOP/s of one GPU in the spec's precision.
    pub peak_flops: f64,
    /// One rank's share of the step's FLOPs at peak: plan.flops.per_rank / peak_flops.
    pub compute_seconds: f64,
    /// Idle time of the pipeline's fill and drain.
    pub bubble_seconds: f64,
    pub dp: AxisComm,
    pub tp: AxisComm,
    pub pp: AxisComm,
    /// Communication on the critical path: dp + tp + pp seconds (all counted as exposed).
    pub exposed_comm_seconds: f64,
    pub step_seconds: f64,
    pub tokens_per_second: f64,
    /// FLOPs of the model itself per step: 6 * params * tokens + attention (no recompute).
    pub model_flops: f64,
    /// Model FLOP utilization: model_flops / (step_seconds * world_size * peak_flops).
    pub mfu: f64,
    /// Hardware FLOP utilization: the same with the recomputed forward counted.
    pub hfu: f64,
    pub notes: Vec<Note>,
}

/// Communication of one parallelism axis, for the stage that spends longest on it.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct AxisComm {
    /// Ranks in one group of this axis (1: nothing to communicate).
    pub group_size: u64,
    /// Global-rank distance between neighbours of a group: tp 1, pp tp, dp tp * pp.
    pub stride: u64,
    /// Some group of this axis has ranks on two nodes, so it runs at network bandwidth.
    pub crosses_nodes: bool,
    /// Bytes per second the axis is credited with (intra- or inter-node, per GPU).
    pub bytes_per_s: f64,
    /// The stage counted (the one whose ranks take longest).
    pub stage: usize,
    /// Bytes one rank of that stage sends per step on this axis.
    pub bytes_per_rank: u64,
    /// Messages it sends per step: ring steps of each collective, or point-to-point sends.
    pub messages: u64,
    /// messages * latency + bytes / bandwidth.
    pub seconds: f64,
}

/// A remark on the estimate for the page, in words a learner understands.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct Note {
    pub level: NoteLevel,
    pub text: String,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "lowercase")]
pub enum NoteLevel {
    /// Worth knowing; nothing wrong.
    Info,
    /// The run would fail or waste much of the hardware.
    Warning,
}

/// The alpha-beta model of a transfer: `messages` fixed costs of `latency_s` each plus
/// `bytes` at `bytes_per_s`:  t = messages * alpha + bytes / beta.
/// A rate that is zero, negative or not finite gives no bandwidth term (never inf/NaN).
pub fn alpha_beta_seconds(messages: u64, bytes: u64, latency_s: f64, bytes_per_s: f64) -> f64 {
    let latency = if latency_s.is_finite() && latency_s > 0.0 { messages as f64 * latency_s } else { 0.0 };
    latency + ratio(bytes as f64, bytes_per_s)
}

/// Whether every group of `size` ranks spaced `stride` apart stays inside one node, with
/// ranks numbered tp innermost, then pp, then dp (Megatron-LM's order; see
/// [`ExperimentSpec::stage_of`]). A group's ranks then fill an aligned block of
/// stride * size consecutive ranks, and the blocks tile the world; all of them stay inside
/// nodes of `gpus_per_node` exactly when the block size divides the node size, or when the
/// whole world fits in one node.
pub fn group_inside_node(stride: u64, size: u64, gpus_per_node: u64, world_size: u64) -> bool {
    let per_node = gpus_per_node.max(1);
    let block = stride.max(1).saturating_mul(size);
    size <= 1 || world_size <= per_node || per_node % block == 0
}

/// Turns `plan` (of `spec`) into memory, time and utilization on `cluster`.
///
/// The step, for P pipeline stages and M micro-batches:
///
/// ```text
///   compute  = flops.per_rank / peak * imbalance     (every rank at peak FLOP/s; imbalance =
///                                                     the busiest stage's work over the
///                                                     average stage's, `stage_imbalance`:
///                                                     every pipeline slot waits for it)
///   busy     = compute + tp + pp                     (each micro-batch's TP all-reduces and
///                                                     PP sends sit between its layers)
///   pipeline = busy / (1 - bubble) = busy * (M+P-1)/M (interleaved (vM+P-1)/vM; the fill and drain slots carry the
///                                                     same per-slot work, idle elsewhere)
///   step     = pipeline + dp                         (gradient sync counted as exposed)
///   MFU      = (6 * params * tokens + attention) / (step * world_size * peak)
/// ```
///
/// World size, stages and FLOPs come from the plan; `cluster.gpus` is only compared with
/// the world size (a note when they differ).
pub fn estimate(spec: &ExperimentSpec, plan: &Plan, cluster: &Cluster) -> Estimate {
    let world_size = plan.world_size;
    let (dp, tp, pp) = (spec.parallel.dp as u64, spec.parallel.tp as u64, spec.parallel.pp as u64);
    let micro_steps = (spec.train.micro_batches as u64).saturating_mul(spec.train.grad_accum as u64);

    // Memory: the peak stage against one GPU.
    let peak_stage = plan.peak_stage.min(plan.stages.len().saturating_sub(1));
    let memory_per_gpu_bytes = plan.peak_rank_memory().total;
    let gpu_memory_bytes = cluster.gpu_memory_bytes;
    let headroom = i128::from(gpu_memory_bytes) - i128::from(memory_per_gpu_bytes);
    let headroom_bytes = headroom.clamp(i128::from(i64::MIN), i128::from(i64::MAX)) as i64;

    // Placement: tp innermost (stride 1), then pp (stride tp), then dp (stride tp * pp).
    let axis = |stride: u64, size: u64| {
        let inside = group_inside_node(stride, size, cluster.gpus_per_node, world_size);
        let bytes_per_s = if inside { cluster.intra_node_bytes_per_s } else { cluster.inter_node_bytes_per_s };
        AxisComm { group_size: size, stride, crosses_nodes: !inside, bytes_per_s, ..AxisComm::default() }
    };
    let slowest_stage = |template: AxisComm, traffic: &dyn Fn(&StagePlan) -> (u64, u64)| {
        let per_stage = plan.stages.iter().map(|st| {
            let (bytes, messages) = if template.group_size > 1 { traffic(st) } else { (0, 0) };
            let seconds = alpha_beta_seconds(messages, bytes, cluster.latency_s, template.bytes_per_s);
            AxisComm { stage: st.stage, bytes_per_rank: bytes, messages, seconds, ..template.clone() }
        });
        per_stage.fold(template.clone(), |best, this| if this.seconds > best.seconds { this } else { best })
    };
    let dp_axis = slowest_stage(axis(tp.saturating_mul(pp), dp), &|st| {
        let c = &st.comm;
        // (expert and context parallelism's all-to-alls run inside the data-parallel group
        // too: W-1 messages each, four per block and micro-batch, six recomputing)
        let bytes = [c.dp_all_reduce, c.dp_reduce_scatter, c.dp_all_gather, c.dp_compressed, c.ep_all_to_all]
            .into_iter()
            .chain([c.cp_all_to_all])
            .fold(0u64, u64::saturating_add);
        let per_block: u64 = if spec.train.checkpointing.recomputes_blocks() { 6 } else { 4 };
        let ep = per_block.saturating_mul((spec.parallel.ep as u64).saturating_sub(1));
        // (the ring: one message per pass, C-1 forward, (C-1) + C backward, C-1 more recomputing)
        let cp = spec.parallel.cp as u64;
        let cp = match (cp > 1, spec.parallel.cp_kind.is_ring()) {
            (false, _) => 0,
            (true, false) => per_block.saturating_mul(cp - 1),
            (true, true) => (3 * cp - 2) + if per_block == 6 { cp - 1 } else { 0 },
        };
        let all_to_all = (ep + cp).saturating_mul(st.layers as u64).saturating_mul(micro_steps);
        (bytes, dp_messages(spec, st, micro_steps).saturating_add(all_to_all))
    });
    let tp_axis = slowest_stage(axis(1, tp), &|st| {
        // Ring all-reduce: 2(T-1) steps; 4 per block and micro-batch (6 when the forward is
        // recomputed), as the planner counts them.
        let per_block: u64 = if spec.train.checkpointing.recomputes_blocks() { 6 } else { 4 };
        let all_reduces = per_block.saturating_mul(st.layers as u64).saturating_mul(micro_steps);
        (st.comm.tp_all_reduce, all_reduces.saturating_mul(tp.saturating_sub(1).saturating_mul(2)))
    });
    let pipe = crate::plan::schedule::Pipeline::of(spec);
    let pp_axis = slowest_stage(axis(tp, pp), &|st| {
        let sends = pipe.messages_per_micro_batch(st.stage) as u64;
        (st.comm.pp_send, sends.saturating_mul(micro_steps))
    });

    // Time.
    let peak_flops = cluster.peak_flops(spec.train.precision);
    let compute_seconds = ratio(plan.flops.per_rank, peak_flops) * stage_imbalance(spec, plan);
    let busy = compute_seconds + tp_axis.seconds + pp_axis.seconds;
    // 1 - bubble = M / (M + P - 1) (interleaved vM / (vM + P - 1)): positive for M >= 1; a
    // broken plan counts no bubble.
    let useful_share = 1.0 - plan.bubble_fraction;
    let pipeline_seconds = if useful_share > 0.0 && useful_share <= 1.0 { busy / useful_share } else { busy };
    let bubble_seconds = pipeline_seconds - busy;
    let step_seconds = pipeline_seconds + dp_axis.seconds;
    let exposed_comm_seconds = dp_axis.seconds + tp_axis.seconds + pp_axis.seconds;
    let tokens_per_second = ratio(plan.flops.tokens_per_step as f64, step_seconds);
    let model_flops = plan.flops.six_params_tokens + plan.flops.attention;
    let capacity = step_seconds * world_size as f64 * peak_flops; // FLOPs the GPUs could do in a step
    let mfu = ratio(model_flops, capacity);
    let hfu = ratio(plan.flops.total, capacity);

    let mut e = Estimate {
        world_size,
        nodes: cluster.nodes_for(world_size),
        peak_stage,
        memory_per_gpu_bytes,
        gpu_memory_bytes,
        fits: memory_per_gpu_bytes <= gpu_memory_bytes,
        headroom_bytes,
        peak_flops,
        compute_seconds,
        bubble_seconds,
        dp: dp_axis,
        tp: tp_axis,
        pp: pp_axis,
        exposed_comm_seconds,
        step_seconds,
        tokens_per_second,
        model_flops,
        mfu,
        hfu,
        notes: Vec::new(),
    };
    e.notes = notes(spec, plan, cluster, &e);
    e
}

/// How much longer the busiest pipeline stage computes per micro-batch than the average
/// one (1 without a pipeline). A stage's training FLOPs per token:
///
/// ```text
///   per block it holds   6 * block_params + 12 * seq_len * d_model
///                        (with checkpointing also 2 * block_params + 4 * seq_len * d_model)
///   the LM head (last)   6 * d_model * vocab
/// ```
///
/// So the last stage is the busiest when the layers split evenly, and the first ones when
/// pp does not divide the layers (they hold one block more). Interleaved stages always
/// split evenly: validation asks pp * virtual_stages to divide the layers.
fn stage_imbalance(spec: &ExperimentSpec, plan: &Plan) -> f64 {
    let m = &spec.model;
    let (params, s, d) = (m.active_block_params() as f64, m.seq_len as f64, m.d_model as f64);
    let recompute = match spec.train.checkpointing {
        Checkpointing::None => 0.0,
        Checkpointing::Selective => 4.0 * s * d,
        Checkpointing::Every | Checkpointing::Sqrt => 2.0 * params + 4.0 * s * d,
    };
    let block = 6.0 * params + 12.0 * s * d + recompute;
    let head = 6.0 * d * m.vocab as f64;
    let work: Vec<f64> =
        plan.stages.iter().map(|st| st.layers as f64 * block + if st.head { head } else { 0.0 }).collect();
    let mean = ratio(work.iter().sum(), work.len() as f64);
    ratio(work.iter().copied().fold(0.0, f64::max), mean).max(1.0)
}

/// a / b, or 0 when b is zero, negative or not finite (no inf or NaN reaches the JSON).
fn ratio(a: f64, b: f64) -> f64 {
    if b.is_finite() && b > 0.0 && a.is_finite() {
        a / b
    } else {
        0.0
    }
}

/// Messages one rank of `stage` sends per step in the data-parallel group (W = dp ranks):
/// a ring all-reduce takes 2(W-1) steps, a reduce-scatter or all-gather W-1.
///
/// - none: one all-reduce per gradient bucket (fp32 buckets of `bucket_bytes`);
/// - zero1: the same, plus an all-gather of each unit's parameters after the update;
/// - zero2: a reduce-scatter of each unit every micro-batch, plus the all-gather;
/// - fsdp: per micro-batch, a gather of each unit before forward and (but the embeddings)
///   before backward, and a reduce-scatter of each unit;
/// - hsdp: fsdp's inside its shard groups (S-1 steps each), and each unit's shard
///   all-reduced across the groups after the last micro-batch.
///
/// Units are the stage's blocks, its embeddings and its head. FSDP's extra gathers for
/// sqrt checkpointing are in the bytes but not counted as messages.
fn dp_messages(spec: &ExperimentSpec, stage: &StagePlan, micro_steps: u64) -> u64 {
    let w = spec.parallel.dp as u64;
    if w <= 1 {
        return 0;
    }
    let ring_step = w - 1;
    let units = (stage.layers as u64) + u64::from(stage.embedding) + u64::from(stage.head);
    let gradient_bytes = stage.params_per_rank.saturating_mul(4);
    let buckets = match spec.parallel.bucket_bytes {
        0 => 1,
        size => gradient_bytes.div_ceil(size).max(1),
    };
    // Per bucket, ring steps of W-1 messages: an all-reduce's two phases; top-k's and
    // int8's one all-gather; PowerSGD's two all-reduces (P, then Q).
    let per_bucket = match spec.parallel.grad_compression {
        GradCompression::None => 2,
        GradCompression::Topk | GradCompression::Int8 => 1,
        GradCompression::Powersgd => 4,
    };
    let collectives_times_steps = match spec.parallel.sharding {
        Sharding::None => buckets.saturating_mul(per_bucket),
        Sharding::Zero1 => buckets.saturating_mul(2).saturating_add(units),
        Sharding::Zero2 => micro_steps.saturating_mul(units).saturating_add(units),
        Sharding::Fsdp => {
            let backward_gathers = units - u64::from(stage.embedding);
            micro_steps.saturating_mul(units.saturating_mul(2).saturating_add(backward_gathers))
        }
        // FSDP's inside the shard group of S ranks (S-1 steps each), and every unit's shard
        // all-reduced across the dp/S groups (two phases of dp/S - 1 steps).
        Sharding::Hsdp => {
            let ways = (spec.parallel.shard_ways() as u64).clamp(1, w);
            let backward_gathers = units - u64::from(stage.embedding);
            let inside = micro_steps.saturating_mul(units.saturating_mul(2).saturating_add(backward_gathers));
            let across = units.saturating_mul(2).saturating_mul(w / ways - 1);
            return inside.saturating_mul(ways - 1).saturating_add(across);
        }
    };
    collectives_times_steps.saturating_mul(ring_step)
}

/// The remarks for the page: what does not fit, what runs slowly and why.
fn notes(spec: &ExperimentSpec, plan: &Plan, cluster: &Cluster, e: &Estimate) -> Vec<Note> {
    let mut notes = Vec::new();
    let mut say = |level, text: String| notes.push(Note { level, text });
    let gb = |bytes: u64| bytes as f64 / GB;
    let (p, t) = (&spec.parallel, &spec.train);

    if e.world_size != cluster.gpus {
        let level = if e.world_size > cluster.gpus { NoteLevel::Warning } else { NoteLevel::Info };
        say(
            level,
            format!(
                "The spec uses dp x tp x pp = {} GPUs; the cluster has {}. The estimate assumes {} GPUs.",
                e.world_size, cluster.gpus, e.world_size
            ),
        );
    }
    if !e.fits {
        let mut text = format!(
            "Out of memory: a GPU of pipeline stage {} needs {:.1} GB, {:.1} GB more than the {:.1} GB it has.",
            e.peak_stage,
            gb(e.memory_per_gpu_bytes),
            gb(e.memory_per_gpu_bytes.saturating_sub(e.gpu_memory_bytes)),
            gb(e.gpu_memory_bytes)
        );
        if !t.checkpointing.recomputes_blocks() {
            text.push_str(" Activation checkpointing would keep one tensor per block instead of all of them.");
        }
        if p.dp > 1 && p.sharding != Sharding::Fsdp {
            text.push_str(" Sharding the model state over the data-parallel group (ZeRO, FSDP) divides it by dp.");
        }
        if p.dp <= 1 {
            text.push_str(" Tensor or pipeline parallelism splits the model itself over more GPUs.");
        }
        say(NoteLevel::Warning, text);
    }
    if e.tp.crosses_nodes {
        say(
            NoteLevel::Warning,
            format!(
                "TP spans nodes: tp={} with {} GPUs per node, so its all-reduces (several per block and \
                 micro-batch) run at {:.0} GB/s instead of {:.0} GB/s. Keep tp within a node.",
                p.tp,
                cluster.gpus_per_node,
                cluster.inter_node_bytes_per_s / GB,
                cluster.intra_node_bytes_per_s / GB
            ),
        );
    }
    if e.pp.crosses_nodes {
        say(
            NoteLevel::Info,
            format!(
                "Pipeline stages are on different nodes: their sends run at {:.0} GB/s. That is the usual \
                 placement: a stage boundary carries one activation per micro-batch.",
                cluster.inter_node_bytes_per_s / GB
            ),
        );
    }
    if e.dp.crosses_nodes {
        say(
            NoteLevel::Info,
            format!(
                "Data-parallel groups span nodes: gradient synchronization runs at {:.0} GB/s per GPU.",
                cluster.inter_node_bytes_per_s / GB
            ),
        );
    }
    if plan.bubble_fraction > 0.2 {
        say(
            NoteLevel::Warning,
            format!(
                "The pipeline idles {:.0}% of the step (bubble {} with P={} stages, M={} micro-batches x \
                 accumulation): use many more micro-batches than stages.",
                100.0 * plan.bubble_fraction,
                crate::plan::schedule::Pipeline::of(spec).formula_name(),
                p.pp,
                spec.pipeline_micro_batches()
            ),
        );
    }
    if e.step_seconds > 0.0 && e.exposed_comm_seconds > 0.5 * e.step_seconds {
        say(
            NoteLevel::Warning,
            format!(
                "Communication takes {:.0}% of the step (DP {:.3} s, TP {:.3} s, PP {:.3} s): the GPUs mostly wait.",
                100.0 * e.exposed_comm_seconds / e.step_seconds,
                e.dp.seconds,
                e.tp.seconds,
                e.pp.seconds
            ),
        );
    }
    if e.peak_flops <= 0.0 || !e.peak_flops.is_finite() {
        say(NoteLevel::Warning, "The cluster has no peak FLOP/s for this precision: no compute time.".into());
    }
    if t.precision == Precision::Fp32 {
        say(
            NoteLevel::Info,
            format!(
                "fp32 runs on the GPU's fp32 units ({:.1} TFLOP/s) instead of its bf16 tensor cores ({:.0} TFLOP/s).",
                cluster.peak_flops_fp32 / 1e12,
                cluster.peak_flops_bf16 / 1e12
            ),
        );
    } else if e.tp.group_size > 1 || e.pp.group_size > 1 {
        say(
            NoteLevel::Info,
            "Activation bytes are counted in fp32, as this engine sends them; Megatron-LM sends them in 16 bits, \
             which halves the TP and PP times."
                .into(),
        );
    }
    if e.dp.seconds > 0.0 {
        say(
            NoteLevel::Info,
            "Gradient synchronization is counted as exposed; overlapping it with backward (as DDP's buckets do) \
             hides most of it."
                .into(),
        );
    }
    notes
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plan::planner::plan;
    use crate::plan::ring::ring_all_reduce_bytes;

    fn gb(bytes: u64) -> f64 {
        bytes as f64 / GB
    }

    fn preset(key: &str) -> ModelSpec {
        model_presets().into_iter().find(|p| p.key == key).map(|p| p.model).expect("preset exists")
    }

    /// A 3D-parallel mixed-precision spec as the large published runs use it: AdamW,
    /// activation checkpointing of every block, 1F1B, micro-batch 1, 25 MiB buckets.
    fn megatron_spec(model: ModelSpec, dp: usize, tp: usize, pp: usize, micro_batches: usize) -> ExperimentSpec {
        let mut spec = ExperimentSpec { model, ..ExperimentSpec::default() };
        spec.parallel = ParallelSpec { dp, tp, pp, bucket_bytes: 25 << 20, ..ParallelSpec::default() };
        spec.train.precision = Precision::Bf16;
        spec.train.optimizer = Optimizer::Adamw;
        spec.train.micro_batch = 1;
        spec.train.micro_batches = micro_batches;
        spec.train.checkpointing = Checkpointing::Every;
        spec
    }

    fn run(spec: &ExperimentSpec, cluster: Cluster) -> (Plan, Estimate) {
        let p = plan(spec).expect("plannable spec");
        let e = estimate(spec, &p, &cluster.for_spec(spec));
        (p, e)
    }

    fn report(name: &str, e: &Estimate) {
        println!(
            "{name}: {:.2} GB per GPU (stage {}), fits {}, headroom {:.2} GB; compute {:.3} s, bubble {:.3} s, \
             DP {:.3} s, TP {:.3} s, PP {:.3} s, step {:.3} s, {:.0} tokens/s, MFU {:.3}, HFU {:.3}",
            gb(e.memory_per_gpu_bytes),
            e.peak_stage,
            e.fits,
            e.headroom_bytes as f64 / GB,
            e.compute_seconds,
            e.bubble_seconds,
            e.dp.seconds,
            e.tp.seconds,
            e.pp.seconds,
            e.step_seconds,
            e.tokens_per_second,
            e.mfu,
            e.hfu
        );
    }

    #[test]
    fn model_presets_count_their_published_parameters() {
        let presets = model_presets();
        for p in &presets {
            let count = p.model.param_count();
            let off = count as f64 / p.published_params as f64 - 1.0;
            println!("{}: {count} parameters, published {} ({:+.3}%)", p.key, p.published_params, 100.0 * off);
            assert!(off.abs() < 0.01, "{}: {count} is {:+.2}% off", p.key, 100.0 * off);
            // Every preset is a plannable model, with whole K/V heads on up to 4 TP ranks.
            let spec = ExperimentSpec { model: p.model.clone(), ..ExperimentSpec::default() };
            assert_eq!(plan(&spec).expect("plan").param_count, count);
            assert_eq!(p.model.key_value_heads() % 4, 0, "{}", p.key);
        }
        // The released checkpoints' exact counts.
        for (key, exact) in [
            ("gpt2-124m", 124_439_808),
            ("llama-7b", 6_738_415_616),
            ("llama3-8b", 8_030_261_248),
            ("mixtral-8x7b", 46_702_792_704),
            ("llama3-70b", 70_553_706_496),
            ("llama3-405b", 405_853_388_800),
        ] {
            assert_eq!(preset(key).param_count(), exact, "{key}");
        }
        // Untying GPT-2's head adds vocab x d_model (the engine's layout: 163M).
        let untied = ModelSpec { tie_embeddings: false, ..preset("gpt2-124m") };
        assert_eq!(untied.param_count(), 124_439_808 + 50257 * 768);
        // Mixtral's token sees 2 of 8 experts: 12.9B active parameters (published 12.9B).
        let active = preset("mixtral-8x7b").active_param_count();
        assert!((active as f64 / 12.9e9 - 1.0).abs() < 0.01, "{active}");
        // The keys are unique.
        let mut keys: Vec<&str> = presets.iter().map(|p| p.key.as_str()).collect();
        keys.sort_unstable();
        keys.dedup();
        assert_eq!(keys.len(), presets.len());
    }

    #[test]
    fn gpt3_175b_fits_on_1024_a100s_with_tp8_pp8_dp16() {
        // Narayanan et al. 2021 (Megatron-LM on 1024 A100 80GB): t=8, p=8, d=16, batch
        // 1536, micro-batch 1, sequence 2048, mixed precision, full recomputation, no ZeRO.
        // 1536 sequences / dp 16 = 96 micro-batches per pipeline.
        let spec = megatron_spec(preset("gpt3-175b"), 16, 8, 8, 96);
        let (p, e) = run(&spec, Cluster::a100_80gb_sxm());
        report("GPT-3 175B, 1024 x A100 80GB, TP8 PP8 DP16", &e);
        let m = &p.stages[e.peak_stage].memory;
        println!(
            "  params {:.2}, grads {:.2}, optimizer {:.2}, activations {:.2}, act grads {:.2}, comm buffers {:.2} GB",
            gb(m.parameters),
            gb(m.gradients),
            gb(m.optimizer_state),
            gb(m.activations),
            gb(m.activation_grads),
            gb(m.comm_buffers)
        );
        assert_eq!((e.world_size, e.nodes), (1024, 128));
        assert!(e.fits, "{:.1} GB", gb(e.memory_per_gpu_bytes));
        assert!(e.headroom_bytes > 0);
        assert_eq!(e.headroom_bytes, 80_000_000_000 - e.memory_per_gpu_bytes as i64);
        // A middle stage holds ~175e9 / 64 = 2.7B parameters per GPU: 16 bytes each is
        // ~44 GB of model state. The first stage (the peak) also holds the token and
        // position embeddings, whole on every TP rank in this engine (Megatron-LM splits
        // the vocabulary over TP): 0.64B more parameters, 54 GB of state.
        let state = |m: &crate::plan::planner::RankMemory| m.parameters + m.gradients + m.optimizer_state;
        assert!((gb(state(&p.stages[4].memory)) - 43.5).abs() < 0.5, "{}", gb(state(&p.stages[4].memory)));
        assert_eq!(e.peak_stage, 0);
        assert_eq!(state(m), 16 * p.stages[0].params_per_rank);
        assert!((gb(state(m)) - 53.8).abs() < 0.5, "{}", gb(state(m)));
        // TP stays in the node (NVLink); PP and DP cross nodes.
        assert!(!e.tp.crosses_nodes && e.pp.crosses_nodes && e.dp.crosses_nodes);
        assert_eq!((e.tp.bytes_per_s, e.pp.bytes_per_s), (300e9, 25e9));
        // The paper measured 153 TFLOP/s per GPU with its count, which includes the
        // recomputed forward (49% of 312): our HFU, peak rates everywhere, is of that order.
        assert!(e.hfu > 0.4 && e.hfu < 0.9, "{}", e.hfu);
        assert!(e.mfu < e.hfu);
        // ZeRO-1 shards the 12 bytes of optimizer state over dp=16: more headroom.
        let mut zero1 = spec.clone();
        zero1.parallel.sharding = Sharding::Zero1;
        let (_, z) = run(&zero1, Cluster::a100_80gb_sxm());
        report("  with ZeRO-1", &z);
        assert!(z.fits && z.memory_per_gpu_bytes < e.memory_per_gpu_bytes);
        // The same model without tensor or pipeline parallelism: 175B x 16 bytes on one GPU.
        let alone = megatron_spec(preset("gpt3-175b"), 1024, 1, 1, 1);
        let (_, a) = run(&alone, Cluster::a100_80gb_sxm());
        assert!(!a.fits && a.headroom_bytes < -2_000_000_000_000);
    }

    #[test]
    fn llama_70b_fits_on_256_gpus_with_tp8_pp4_dp8() {
        // The seed deck's recipe: TP=8 in a node, PP=4 across nodes, DP=8; "70B / (8 x 4)
        // ~ 2.2B per GPU, ~4.4 GB" of bf16 weights. LLaMA-2's batch: 4M tokens = 1024
        // sequences of 4096, so 128 micro-batches of 1 per pipeline.
        let spec = megatron_spec(preset("llama-70b"), 8, 8, 4, 128);
        for (name, cluster) in [("A100 80GB", Cluster::a100_80gb_sxm()), ("H100 80GB", Cluster::h100_80gb_sxm())] {
            let (p, e) = run(&spec, cluster);
            report(&format!("70B, 256 x {name}, TP8 PP4 DP8"), &e);
            assert_eq!((e.world_size, e.nodes), (256, 32));
            assert!(e.fits, "{:.1} GB", gb(e.memory_per_gpu_bytes));
            let middle = &p.stages[1];
            assert!((middle.params_per_rank as f64 / 2.2e9 - 1.0).abs() < 0.1, "{}", middle.params_per_rank);
            assert!((gb(middle.memory.parameters) - 4.4).abs() < 0.4, "{}", gb(middle.memory.parameters));
            assert!(e.mfu > 0.0 && e.mfu < 1.0);
        }
        // On A100 40GB the same layout does not fit without sharding the optimizer state.
        let (_, small) = run(&spec, Cluster::a100_40gb_sxm());
        report("70B, 256 x A100 40GB, TP8 PP4 DP8", &small);
        assert!(!small.fits);
        assert!(small.notes.iter().any(|n| n.level == NoteLevel::Warning && n.text.contains("ZeRO")));
    }

    #[test]
    fn seed_example_3b_fits_one_a100_80gb() {
        // The deck's quick math: 3B with Adam in mixed precision is 3B x 16 = 48 GB of
        // state, which leaves 32 GB of an 80 GB A100 for activations: fine with
        // checkpointing at a moderate batch. A GPT of ~3.0B: 36 blocks of width 2560.
        let model = ModelSpec::dense(36, 2560, 32, 2048, 32000);
        let params = model.param_count();
        assert!((params as f64 / 3e9 - 1.0).abs() < 0.02, "{params}");
        let mut spec = megatron_spec(model, 1, 1, 1, 1);
        spec.train.micro_batch = 4;
        let (p, e) = run(&spec, Cluster::a100_80gb_sxm());
        report("3B, 1 x A100 80GB, micro-batch 4 x 2048, checkpointing", &e);
        let m = &p.stages[0].memory;
        let state = m.parameters + m.gradients + m.optimizer_state;
        assert_eq!(state, 16 * params);
        assert!((gb(state) - 48.0).abs() < 0.5, "{}", gb(state));
        assert!(e.fits);
        assert!(gb(e.headroom_bytes as u64) > 20.0, "{}", e.headroom_bytes);
        // Without checkpointing the same batch's activations (with s x s attention
        // probabilities in every block) no longer fit in those 32 GB.
        spec.train.checkpointing = Checkpointing::None;
        let (_, full) = run(&spec, Cluster::a100_80gb_sxm());
        report("3B, 1 x A100 80GB, micro-batch 4 x 2048, no checkpointing", &full);
        assert!(!full.fits);
        assert!(full.notes.iter().any(|n| n.text.contains("checkpointing")));
    }

    #[test]
    fn seed_example_7b_does_not_fit_one_gpu() {
        // "7B x 16 bytes = 112 GB": more than an 80 GB GPU before any activation, in
        // mixed precision (2 + 2 + 12) and in fp32 (4 + 4 + 8) alike.
        for precision in [Precision::Bf16, Precision::Fp32] {
            let mut spec = megatron_spec(preset("llama-7b"), 1, 1, 1, 1);
            spec.train.precision = precision;
            for (name, cluster) in [("A100 80GB", Cluster::a100_80gb_sxm()), ("H100 80GB", Cluster::h100_80gb_sxm())] {
                let (p, e) = run(&spec, cluster);
                report(&format!("7B {precision:?}, 1 x {name}"), &e);
                let m = &p.stages[0].memory;
                let state = m.parameters + m.gradients + m.optimizer_state;
                assert_eq!(state, 16 * p.param_count); // 6.71B x 16 = 107 GB
                assert!(gb(state) > 100.0);
                assert!(!e.fits && e.headroom_bytes < -20_000_000_000, "{}", e.headroom_bytes);
                assert!(e.notes.iter().any(|n| n.level == NoteLevel::Warning && n.text.contains("Out of memory")));
            }
        }
        // Eight GPUs with FSDP: 16 x 6.7B / 8 = 13.4 GB of state each, which fits.
        let mut fsdp = megatron_spec(preset("llama-7b"), 8, 1, 1, 1);
        fsdp.parallel.sharding = Sharding::Fsdp;
        let (_, e) = run(&fsdp, Cluster::a100_80gb_sxm());
        report("7B FSDP, 8 x A100 80GB", &e);
        assert!(e.fits);
    }

    #[test]
    fn mfu_is_a_fraction_for_every_preset_and_cluster() {
        let layouts = [(1, 1, 1), (8, 1, 1), (1, 8, 1), (2, 8, 4), (16, 8, 8)];
        for model in model_presets() {
            for cluster in cluster_presets() {
                for (dp, tp, pp) in layouts {
                    // (experts are not split over tensor-parallel ranks)
                    if model.model.layers < pp
                        || model.model.key_value_heads() % tp != 0
                        || (model.model.is_moe() && tp > 1)
                    {
                        continue;
                    }
                    let spec = megatron_spec(model.model.clone(), dp, tp, pp, 4 * pp);
                    let (_, e) = run(&spec, cluster.cluster.clone());
                    let what = format!("{} on {} dp{dp} tp{tp} pp{pp}", model.key, cluster.key);
                    assert!(e.mfu > 0.0 && e.mfu < 1.0, "{what}: {}", e.mfu);
                    assert!(e.hfu >= e.mfu && e.hfu <= 1.0 + 1e-12, "{what}: {}", e.hfu);
                    assert!(e.step_seconds >= e.compute_seconds && e.tokens_per_second > 0.0, "{what}");
                }
            }
        }
        // With no communication and no bubble, the only loss is the recomputed forward:
        // MFU = model FLOPs / all FLOPs, HFU = 1.
        let spec = megatron_spec(preset("gpt2-124m"), 1, 1, 1, 1);
        let (p, e) = run(&spec, Cluster::h100_80gb_sxm());
        assert_eq!(e.exposed_comm_seconds, 0.0);
        assert!((e.hfu - 1.0).abs() < 1e-12, "{}", e.hfu);
        assert!((e.mfu - e.model_flops / p.flops.total).abs() < 1e-12);
        assert!((e.step_seconds - p.flops.total / 989e12).abs() < 1e-15);
    }

    #[test]
    fn step_time_grows_when_tp_crosses_nodes() {
        // 13B, tp=8: inside a node of 8 GPUs; on nodes of 4 it spans two.
        let spec = megatron_spec(preset("llama-13b"), 4, 8, 1, 8);
        let (_, inside) = run(&spec, Cluster::a100_80gb_sxm());
        let four_per_node = Cluster { gpus_per_node: 4, ..Cluster::a100_80gb_sxm() };
        let (_, across) = run(&spec, four_per_node);
        report("13B TP8 in a node", &inside);
        report("13B TP8 over two nodes", &across);
        assert!(!inside.tp.crosses_nodes && across.tp.crosses_nodes);
        assert_eq!(inside.tp.bytes_per_rank, across.tp.bytes_per_rank);
        // 300 / 25 GB/s: the bandwidth term is 12 times longer.
        let beta = |e: &Estimate| e.tp.seconds - e.tp.messages as f64 * 5e-6;
        assert!((beta(&across) / beta(&inside) - 12.0).abs() < 1e-6);
        assert!(across.step_seconds > inside.step_seconds * 1.5, "{} {}", across.step_seconds, inside.step_seconds);
        assert!(across.mfu < inside.mfu);
        assert!(across.notes.iter().any(|n| n.level == NoteLevel::Warning && n.text.starts_with("TP spans nodes")));
        assert!(!inside.notes.iter().any(|n| n.text.starts_with("TP spans nodes")));
        // tp=16 on nodes of 8 crosses as well.
        let wide = megatron_spec(preset("llama-13b"), 1, 8, 1, 1);
        let mut wider = wide.clone();
        (wider.model.heads, wider.model.kv_heads) = (16 * 4, 16 * 4); // 80-wide heads, so that tp=16 divides them
        wider.parallel.tp = 16;
        let (_, e) = run(&wider, Cluster::a100_80gb_sxm());
        assert!(e.tp.crosses_nodes);
    }

    #[test]
    fn alpha_beta_formula_on_hand_computed_cases() {
        // 10 messages of 5 us and 1 GB at 10 GB/s: 50 us + 0.1 s.
        assert!((alpha_beta_seconds(10, 1_000_000_000, 5e-6, 10e9) - 0.10005).abs() < 1e-15);
        // No bandwidth: the latency term alone (and never inf).
        assert_eq!(alpha_beta_seconds(4, 1_000, 1e-3, 0.0), 4e-3);
        assert_eq!(alpha_beta_seconds(4, 1_000, f64::NAN, f64::INFINITY), 0.0);

        // DDP over 4 ranks in one node: the default tiny GPT (110,336 parameters), fp32
        // gradient buckets of 64 KiB: ceil(441,344 / 65,536) = 7 buckets, each a ring
        // all-reduce of 2 * 3 = 6 steps: 42 messages.
        let mut spec = ExperimentSpec::default();
        spec.parallel.dp = 4;
        spec.parallel.bucket_bytes = 64 << 10;
        let cluster = Cluster {
            gpus: 4,
            gpus_per_node: 4,
            intra_node_bytes_per_s: 1e9,
            inter_node_bytes_per_s: 1e8,
            latency_s: 1e-5,
            ..Cluster::a100_80gb_sxm()
        };
        let p = plan(&spec).unwrap();
        let e = estimate(&spec, &p, &cluster);
        let bytes = ring_all_reduce_bytes(110_336, 4, 4); // 2 * 3/4 * 110,336 * 4 = 662,016
        assert_eq!(bytes, 662_016);
        assert_eq!((e.dp.bytes_per_rank, e.dp.messages, e.dp.crosses_nodes), (bytes, 42, false));
        assert!((e.dp.seconds - (42.0 * 1e-5 + 662_016.0 / 1e9)).abs() < 1e-15, "{}", e.dp.seconds);
        // Step = compute + DP (no TP, PP or bubble); compute in fp32 at 19.5 TFLOP/s.
        let compute = p.flops.per_rank / 19.5e12;
        assert!((e.compute_seconds - compute).abs() < 1e-18);
        assert!((e.step_seconds - (compute + e.dp.seconds)).abs() < 1e-15);
        // Two nodes of 2: the same ring at the network's 0.1 GB/s.
        let e2 = estimate(&spec, &p, &Cluster { gpus_per_node: 2, ..cluster.clone() });
        assert!(e2.dp.crosses_nodes);
        assert!((e2.dp.seconds - (42.0 * 1e-5 + 662_016.0 / 1e8)).abs() < 1e-15);

        // A pipeline of 2 stages, 2 micro-batches: bubble 1/3, so the busy time is
        // stretched by (M+P-1)/M = 3/2. Each stage sends one activation (8 x 32 x 64 fp32)
        // per micro-batch: 2 messages of 65,536 bytes.
        let mut pipe = ExperimentSpec::default();
        pipe.parallel.pp = 2;
        pipe.train.micro_batches = 2;
        let p = plan(&pipe).unwrap();
        let e = estimate(&pipe, &p, &cluster);
        assert_eq!((e.pp.bytes_per_rank, e.pp.messages), (2 * 65_536, 2));
        assert!((e.pp.seconds - (2.0 * 1e-5 + 131_072.0 / 1e9)).abs() < 1e-15);
        let busy = e.compute_seconds + e.pp.seconds;
        assert!((e.step_seconds - 1.5 * busy).abs() < 1e-15);
        assert!((e.bubble_seconds - 0.5 * busy).abs() < 1e-15);

        // Every pipeline slot waits for the busiest stage. Per token, a block of this model
        // (d 64, seq 32) computes 6 x 49,984 + 12 x 32 x 64 = 324,480 FLOPs and the head on
        // the last stage 6 x 64 x 64 = 24,576. One layer a stage: the last is busiest,
        // 349,056 against a mean of 336,768. 3 + 2 layers (5 on 2 stages): the first is,
        // 973,440 against 823,488.
        assert_eq!(pipe.model.active_block_params(), 49_984);
        let average = |p: &Plan| p.flops.per_rank / 19.5e12;
        let p = plan(&pipe).unwrap();
        let even = estimate(&pipe, &p, &cluster).compute_seconds / average(&p);
        assert!((even - 349_056.0 / 336_768.0).abs() < 1e-12, "{even}");
        let mut uneven = pipe.clone();
        uneven.model.layers = 5;
        let p = plan(&uneven).unwrap();
        assert_eq!(p.stages.iter().map(|st| (st.layers, st.head)).collect::<Vec<_>>(), [(3, false), (2, true)]);
        let imbalance = estimate(&uneven, &p, &cluster).compute_seconds / average(&p);
        assert!((imbalance - 973_440.0 / 823_488.0).abs() < 1e-12, "{imbalance}");
    }

    #[test]
    fn placement_follows_tp_then_pp_then_dp() {
        // tp=8 fills a node of 8.
        assert!(group_inside_node(1, 8, 8, 64));
        // tp=3 on nodes of 8: the group of ranks 6, 7, 8 straddles two nodes.
        assert!(!group_inside_node(1, 3, 8, 24));
        // ... unless the whole world is one node.
        assert!(group_inside_node(1, 3, 8, 6));
        // pp=4 after tp=2: ranks 0, 2, 4, 6 are one node.
        assert!(group_inside_node(2, 4, 8, 64));
        // dp after tp=8: one rank per node.
        assert!(!group_inside_node(8, 2, 8, 16));
        // A group of one never communicates; a zero node size counts as one GPU per node.
        assert!(group_inside_node(8, 1, 8, 16));
        assert!(!group_inside_node(1, 2, 0, 16));
    }

    #[test]
    fn degenerate_clusters_give_finite_numbers() {
        let spec = megatron_spec(preset("gpt2-124m"), 2, 2, 2, 2);
        let p = plan(&spec).unwrap();
        let zero = Cluster {
            gpus: 0,
            gpus_per_node: 0,
            gpu_memory_bytes: 0,
            peak_flops_bf16: 0.0,
            peak_flops_fp16: 0.0,
            peak_flops_fp32: 0.0,
            intra_node_bytes_per_s: 0.0,
            inter_node_bytes_per_s: f64::NAN,
            latency_s: -1.0,
        };
        let e = estimate(&spec, &p, &zero);
        assert!(!e.fits);
        assert_eq!(e.headroom_bytes, -(e.memory_per_gpu_bytes as i64));
        for x in [e.compute_seconds, e.step_seconds, e.tokens_per_second, e.mfu, e.hfu, e.dp.seconds, e.tp.seconds] {
            assert!(x.is_finite() && x >= 0.0, "{x}");
        }
        assert_eq!((e.mfu, e.tokens_per_second), (0.0, 0.0));
        assert!(e.notes.iter().any(|n| n.text.contains("no peak FLOP/s")));
        assert!(e.notes.iter().any(|n| n.text.contains("the cluster has 0")));
        // An empty plan (no stages) does not panic either.
        let empty = Plan { stages: Vec::new(), ..p.clone() };
        let e = estimate(&spec, &empty, &Cluster::default());
        assert_eq!((e.memory_per_gpu_bytes, e.fits), (0, true));
        // The estimate and the clusters go through JSON (the page renders them).
        let e = estimate(&spec, &p, &Cluster::default().for_spec(&spec));
        // (serde_json may round the last bit of an f64, so floats are compared to 1e-12.)
        let again: Estimate = serde_json::from_str(&serde_json::to_string(&e).unwrap()).unwrap();
        assert_eq!(
            (again.memory_per_gpu_bytes, again.headroom_bytes, &again.notes),
            (e.memory_per_gpu_bytes, e.headroom_bytes, &e.notes)
        );
        assert_eq!(
            (again.dp.messages, again.tp.bytes_per_rank, again.pp.crosses_nodes),
            (e.dp.messages, e.tp.bytes_per_rank, e.pp.crosses_nodes)
        );
        assert!((again.step_seconds / e.step_seconds - 1.0).abs() < 1e-12);
        assert!((again.mfu / e.mfu - 1.0).abs() < 1e-12);
        let cluster: Cluster = serde_json::from_str("{}").unwrap();
        assert_eq!(cluster, Cluster::a100_80gb_sxm());
        let presets: Vec<ClusterPreset> =
            serde_json::from_str(&serde_json::to_string(&cluster_presets()).unwrap()).unwrap();
        assert_eq!(presets, cluster_presets());
    }
}
