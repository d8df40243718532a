//! Ready-made experiments for the "new experiment" form and the demos.

use crate::spec::*;

pub struct Preset {
    pub key: &'static str,
    pub title: &'static str,
    pub description: &'static str,
    pub spec: ExperimentSpec,
}

pub fn presets() -> Vec<Preset> {
    let tiny = ExperimentSpec::default();

    let mut reference = ExperimentSpec { name: "reference-gpt".into(), ..ExperimentSpec::default() };
    reference.model = ModelSpec::dense(4, 256, 4, 128, 256);
    reference.train.micro_batch = 16;
    reference.train.steps = 30;
    reference.train.lr = 1e-3;

    let mut text = ExperimentSpec { name: "shakespeare-bytes".into(), ..ExperimentSpec::default() };
    text.data.dataset = Dataset::Text;
    text.model = ModelSpec::dense(2, 128, 4, 64, 256);
    text.train.steps = 200;
    text.train.micro_batch = 16;

    // The Shakespeare preset's size in Llama blocks: 4 query heads on 2 K/V heads, a SwiGLU
    // of 8/3 x d_model (344, a multiple of 8), rotary positions; its text cut by a BPE of
    // 512 tokens (about 2 bytes each).
    let mut llama = ExperimentSpec { name: "shakespeare-llama".into(), ..text.clone() };
    llama.model = ModelSpec::llama(2, 128, 4, 2, 344, 64, 512);
    llama.data.tokenizer = TokenizerKind::Bpe;

    let mut ddp = ExperimentSpec { name: "ddp-2-ranks".into(), ..ExperimentSpec::default() };
    ddp.parallel.dp = 2;
    ddp.train.micro_batch = 4;

    let mut ring = ExperimentSpec { name: "all-reduce-demo".into(), ..ExperimentSpec::default() };
    ring.parallel.dp = 4;
    ring.demo = Some(CollectiveDemo { op: DemoOp::AllReduce, elements: 16 });

    // The same 16 numbers over 8 ranks by a binary tree, and by rings inside and across
    // two "nodes" of 4 ranks.
    let mut tree = ring.clone();
    tree.name = "tree-all-reduce-demo".into();
    tree.parallel.dp = 8;
    tree.parallel.allreduce = AllReduce::Tree;
    let mut hierarchical = tree.clone();
    hierarchical.name = "hierarchical-all-reduce-demo".into();
    hierarchical.parallel.allreduce = AllReduce::Hierarchical;
    hierarchical.parallel.ranks_per_node = 4;

    // Two replicas that meet every 8 steps: 12 outer steps.
    let mut diloco = ExperimentSpec { name: "diloco-2-replicas".into(), ..ddp.clone() };
    diloco.train.steps = 96;
    diloco.parallel.sync = DataSync::Diloco;
    (diloco.parallel.outer_steps_every, diloco.parallel.outer_lr, diloco.parallel.outer_momentum) = (8, 0.7, 0.9);

    // Four workers pushing to a parameter server on rank 0, none waiting for another.
    let mut async_ps = ExperimentSpec { name: "async-ps-4-workers".into(), ..ExperimentSpec::default() };
    (async_ps.parallel.dp, async_ps.parallel.sync) = (4, DataSync::AsyncPs);
    async_ps.train.micro_batch = 2;

    // Four fault-tolerant replicas; a drill kills rank 2's process after step 5.
    let mut lost_replica = ExperimentSpec { name: "lost-replica-drill".into(), ..ExperimentSpec::default() };
    (lost_replica.parallel.dp, lost_replica.parallel.fault_tolerance) = (4, FaultTolerance::Replicas);
    lost_replica.parallel.fault_drill = Some(FaultDrill { rank: 2, after_step: 5 });
    lost_replica.train.micro_batch = 2;

    // FSDP in 2 groups of 2 (ranks_per_node 2: two "hosts"), replicas across them.
    let mut hsdp = ExperimentSpec { name: "hsdp-2-groups-of-2".into(), ..ExperimentSpec::default() };
    (hsdp.parallel.dp, hsdp.parallel.sharding, hsdp.parallel.ranks_per_node) = (4, Sharding::Hsdp, 2);
    hsdp.train.micro_batch = 2;

    // The ddp2 preset's batch 8-fold (2 x 32 sequences) and its learning rate 8-fold
    // (the linear scaling rule: 3e-3 x 8), under LAMB.
    let mut lamb = ExperimentSpec { name: "lamb-batch-8x".into(), ..ddp.clone() };
    lamb.train.steps = 96;
    (lamb.train.micro_batch, lamb.train.lr, lamb.train.optimizer) = (32, 0.024, Optimizer::Lamb);

    let mut topk = ddp.clone();
    topk.name = "ddp-2-ranks-top-k-1pct".into();
    topk.parallel.grad_compression = GradCompression::Topk;
    topk.parallel.compression_ratio = 0.01;

    let mut pipeline = ExperimentSpec { name: "pipeline-1f1b".into(), ..ExperimentSpec::default() };
    pipeline.model = ModelSpec::dense(4, 64, 4, 32, 64);
    pipeline.parallel.pp = 4;
    pipeline.parallel.pp_schedule = PpSchedule::OneFOneB;
    pipeline.train.micro_batch = 2;
    pipeline.train.micro_batches = 8;
    pipeline.train.steps = 10;
    pipeline.train.warmup_steps = 2;

    // Two blocks per stage, one in each of the V's chunks.
    let mut zbv = ExperimentSpec { name: "pipeline-zbv".into(), ..pipeline.clone() };
    zbv.model = ModelSpec::dense(8, 64, 4, 32, 64);
    zbv.parallel.pp_schedule = PpSchedule::Zbv;
    let dualpipev = ExperimentSpec {
        name: "pipeline-dualpipev".into(),
        parallel: ParallelSpec { pp_schedule: PpSchedule::DualPipeV, ..zbv.parallel.clone() },
        ..zbv.clone()
    };

    let mut megatron = ExperimentSpec { name: "megatron-tp2".into(), ..ExperimentSpec::default() };
    megatron.model = ModelSpec::dense(2, 128, 4, 64, 64);
    megatron.parallel.tp = 2;
    megatron.train.micro_batch = 8;
    megatron.train.steps = 20;

    let mut three_d = ExperimentSpec { name: "3d-dp2-tp2-pp2".into(), ..ExperimentSpec::default() };
    three_d.model = ModelSpec::dense(4, 64, 4, 32, 64);
    three_d.parallel = ParallelSpec { dp: 2, tp: 2, pp: 2, ..ParallelSpec::default() };
    three_d.train.micro_batch = 2;
    three_d.train.micro_batches = 4;
    three_d.train.steps = 10;
    three_d.train.warmup_steps = 2;

    let mut fsdp = ddp.clone();
    fsdp.name = "fsdp-4-ranks".into();
    fsdp.parallel.dp = 4;
    fsdp.parallel.sharding = Sharding::Fsdp;
    fsdp.train.micro_batch = 2;

    // ZeRO-1 and ZeRO-2 in bf16: the fp32 master copy is where the texts' two ways of
    // counting their model state differ (sharded with the moments, or kept whole).
    let mut zero1 = fsdp.clone();
    zero1.name = "zero1-4-ranks-bf16".into();
    zero1.parallel.sharding = Sharding::Zero1;
    zero1.train.precision = Precision::Bf16;
    let mut zero2 = zero1.clone();
    zero2.name = "zero2-4-ranks-bf16".into();
    zero2.parallel.sharding = Sharding::Zero2;

    let mut offload = reference.clone();
    offload.name = "reference-optimizer-on-disk".into();
    offload.parallel.offload = Offload::Disk;

    let mut recompute = ExperimentSpec { name: "checkpointing-every".into(), ..ExperimentSpec::default() };
    recompute.model = ModelSpec::dense(4, 128, 4, 128, 64);
    recompute.train.micro_batch = 8;
    recompute.train.steps = 20;
    recompute.train.checkpointing = Checkpointing::Every;

    // Mixed precision: a step of 32768 tokens (64 sequences of 64, 8 accumulation steps)
    // weights each token's loss by 1/32768, and with 4096 tokens in the vocabulary the
    // logit gradient of an unlikely token, p / 32768 ~ 1e-8, is below fp16's smallest
    // subnormal (6e-8): without loss scaling most of those gradients are stored as 0.
    let mut fp16_plain = ExperimentSpec { name: "fp16-no-loss-scaling".into(), ..ExperimentSpec::default() };
    fp16_plain.model = ModelSpec::dense(1, 32, 2, 64, 4096);
    fp16_plain.train.micro_batch = 64;
    fp16_plain.train.grad_accum = 8;
    fp16_plain.train.steps = 20;
    fp16_plain.train.warmup_steps = 0;
    fp16_plain.train.lr = 3e-3;
    fp16_plain.train.precision = Precision::Fp16;
    let mut fp16_scaled = fp16_plain.clone();
    fp16_scaled.name = "fp16-dynamic-loss-scaling".into();
    fp16_scaled.train.loss_scaling = LossScaling::Dynamic;
    let mut bf16 = fp16_plain.clone();
    bf16.name = "bf16".into();
    bf16.train.precision = Precision::Bf16;

    // Long sequences for a small model: the T x T attention scores outweigh the rest.
    let mut flash = ExperimentSpec { name: "flash-attention".into(), ..ExperimentSpec::default() };
    flash.model = ModelSpec::dense(2, 64, 4, 512, 64);
    flash.train.micro_batch = 2;
    flash.train.steps = 10;
    flash.train.attention = Attention::Flash;

    // The flash preset's shape, 6 blocks deep, with naive attention: selective recompute
    // drops the T x T probabilities every block keeps and makes them again in its backward
    // (one block's held at a time).
    // Long sequences (T = 512) split over cp = 2 ranks by Ulysses' all-to-alls: each rank
    // keeps half the tokens and, in attention, half the heads' T x T probabilities.
    let mut ulysses = ExperimentSpec { name: "ulysses-context-parallel".into(), ..ExperimentSpec::default() };
    ulysses.model = ModelSpec::dense(4, 64, 4, 512, 64);
    (ulysses.parallel.dp, ulysses.parallel.cp) = (2, 2);
    ulysses.train.micro_batch = 2;
    ulysses.train.steps = 10;
    // The same on the ring: keys and values passed round, each rank's queries on their
    // positions (two balanced chunks of 128 each), flash attention's log-sum-exps.
    let mut ring_attention = ExperimentSpec { name: "ring-attention".into(), ..ulysses.clone() };
    (ring_attention.parallel.cp_kind, ring_attention.train.attention) = (ContextParallel::Ring, Attention::Flash);
    let mut selective = ExperimentSpec { name: "selective-recompute".into(), ..ExperimentSpec::default() };
    selective.model = ModelSpec::dense(6, 64, 4, 512, 64);
    selective.train.micro_batch = 2;
    selective.train.steps = 10;
    selective.train.checkpointing = Checkpointing::Selective;
    // bf16 storage, the blocks' products in FP8 with delayed scaling.
    let mut fp8 = ExperimentSpec { name: "fp8-delayed-scaling".into(), ..ExperimentSpec::default() };
    fp8.model = ModelSpec::dense(2, 128, 4, 64, 256);
    fp8.train.micro_batch = 8;
    fp8.train.steps = 40;
    (fp8.train.precision, fp8.train.fp8) = (Precision::Bf16, Fp8Recipe::Delayed);

    let mut fp8_all_gather = ExperimentSpec { name: "fsdp-fp8-all-gather".into(), ..fp8.clone() };
    fp8_all_gather.model = ModelSpec::dense(4, 128, 4, 64, 256);
    fp8_all_gather.train.steps = 10;
    (fp8_all_gather.parallel.dp, fp8_all_gather.parallel.sharding) = (2, Sharding::Fsdp);
    (fp8_all_gather.parallel.comm_dtype, fp8_all_gather.parallel.fp8_all_gather) = (Precision::Bf16, true);

    // Deep enough that most of the activations are blocks' (the head's and each block's
    // output stay on the device).
    let mut offload_activations = ExperimentSpec { name: "activations-on-disk".into(), ..ExperimentSpec::default() };
    offload_activations.model = ModelSpec::dense(8, 64, 4, 256, 64);
    offload_activations.train.micro_batch = 4;
    offload_activations.train.steps = 10;
    offload_activations.train.activation_offload = Offload::Disk;

    let mut experts = ExperimentSpec { name: "moe-4-experts-ep2".into(), ..ExperimentSpec::default() };
    experts.model =
        ModelSpec { experts: 4, expert_top_k: 2, capacity_factor: 1.25, ..ModelSpec::dense(2, 64, 4, 32, 64) };
    experts.parallel.dp = 2;
    experts.parallel.ep = 2;
    experts.train.micro_batch = 4;
    experts.train.steps = 50;

    vec![
        Preset {
            key: "tiny",
            title: "Tiny GPT on a Markov chain",
            description: "2 layers, d_model 64: trains in seconds; the loss falls from ln(vocab) towards the chain's entropy rate.",
            spec: tiny,
        },
        Preset {
            key: "reference",
            title: "Reference config (benchmark shape)",
            description: "4 layers, d_model 256, 4 heads, seq 128, vocab 256, batch 16: the shape the PyTorch comparison uses.",
            spec: reference,
        },
        Preset {
            key: "text",
            title: "Shakespeare, byte level",
            description: "A small public-domain English text, one token per byte.",
            spec: text,
        },
        Preset {
            key: "llama",
            title: "A small Llama on Shakespeare",
            description: "The Shakespeare preset in Llama blocks: RMSNorm, rotary position embeddings instead of a learned table, 4 query heads sharing 2 key/value heads (grouped-query attention), a SwiGLU MLP and no biases; the text cut by a byte-level BPE of 512 tokens learned from it (about 2 bytes a token, so the 64 tokens of a sequence hold twice the text). Compare it with the byte-level preset by the validation loss per byte the result shows; resubmit it with family gpt2 to compare the blocks.",
            spec: llama,
        },
        Preset {
            key: "ddp2",
            title: "DDP on 2 ranks",
            description: "Same global batch as the tiny preset, split across two data-parallel ranks.",
            spec: ddp,
        },
        Preset {
            key: "allreduce",
            title: "All-reduce demo (4 ranks, 16 numbers)",
            description: "No training: 4 rank processes all-reduce a 16-element vector over the ring. Rank r starts with (r+1)*100 + i, so every chunk of the replay can be checked by hand.",
            spec: ring,
        },
        Preset {
            key: "allreduce-tree",
            title: "Tree all-reduce demo (8 ranks, 16 numbers)",
            description: "The all-reduce demo's numbers over 8 ranks by a binary tree rooted at rank 0: partial sums climb it in log2 8 = 3 steps and the result comes down in 3 more, where a ring takes 2(W-1) = 14; but whole buffers travel each edge, so rank 0 sends 3 x D where a ring rank sends 2(W-1)/W x D.",
            spec: tree,
        },
        Preset {
            key: "allreduce-hierarchical",
            title: "Hierarchical all-reduce demo (2 nodes of 4 ranks)",
            description: "The same numbers over 8 ranks counted as 2 nodes of 4: a ring inside each node, a ring across the 2 nodes' first ranks (the only traffic between nodes), then each leader sends the result to its node. The replay marks the steps that cross between nodes.",
            spec: hierarchical,
        },
        Preset {
            key: "pipeline",
            title: "GPipe vs 1F1B (4 stages, 8 micro-batches)",
            description: "4 layers cut into 4 pipeline stages, one rank each, 8 micro-batches per step, 1F1B schedule. Resubmit it with pp_schedule \"gpipe\" and compare the two on the pipeline page: same bubble formula (P-1)/(M+P-1), different activation memory.",
            spec: pipeline,
        },
        Preset {
            key: "zbv",
            title: "Zero-bubble V (4 stages, 8 micro-batches)",
            description: "8 blocks cut into 8 chunks laid out in a V over 4 stages: stage s runs chunk s on the way down and chunk 7-s on the way back, so stage 0 holds the embeddings and the head and stage 3 hands its first chunk's output to its own second. Each backward is split into B and W as in ZB-H1. Resubmit it with pp_schedule \"zb-h1\" and compare the pipeline pages: the same blocks, the replayed bubble about half, the activation peaks of each stage the planner's.",
            spec: zbv,
        },
        Preset {
            key: "dualpipev",
            title: "DualPipeV (4 stages, 8 micro-batches)",
            description: "The zbv preset's V (8 blocks in 8 chunks over 4 stages) run in DeepSeek's DualPipeV order: forwards down to fill the V, then each forward paired with another micro-batch's backward, the backward whole in the steady state and split into B and W only at the ends. Resubmit it with pp_schedule \"zbv\" and compare the pipeline pages and memory: run one pass after the other, the pairs idle about as ZBV does, under DeepSeek's (P-1)(F&B+B-3W); every stage holds one chunk's activations more (2P+1 against 2P) but fewer Bs waiting for their W, so the stages' peaks are even where ZBV's last stage peaks highest, as the planner says.",
            spec: dualpipev,
        },
        Preset {
            key: "diloco",
            title: "DiLoCo: 2 replicas meeting every 8 steps",
            description: "The ddp2 preset's replicas each take 8 AdamW steps alone on their half of every batch, sending nothing; then they all-reduce how far their parameters moved, and an outer Nesterov step (lr 0.7, momentum 0.9) on the mean change sets both replicas' parameters. Resubmit it with sync \"every_step\" (DDP) and compare: the links page's all-reduce bytes per step fall 8-fold, the compare page draws the two loss curves at equal tokens.",
            spec: diloco,
        },
        Preset {
            key: "async-ps",
            title: "Asynchronous SGD: 4 workers and a parameter server",
            description: "4 ranks each train on their own 2 sequences a step and push the gradient to a parameter server kept by rank 0, which applies each gradient as it arrives and sends the parameters back: no rank waits for another. The run's page draws every update the server applied at its staleness, how many other workers' gradients reached the parameters between a worker's pull and its push. Rank 0 sends the parameters to each of the 3 others every round, (W-1) x 4N bytes, where a ring all-reduce sends 2(W-1)/W x 4N from each rank: resubmit it with sync \"every_step\" (DDP) and compare the links and the loss.",
            spec: async_ps,
        },
        Preset {
            key: "lost-replica",
            title: "A replica lost and rejoined (4 fault-tolerant replicas, a drill)",
            description: "4 data-parallel replicas that agree every step on who is alive, through a quorum the worker keeps. A drill kills rank 2's process (SIGKILL) after step 5: the step it dies in finishes with the 3 others (their mean gradient, the batch theirs alone), the worker starts a new process for rank 2, and at the next step's start rank 0 copies it the parameters and the AdamW state, 24 + 12N bytes, which the planner predicts. No checkpoint is read and the run is not queued again: one attempt, every step's point. The log says when the replica was lost and how long it took to rejoin; the timeline marks the loss and the copy; every replica ends with the same parameters, bit for bit (their digests are in the log).",
            spec: lost_replica,
        },
        Preset {
            key: "hsdp",
            title: "Hybrid sharding: FSDP in 2 groups of 2",
            description: "4 ranks in two groups of 2 (ranks_per_node 2, as if each group were a host): inside a group every unit is cut in two, gathered for its forward and backward and its gradient reduce-scattered, as FSDP on 2 ranks; across the groups each rank all-reduces only its gradient shard with the rank holding the same shard in the other group. Each rank holds FSDP-at-2's memory. Resubmit it with sharding \"fsdp\" and compare the links: FSDP's ring over all 4 ranks crosses between the groups on every step of every collective.",
            spec: hsdp,
        },
        Preset {
            key: "lamb-large-batch",
            title: "LAMB at 8x the batch, lr scaled 8x",
            description: "The ddp2 preset with 8 times the batch (32 sequences per rank) and, by the linear scaling rule, 8 times the learning rate (0.024), trained with LAMB: each tensor's Adam step is scaled by its trust ratio, the norm of its weights over the norm of its step, so every tensor moves by about lr times its own size. Resubmit it with optimizer \"adamw\" and compare: at this learning rate AdamW's loss climbs above where it started before it falls, and ends higher.",
            spec: lamb,
        },
        Preset {
            key: "topk",
            title: "DDP with top-k gradient compression (1%)",
            description: "The ddp2 preset with each gradient tensor cut to its 1% largest values and their indices, all-gathered instead of all-reduced; what each rank leaves out is added to its next step's gradient (error feedback). Compare the bytes per step and the loss curve with the ddp2 preset.",
            spec: topk,
        },
        Preset {
            key: "megatron",
            title: "Megatron tensor parallel (2 ranks)",
            description: "Every block split over 2 ranks: each computes 2 of the 4 attention heads and half of the MLP's hidden units. Per block the ranks all-reduce the activations twice going forward and twice going back (the timeline's comm lane); each holds about half of every block's parameters.",
            spec: megatron,
        },
        Preset {
            key: "fsdp",
            title: "FSDP on 4 ranks",
            description: "Fully sharded data parallel (ZeRO-3): parameters, gradients and Adam state are split over 4 ranks, each unit gathered for its forward and backward and freed. Each rank holds 16N/4 bytes of model state; the memory page shows the gather and free pulses.",
            spec: fsdp,
        },
        Preset {
            key: "zero1",
            title: "ZeRO-1 on 4 ranks (bf16)",
            description: "Adam's state and the fp32 master weights sharded over 4 ranks, the bf16 parameters and gradients whole on each: the gradient is all-reduced as in DDP, each rank updates its quarter and the ranks all-gather the updated parameters. The memory page shows 4N + 12N/4 bytes of model state per rank; the texts also count ZeRO-1 as 8N + 8N/K, with the master copy kept whole.",
            spec: zero1,
        },
        Preset {
            key: "zero2",
            title: "ZeRO-2 on 4 ranks (bf16)",
            description: "Gradients, Adam's state and the fp32 master weights sharded over 4 ranks, the bf16 parameters whole on each (2N + 14N/4 bytes of model state per rank): every unit's gradient is reduce-scattered as backward finishes it, each rank updates its quarter of the parameters and the ranks all-gather them. Per step a rank sends 2(W-1)/W x D, as much as DDP's all-reduce, in two halves; compare with the fsdp preset's 3(W-1)/W x D.",
            spec: zero2,
        },
        Preset {
            key: "3d",
            title: "3D parallel on 8 ranks (dp2 x tp2 x pp2)",
            description: "Two replicas of a two-stage pipeline whose stages are each split over two tensor-parallel ranks: TP inside, PP across, DP everywhere. The losses match one rank with the same global batch.",
            spec: three_d,
        },
        Preset {
            key: "checkpointing",
            title: "Activation checkpointing (every block)",
            description: "Forward keeps only each block's output; backward runs each block's forward again just before its backward. Resubmit it with checkpointing \"none\" and compare the memory cards (activations fall to about a third) and the step times (about one more forward per step); the losses are identical.",
            spec: recompute,
        },
        Preset {
            key: "offload-disk",
            title: "Optimizer state offloaded to disk (reference model)",
            description: "The reference model with AdamW's moments in a file, streamed through one piece of 262,144 parameters at a time as the optimizer updates them (ZeRO-Infinity's NVMe tier): the memory page's optimizer state falls to one piece, and each step pays for reading and writing the rest. Its partner for the comparison is the reference preset itself: compare the two runs' memory cards and step times.",
            spec: offload,
        },
        Preset {
            key: "fp16-plain",
            title: "fp16 without loss scaling (gradients underflow)",
            description: "32768 tokens per step and a 4096-token vocabulary: most logit gradients are below fp16's smallest subnormal and are stored as 0, so the loss falls more slowly than in fp32. Run the next two presets too and compare the three curves.",
            spec: fp16_plain,
        },
        Preset {
            key: "fp16-scaled",
            title: "fp16 with dynamic loss scaling",
            description: "The same run with the loss multiplied by 2^16 before backward: the gradients fit in fp16, are divided by the scale again in fp32, and the curve follows fp32's. The loss scale and the skipped steps are shown as the run goes.",
            spec: fp16_scaled,
        },
        Preset {
            key: "bf16",
            title: "bf16 (no loss scaling needed)",
            description: "The same run in bf16: 8 exponent bits, the range of fp32, so the tiny gradients survive without scaling; 7 mantissa bits, so each value is rounded more coarsely than in fp16.",
            spec: bf16,
        },
        Preset {
            key: "flash",
            title: "FlashAttention on long sequences (T = 512)",
            description: "A small model on sequences of 512 tokens with FlashAttention: the attention scores are computed tile by tile and never stored, so backward recomputes them. Resubmit it with attention \"naive\" and compare the memory cards: the naive run keeps every head's T x T probabilities for backward, most of its activations here; the losses are the same.",
            spec: flash,
        },
        Preset {
            key: "selective",
            title: "Selective recompute on long sequences (T = 512)",
            description: "A small model (6 blocks, d_model 64) on sequences of 512 tokens with naive attention and selective recompute: each block keeps everything but its heads' T x T attention probabilities, which its backward computes again from the q and k it kept (one block's at a time). Resubmit it with checkpointing \"none\" and compare the memory cards (most of the activations here are those probabilities) and the timeline's recompute spans (the softmax and the two products around it, a small part of the step); the losses are identical.",
            spec: selective,
        },
        Preset {
            key: "fp8",
            title: "FP8 products with delayed scaling (bf16 storage)",
            description: "The blocks' four linear layers multiply FP8 operands: inputs and weights in E4M3, output gradients in E5M2, each tensor with its own power-of-two scale, sums in f32 (emulated exactly on the CPU: the cast values are stored in bf16). Delayed scaling starts every scale at 1, so a good share of the first step's gradients (a third here) underflow; from then on each scale comes from the largest amax of the tensor's last 16 steps. The run's stats show each step's saturated and flushed elements and the scales. Resubmit it with fp8 \"none\" and compare the loss curves.",
            spec: fp8,
        },
        Preset {
            key: "fp8-all-gather",
            title: "FSDP gathering its weights in FP8 (dp=2, bf16)",
            description: "The fp8 preset on 2 ranks with FSDP: before each block's all-gather, each rank casts its shard of the four linear weights to E4M3 with the weight's scale, so they cross the wire in one byte each instead of bf16's two; the norms, biases, embeddings and head stay bf16. The model takes the weights as they arrive: they are the casts it would have made. Resubmit it with fp8_all_gather off and compare the links (the all-gathers' bytes, each the planner's) and the loss curves (identical).",
            spec: fp8_all_gather,
        },
        Preset {
            key: "offload-activations",
            title: "Activations offloaded to disk (8 blocks, T = 256)",
            description: "Each block's activations but its output go to a file after its forward and come back for its backward, the next block's read on a thread while this one's backward runs: the device holds each block's output, the head's and two blocks' worth on their way (the memory page's activations), and the rest is booked as offloaded. The timeline's offload lane shows every block going out and coming back. Resubmit it with activation_offload \"none\" and compare the memory cards and the step times; the losses are identical.",
            spec: offload_activations,
        },
        Preset {
            key: "ulysses",
            title: "Context parallelism, Ulysses (cp=2, T = 512)",
            description: "Sequences of 512 tokens split over 2 ranks (cp = 2 of the 2 data-parallel ranks, which read the same sequences): each keeps 256 tokens of every sequence through the embeddings, norms, MLPs and loss, and around attention two all-to-alls turn q, k and v into whole sequences of half the heads and attention's output back (the timeline's CP lane; four per block and micro-batch). Resubmit it with dp 1 and cp 1 (whole sequences, one rank) and compare: the same losses, about half the activations per rank.",
            spec: ulysses,
        },
        Preset {
            key: "ring",
            title: "Ring attention, causally balanced (cp=2, T = 512)",
            description: "The ulysses preset's sequences on the ring: each rank keeps the queries of 256 tokens, chunks 0 and 3 of 4 on rank 0 and 1 and 2 on rank 1 so both have as much of the causal triangle, and the blocks of keys and values travel round the ranks, each block's attention merged into the output by its log-sum-exp, FlashAttention's way (the timeline's CP lane: one pass forward and three back per block). Resubmit it with dp 1 and cp 1 for whole sequences on one rank, or with cp_kind ring-unbalanced to see the unbalanced split.",
            spec: ring_attention,
        },
        Preset {
            key: "experts",
            title: "Mixture of Experts, experts over 2 ranks (ep=2)",
            description: "Each block's MLP becomes 4 experts and a router that sends every token to 2 of them; an expert takes at most 1.25 times its even share of a micro-batch's tokens and the rest of its assignments are dropped (counted on the page, step by step). The 2 data-parallel ranks hold 2 experts each: tokens cross to their experts and back by all-to-all, four per block and micro-batch (the timeline's EP lane). Resubmit it with ep 1 and compare: the same losses, more parameters per rank, no all-to-all.",
            spec: experts,
        },
    ]
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::spec::validate::Limits;

    #[test]
    fn every_preset_is_valid() {
        for p in presets() {
            assert_eq!(p.spec.validate(&Limits::default()), Ok(()), "preset {}", p.key);
        }
    }
}
