//! Spec validation: one set of rules for the browser (instant field errors), the
//! server (the authority) and the worker. Every message is written for a learner.

use serde::{Deserialize, Serialize};

use crate::spec::field_error::FieldError;
use crate::spec::*;

/// What one experiment may ask of the worker pool: a server setting, so that one
/// person cannot tie up a shared machine.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(default)]
pub struct Limits {
    pub max_world_size: usize,
    pub max_params: u64,
    pub max_steps: u64,
    pub max_layers: usize,
    pub max_d_model: usize,
    pub max_seq_len: usize,
    pub max_vocab: usize,
    pub max_micro_batch: usize,
    pub max_micro_batches: usize,
    pub max_grad_accum: usize,
    pub max_name_len: usize,
    /// Tokens of one optimizer step across all ranks (bounds memory and step time).
    pub max_tokens_per_step: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            max_world_size: 8,
            max_params: 50_000_000,
            max_steps: 20_000,
            max_layers: 32,
            max_d_model: 1024,
            max_seq_len: 1024,
            max_vocab: 65_536,
            max_micro_batch: 256,
            max_micro_batches: 64,
            max_grad_accum: 64,
            max_name_len: 100,
            max_tokens_per_step: 1 << 20,
        }
    }
}

impl Limits {
    /// No limit at all: for a rank process, whose launcher applied the run's limits (a
    /// server's, or `distlab-worker run --limits`) before starting it; the rules still apply.
    pub fn none() -> Self {
        Limits {
            max_world_size: usize::MAX,
            max_params: u64::MAX,
            max_steps: u64::MAX,
            max_layers: usize::MAX,
            max_d_model: usize::MAX,
            max_seq_len: usize::MAX,
            max_vocab: usize::MAX,
            max_micro_batch: usize::MAX,
            max_micro_batches: usize::MAX,
            max_grad_accum: usize::MAX,
            max_name_len: usize::MAX,
            max_tokens_per_step: usize::MAX,
        }
    }
}

/// A spec that passed [`ExperimentSpec::validate`]: what the training engine takes, so that
/// a spec is checked once, where it enters (the browser's form, the server's API, the
/// worker's lease or spec file, a rank process's start), and nowhere inside.
#[derive(Clone, Debug, PartialEq, Serialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(transparent)]
pub struct ValidSpec(ExperimentSpec);

impl std::ops::Deref for ValidSpec {
    type Target = ExperimentSpec;
    fn deref(&self) -> &ExperimentSpec {
        &self.0
    }
}

impl ValidSpec {
    pub fn into_inner(self) -> ExperimentSpec {
        self.0
    }

    /// `spec` unchecked, for tests that drive the engine on what no user can submit (one
    /// process holding a ZeRO or FSDP shard of a group of one). Input is never taken this way.
    #[doc(hidden)]
    pub fn assume_valid(spec: ExperimentSpec) -> Self {
        ValidSpec(spec)
    }
}

impl ExperimentSpec {
    /// The spec as a [`ValidSpec`] if it passes every rule, else all the problems.
    pub fn validated(self, limits: &Limits) -> Result<ValidSpec, Vec<FieldError>> {
        self.validate(limits)?;
        Ok(ValidSpec(self))
    }

