//! An experiment spec in words, one line per section, with the raw JSON beside it.

use distlab_common::ExperimentSpec;
use leptos::prelude::*;
use leptos_router::components::A;
use serde::Serialize;

use crate::format;

/// The JSON spelling of an enum value (`"1f1b"`, `"adamw"`, ...).
pub fn label<T: Serialize>(value: &T) -> String {
    match serde_json::to_value(value) {
        Ok(serde_json::Value::String(s)) => s,
        Ok(other) => other.to_string(),
        Err(_) => "?".into(),
    }
}

/// "2L · d64 · 4h · seq 32 · vocab 64, markov, dp1 tp1 pp1, fp32, cpu": what ran, in one line.
pub fn one_line(spec: &ExperimentSpec) -> String {
    let (m, p, t) = (&spec.model, &spec.parallel, &spec.train);
    if let Some(demo) = &spec.demo {
        return format!(
            "collective demo · {} of {} numbers · ring of {} ranks · {}",
            demo.op.as_str(),
            demo.elements,
            p.dp,
            label(&spec.backend)
        );
    }
    let heads = match m.family.is_gpt2() {
        true => format!("{} heads", m.heads),
        false => format!("{} heads ({} K/V), SwiGLU {}", m.heads, m.key_value_heads(), m.d_ff()),
    };
    let mut parts = vec![
        format!("{} layers, d_model {}, {heads}, seq {}, vocab {}", m.layers, m.d_model, m.seq_len, m.vocab),
        match spec.data.tokenizer {
            distlab_common::TokenizerKind::Bpe => format!("{} BPE", label(&spec.data.dataset)),
            distlab_common::TokenizerKind::Bytes => label(&spec.data.dataset),
        },
        format!("dp{} tp{} pp{}", p.dp, p.tp, p.pp),
    ];
    if m.is_moe() {
        parts.insert(1, format!("{} experts top-{}", m.experts, m.expert_top_k));
    }
    if !m.family.is_gpt2() {
        parts[0] = format!("Llama {}", parts[0]);
    }
    if p.ep > 1 {
        parts.push(format!("ep{}", p.ep));
    }
    if p.cp > 1 {
        parts.push(format!("cp{} {}", p.cp, p.cp_kind.as_str()));
    }
    if p.sharding != distlab_common::Sharding::None {
        parts.push(label(&p.sharding));
    }
    parts.push(format!("batch {}", spec.global_batch()));
    parts.push(format!("{} lr {}", label(&t.optimizer), format::num(t.lr)));
    parts.push(label(&t.precision));
    parts.push(label(&spec.backend));
    parts.join(" · ")
}