    /// Checks every rule and returns all the problems at once (empty list = valid).
    pub fn validate(&self, limits: &Limits) -> Result<(), Vec<FieldError>> {
        let mut errs = Vec::new();
        let mut err = |field: &str, message: String| errs.push(FieldError::new(field, message));

        // name
        if self.name.trim().is_empty() {
            err("name", "give the experiment a name".into());
        } else if self.name.chars().count() > limits.max_name_len {
            err("name", format!("name is longer than {} characters", limits.max_name_len));
        } else if self.name.chars().any(|c| c.is_control()) {
            err("name", "name must not contain control characters".into());
        }

        // model
        let m = &self.model;
        in_range(&mut err, "model.layers", m.layers, 1, limits.max_layers, "layers");
        in_range(&mut err, "model.d_model", m.d_model, 1, limits.max_d_model, "d_model");
        in_range(&mut err, "model.heads", m.heads, 1, m.d_model.max(1), "heads");
        in_range(&mut err, "model.seq_len", m.seq_len, 1, limits.max_seq_len, "seq_len");
        in_range(&mut err, "model.vocab", m.vocab, 2, limits.max_vocab, "vocab");
        if m.heads >= 1 && m.d_model >= 1 && m.d_model % m.heads != 0 {
            err(
                "model.heads",
                format!("heads={} does not divide d_model={}: every head needs the same width", m.heads, m.d_model),
            );
        }
        self.check_family(&mut err);
        match self.data.tokenizer {
            TokenizerKind::Bytes if self.data.dataset.is_text() && m.vocab < 256 && m.vocab >= 2 => err(
                "model.vocab",
                format!("the text dataset has one token per byte, so vocab must be at least 256 (it is {})", m.vocab),
            ),
            TokenizerKind::Bpe if !self.data.dataset.is_text() => err(
                "data.tokenizer",
                "bpe cuts a text into tokens: it needs dataset=text or upload (the Markov chain's tokens are \
                 already ids)"
                    .into(),
            ),
            TokenizerKind::Bpe if m.vocab < MIN_BPE_VOCAB && m.vocab >= 2 => err(
                "model.vocab",
                format!(
                    "a byte-level BPE starts from the 256 bytes and merges pairs into new tokens: vocab must be at \
                     least {MIN_BPE_VOCAB} (it is {})",
                    m.vocab
                ),
            ),
            _ => {}
        }
        match (self.data.dataset, self.data.upload_id) {
            (Dataset::Upload, None) => {
                err("data.upload_id", "dataset=upload needs the id of an uploaded text (POST /api/datasets)".into())
            }
            (Dataset::Upload, Some(id)) if id < 1 => err("data.upload_id", format!("{id} is not a dataset id")),
            (Dataset::Markov | Dataset::Text, Some(_)) => {
                err("data.upload_id", "upload_id is for dataset=upload; leave it out for the built-in datasets".into())
            }
            _ => {}
        }
        // Counted only within the limits above, where the count cannot overflow.
        let within = |value: usize, max: usize| (1..=max).contains(&value);
        if within(m.layers, limits.max_layers)
            && within(m.d_model, limits.max_d_model)
            && within(m.vocab, limits.max_vocab)
            && within(m.seq_len, limits.max_seq_len)
            && within(m.heads, m.d_model)
            && m.experts <= MAX_EXPERTS
            // (other widths are refused above; these keep the count inside u64)
            && m.ffn_hidden <= m.d_model.saturating_mul(MAX_FFN_RATIO)
            && m.kv_heads <= m.heads
        {
            let params = m.param_count();
            if params > limits.max_params {
                err(
                    "model",
                    format!("this model has {} parameters; this server allows at most {}", params, limits.max_params),
                );
            }
        }

        // parallel
        let p = &self.parallel;
        in_range(&mut err, "parallel.dp", p.dp, 1, limits.max_world_size, "dp");
        in_range(&mut err, "parallel.tp", p.tp, 1, limits.max_world_size, "tp");
        in_range(&mut err, "parallel.pp", p.pp, 1, limits.max_world_size, "pp");
        let world = p.dp.saturating_mul(p.tp).saturating_mul(p.pp);
        if p.dp >= 1 && p.tp >= 1 && p.pp >= 1 && world > limits.max_world_size {
            err(
                "parallel",
                format!(
                    "world size dp*tp*pp = {}*{}*{} = {} is more than the {} ranks this server allows",
                    p.dp, p.tp, p.pp, world, limits.max_world_size
                ),
            );
        }
        if p.tp > 1 && m.heads >= 1 && m.heads % p.tp != 0 {
            err(
                "parallel.tp",
                format!("tp={} does not divide heads={}: each tensor-parallel rank takes whole heads", p.tp, m.heads),
            );
        }
        if p.tp > 1 && m.d_ff() % p.tp != 0 {
            err("parallel.tp", format!("tp={} does not divide the MLP width d_ff={}", p.tp, m.d_ff()));
        }
        if p.pp > 1 && m.layers >= 1 && p.pp > m.layers {
            err(
                "parallel.pp",
                format!("pp={} is more than layers={}: every pipeline stage needs at least one layer", p.pp, m.layers),
            );
        }
        if p.sharding != Sharding::None && p.dp < 2 {
            err(
                "parallel.sharding",
                format!(
                    "sharding={} splits state across data-parallel ranks, so it needs dp >= 2",
                    p.sharding.as_str()
                ),
            );
        }
        if p.bucket_bytes < 1024 || p.bucket_bytes > 1 << 30 {
            err("parallel.bucket_bytes", "bucket_bytes must be between 1 KiB (1024) and 1 GiB".into());
        }
        if p.comm_dtype != Precision::Fp32 && p.comm_dtype != self.train.precision {
            err(
                "parallel.comm_dtype",
                format!(
                    "comm_dtype={} sends the data-parallel collectives in a 2-byte format, which a run in {} \
                     does not have: use fp32, or the run's own precision",
                    p.comm_dtype.as_str(),
                    self.train.precision.as_str()
                ),
            );
        }
        if p.offload != Offload::None
            && !self.train.optimizer.keeps_moments()
            && self.train.precision == Precision::Fp32
        {
            err(
                "parallel.offload",
                format!(
                    "offload={} moves the optimizer's state off the device, and {} in fp32 keeps none (no moments, \
                     no master weights): use adamw or lamb, or a 2-byte precision, or offload=none",
                    p.offload.as_str(),
                    self.train.optimizer.as_str()
                ),
            );
        }
        if p.sequence_parallel {
            // (saturating: the sizes are range-checked elsewhere, maybe not yet)
            let tokens = self.train.micro_batch.saturating_mul(self.model.seq_len);
            if p.tp < 2 {
                err(
                    "parallel.sequence_parallel",
                    format!(
                        "sequence parallelism splits the LayerNorm regions across a tensor-parallel group: it \
                         needs tp >= 2 (it is {})",
                        p.tp
                    ),
                );
            } else if tokens % p.tp != 0 {
                err(
                    "parallel.sequence_parallel",
                    format!(
                        "sequence parallelism gives each of the tp={} ranks an equal share of a micro-batch's \
                         micro_batch x seq_len = {tokens} tokens: make it a multiple of tp",
                        p.tp
                    ),
                );
            }
        }
        in_range(&mut err, "parallel.ranks_per_node", p.ranks_per_node, 1, limits.max_world_size, "ranks_per_node");
        match (&self.demo, p.allreduce) {
            (None, _) | (Some(_), AllReduce::Ring) => {}
            (Some(demo), _) if demo.op == DemoOp::AllReduce => {}
            (Some(demo), _) => err(
                "parallel.allreduce",
                format!(
                    "allreduce={} is an all-reduce's algorithm: a demo of {} runs its own",
                    p.allreduce.as_str(),
                    demo.op.as_str()
                ),
            ),
        }
        if p.allreduce != AllReduce::Ring && p.sharding.shards_grads() {
            err(
                "parallel.allreduce",
                format!(
                    "allreduce={} is the gradient all-reduce of DDP and ZeRO-1; sharding={} reduce-scatters \
                     the gradients instead",
                    p.allreduce.as_str(),
                    p.sharding.as_str()
                ),
            );
        }
        if p.allreduce != AllReduce::Ring && p.comm_dtype != Precision::Fp32 {
            err(
                "parallel.allreduce",
                format!(
                    "allreduce={} runs in fp32; comm_dtype={} (a 2-byte wire) runs on the ring only",
                    p.allreduce.as_str(),
                    p.comm_dtype.as_str()
                ),
            );
        }
        self.check_compression(&mut err);
        self.check_pipeline_schedule(&mut err);
        self.check_experts(&mut err);
        self.check_context_parallel(&mut err);
        match p.sync {
            DataSync::Diloco => self.check_diloco(&mut err),
            DataSync::AsyncPs => self.check_async_ps(&mut err),
            DataSync::EveryStep => {}
        }
        if p.fault_tolerance == FaultTolerance::Replicas {
            self.check_fault_tolerance(&mut err);
        }
        if let Some(drill) = p.fault_drill {
            self.check_fault_drill(drill, &mut err);
        }
        if self.train.optimizer.layer_wise() {
            self.check_layer_wise(&mut err);
        }
        if p.sharding == Sharding::Hsdp {
            self.check_hsdp(&mut err);
        } else if p.shard_group != 0 {
            err(
                "parallel.shard_group",
                format!(
                    "shard_group is hybrid sharding's: use sharding=hsdp, or shard_group=0 (it is {})",
                    p.shard_group
                ),
            );
        }
        if p.prefetch && p.sharding != Sharding::Fsdp {
            err(
                "parallel.prefetch",
                format!(
                    "prefetch gathers the next unit's parameters while one computes; only sharding=fsdp gathers \
                     parameters during compute (it is {})",
                    p.sharding.as_str()
                ),
            );
        }

        // train
        let t = &self.train;
        if t.steps < 1 || t.steps > limits.max_steps {
            err("train.steps", format!("steps must be between 1 and {} (it is {})", limits.max_steps, t.steps));
        }
        in_range(&mut err, "train.micro_batch", t.micro_batch, 1, limits.max_micro_batch, "micro_batch");
        in_range(&mut err, "train.micro_batches", t.micro_batches, 1, limits.max_micro_batches, "micro_batches");
        in_range(&mut err, "train.grad_accum", t.grad_accum, 1, limits.max_grad_accum, "grad_accum");
        if !(t.lr.is_finite() && t.lr > 0.0 && t.lr <= 10.0) {
            err("train.lr", format!("the learning rate must be a number above 0 and at most 10 (it is {})", t.lr));
        }
        if t.warmup_steps > t.steps {
            err(
                "train.warmup_steps",
                format!("warmup_steps={} is longer than the run (steps={})", t.warmup_steps, t.steps),
            );
        }
        if !(t.weight_decay.is_finite() && (0.0..=1.0).contains(&t.weight_decay)) {
            err("train.weight_decay", "weight_decay must be between 0 and 1".into());
        }
        if !(t.grad_clip.is_finite() && t.grad_clip >= 0.0) {
            err("train.grad_clip", "grad_clip must be 0 (off) or a positive number".into());
        }
        if t.checkpointing == Checkpointing::Selective && t.attention == Attention::Flash {
            err(
                "train.checkpointing",
                "selective recompute drops attention's (T, T) probabilities and computes them again in backward, \
                 which flash attention already does (it keeps one log-sum-exp per row): use attention=naive, or \
                 checkpointing=none"
                    .into(),
            );
        }
        if t.fp8 != Fp8Recipe::None {
            self.check_fp8(&mut err);
        }
        if self.parallel.fp8_all_gather {
            self.check_fp8_all_gather(&mut err);
        }
        if t.activation_offload != Offload::None && t.checkpointing.recomputes_blocks() {
            err(
                "train.checkpointing",
                format!(
                    "activation_offload={} moves each block's activations off the device between its forward and \
                     its backward; checkpointing={} keeps none of them (it recomputes them): use one or the other",
                    t.activation_offload.as_str(),
                    t.checkpointing.as_str()
                ),
            );
        }
        if t.loss_scaling == LossScaling::Dynamic && t.precision != Precision::Fp16 {
            err(
                "train.loss_scaling",
                format!("dynamic loss scaling is for fp16; {} does not need it", t.precision.as_str()),
            );
        }
        if let Some(from) = t.resume_from {
            if from.step < 1 || from.step >= t.steps {
                err(
                    "train.resume_from",
                    format!(
                        "resume_from.step is the checkpoint's step, where this run starts: between 1 and steps-1 = {} \
                         (it is {})",
                        t.steps.saturating_sub(1),
                        from.step
                    ),
                );
            }
            if self.demo.is_some() {
                err("train.resume_from", "a collective demo trains nothing to resume".into());
            }
        }
        if t.checkpoint_every > t.steps {
            err(
                "train.checkpoint_every",
                format!(
                    "checkpoint_every={} is longer than the run (steps={}); use 0 for no checkpoints",
                    t.checkpoint_every, t.steps
                ),
            );
        }
        if let Some(demo) = &self.demo {
            if demo.op == DemoOp::AllToAll && p.dp >= 1 && demo.elements % p.dp != 0 {
                err(
                    "demo.elements",
                    format!(
                        "all_to_all cuts each vector into dp = {} equal chunks, one per rank: {} elements do not \
                         divide",
                        p.dp, demo.elements
                    ),
                );
            }
            if demo.elements < 1 || demo.elements > 4096 {
                err(
                    "demo.elements",
                    format!("a demo vector has between 1 and 4096 elements (it is {})", demo.elements),
                );
            }
            if p.tp != 1 || p.pp != 1 {
                err("demo", "a collective demo runs across the dp ranks only: use tp=1 and pp=1".into());
            }
        }

        let tokens = world_tokens(self);
        if tokens > limits.max_tokens_per_step as u128 {
            err(
                "train.micro_batch",
                format!(
                    "one step would process {} tokens; this server allows at most {}",
                    tokens, limits.max_tokens_per_step
                ),
            );
        }

        if errs.is_empty() {
            Ok(())
        } else {
            Err(errs)
        }
    }
}

impl ExperimentSpec {
    /// The block's design: GPT-2 blocks as GPT-2 has them (multi-head attention, a 4 x
    /// d_model MLP, learned positions); Llama blocks with grouped-query attention, their
    /// own MLP width and rotary positions. Neither ties its LM head to the embedding yet.
    fn check_family(&self, err: &mut impl FnMut(&str, String)) {
        let (m, p) = (&self.model, &self.parallel);
        let kv_heads = m.key_value_heads();
        match m.family {
            ModelFamily::Gpt2 => {
                if kv_heads != m.heads {
                    err(
                        "model.kv_heads",
                        format!(
                            "GPT-2 blocks use multi-head attention: kv_heads={} must be 0 or heads={} \
                             (grouped-query attention is family=llama)",
                            m.kv_heads, m.heads
                        ),
                    );
                }
                if m.ffn_hidden != 0 && m.ffn_hidden != m.d_model.saturating_mul(4) {
                    err(
                        "model.ffn_hidden",
                        format!(
                            "a GPT-2 MLP is 4 x d_model wide: ffn_hidden={} must be 0 or {} (family=llama \
                             chooses its own)",
                            m.ffn_hidden,
                            m.d_model.saturating_mul(4)
                        ),
                    );
                }
                if m.rope_theta != DEFAULT_ROPE_THETA {
                    err("model.rope_theta", "GPT-2 learns its positions: rope_theta is for family=llama".into());
                }
            }
            ModelFamily::Llama => {
                if m.heads >= 1 && (kv_heads > m.heads || m.heads % kv_heads != 0) {
                    err(
                        "model.kv_heads",
                        format!(
                            "kv_heads={} does not divide heads={}: each key/value head serves a whole group of \
                             query heads",
                            m.kv_heads, m.heads
                        ),
                    );
                }
                if m.heads >= 1 && m.d_model % m.heads == 0 && (m.d_model / m.heads) % 2 != 0 {
                    err(
                        "model.heads",
                        format!(
                            "rotary positions turn pairs of a head's dimensions: the head width d_model/heads = {} \
                             must be even",
                            m.d_model / m.heads
                        ),
                    );
                }
                if m.ffn_hidden > m.d_model.saturating_mul(MAX_FFN_RATIO) {
                    err(
                        "model.ffn_hidden",
                        format!(
                            "ffn_hidden={} is more than {MAX_FFN_RATIO} x d_model = {}",
                            m.ffn_hidden,
                            m.d_model.saturating_mul(MAX_FFN_RATIO)
                        ),
                    );
                }
                if !(m.rope_theta.is_finite() && m.rope_theta > 1.0 && m.rope_theta <= 1e9) {
                    err(
                        "model.rope_theta",
                        format!("rope_theta must be above 1, at most 1e9 (it is {})", m.rope_theta),
                    );
                }
                if p.tp > 1 && m.heads % p.tp == 0 && kv_heads % p.tp != 0 {
                    err(
                        "parallel.tp",
                        format!(
                            "tp={} does not divide kv_heads={kv_heads}: each tensor-parallel rank takes whole K/V \
                             heads (Megatron-LM would copy them to every rank instead; distlab keeps each on one)",
                            p.tp
                        ),
                    );
                }
            }
        }
        if m.tie_embeddings {
            err(
                "model.tie_embeddings",
                "the training engine keeps the LM head apart from the token embedding: tie_embeddings must be \
                 false (tied heads are for the planner)"
                    .into(),
            );
        }
    }

    /// `parallel.pp_schedule` and `parallel.virtual_stages`: interleaving cuts the layers
    /// into pp * v equal chunks and takes micro-batches through them in groups of pp.
    pub(crate) fn check_pipeline_schedule(&self, err: &mut impl FnMut(&str, String)) {
        let p = &self.parallel;
        in_range(err, "parallel.virtual_stages", p.virtual_stages, 1, 16, "virtual_stages");
        if p.pp_schedule.splits_backward() {
            self.check_zero_bubble(err);
        }
        if p.pp_schedule.is_v() {
            self.check_v(err);
        }
        if p.pp_schedule != PpSchedule::Interleaved {
            if p.virtual_stages != 1 {
                err(
                    "parallel.virtual_stages",
                    format!(
                        "virtual_stages={} is for pp_schedule=interleaved; {} runs one chunk per stage (use 1)",
                        p.virtual_stages,
                        p.pp_schedule.as_str()
                    ),
                );
            }
            return;
        }
        if p.pp < 2 {
            err("parallel.pp_schedule", format!("interleaved needs a pipeline: pp >= 2 (it is {})", p.pp));
        }
        if p.virtual_stages < 2 {
            err(
                "parallel.virtual_stages",
                format!(
                    "interleaved gives each stage virtual_stages >= 2 chunks of layers (it is {})",
                    p.virtual_stages
                ),
            );
        }
        let chunks = p.pp.saturating_mul(p.virtual_stages);
        let layers = self.model.layers;
        if chunks >= 1 && layers >= 1 && layers % chunks != 0 {
            err(
                "parallel.virtual_stages",
                format!(
                    "interleaved cuts the layers into pp * virtual_stages = {chunks} equal chunks: layers={layers} \
                     must be a multiple of {chunks}"
                ),
            );
        }
        let micro = self.pipeline_micro_batches();
        if p.pp >= 1 && micro % p.pp != 0 {
            err(
                "train.micro_batches",
                format!(
                    "interleaved takes micro-batches through the chunks in groups of pp={}: micro_batches * \
                     grad_accum = {micro} must be a multiple of it",
                    p.pp
                ),
            );
        }
    }

    /// `parallel.fp8_all_gather`: FSDP's gathers of the blocks' linear weights in FP8.
    fn check_fp8_all_gather(&self, err: &mut impl FnMut(&str, String)) {
        let (t, p) = (&self.train, &self.parallel);
        let mut refuse = |field: &str, why: String| err(field, format!("fp8_all_gather: {why}"));
        if t.fp8 == Fp8Recipe::None {
            refuse(
                "train.fp8",
                "the weights are gathered as the FP8 casts the products use; without FP8 products there are \
                 none: set fp8=delayed or current"
                    .into(),
            );
        }
        if p.sharding != Sharding::Fsdp {
            refuse(
                "parallel.sharding",
                format!(
                    "only FSDP gathers the parameters before each forward and backward (ZeRO-2 gathers the \
                     updated ones in full precision): use sharding=fsdp (it is {})",
                    p.sharding.as_str()
                ),
            );
        }
        if p.dp < 2 {
            refuse("parallel.dp", "one rank holds every parameter and gathers nothing: use dp of 2 or more".into());
        }
        if p.prefetch {
            refuse(
                "parallel.prefetch",
                "the prefetch thread gathers in the wire format, the FP8 gathers run on the training thread (not \
                 yet both): turn prefetch off"
                    .into(),
            );
        }
    }

    /// `parallel.sync: diloco`: replicas that each hold the whole model and their own
    /// optimizer, and meet every H steps.
    fn check_diloco(&self, err: &mut impl FnMut(&str, String)) {
        let (t, p) = (&self.train, &self.parallel);
        let mut refuse = |field: &str, why: String| err(field, format!("sync=diloco: {why}"));
        if p.dp < 2 {
            refuse("parallel.dp", format!("it averages the replicas' changes: use dp of 2 or more (it is {})", p.dp));
        }
        if p.sharding != Sharding::None {
            refuse(
                "parallel.sharding",
                format!(
                    "each replica steps alone with the whole model and its own optimizer: use sharding=none (it is \
                     {})",
                    p.sharding.as_str()
                ),
            );
        }
        for (field, size) in [("parallel.ep", p.ep), ("parallel.cp", p.cp)] {
            if size > 1 {
                refuse(
                    field,
                    "expert and context parallelism split a replica over ranks of the data-parallel group: use \
                     ep=1 and cp=1"
                        .into(),
                );
            }
        }
        if p.grad_compression != GradCompression::None || p.allreduce != AllReduce::Ring {
            refuse(
                "parallel.grad_compression",
                "no gradient is sent between replicas; the outer step's ring all-reduce of the parameter \
                 changes is neither compressed nor another algorithm (use grad_compression=none, allreduce=ring)"
                    .into(),
            );
        }
        if p.comm_dtype != Precision::Fp32 {
            refuse(
                "parallel.comm_dtype",
                format!(
                    "the parameter changes cross the wire in fp32 (2-byte changes would round away the small \
                     ones): use comm_dtype=fp32 (it is {})",
                    p.comm_dtype.as_str()
                ),
            );
        }
        if p.offload != Offload::None {
            refuse("parallel.offload", "the inner optimizer's state stays on the device: use offload=none".into());
        }
        if t.precision != Precision::Fp32 {
            refuse(
                "train.precision",
                format!(
                    "the outer step would have to reset the inner optimizer's fp32 master weights, which it does \
                     not yet: use precision=fp32 (it is {})",
                    t.precision.as_str()
                ),
            );
        }
        if t.checkpoint_every > 0 {
            refuse(
                "train.checkpoint_every",
                "checkpoints do not keep the outer step's parameters and momentum yet: use checkpoint_every=0".into(),
            );
        }
        if !(1..=10_000).contains(&p.outer_steps_every) {
            refuse(
                "parallel.outer_steps_every",
                format!("outer_steps_every (H) must be from 1 to 10000 (it is {})", p.outer_steps_every),
            );
        } else if t.steps % p.outer_steps_every != 0 {
            refuse(
                "train.steps",
                format!(
                    "the run ends on an outer step, so that the replicas end as one model: steps={} must be a \
                     multiple of outer_steps_every={}",
                    t.steps, p.outer_steps_every
                ),
            );
        }
        if !(p.outer_lr.is_finite() && p.outer_lr > 0.0 && p.outer_lr <= 10.0) {
            refuse("parallel.outer_lr", format!("outer_lr must be above 0 and at most 10 (it is {})", p.outer_lr));
        }
        if !(p.outer_momentum.is_finite() && (0.0..1.0).contains(&p.outer_momentum)) {
            refuse(
                "parallel.outer_momentum",
                format!("outer_momentum must be from 0 to below 1 (it is {})", p.outer_momentum),
            );
        }
    }