#[component]
pub fn SpecView(spec: ExperimentSpec) -> impl IntoView {
    let (m, d, p, t) = (&spec.model, &spec.data, &spec.parallel, &spec.train);
    let model = format!(
        "{}{} layers · d_model {} · {} heads · seq_len {} · vocab {}{} — {} parameters",
        match m.family.is_gpt2() {
            true => String::new(),
            false => format!(
                "Llama blocks (RMSNorm, rotary positions with base {}, {} K/V heads, SwiGLU {} wide, no biases) · ",
                m.rope_theta,
                m.key_value_heads(),
                m.d_ff()
            ),
        },
        m.layers,
        m.d_model,
        m.heads,
        m.seq_len,
        m.vocab,
        match m.is_moe() {
            false => String::new(),
            true => format!(
                " · {} experts per block, top-{}, capacity factor {}, balance loss × {} ({} parameters active per token)",
                m.experts,
                m.expert_top_k,
                format::num(m.capacity_factor),
                format::num(m.aux_loss_coef),
                format::si(m.active_param_count() as f64)
            ),
        },
        format::si(m.param_count() as f64)
    );
    let data = match d.tokenizer {
        distlab_common::TokenizerKind::Bpe => {
            format!("{} · byte-level BPE of {} tokens learned from it · seed {}", label(&d.dataset), m.vocab, d.seed)
        }
        distlab_common::TokenizerKind::Bytes => format!("{} · seed {}", label(&d.dataset), d.seed),
    };
    let parallel = format!(
        "dp {}{} × tp {}{} × pp {} = {} rank{} · sharding {}{} · schedule {} · bucket {} bytes · {} on the wire{}",
        p.dp,
        match (p.ep > 1, p.cp > 1) {
            (true, _) => format!(" (experts over ep = {} of them)", p.ep),
            (_, true) => format!(
                " (sequences split over cp = {} of them, {}: {} replicas of the data)",
                p.cp,
                p.cp_kind.as_str(),
                p.data_replicas()
            ),
            _ => String::new(),
        },
        p.tp,
        if p.sequence_parallel { " (sequence parallel)" } else { "" },
        p.pp,
        spec.world_size(),
        if spec.world_size() == 1 { "" } else { "s" },
        label(&p.sharding),
        match (p.sharding == distlab_common::Sharding::Hsdp, p.prefetch) {
            (true, _) => format!(" (groups of {} ranks, {} replicas)", p.shard_ways(), p.dp / p.shard_ways().max(1)),
            (false, true) => " with prefetch".into(),
            (false, false) => String::new(),
        },
        match p.pp_schedule {
            distlab_common::PpSchedule::Interleaved => format!("interleaved (v = {})", p.virtual_stages),
            schedule => schedule.title().into(),
        },
        p.bucket_bytes,
        label(&p.comm_dtype),
        if p.fp8_all_gather { " (the blocks' weights gathered in FP8)" } else { "" }.to_string()
            + &match p.offload {
                distlab_common::Offload::None => String::new(),
                offload => format!(" · optimizer state offloaded to {}", offload.as_str()),
            }
            + &match p.allreduce {
                distlab_common::AllReduce::Ring => String::new(),
                distlab_common::AllReduce::Hierarchical => {
                    format!(" · hierarchical all-reduce, {} ranks per node", p.ranks_per_node)
                }
                other => format!(" · {} all-reduce", other.as_str()),
            }
            + &match p.grad_compression {
                distlab_common::GradCompression::None => String::new(),
                distlab_common::GradCompression::Topk => {
                    format!(
                        " · top-k compression ({} of each tensor) with error feedback",
                        format::num(p.compression_ratio)
                    )
                }
                distlab_common::GradCompression::Int8 => " · int8 compression with error feedback".into(),
                distlab_common::GradCompression::Powersgd => {
                    format!(" · PowerSGD compression (rank {}) with error feedback", p.compression_rank)
                }
            }
            + &match p.sync {
                distlab_common::DataSync::EveryStep => String::new(),
                distlab_common::DataSync::Diloco => format!(
                    " · DiLoCo: replicas step alone, an outer step every {} (lr {}, Nesterov momentum {})",
                    p.outer_steps_every,
                    format::num(p.outer_lr),
                    format::num(p.outer_momentum)
                ),
                distlab_common::DataSync::AsyncPs => {
                    " · asynchronous SGD: every rank pushes its gradient to a parameter server on rank 0 and pulls \
                     the parameters, without waiting for the others"
                        .into()
                }
            }
            + &match p.fault_tolerance {
                distlab_common::FaultTolerance::None => String::new(),
                distlab_common::FaultTolerance::Replicas => {
                    " · fault-tolerant replicas: a rank that dies is dropped from the step, and a new process rejoins \
                     with a live replica's state"
                        .into()
                }
            }
            + &match p.fault_drill {
                Some(d) => format!(" · drill: rank {}'s process killed after step {}", d.rank, d.after_step),
                None => String::new(),
            }
    );
    let batch = format!(
        "{} sequences = {} tokens per step (dp {} × micro_batch {} × micro_batches {} × grad_accum {})",
        spec.global_batch(),
        spec.tokens_per_step(),
        p.dp,
        t.micro_batch,
        t.micro_batches,
        t.grad_accum
    );
    let optim = format!(
        "{} steps · {} · lr {} ({}, warmup {}) · weight_decay {} · grad_clip {} · seed {}",
        t.steps,
        label(&t.optimizer),
        format::num(t.lr),
        label(&t.lr_schedule),
        t.warmup_steps,
        t.weight_decay,
        t.grad_clip,
        t.seed
    );
    let numerics = format!(
        "{} · loss scaling {} · activation checkpointing {}{}{} · {} attention{}{}",
        label(&t.precision),
        label(&t.loss_scaling),
        label(&t.checkpointing),
        match t.activation_offload {
            distlab_common::Offload::None => String::new(),
            offload => format!(" · activations offloaded to {}", offload.as_str()),
        },
        match t.fp8 {
            distlab_common::Fp8Recipe::None => String::new(),
            fp8 => format!(" · fp8 products, {} scaling", fp8.as_str()),
        },
        label(&t.attention),
        if t.eval_every > 0 { format!(" · validation every {} steps", t.eval_every) } else { String::new() },
        if t.checkpoint_every > 0 {
            format!(" · checkpoint every {} steps ({})", t.checkpoint_every, label(&t.checkpoint_write))
        } else {
            String::new()
        }
    );
    let backend = label(&spec.backend);
    let demo = spec.demo.as_ref().map(|d| {
        format!(
            "{} of {} numbers over the {} dp ranks, rank r starting with (r+1)·100 + i — no training: the model, data and training settings below are not used",
            d.op.as_str(),
            d.elements,
            p.dp
        )
    });
    let resumed = t.resume_from.map(|from| {
        view! {
            <dt>"resumed from"</dt>
            <dd id="spec-resumed-from">
                <A href=format!("/experiments/{}", from.experiment)>{format!("experiment {}", from.experiment)}</A>
                {format!("'s checkpoint of step {}, re-cut for these ranks (steps before it ran there)", from.step)}
            </dd>
        }
    });
    let json = serde_json::to_string_pretty(&spec).unwrap_or_default();
    view! {
        <dl class="spec" id="spec">
            {demo.map(|d| view! { <dt>"collective demo"</dt><dd id="spec-demo">{d}</dd> })}
            <dt>"model"</dt><dd>{model}</dd>
            <dt>"data"</dt><dd>{data}</dd>
            <dt>"parallel"</dt><dd>{parallel}</dd>
            <dt>"batch"</dt><dd>{batch}</dd>
            <dt>"training"</dt><dd>{optim}</dd>
            <dt>"numerics"</dt><dd>{numerics}</dd>
            <dt>"backend"</dt><dd>{backend}</dd>
            {resumed}
        </dl>
        <details class="spec-json">
            <summary>"spec as JSON"</summary>
            <pre>{json}</pre>
        </details>
    }
}