    /// `sync: async_ps`: every data-parallel rank a worker of one parameter server (on
    /// rank 0), the model whole on each.
    fn check_async_ps(&self, err: &mut impl FnMut(&str, String)) {
        let (t, p) = (&self.train, &self.parallel);
        let mut refuse = |field: &str, why: String| err(field, format!("sync=async_ps: {why}"));
        if p.dp < 2 {
            refuse(
                "parallel.dp",
                format!("workers push to a parameter server on rank 0: use dp of 2 or more (it is {})", p.dp),
            );
        }
        if p.sharding != Sharding::None {
            refuse(
                "parallel.sharding",
                format!(
                    "every worker holds the whole model and the server the whole optimizer: use sharding=none (it \
                     is {})",
                    p.sharding.as_str()
                ),
            );
        }
        for (field, name, size) in p.model_splits().filter(|s| s.2 > 1) {
            refuse(
                field,
                format!("one server keeps the whole model, so a worker is one rank with all of it: use {name}=1 (it is {size})"),
            );
        }
        if p.grad_compression != GradCompression::None || p.allreduce != AllReduce::Ring {
            refuse(
                "parallel.grad_compression",
                "nothing is all-reduced: each gradient goes whole to the server (use grad_compression=none, \
                 allreduce=ring)"
                    .into(),
            );
        }
        if p.comm_dtype != Precision::Fp32 {
            refuse(
                "parallel.comm_dtype",
                format!(
                    "gradients and parameters cross the wire in fp32: use comm_dtype=fp32 (it is {})",
                    p.comm_dtype.as_str()
                ),
            );
        }
        if p.offload != Offload::None {
            refuse(
                "parallel.offload",
                "the server keeps the optimizer's state in its own memory: use offload=none".into(),
            );
        }
        if t.optimizer.layer_wise() {
            refuse(
                "train.optimizer",
                format!(
                    "the server applies AdamW or SGD to each gradient as it comes: use optimizer=adamw or sgd (it \
                     is {})",
                    t.optimizer.as_str()
                ),
            );
        }
        if t.precision == Precision::Fp16 {
            refuse(
                "train.precision",
                "each worker would scale its loss by a dynamic scale of its own, which the server's step does \
                 not take apart yet: use precision=fp32 or bf16"
                    .into(),
            );
        }
        if t.checkpoint_every > 0 {
            refuse(
                "train.checkpoint_every",
                "checkpoints do not keep the server's parameters and optimizer yet: use checkpoint_every=0".into(),
            );
        }
    }

    /// `fault_tolerance: replicas`: data-parallel replicas of one rank each, holding the
    /// whole model, that a quorum keeps together.
    fn check_fault_tolerance(&self, err: &mut impl FnMut(&str, String)) {
        let (t, p) = (&self.train, &self.parallel);
        let mut refuse = |field: &str, why: String| err(field, format!("fault_tolerance=replicas: {why}"));
        if p.dp < 2 {
            refuse(
                "parallel.dp",
                format!("the replicas go on without the one that dies: use dp of 2 or more (it is {})", p.dp),
            );
        }
        if p.sharding != Sharding::None {
            refuse(
                "parallel.sharding",
                format!(
                    "a replacement copies the whole model and optimizer from any live replica, so every replica \
                     holds all of it: use sharding=none (it is {})",
                    p.sharding.as_str()
                ),
            );
        }
        if p.sync != DataSync::EveryStep {
            refuse(
                "parallel.sync",
                format!("the replicas sum their gradients every step: use sync=every_step (it is {})", p.sync.as_str()),
            );
        }
        for (field, name, size) in p.model_splits().filter(|s| s.2 > 1) {
            refuse(
                field,
                format!(
                    "a replica is one rank that can die alone; ranks that split a model would take their partners \
                     with them: use {name}=1 (it is {size})"
                ),
            );
        }
        if p.grad_compression != GradCompression::None || p.allreduce != AllReduce::Ring {
            refuse(
                "parallel.grad_compression",
                "each quorum's gradients are summed by a plain ring of its members: use grad_compression=none, \
                 allreduce=ring"
                    .into(),
            );
        }
        if p.comm_dtype != Precision::Fp32 {
            refuse(
                "parallel.comm_dtype",
                format!("the gradients cross the wire in fp32: use comm_dtype=fp32 (it is {})", p.comm_dtype.as_str()),
            );
        }
        if p.offload != Offload::None {
            refuse(
                "parallel.offload",
                "a replacement copies the optimizer's state from a peer's memory: use offload=none".into(),
            );
        }
        if t.precision == Precision::Fp16 {
            refuse(
                "train.precision",
                "the dynamic loss scale is not copied to a replacement yet: use precision=fp32 or bf16".into(),
            );
        }
        if t.checkpoint_every > 0 {
            refuse(
                "train.checkpoint_every",
                "the live replicas are the replacement's checkpoint; checkpoints written by a rank that can die \
                 and come back are not kept yet: use checkpoint_every=0"
                    .into(),
            );
        }
    }

    /// `fault_drill`: one rank killed once, where the replicas can go on without it.
    fn check_fault_drill(&self, drill: FaultDrill, err: &mut impl FnMut(&str, String)) {
        let (t, p) = (&self.train, &self.parallel);
        if p.fault_tolerance != FaultTolerance::Replicas {
            err(
                "parallel.fault_drill",
                "a drill kills a rank's process to show the replicas going on without it; without \
                 fault_tolerance=replicas the run would just fail: use fault_tolerance=replicas"
                    .into(),
            );
        }
        if drill.rank >= p.dp.max(1) {
            err(
                "parallel.fault_drill.rank",
                format!(
                    "the drill kills one of the dp={} replicas: rank must be below {} (it is {})",
                    p.dp, p.dp, drill.rank
                ),
            );
        }
        if drill.after_step.saturating_add(2) > t.steps {
            err(
                "parallel.fault_drill.after_step",
                format!(
                    "the replicas need a step after the drill to go on in: after_step must be at most steps - 2 = {} \
                     (it is {})",
                    t.steps.saturating_sub(2),
                    drill.after_step
                ),
            );
        }
    }

    /// `sharding: hsdp`: FSDP inside groups of S consecutive data-parallel ranks, replicas
    /// across them.
    fn check_hsdp(&self, err: &mut impl FnMut(&str, String)) {
        let p = &self.parallel;
        let ways = p.shard_ways();
        let mut refuse = |field: &str, why: String| err(field, format!("sharding=hsdp: {why}"));
        if ways < 2 || ways >= p.dp || p.dp % ways != 0 {
            refuse(
                "parallel.shard_group",
                format!(
                    "the shard group (shard_group, or ranks_per_node when it is 0) must divide dp into 2 or more \
                     groups of 2 or more ranks: it is {ways} for dp={} (one group of dp is sharding=fsdp)",
                    p.dp
                ),
            );
        }
        if self.train.checkpoint_every > 0 {
            refuse(
                "train.checkpoint_every",
                "checkpoints are written and read by data-parallel rank, and every group holds the same shards: \
                 not yet with hybrid sharding (use checkpoint_every=0)"
                    .into(),
            );
        }
        // (prefetch, FP8 gathers and expert parallelism refuse it with their own reasons)
        if p.cp > 1 {
            refuse("parallel.cp", "context parallelism runs with sharding=fsdp, not yet with hybrid sharding".into());
        }
    }

    /// `train.optimizer: lamb | lars`: every tensor's trust ratio from its whole norms,
    /// summed over the ranks a ZeRO/FSDP shard spreads it on; tensor and expert parallelism
    /// would split a tensor over other groups too, which the sum does not cover yet.
    fn check_layer_wise(&self, err: &mut impl FnMut(&str, String)) {
        let (t, p) = (&self.train, &self.parallel);
        for (field, size, what) in [("parallel.tp", p.tp, "tensor"), ("parallel.ep", p.ep, "expert")] {
            if size > 1 {
                err(
                    field,
                    format!(
                        "optimizer={} scales each tensor's step by its own norms, and {what} parallelism splits \
                         tensors over ranks whose norms it does not sum yet: use {}=1 (it is {size})",
                        t.optimizer.as_str(),
                        &field["parallel.".len()..]
                    ),
                );
            }
        }
    }

    /// `train.fp8`: the blocks' four products in FP8, each tensor scaled on its own rank.
    fn check_fp8(&self, err: &mut impl FnMut(&str, String)) {
        let (t, p) = (&self.train, &self.parallel);
        let recipe = t.fp8.as_str();
        let mut refuse = |field: &str, why: String| err(field, format!("fp8={recipe}: {why}"));
        if t.precision == Precision::Fp16 {
            refuse(
                "train.precision",
                "a cast value is stored as q / scale, and fp16's range cannot hold those of small gradients \
                 (their scales reach 2^20 and more): use fp32 or bf16"
                    .into(),
            );
        }
        if p.tp > 1 {
            refuse(
                "parallel.tp",
                format!(
                    "each tensor is scaled from its amax on its rank, and tensor parallelism's ranks hold parts of \
                     one tensor whose amaxes would have to be agreed on first (not yet): use tp=1 (it is {})",
                    p.tp
                ),
            );
        }
        if self.model.is_moe() {
            refuse("model.experts", "the experts' MLPs are not cast to FP8 yet: use a dense model".into());
        }
        if t.checkpointing.recomputes_blocks() {
            refuse(
                "train.checkpointing",
                "a block's recomputed forward would cast its products again and count them twice (not yet): use \
                 checkpointing=none or selective"
                    .into(),
            );
        }
        if p.pp_schedule.splits_backward() && p.pp > 1 {
            refuse(
                "parallel.pp_schedule",
                format!(
                    "{}'s W would multiply the gradients its B cast to E5M2, which it does not keep yet: use 1f1b",
                    p.pp_schedule.as_str()
                ),
            );
        }
    }

    /// `pp_schedule: zbv | dualpipev`: the layers cut into 2P chunks laid out in a V, and
    /// enough micro-batches to fill it (DualPipeV's steady state pairs a forward down with
    /// a backward back from the start: 2P).
    fn check_v(&self, err: &mut impl FnMut(&str, String)) {
        let p = &self.parallel;
        let schedule = p.pp_schedule.as_str();
        let (chunks, layers) = (p.pp.saturating_mul(2), self.model.layers);
        if chunks >= 2 && layers % chunks != 0 {
            err(
                "parallel.pp_schedule",
                format!(
                    "pp_schedule={schedule} cuts the layers into 2 * pp = {chunks} equal chunks, two per stage in \
                     a V: layers={layers} must be a multiple of {chunks}"
                ),
            );
        }
        let micro = self.pipeline_micro_batches();
        let (fill, formula) = match p.pp_schedule {
            PpSchedule::DualPipeV => (chunks, "2 * pp"),
            _ => (chunks.saturating_sub(1), "2 * pp - 1"),
        };
        if micro < fill {
            err(
                "train.micro_batches",
                format!(
                    "pp_schedule={schedule} fills its V with {formula} = {fill} micro-batches: micro_batches * \
                     grad_accum = {micro} is fewer"
                ),
            );
        }
    }

    /// `pp_schedule: zb-h1` and `zbv`: their W passes write each block's weight gradients
    /// after the block's B, from what the B left and the saved activations.
    fn check_zero_bubble(&self, err: &mut impl FnMut(&str, String)) {
        let p = &self.parallel;
        let schedule = p.pp_schedule.as_str();
        let mut refuse = |field: &str, why: String| err(field, format!("pp_schedule={schedule}: {why}"));
        if p.pp < 2 {
            refuse("parallel.pp_schedule", format!("fills a pipeline's bubbles; it needs pp >= 2 (it is {})", p.pp));
        }
        if p.splits_sequence() {
            refuse(
                "parallel.sequence_parallel",
                "the W would gather each LayerNorm output across the tensor-parallel group once more: turn \
                 sequence_parallel off"
                    .into(),
            );
        }
        if self.train.checkpointing.recomputes_blocks() {
            refuse(
                "train.checkpointing",
                "the W needs the activations the B used, which checkpointing recomputes into buffers the next \
                 block reuses: use checkpointing=none or selective"
                    .into(),
            );
        }
        if self.train.activation_offload != Offload::None {
            refuse(
                "train.activation_offload",
                "the W reads a block's activations again after its B, and offload brings them back once, for \
                 the backward: use activation_offload=none or another schedule"
                    .into(),
            );
        }
    }

    /// Mixture of Experts (`model.experts` and its settings) and expert parallelism
    /// (`parallel.ep`, the experts spread over ranks of the data-parallel group).
    pub(crate) fn check_experts(&self, err: &mut impl FnMut(&str, String)) {
        let (m, p) = (&self.model, &self.parallel);
        if m.experts > MAX_EXPERTS {
            err(
                "model.experts",
                format!("experts must be at most {MAX_EXPERTS} (0: a dense MLP); it is {}", m.experts),
            );
        }
        if m.is_moe() {
            in_range(err, "model.expert_top_k", m.expert_top_k, 1, m.experts.min(MAX_EXPERTS), "expert_top_k");
            let cf = m.capacity_factor;
            if !(cf > 0.0 && cf <= 64.0) {
                err(
                    "model.capacity_factor",
                    format!(
                        "capacity_factor scales each expert's share of the tokens: above 0, at most 64 (it is {cf})"
                    ),
                );
            }
            let alpha = m.aux_loss_coef;
            if !(0.0..=10.0).contains(&alpha) {
                err("model.aux_loss_coef", format!("aux_loss_coef must be from 0 to 10 (it is {alpha})"));
            }
            let mut refuse = |field: &str, why: String| err(field, format!("experts={}: {why}", m.experts));
            if p.tp > 1 {
                refuse("parallel.tp", "the experts are not split across tensor-parallel ranks: use tp=1".into());
            }
            if p.pp_schedule.splits_backward() {
                refuse(
                    "parallel.pp_schedule",
                    format!(
                        "{}'s W is not written for the experts' weights: use 1f1b or interleaved",
                        p.pp_schedule.as_str()
                    ),
                );
            }
        }
        in_range(err, "parallel.ep", p.ep, 1, MAX_EXPERTS, "ep");
        if p.ep <= 1 {
            return;
        }
        let mut refuse = |field: &str, why: String| err(field, format!("ep={}: {why}", p.ep));
        if !m.is_moe() {
            refuse("parallel.ep", "expert parallelism spreads the experts; a dense model (experts=0) has none".into());
        } else if m.experts % p.ep != 0 {
            refuse("parallel.ep", format!("every rank takes experts/ep experts: ep must divide experts={}", m.experts));
        }
        if p.dp % p.ep != 0 {
            refuse(
                "parallel.ep",
                format!("the experts are spread over ep ranks of the data-parallel group: ep must divide dp={}", p.dp),
            );
        }
        if p.sharding != Sharding::None {
            refuse(
                "parallel.sharding",
                format!(
                    "sharding={} cuts every unit across the data-parallel group, whose ranks now hold different \
                     experts: use sharding=none",
                    p.sharding.as_str()
                ),
            );
        }
        if p.grad_compression != GradCompression::None {
            refuse("parallel.grad_compression", "compress a dense model's gradients (ep=1)".into());
        }
        if self.train.resume_from.is_some() {
            refuse(
                "train.resume_from",
                "an elastic resume re-cuts a checkpoint whose ranks all hold the same model; here each holds its own \
                 experts: start from scratch, or resume with ep=1"
                    .into(),
            );
        }
    }

    /// Context parallelism (`parallel.cp`): the sequences split along their tokens over cp
    /// ranks of the data-parallel group, Ulysses' all-to-alls around attention.
    fn check_context_parallel(&self, err: &mut impl FnMut(&str, String)) {
        let (m, p) = (&self.model, &self.parallel);
        in_range(err, "parallel.cp", p.cp, 1, 64, "cp");
        if p.cp <= 1 {
            return;
        }
        let mut refuse = |field: &str, why: String| err(field, format!("cp={}: {why}", p.cp));
        if p.dp % p.cp != 0 {
            refuse(
                "parallel.cp",
                format!(
                    "the ranks that share a sequence are cp consecutive ranks of the data-parallel group: cp must \
                     divide dp={}",
                    p.dp
                ),
            );
        }
        if m.seq_len % p.cp != 0 {
            refuse("parallel.cp", format!("each rank holds seq_len/cp tokens: cp must divide seq_len={}", m.seq_len));
        }
        let tp = p.tp.max(1);
        let (heads, kv_heads) = (m.heads / tp, m.key_value_heads() / tp);
        match p.cp_kind {
            ContextParallel::Ulysses if heads % p.cp != 0 || kv_heads % p.cp != 0 => refuse(
                "parallel.cp",
                format!(
                    "ulysses gives each rank heads/cp of its {heads} query and {kv_heads} key/value heads (per \
                     tensor-parallel rank) for the whole sequence: cp must divide both (the ring has no such limit)"
                ),
            ),
            ContextParallel::Ring if m.seq_len % (2 * p.cp) != 0 => refuse(
                "parallel.cp_kind",
                format!(
                    "ring splits each sequence in 2cp = {} chunks, two per rank, for causal balance: 2cp must divide \
                     seq_len={} (or use ring-unbalanced)",
                    2 * p.cp,
                    m.seq_len
                ),
            ),
            _ => {}
        }
        if p.cp_kind.is_ring() && self.train.attention != Attention::Flash {
            refuse(
                "train.attention",
                format!(
                    "{} attends block by block and keeps one log-sum-exp per row, FlashAttention's way: set \
                     attention flash",
                    p.cp_kind.as_str()
                ),
            );
        }
        if m.is_moe() {
            refuse(
                "model.experts",
                "the experts' all-to-alls run over the data-parallel group the context-parallel ranks share: \
                 use a dense model (experts=0)"
                    .into(),
            );
        }
        if p.prefetch {
            refuse(
                "parallel.prefetch",
                "FSDP's prefetch gathers on a thread of its own over the links the context-parallel exchanges \
                 use at the same time: turn prefetch off"
                    .into(),
            );
        }
        if self.train.resume_from.is_some() {
            refuse(
                "train.resume_from",
                "an elastic resume re-cuts the data-parallel group by sequences; start from scratch".into(),
            );
        }
        if self.demo.is_some() {
            refuse("demo", "the collective demos run no model: use cp=1".into());
        }
    }

    /// `parallel.grad_compression` and its settings: DDP's gradient all-reduce on the ring
    /// is what a compressor replaces.
    fn check_compression(&self, err: &mut impl FnMut(&str, String)) {
        let p = &self.parallel;
        let ratio = p.compression_ratio;
        if !(ratio > 0.0 && ratio <= 1.0) {
            err(
                "parallel.compression_ratio",
                format!("compression_ratio is the share of each gradient tensor top-k sends: above 0, at most 1 (it is {ratio})"),
            );
        }
        in_range(err, "parallel.compression_rank", p.compression_rank, 1, 64, "compression_rank");
        let method = p.grad_compression;
        if method == GradCompression::None {
            return;
        }
        let name = method.as_str();
        let mut refuse = |field: &str, why: String| err(field, format!("grad_compression={name}: {why}"));
        if p.dp < 2 {
            refuse(
                "parallel.grad_compression",
                format!("compresses what DDP's ranks exchange; it needs dp >= 2 (it is {})", p.dp),
            );
        }
        if p.sharding != Sharding::None {
            refuse(
                "parallel.grad_compression",
                format!(
                    "compresses DDP's gradient all-reduce; sharding={} sums the gradients another way",
                    p.sharding.as_str()
                ),
            );
        }
        if p.allreduce != AllReduce::Ring {
            refuse(
                "parallel.grad_compression",
                format!("replaces the all-reduce itself; leave allreduce=ring (it is {})", p.allreduce.as_str()),
            );
        }
        if p.comm_dtype != Precision::Fp32 {
            refuse(
                "parallel.comm_dtype",
                "the compressed messages cross the wire as they are: use comm_dtype=fp32".into(),
            );
        }
        if self.train.loss_scaling == LossScaling::Dynamic {
            refuse(
                "train.loss_scaling",
                "the error-feedback residual would mix gradients scaled by different loss scales: use bf16, or fp32"
                    .into(),
            );
        }
        if self.demo.is_some() {
            refuse("demo", "the collective demos exchange plain vectors, not gradients".into());
        }
    }
}

/// The most experts a block may have.
pub const MAX_EXPERTS: usize = 64;

/// The widest MLP a Llama spec may ask for, in multiples of d_model.
pub const MAX_FFN_RATIO: usize = 16;

fn world_tokens(spec: &ExperimentSpec) -> u128 {
    [
        spec.parallel.data_replicas(),
        spec.train.micro_batch,
        spec.train.micro_batches,
        spec.train.grad_accum,
        spec.model.seq_len,
    ]
    .iter()
    .fold(1u128, |product, &x| product.saturating_mul(x as u128))
}

fn in_range(err: &mut impl FnMut(&str, String), field: &str, value: usize, min: usize, max: usize, name: &str) {
    if value < min || value > max {
        err(field, format!("{name} must be between {min} and {max} (it is {value})"));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    /// Applies a JSON patch (objects merged) to the default spec, then validates it.
    fn errors_for(patch: serde_json::Value) -> Vec<FieldError> {
        let mut value = serde_json::to_value(ExperimentSpec::default()).unwrap();
        merge(&mut value, patch);
        let spec = ExperimentSpec::from_json_value(value).expect("patch keeps the JSON shape");
        spec.validate(&Limits::default()).err().unwrap_or_default()
    }

    fn merge(a: &mut serde_json::Value, b: serde_json::Value) {
        match (a, b) {
            (serde_json::Value::Object(a), serde_json::Value::Object(b)) => {
                for (k, v) in b {
                    merge(a.entry(k).or_insert(serde_json::Value::Null), v);
                }
            }
            (a, b) => *a = b,
        }
    }

    #[test]
    fn only_a_spec_that_passes_becomes_a_valid_spec() {
        let valid = ExperimentSpec::default().validated(&Limits::default()).unwrap();
        assert_eq!(*valid, ExperimentSpec::default());
        // It travels as the plain spec (the launcher writes it for the rank processes).
        assert_eq!(serde_json::to_value(&valid).unwrap(), serde_json::to_value(ExperimentSpec::default()).unwrap());
        let mut bad = ExperimentSpec::default();
        bad.parallel.tp = 3;
        let errors = bad.validated(&Limits::default()).unwrap_err();
        assert!(errors.iter().any(|e| e.field == "parallel.tp"), "{errors:?}");
    }

    #[test]
    fn default_spec_is_valid() {
        assert_eq!(ExperimentSpec::default().validate(&Limits::default()), Ok(()));
    }

    #[test]
    fn table_of_bad_specs() {
        let table: Vec<(serde_json::Value, Vec<(&str, &str)>)> = vec![
            (json!({"name": "  "}), vec![("name", "give the experiment a name")]),
            (json!({"model": {"heads": 3}}), vec![("model.heads", "heads=3 does not divide d_model=64")]),
            // A head count near u64's limit is refused, not multiplied into the parameter count.
            (
                json!({"model": {"heads": 13151339464960996582u64}}),
                vec![
                    ("model.heads", "heads must be between 1 and 64 (it is 13151339464960996582)"),
                    ("model.heads", "heads=13151339464960996582 does not divide d_model=64"),
                ],
            ),
            (json!({"model": {"layers": 0}}), vec![("model.layers", "layers must be between 1 and 32 (it is 0)")]),
            (json!({"model": {"vocab": 1}}), vec![("model.vocab", "vocab must be between 2 and 65536 (it is 1)")]),
            (json!({"model": {"seq_len": 5000}}), vec![("model.seq_len", "seq_len must be between 1 and 1024")]),
            (json!({"data": {"dataset": "text"}}), vec![("model.vocab", "at least 256")]),
            (json!({"data": {"tokenizer": "bpe"}}), vec![("data.tokenizer", "it needs dataset=text or upload")]),
            (
                json!({"data": {"dataset": "text", "tokenizer": "bpe"}, "model": {"vocab": 256}}),
                vec![("model.vocab", "vocab must be at least 257 (it is 256)")],
            ),
            (
                json!({"parallel": {"tp": 3}}),
                vec![
                    ("parallel.tp", "tp=3 does not divide heads=4"),
                    ("parallel.tp", "tp=3 does not divide the MLP width d_ff=256"),
                ],
            ),
            (json!({"parallel": {"pp": 3}}), vec![("parallel.pp", "pp=3 is more than layers=2")]),
            (
                json!({"model": {"kv_heads": 2, "ffn_hidden": 172, "tie_embeddings": true, "rope_theta": 5e5}}),
                vec![
                    ("model.kv_heads", "kv_heads=2 must be 0 or heads=4"),
                    ("model.ffn_hidden", "ffn_hidden=172 must be 0 or 256"),
                    ("model.rope_theta", "rope_theta is for family=llama"),
                    ("model.tie_embeddings", "tie_embeddings must be false"),
                ],
            ),
            (
                json!({"model": {"family": "llama", "kv_heads": 3, "ffn_hidden": 5000, "rope_theta": 0.5}}),
                vec![
                    ("model.kv_heads", "kv_heads=3 does not divide heads=4"),
                    ("model.ffn_hidden", "ffn_hidden=5000 is more than 16 x d_model = 1024"),
                    ("model.rope_theta", "rope_theta must be above 1"),
                ],
            ),
            (
                json!({"model": {"family": "llama", "heads": 64, "experts": 2}}),
                vec![("model.heads", "the head width d_model/heads = 1 must be even")],
            ),
            (
                json!({"model": {"family": "llama", "kv_heads": 1}, "parallel": {"tp": 2}}),
                vec![("parallel.tp", "tp=2 does not divide kv_heads=1: each tensor-parallel rank takes whole K/V")],
            ),
            (
                json!({"train": {"checkpointing": "every"}, "parallel": {"dp": 2, "pp_schedule": "zb-h1", "sharding": "fsdp"}}),
                vec![
                    ("parallel.pp_schedule", "zb-h1: fills a pipeline's bubbles; it needs pp >= 2"),
                    ("train.checkpointing", "use checkpointing=none"),
                ],
            ),
            (
                json!({"model": {"layers": 6}, "parallel": {"dp": 2, "pp": 2, "pp_schedule": "zbv", "sharding": "zero2"}, "train": {"micro_batches": 2}}),
                vec![
                    ("parallel.pp_schedule", "zbv cuts the layers into 2 * pp = 4 equal chunks"),
                    ("train.micro_batches", "zbv fills its V with 2 * pp - 1 = 3 micro-batches"),
                ],
            ),
            (
                json!({"model": {"layers": 8}, "parallel": {"pp": 2, "pp_schedule": "dualpipev"}, "train": {"micro_batches": 3}}),
                vec![("train.micro_batches", "dualpipev fills its V with 2 * pp = 4 micro-batches: micro_batches * grad_accum = 3")],
            ),
            (
                json!({"parallel": {"sync": "diloco", "sharding": "zero1", "outer_steps_every": 0, "outer_momentum": 1.0}, "train": {"precision": "bf16"}}),
                vec![
                    ("parallel.sharding", "sharding=zero1 splits state across data-parallel ranks"),
                    ("parallel.dp", "sync=diloco: it averages the replicas' changes: use dp of 2 or more"),
                    ("parallel.sharding", "sync=diloco: each replica steps alone"),
                    ("train.precision", "sync=diloco: the outer step would have to reset"),
                    ("parallel.outer_steps_every", "outer_steps_every (H) must be from 1 to 10000 (it is 0)"),
                    ("parallel.outer_momentum", "outer_momentum must be from 0 to below 1 (it is 1)"),
                ],
            ),
            (
                json!({"parallel": {"sync": "async_ps", "dp": 2, "comm_dtype": "fp16"}, "train": {"optimizer": "lamb", "precision": "fp16", "checkpoint_every": 2}}),
                vec![
                    ("parallel.comm_dtype", "sync=async_ps: gradients and parameters cross the wire in fp32"),
                    ("train.optimizer", "sync=async_ps: the server applies AdamW or SGD to each gradient as it comes"),
                    ("train.precision", "sync=async_ps: each worker would scale its loss by a dynamic scale of its own"),
                    ("train.checkpoint_every", "sync=async_ps: checkpoints do not keep the server's parameters"),
                ],
            ),
            (
                json!({"parallel": {"sync": "async_ps", "sharding": "zero2", "tp": 2}}),
                vec![
                    ("parallel.tp", "sync=async_ps: one server keeps the whole model, so a worker is one rank with all of it: use tp=1 (it is 2)"),
                    ("parallel.sharding", "sharding=zero2 splits state across data-parallel ranks"),
                    ("parallel.dp", "sync=async_ps: workers push to a parameter server on rank 0: use dp of 2 or more (it is 1)"),
                    ("parallel.sharding", "sync=async_ps: every worker holds the whole model"),
                ],
            ),
            (
                json!({"parallel": {"fault_tolerance": "replicas"}}),
                vec![("parallel.dp", "fault_tolerance=replicas: the replicas go on without the one that dies: use dp of 2 or more (it is 1)")],
            ),
            (
                json!({"parallel": {"fault_tolerance": "replicas", "dp": 2, "tp": 2}, "train": {"precision": "fp16", "loss_scaling": "dynamic", "checkpoint_every": 5}}),
                vec![
                    ("parallel.tp", "fault_tolerance=replicas: a replica is one rank that can die alone"),
                    ("train.precision", "fault_tolerance=replicas: the dynamic loss scale is not copied"),
                    ("train.checkpoint_every", "fault_tolerance=replicas: the live replicas are the replacement's checkpoint"),
                ],
            ),
            (
                json!({"parallel": {"fault_drill": {"rank": 2, "after_step": 99}}}),
                vec![
                    ("parallel.fault_drill", "without fault_tolerance=replicas the run would just fail"),
                    ("parallel.fault_drill.rank", "rank must be below 1 (it is 2)"),
                    ("parallel.fault_drill.after_step", "after_step must be at most steps - 2 = 98 (it is 99)"),
                ],
            ),
            (
                json!({"model": {"experts": 65, "expert_top_k": 0}}),
                vec![("model.experts", "experts must be at most 64"), ("model.expert_top_k", "between 1 and 64")],
            ),
            (
                json!({"model": {"experts": 4, "expert_top_k": 5, "capacity_factor": 0.0, "aux_loss_coef": -1.0}}),
                vec![
                    ("model.expert_top_k", "expert_top_k must be between 1 and 4 (it is 5)"),
                    ("model.capacity_factor", "above 0, at most 64 (it is 0)"),
                    ("model.aux_loss_coef", "from 0 to 10 (it is -1)"),
                ],
            ),
            (
                json!({"model": {"experts": 4}, "parallel": {"tp": 2, "pp": 2, "pp_schedule": "zb-h1"}}),
                vec![
                    ("parallel.tp", "experts=4: the experts are not split across tensor-parallel ranks"),
                    ("parallel.pp_schedule", "experts=4: zb-h1's W is not written for the experts"),
                ],
            ),
            (
                json!({"parallel": {"dp": 2, "ep": 2}}),
                vec![("parallel.ep", "ep=2: expert parallelism spreads the experts; a dense model")],
            ),
            (
                json!({"parallel": {"dp": 2, "cp": 3}}),
                vec![
                    ("parallel.cp", "cp=3: the ranks that share a sequence are cp consecutive ranks of the data-parallel group: cp must divide dp=2"),
                    ("parallel.cp", "cp=3: each rank holds seq_len/cp tokens: cp must divide seq_len=32"),
                    ("parallel.cp", "cp=3: ulysses gives each rank heads/cp of its 4 query and 4 key/value heads"),
                ],
            ),
            (
                json!({"model": {"experts": 4}, "parallel": {"dp": 2, "cp": 2},
                       "train": {"resume_from": {"experiment": 1, "step": 5}}}),
                vec![
                    ("model.experts", "cp=2: the experts' all-to-alls run over the data-parallel group"),
                    ("train.resume_from", "cp=2: an elastic resume re-cuts the data-parallel group"),
                ],
            ),
            (json!({"parallel": {"cp": 0}}), vec![("parallel.cp", "cp must be between 1 and 64 (it is 0)")]),
            (
                json!({"model": {"seq_len": 20},
                       "parallel": {"dp": 4, "cp": 4, "cp_kind": "ring", "sharding": "fsdp", "prefetch": true}}),
                vec![
                    ("parallel.prefetch", "cp=4: FSDP's prefetch gathers on a thread of its own"),
                    ("parallel.cp_kind", "cp=4: ring splits each sequence in 2cp = 8 chunks"),
                    ("train.attention", "cp=4: ring attends block by block and keeps one log-sum-exp per row"),
                ],
            ),
            (
                json!({"model": {"experts": 6}, "parallel": {"dp": 2, "ep": 4, "sharding": "zero1"},
                       "train": {"resume_from": {"experiment": 1, "step": 5}}}),
                vec![
                    ("parallel.ep", "ep=4: every rank takes experts/ep experts: ep must divide experts=6"),
                    (
                        "parallel.ep",
                        "ep=4: the experts are spread over ep ranks of the data-parallel group: ep must divide dp=2",
                    ),
                    ("parallel.sharding", "ep=4: sharding=zero1 cuts every unit"),
                    ("train.resume_from", "ep=4: an elastic resume re-cuts a checkpoint"),
                ],
            ),
            (
                json!({"parallel": {"virtual_stages": 2}}),
                vec![("parallel.virtual_stages", "virtual_stages=2 is for pp_schedule=interleaved")],
            ),
            (
                json!({"parallel": {"pp_schedule": "interleaved", "virtual_stages": 1}}),
                vec![("parallel.pp_schedule", "needs a pipeline: pp >= 2"), ("parallel.virtual_stages", ">= 2 chunks")],
            ),
            (
                json!({"model": {"layers": 6}, "train": {"micro_batches": 3},
                       "parallel": {"pp": 2, "pp_schedule": "interleaved", "virtual_stages": 2}}),
                vec![
                    ("parallel.virtual_stages", "layers=6 must be a multiple of 4"),
                    ("train.micro_batches", "micro_batches * grad_accum = 3 must be a multiple of it"),
                ],
            ),
            (json!({"parallel": {"dp": 0}}), vec![("parallel.dp", "dp must be between 1 and 8 (it is 0)")]),
            (
                json!({"parallel": {"dp": 6, "sharding": "hsdp", "shard_group": 4}}),
                vec![("parallel.shard_group", "sharding=hsdp: the shard group (shard_group, or ranks_per_node when it is 0) must divide dp")],
            ),
            (
                json!({"parallel": {"dp": 4, "sharding": "hsdp", "ranks_per_node": 4}}),
                vec![("parallel.shard_group", "it is 4 for dp=4 (one group of dp is sharding=fsdp)")],
            ),
            (
                json!({"parallel": {"dp": 4, "sharding": "fsdp", "shard_group": 2}}),
                vec![("parallel.shard_group", "shard_group is hybrid sharding's")],
            ),
            (json!({"parallel": {"dp": 4, "tp": 4}}), vec![("parallel", "world size dp*tp*pp = 4*4*1 = 16")]),
            (json!({"parallel": {"sharding": "zero2"}}), vec![("parallel.sharding", "needs dp >= 2")]),
            (json!({"parallel": {"bucket_bytes": 10}}), vec![("parallel.bucket_bytes", "between 1 KiB")]),
            (
                json!({"parallel": {"dp": 2, "sharding": "zero2", "prefetch": true}}),
                vec![("parallel.prefetch", "only sharding=fsdp")],
            ),
            (
                json!({"parallel": {"offload": "disk"}, "train": {"optimizer": "sgd"}}),
                vec![("parallel.offload", "sgd in fp32 keeps none")],
            ),
            (
                json!({"parallel": {"offload": "host"}, "train": {"optimizer": "lars"}}),
                vec![("parallel.offload", "lars in fp32 keeps none")],
            ),
            (
                json!({"parallel": {"tp": 2}, "train": {"optimizer": "lamb"}}),
                vec![("parallel.tp", "optimizer=lamb scales each tensor's step by its own norms, and tensor parallelism")],
            ),
            (
                json!({"parallel": {"allreduce": "tree", "comm_dtype": "bf16"}, "train": {"precision": "bf16"}}),
                vec![("parallel.allreduce", "runs on the ring only")],
            ),
            (json!({"parallel": {"ranks_per_node": 0}}), vec![("parallel.ranks_per_node", "between 1 and 8")]),
            (
                json!({"parallel": {"grad_compression": "topk", "compression_ratio": 0.0}}),
                vec![
                    ("parallel.compression_ratio", "above 0, at most 1 (it is 0)"),
                    ("parallel.grad_compression", "needs dp >= 2 (it is 1)"),
                ],
            ),
            (
                json!({"parallel": {"dp": 2, "grad_compression": "powersgd", "compression_rank": 0, "sharding": "zero1"}}),
                vec![
                    ("parallel.compression_rank", "between 1 and 64 (it is 0)"),
                    (
                        "parallel.grad_compression",
                        "grad_compression=powersgd: compresses DDP's gradient all-reduce; sharding=zero1",
                    ),
                ],
            ),
            (
                json!({"train": {"steps": 10, "resume_from": {"experiment": 3, "step": 10}}}),
                vec![("train.resume_from", "between 1 and steps-1 = 9 (it is 10)")],
            ),
            (
                json!({"parallel": {"sequence_parallel": true}}),
                vec![("parallel.sequence_parallel", "it needs tp >= 2 (it is 1)")],
            ),
            (
                json!({"parallel": {"tp": 2, "sequence_parallel": true}, "model": {"seq_len": 7}, "train": {"micro_batch": 1}}),
                vec![("parallel.sequence_parallel", "= 7 tokens: make it a multiple of tp")],
            ),
            (
                json!({"train": {"steps": 0, "warmup_steps": 0}}),
                vec![("train.steps", "steps must be between 1 and 20000")],
            ),
            (json!({"train": {"lr": -1.0}}), vec![("train.lr", "above 0")]),
            (json!({"train": {"lr": 0.0}}), vec![("train.lr", "above 0")]),
            (
                json!({"train": {"micro_batch": 0}}),
                vec![("train.micro_batch", "micro_batch must be between 1 and 256")],
            ),
            (json!({"train": {"warmup_steps": 500}}), vec![("train.warmup_steps", "longer than the run")]),
            (json!({"train": {"loss_scaling": "dynamic"}}), vec![("train.loss_scaling", "for fp16")]),
            (
                json!({"train": {"fp8": "delayed", "precision": "fp16", "checkpoint_every": 5}, "parallel": {"tp": 2}}),
                vec![("train.precision", "fp16's range cannot hold"), ("parallel.tp", "use tp=1 (it is 2)")],
            ),
            (
                json!({"parallel": {"fp8_all_gather": true, "dp": 1}}),
                vec![
                    ("train.fp8", "set fp8=delayed or current"),
                    ("parallel.sharding", "use sharding=fsdp (it is none)"),
                    ("parallel.dp", "gathers nothing"),
                ],
            ),
            (
                json!({"train": {"fp8": "current", "precision": "bf16"},
                       "parallel": {"fp8_all_gather": true, "dp": 2, "sharding": "fsdp", "prefetch": true}}),
                vec![("parallel.prefetch", "fp8_all_gather: the prefetch thread")],
            ),
            (
                json!({"train": {"activation_offload": "disk", "checkpointing": "sqrt"}}),
                vec![("train.checkpointing", "use one or the other")],
            ),
            (
                json!({"train": {"activation_offload": "disk"}, "parallel": {"pp": 2, "pp_schedule": "zb-h1"}}),
                vec![("train.activation_offload", "offload brings them back once")],
            ),
            (
                json!({"train": {"checkpointing": "selective", "attention": "flash"}}),
                vec![("train.checkpointing", "which flash attention already does")],
            ),
            (json!({"train": {"grad_clip": -1.0}}), vec![("train.grad_clip", "positive")]),
            (json!({"demo": {"elements": 0}}), vec![("demo.elements", "between 1 and 4096")]),
            (json!({"demo": {"op": "all_reduce"}, "parallel": {"tp": 2}}), vec![("demo", "tp=1 and pp=1")]),
            (
                json!({"model": {"d_model": 1024, "layers": 32, "vocab": 65536}}),
                vec![("model", "parameters; this server allows at most")],
            ),
            // Several problems at once: all of them are reported.
            (
                json!({"model": {"heads": 5}, "parallel": {"tp": 2}, "train": {"steps": 0, "warmup_steps": 0}}),
                vec![
                    ("model.heads", "heads=5"),
                    ("parallel.tp", "tp=2 does not divide heads=5"),
                    ("train.steps", "between 1"),
                ],
            ),
        ];
        for (patch, expected) in table {
            let errs = errors_for(patch.clone());
            assert_eq!(errs.len(), expected.len(), "patch {patch}: got {errs:?}");
            for (field, needle) in expected {
                assert!(
                    errs.iter().any(|e| e.field == field && e.message.contains(needle)),
                    "patch {patch}: expected {field} ~ {needle:?}, got {errs:?}"
                );
            }
        }
    }

    #[test]
    fn nan_lr_is_rejected() {
        let mut spec = ExperimentSpec::default();
        spec.train.lr = f64::NAN;
        let errs = spec.validate(&Limits::default()).unwrap_err();
        assert_eq!(errs[0].field, "train.lr");
    }
}
