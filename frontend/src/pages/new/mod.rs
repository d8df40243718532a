//! `/new`: the experiment form. Presets fill every field; every field stays editable.
//! On every change the form is turned into an `ExperimentSpec` and checked with the
//! same `validate` the server runs, so each message appears next to its field at once
//! and the submit button stays disabled until the spec is valid. The server remains
//! the authority: its 422 field errors are shown the same way.
//!
//! Below the form, the planner's prediction for the current spec (memory per rank by
//! category, communication per step, bubble, FLOPs) follows every change, computed in
//! the browser by the same planner the server runs (`components::plan_panel`).
//!
//! The "collective demo" section is optional: its checkbox (ticked by the all-reduce
//! preset) adds `demo` to the spec, and the sections only training uses are greyed out.
//! The sections themselves are drawn by `sections`.

mod sections;

use distlab_common::presets::{presets, Preset};
use distlab_common::{CollectiveDemo, DemoOp, ExperimentSpec, FieldError, Limits};
use leptos::prelude::*;
use leptos_router::hooks::{use_navigate, use_query_map};
use serde_json::{Map, Value};

use self::sections::FormSections;
use crate::api::{self, RequestError};
use crate::components::doc_link::DocLink;
use crate::components::plan_panel::{next_state, PlanPanel, PlanState};
use crate::format;
use crate::load::load;

#[derive(Clone, Copy, Debug, PartialEq)]
enum Kind {
    Text,
    /// A whole number, 0 or more.
    Int,
    /// A whole number, or empty for none (the field is left out of the spec).
    OptionalInt,
    Float,
    /// One of these JSON strings.
    Choice(&'static [&'static str]),
    /// true or false.
    Bool,
}

/// One input of the form, named by its path in the spec (`train.steps`).
#[derive(Debug)]
struct FieldDef {
    path: &'static str,
    kind: Kind,
    help: &'static str,
}

struct SectionDef {
    /// Errors about the section as a whole (`"model"`, `"parallel"`) show under its title.
    /// The section [`DEMO`] is only part of the spec while its checkbox is ticked.
    key: &'static str,
    title: &'static str,
    fields: &'static [FieldDef],
}

const fn f(path: &'static str, kind: Kind, help: &'static str) -> FieldDef {
    FieldDef { path, kind, help }
}

/// The key of the optional collective-demo section.
const DEMO: &str = "demo";

const SECTIONS: &[SectionDef] = &[
    SectionDef {
        key: "general",
        title: "Experiment",
        fields: &[
            f("name", Kind::Text, "a name for the list"),
            f(
                "backend",
                Kind::Choice(&["cpu", "cuda"]),
                "cpu runs everything; cuda needs a worker with a GPU and runs the same engine (not the collective demos)",
            ),
        ],
    },
    SectionDef {
        key: DEMO,
        title: "Collective demo instead of training",
        fields: &[
            f(
                "demo.op",
                Kind::Choice(&["all_reduce", "reduce_scatter", "all_gather", "all_to_all"]),
                "the collective the dp ranks run, once",
            ),
            f(
                "demo.elements",
                Kind::Int,
                "numbers in each rank's vector (1 to 4096; up to 64 keep every value for the replay)",
            ),
        ],
    },
    SectionDef {
        key: "model",
        title: "Model (GPT decoder)",
        fields: &[
            f(
                "model.family",
                Kind::Choice(&["gpt2", "llama"]),
                "gpt2: LayerNorm, learned positions, GELU MLP, biases; llama: RMSNorm, rotary positions, \
                 grouped-query attention, SwiGLU, no biases",
            ),
            f("model.layers", Kind::Int, "transformer blocks"),
            f("model.d_model", Kind::Int, "width of the residual stream"),
            f("model.heads", Kind::Int, "attention heads; must divide d_model"),
            f(
                "model.kv_heads",
                Kind::Int,
                "llama: key/value heads, each serving heads / kv_heads query heads (0 = heads: multi-head)",
            ),
            f("model.ffn_hidden", Kind::Int, "llama: the SwiGLU's width (0 = 8/3 × d_model rounded up to 256)"),
            f("model.rope_theta", Kind::Float, "llama: the rotary positions' base (Llama 2: 10000; Llama 3: 500000)"),
            f("model.seq_len", Kind::Int, "tokens per sequence (context length)"),
            f("model.vocab", Kind::Int, "number of distinct tokens"),
            f("model.experts", Kind::Int, "Mixture of Experts: MLPs per block, a router picks for each token (0 = dense)"),
            f("model.expert_top_k", Kind::Int, "experts each token visits"),
            f(
                "model.capacity_factor",
                Kind::Float,
                "each expert takes at most capacity_factor × tokens × top_k / experts of a micro-batch; the rest is dropped",
            ),
            f("model.aux_loss_coef", Kind::Float, "weight of the router's load-balancing loss"),
        ],
    },
    SectionDef {
        key: "data",
        title: "Data",
        fields: &[
            f(
                "data.dataset",
                Kind::Choice(&["markov", "text", "upload"]),
                "markov: random chain with a known loss floor; text: bytes of English; upload: your own text",
            ),
            f("data.upload_id", Kind::OptionalInt, "dataset=upload: which uploaded text (upload or pick one below)"),
            f(
                "data.tokenizer",
                Kind::Choice(&["bytes", "bpe"]),
                "text: one token per byte, or a byte-level BPE of model.vocab tokens learned from the training text",
            ),
            f("data.seed", Kind::Int, "fixes the chain and the batches"),
        ],
    },
    SectionDef {
        key: "parallel",
        title: "Parallelism (world size = dp × tp × pp ranks)",
        fields: &[
            f("parallel.dp", Kind::Int, "data-parallel replicas"),
            f("parallel.tp", Kind::Int, "tensor-parallel ranks (split heads and MLP)"),
            f("parallel.pp", Kind::Int, "pipeline stages (split layers)"),
            f("parallel.ep", Kind::Int, "expert parallelism: the experts spread over ep of the dp ranks (all-to-all)"),
            f(
                "parallel.cp",
                Kind::Int,
                "context parallelism: each sequence split along its tokens over cp of the dp ranks (all-to-all around attention)",
            ),
            f(
                "parallel.cp_kind",
                Kind::Choice(&["ulysses", "ring", "ring-unbalanced"]),
                "cp > 1: how the ranks meet in attention (Ulysses: heads/cp each; the ring: k and v passed round, attention flash)",
            ),
            f(
                "parallel.sequence_parallel",
                Kind::Bool,
                "tp > 1: LayerNorms and residuals split along the tokens (Megatron-SP)",
            ),
            f(
                "parallel.sharding",
                Kind::Choice(&["none", "zero1", "zero2", "fsdp", "hsdp"]),
                "shard optimizer state / gradients / parameters over dp (hsdp: inside groups, replicas across)",
            ),
            f("parallel.shard_group", Kind::Int, "hsdp: ranks per shard group (0 = ranks_per_node)"),
            f(
                "parallel.pp_schedule",
                Kind::Choice(&["gpipe", "1f1b", "interleaved", "zb-h1", "zbv", "dualpipev"]),
                "order of micro-batches in the pipeline",
            ),
            f(
                "parallel.virtual_stages",
                Kind::Int,
                "interleaved: chunks of layers per stage (v; 1 for the others)",
            ),
            f("parallel.bucket_bytes", Kind::Int, "gradient all-reduce bucket size"),
            f("parallel.prefetch", Kind::Bool, "fsdp: gather the next unit while this one computes"),
            f(
                "parallel.comm_dtype",
                Kind::Choice(&["fp32", "bf16", "fp16"]),
                "data-parallel collectives on the wire: fp32, or the run's own 2-byte format",
            ),
            f(
                "parallel.fp8_all_gather",
                Kind::Bool,
                "fsdp with fp8: the blocks' weights cast to FP8 before they are gathered (1 byte each on the wire)",
            ),
            f(
                "parallel.allreduce",
                Kind::Choice(&["ring", "tree", "naive", "hierarchical"]),
                "how DDP all-reduces the gradients",
            ),
            f("parallel.ranks_per_node", Kind::Int, "hierarchical: ranks per node (a ring inside, one across)"),
            f(
                "parallel.grad_compression",
                Kind::Choice(&["none", "topk", "int8", "powersgd"]),
                "DDP's gradients compressed on the wire, what is not sent kept for the next step",
            ),
            f("parallel.compression_ratio", Kind::Float, "topk: share of each tensor's values sent"),
            f("parallel.compression_rank", Kind::Int, "powersgd: rank of each matrix's approximation"),
            f(
                "parallel.offload",
                Kind::Choice(&["none", "host", "disk"]),
                "ZeRO-Offload: optimizer state and its update off the device (host: cuda only)",
            ),
            f(
                "parallel.sync",
                Kind::Choice(&["every_step", "diloco", "async_ps"]),
                "how replicas stay together: gradients summed every step, DiLoCo's local steps and an outer step every H, \
                 or asynchronous SGD through a parameter server on rank 0",
            ),
            f("parallel.outer_steps_every", Kind::Int, "diloco: inner steps each replica takes alone between outer steps (H)"),
            f("parallel.outer_lr", Kind::Float, "diloco: the outer step's learning rate on the replicas' mean change"),
            f("parallel.outer_momentum", Kind::Float, "diloco: the outer step's Nesterov momentum (0: none)"),
            f(
                "parallel.fault_tolerance",
                Kind::Choice(&["none", "replicas"]),
                "when a rank's process dies: the run stops (and resumes from a checkpoint), or the other replicas go \
                 on without it and a new process rejoins with a live replica's state",
            ),
            f(
                "parallel.fault_drill.rank",
                Kind::OptionalInt,
                "replicas: a drill kills this rank's process once (SIGKILL)...",
            ),
            f("parallel.fault_drill.after_step", Kind::OptionalInt, "...after this step"),
        ],
    },
    SectionDef {
        key: "train",
        title: "Training",
        fields: &[
            f("train.steps", Kind::Int, "optimizer steps"),
            f("train.micro_batch", Kind::Int, "sequences per rank per micro-batch"),
            f("train.micro_batches", Kind::Int, "pipeline micro-batches per step"),
            f("train.grad_accum", Kind::Int, "gradient accumulation steps"),
            f("train.lr", Kind::Float, "peak learning rate"),
            f("train.warmup_steps", Kind::Int, "linear warm-up steps"),
            f("train.lr_schedule", Kind::Choice(&["cosine", "constant"]), "after warm-up"),
            f("train.optimizer", Kind::Choice(&["adamw", "sgd", "lamb", "lars"]), "lamb, lars: each tensor's step scaled by its own norms"),
            f("train.weight_decay", Kind::Float, "0 to 1"),
            f("train.grad_clip", Kind::Float, "max gradient norm; 0 = off"),
            f("train.precision", Kind::Choice(&["fp32", "bf16", "fp16"]), "storage type of weights and activations"),
            f("train.loss_scaling", Kind::Choice(&["none", "dynamic"]), "dynamic: for fp16"),
            f("train.checkpointing", Kind::Choice(&["none", "selective", "every", "sqrt"]), "activation recomputation"),
            f(
                "train.fp8",
                Kind::Choice(&["none", "delayed", "current"]),
                "the blocks' products on FP8 operands (E4M3; gradients E5M2), each tensor's scale from its amax",
            ),
            f(
                "train.activation_offload",
                Kind::Choice(&["none", "host", "disk"]),
                "each block's activations off the device between its forward and its backward (host: cuda only)",
            ),
            f(
                "train.attention",
                Kind::Choice(&["naive", "flash"]),
                "flash: tiled, keeps one log-sum-exp per row instead of the T×T probabilities",
            ),
            f(
                "train.eval_every",
                Kind::Int,
                "validation loss on held-out data every N steps and after the last; 0 = never",
            ),
            f("train.checkpoint_every", Kind::Int, "save a resumable checkpoint every N steps; 0 = never"),
            f(
                "train.checkpoint_write",
                Kind::Choice(&["async", "sync"]),
                "async: a writer thread saves it while training goes on",
            ),
            f("train.seed", Kind::Int, "initial weights"),
            f(
                "train.resume_from.experiment",
                Kind::OptionalInt,
                "elastic resume: start from this experiment's checkpoint, with any dp and sharding (empty: from scratch)",
            ),
            f("train.resume_from.step", Kind::OptionalInt, "elastic resume: the step of its checkpoint"),
        ],
    },
];

/// A field of the form with its current text.
#[derive(Clone, Copy)]
struct FormField {
    def: &'static FieldDef,
    value: RwSignal<String>,
}

fn all_fields() -> impl Iterator<Item = &'static FieldDef> {
    SECTIONS.iter().flat_map(|s| s.fields.iter())
}

fn is_demo_field(path: &str) -> bool {
    path.starts_with("demo.")
}

/// Fields a collective demo does not use: it trains no model, and runs on dp ranks only.
fn training_only(path: &str) -> bool {
    ["model.", "data.", "train."].iter().any(|p| path.starts_with(p))
        || matches!(
            path,
            "parallel.tp"
                | "parallel.pp"
                | "parallel.ep"
                | "parallel.cp"
                | "parallel.cp_kind"
                | "parallel.sharding"
                | "parallel.pp_schedule"
                | "parallel.virtual_stages"
                | "parallel.bucket_bytes"
                | "parallel.prefetch"
                | "parallel.comm_dtype"
                | "parallel.fp8_all_gather"
                | "parallel.offload"
                | "parallel.sequence_parallel"
                | "parallel.ranks_per_node"
                | "parallel.grad_compression"
                | "parallel.compression_ratio"
                | "parallel.compression_rank"
                | "parallel.sync"
                | "parallel.outer_steps_every"
                | "parallel.outer_lr"
                | "parallel.outer_momentum"
                | "parallel.shard_group"
        )
}

/// The text of each field for a spec. Without a demo the demo fields show the
/// defaults, ready for when the checkbox is ticked.
fn field_texts(spec: &ExperimentSpec) -> Vec<String> {
    let mut value = serde_json::to_value(spec).unwrap_or(Value::Null);
    // The model fields a GPT-2 spec leaves out of its JSON show their values all the same.
    if let Some(model) = value.get_mut("model").and_then(Value::as_object_mut) {
        let m = &spec.model;
        model.entry("family").or_insert(Value::from(if m.family.is_gpt2() { "gpt2" } else { "llama" }));
        model.entry("kv_heads").or_insert(Value::from(m.kv_heads));
        model.entry("ffn_hidden").or_insert(Value::from(m.ffn_hidden));
        model.entry("rope_theta").or_insert(Value::from(m.rope_theta));
    }
    if let Some(data) = value.get_mut("data").and_then(Value::as_object_mut) {
        data.entry("tokenizer").or_insert(Value::from("bytes"));
    }
    if spec.demo.is_none() {
        if let Value::Object(map) = &mut value {
            map.insert(DEMO.into(), serde_json::to_value(CollectiveDemo::default()).unwrap_or(Value::Null));
        }
    }
    all_fields()
        .map(|def| {
            let mut v = &value;
            for key in def.path.split('.') {
                v = v.get(key).unwrap_or(&Value::Null);
            }
            match v {
                Value::String(s) => s.clone(),
                Value::Null => String::new(),
                other => other.to_string(),
            }
        })
        .collect()
}

/// What the form holds now: the spec (when it parses) and every problem with it.
#[derive(Clone, Debug, PartialEq)]
struct Checked {
    spec: Option<ExperimentSpec>,
    errors: Vec<FieldError>,
    /// Every field's text parsed (a field that did not is filled with its default in `spec`).
    complete: bool,
}

/// Turns the texts into a spec and checks it with the server's own rules; the demo
/// fields count only when `demo` (the section's checkbox) is on.
fn check(texts: &[(&'static FieldDef, String)], demo: bool) -> Checked {
    let mut errors = Vec::new();
    let mut root = Map::new();
    let dataset = texts.iter().find(|(def, _)| def.path == "data.dataset").map(|(_, text)| text.as_str());
    for (def, text) in texts {
        if is_demo_field(def.path) && !demo {
            continue;
        }
        // An upload picked earlier stays in its field, but only dataset=upload names it.
        if def.path == "data.upload_id" && dataset != Some("upload") {
            continue;
        }
        let parsed = match def.kind {
            Kind::Text | Kind::Choice(_) => Ok(Value::String(text.clone())),
            Kind::Bool => match text.trim() {
                "true" => Ok(Value::Bool(true)),
                "false" => Ok(Value::Bool(false)),
                t => Err(format!("must be true or false (it is \"{t}\")")),
            },
            Kind::Int | Kind::OptionalInt => match text.trim() {
                "" if def.kind == Kind::OptionalInt => continue,
                "" => Err("enter a whole number".to_string()),
                t => t
                    .parse::<u64>()
                    .map(Value::from)
                    .map_err(|_| format!("must be a whole number, 0 or more (it is \"{t}\")")),
            },
            Kind::Float => match text.trim() {
                "" => Err("enter a number".to_string()),
                t => match t.parse::<f64>() {
                    Ok(x) if x.is_finite() => Ok(Value::from(x)),
                    _ => Err(format!("must be a number such as 0.001 or 3e-4 (it is \"{t}\")")),
                },
            },
        };
        match parsed {
            Ok(v) => insert(&mut root, def.path, v),
            Err(message) => errors.push(FieldError::new(def.path, message)),
        }
    }
    let unparsed: Vec<String> = errors.iter().map(|e| e.field.clone()).collect();
    let complete = unparsed.is_empty();
    match ExperimentSpec::from_json_value(Value::Object(root)) {
        Ok(spec) => {
            if let Err(found) = spec.validate(&Limits::default()) {
                // A field that did not parse was filled with its default: say nothing more about it.
                errors.extend(found.into_iter().filter(|e| !unparsed.contains(&e.field)));
            }
            Checked { spec: Some(spec), errors, complete }
        }
        Err(found) => {
            errors.extend(found);
            Checked { spec: None, errors, complete: false }
        }
    }
}

fn insert(root: &mut Map<String, Value>, path: &str, value: Value) {
    match path.split_once('.') {
        None => {
            root.insert(path.to_string(), value);
        }
        Some((head, rest)) => {
            let child = root.entry(head.to_string()).or_insert_with(|| Value::Object(Map::new()));
            if let Value::Object(map) = child {
                insert(map, rest, value);
            }
        }
    }
}

/// Settings the chosen backend cannot run yet (the server refuses them at submission).
fn ambitious(spec: &ExperimentSpec) -> Vec<String> {
    distlab_common::backends::unsupported_on_backend(spec).iter().map(ToString::to_string).collect()
}

#[component]
pub fn NewExperiment() -> impl IntoView {
    let presets = presets();
    // `/new?preset=KEY` (a flashcard's demo link) starts from that preset.
    let asked = use_query_map().read_untracked().get("preset");
    let start = presets.iter().find(|p| Some(p.key) == asked.as_deref()).or(presets.first());
    let first = start.map(|p| p.spec.clone()).unwrap_or_default();
    // `/new?resume_from=ID&step=K` (an experiment's "continue" link) starts from that
    // experiment's spec, resuming from its checkpoint of step K.
    let query = use_query_map().read_untracked();
    let continue_from = query.get("resume_from").and_then(|id| id.parse::<i64>().ok());
    let continue_step = query.get("step").and_then(|step| step.parse::<u64>().ok());
    let fields: Vec<FormField> = all_fields()
        .zip(field_texts(&first))
        .map(|(def, text)| FormField { def, value: RwSignal::new(text) })
        .collect();
    let fields = StoredValue::new(fields);
    let active_preset = RwSignal::new(start.map(|p| p.key));
    let demo_on = RwSignal::new(first.demo.is_some());
    let server_error = RwSignal::new(None::<RequestError>);
    let submitting = RwSignal::new(false);

    let checked = Memo::new(move |_| {
        let texts: Vec<_> = fields.with_value(|fs| fs.iter().map(|f| (f.def, f.value.get())).collect());
        check(&texts, demo_on.get())
    });
    // Local problems, plus the server's from the last submit (until the next edit).
    let errors_for = move |field: &'static str| {
        let mut messages: Vec<String> =
            checked.with(|c| c.errors.iter().filter(|e| e.field == field).map(|e| e.message.clone()).collect());
        if let Some(server) = server_error.get() {
            for e in server.fields.iter().filter(|e| e.field == field) {
                if !messages.contains(&e.message) {
                    messages.push(e.message.clone());
                }
            }
        }
        messages
    };
    let is_valid = move || checked.with(|c| c.errors.is_empty() && c.spec.is_some());
    // The planner's view of the current spec; half-typed text keeps the last plan.
    let plan_state = Memo::new(move |prev: Option<&PlanState>| {
        checked.with(|c| next_state(prev, c.spec.as_ref().filter(|_| c.complete)))
    });

    let apply_preset = move |preset: &Preset| {
        let texts = field_texts(&preset.spec);
        fields.with_value(|fs| {
            for (f, text) in fs.iter().zip(texts) {
                f.value.set(text);
            }
        });
        demo_on.set(preset.spec.demo.is_some());
        active_preset.set(Some(preset.key));
        server_error.set(None);
    };
    let on_edit = move || {
        server_error.set(None);
        active_preset.set(None);
    };
    if let (Some(experiment), Some(step)) = (continue_from, continue_step) {
        let source = load(move || api::get_experiment(experiment));
        // Once it is in (a source that did not load leaves the form as it is).
        Effect::new(move || {
            let Some(Ok(source)) = source.get() else { return };
            let mut spec = source.spec;
            spec.name = format!("{} (continued from step {step})", source.name);
            spec.train.resume_from = Some(distlab_common::ResumeFrom { experiment, step });
            let texts = field_texts(&spec);
            fields.with_value(|fs| fs.iter().zip(texts).for_each(|(f, text)| f.value.set(text)));
            demo_on.set(false);
            active_preset.set(None);
        });
    }

    let navigate = use_navigate();
    let submit = move |ev: leptos::ev::SubmitEvent| {
        ev.prevent_default();
        let Some(spec) = checked.with_untracked(|c| c.errors.is_empty().then(|| c.spec.clone()).flatten()) else {
            return;
        };
        if submitting.get_untracked() {
            return;
        }
        submitting.set(true);
        server_error.set(None);
        let navigate = navigate.clone();
        leptos::task::spawn_local(async move {
            let body = serde_json::to_value(&spec).unwrap_or(Value::Null);
            match api::create_experiment(&body).await {
                Ok(created) => navigate(&format!("/experiments/{}", created.id), Default::default()),
                Err(e) => {
                    server_error.try_set(Some(e));
                    submitting.try_set(false);
                }
            }
        });
    };

    let preset_buttons = presets
        .into_iter()
        .map(|preset| {
            let key = preset.key;
            let title = preset.title;
            let description = preset.description;
            view! {
                <button
                    type="button"
                    class="preset"
                    class:active=move || active_preset.get() == Some(key)
                    id=format!("preset-{key}")
                    data-preset=key
                    on:click=move |_| apply_preset(&preset)
                >
                    <strong>{title}</strong>
                    <span>{description}</span>
                </button>
            }
        })
        .collect_view();

    let errors_for = Callback::new(errors_for);

    // Problems that belong to no field of the form (e.g. unknown fields).
    let known = |field: &str| {
        field.is_empty() || SECTIONS.iter().any(|s| s.key == field) || all_fields().any(|d| d.path == field)
    };
    // A section-level problem of a section that is not shown goes to the list below the form.
    let known = move |field: &str| known(field) && (field != DEMO || demo_on.get());
    let other_errors = move || {
        let mut out: Vec<String> = checked.with(|c| {
            c.errors.iter().filter(|e| !known(&e.field) || e.field.is_empty()).map(|e| e.to_string()).collect()
        });
        if let Some(server) = server_error.get() {
            out.push(format!("the server did not accept the experiment: {}", server.message));
            out.extend(server.fields.iter().filter(|e| !known(&e.field) || e.field.is_empty()).map(|e| e.to_string()));
        }
        out
    };

    view! {
        <section class="card">
            <div class="card-head">
                <h1>"New experiment"</h1>
                <DocLink page="index"/>
            </div>
            <p class="muted">"Start from a preset, then change anything. Every change is checked at once with the server's own rules."</p>
            <div class="presets" id="presets">{preset_buttons}</div>
            <p class="note" id="support-note">
                "Note: the current worker runs data parallelism (DDP, ZeRO-1, ZeRO-2 or FSDP), tensor parallelism "
                "(Megatron) and pipeline parallelism (GPipe, 1F1B), in any dp x tp x pp mix, one process per rank, "
                "with activation checkpointing, gradient accumulation and checkpoints, on the CPU, in fp32, bf16 or "
                "fp16 (2-byte weights, gradients and activations; fp32 master weights; dynamic loss scaling for fp16). "
                "A worker built with CUDA on a machine with a GPU also runs backend cuda, the same engine: a GPU "
                "per rank where there are enough (NCCL for data-parallel gradients), ranks sharing GPUs otherwise."
            </p>
        </section>
        <form class="card spec-form" id="new-experiment-form" on:submit=submit novalidate=true>
            <FormSections fields=fields demo_on=demo_on errors_for=errors_for on_edit=on_edit/>
            <Summary checked=checked/>
            {move || (!demo_on.get()).then(|| view! { <PlanPanel state=plan_state/> })}
            {move || {
                let list = other_errors();
                (!list.is_empty())
                    .then(|| view! { <div class="alert error" id="form-errors"><ul>{list.into_iter().map(|m| view! { <li>{m}</li> }).collect_view()}</ul></div> })
            }}
            {move || {
                let list = checked.with(|c| c.spec.as_ref().map(ambitious).unwrap_or_default());
                (!list.is_empty())
                    .then(|| view! {
                        <p class="note warn" id="support-warning">
                            "Not on this backend yet: " {list.join("; ")}
                        </p>
                    })
            }}
            <div class="actions">
                <button type="submit" class="button primary" id="submit" disabled=move || !is_valid() || submitting.get()>
                    {move || if submitting.get() { "Submitting…" } else { "Run experiment" }}
                </button>
                <span class="muted" id="validity">
                    {move || {
                        let n = checked.with(|c| c.errors.len());
                        match n {
                            0 => "the spec is valid".to_string(),
                            1 => "1 problem to fix".to_string(),
                            n => format!("{n} problems to fix"),
                        }
                    }}
                </span>
            </div>
        </form>
    }
}

#[component]
fn FieldInput(
    field: FormField,
    #[prop(into)] errors: Signal<Vec<String>>,
    on_edit: impl Fn() + Copy + Send + Sync + 'static,
    /// Greyed out: a collective demo does not use it.
    #[prop(into)]
    unused: Signal<bool>,
) -> impl IntoView {
    let def = field.def;
    let id = format!("field-{}", def.path.replace('.', "-"));
    let label = def.path.rsplit('.').next().unwrap_or(def.path);
    let control = match def.kind {
        Kind::Choice(_) | Kind::Bool => {
            let options: &[&str] = match def.kind {
                Kind::Choice(options) => options,
                _ => &["false", "true"],
            };
            view! {
                <select
                    id=id.clone()
                    name=def.path
                    on:change=move |ev| { field.value.set(event_target_value(&ev)); on_edit(); }
                >
                    {options
                        .iter()
                        .map(|&o| view! { <option value=o selected=move || field.value.get() == o>{o}</option> })
                        .collect_view()}
                </select>
            }
            .into_any()
        }
        kind => view! {
            <input
                id=id.clone()
                name=def.path
                type="text"
                autocomplete="off"
                spellcheck="false"
                inputmode=match kind { Kind::Int | Kind::OptionalInt => "numeric", Kind::Float => "decimal", _ => "text" }
                prop:value=move || field.value.get()
                on:input=move |ev| { field.value.set(event_target_value(&ev)); on_edit(); }
            />
        }
        .into_any(),
    };
    view! {
        <div class="field" class:invalid=move || !errors.with(|e| e.is_empty()) class:unused=move || unused.get()
            title=move || unused.get().then_some("not used by a collective demo")>
            <label for=id>{label}</label>
            {control}
            {(!def.help.is_empty()).then(|| view! { <small class="help">{def.help}</small> })}
            <ErrorList messages=errors field=def.path/>
        </div>
    }
}

#[component]
fn ErrorList(#[prop(into)] messages: Signal<Vec<String>>, field: &'static str) -> impl IntoView {
    move || messages.get().into_iter().map(|m| view! { <p class="field-error" data-field=field>{m}</p> }).collect_view()
}

/// What the spec amounts to: ranks, batch, parameters, compute per step.
#[component]
fn Summary(checked: Memo<Checked>) -> impl IntoView {
    move || {
        checked.with(|c| c.spec.clone()).map(|spec| {
            if let Some(demo) = &spec.demo {
                let w = spec.parallel.dp;
                let d = demo.elements as f64 * 4.0;
                let (formula, factor) = match demo.op {
                    DemoOp::AllReduce => ("2(W-1)/W × D", 2.0),
                    _ => ("(W-1)/W × D", 1.0),
                };
                let per_rank = factor * (w as f64 - 1.0) / w.max(1) as f64 * d;
                return view! {
                    <div class="derived" id="derived">
                        <div><span class="k">"ring size W"</span><span class="v">{w}</span></div>
                        <div><span class="k">"collective"</span><span class="v">{demo.op.as_str()}</span></div>
                        <div><span class="k">"buffer D"</span><span class="v">{format!("{} × 4 B = {} B", demo.elements, d)}</span></div>
                        <div><span class="k">{format!("bytes each rank sends: {formula}")}</span><span class="v">{format::bytes(per_rank)}</span></div>
                        <div><span class="k">"ring steps"</span><span class="v">{factor as usize * w.saturating_sub(1)}</span></div>
                    </div>
                }
                .into_any();
            }
            let flops = spec.model.train_flops_per_token() * spec.tokens_per_step() as f64;
            view! {
                <div class="derived" id="derived">
                    <div><span class="k">"ranks"</span><span class="v">{spec.world_size()}</span></div>
                    <div><span class="k">"parameters"</span><span class="v">{format::si(spec.model.param_count() as f64)}</span></div>
                    <div><span class="k">"sequences / step"</span><span class="v">{spec.global_batch()}</span></div>
                    <div><span class="k">"tokens / step"</span><span class="v">{format::si(spec.tokens_per_step() as f64)}</span></div>
                    <div><span class="k">"FLOPs / step"</span><span class="v">{format::si(flops)}</span></div>
                    <div><span class="k">"uniform loss ln(vocab)"</span><span class="v">{format!("{:.3}", (spec.model.vocab.max(1) as f64).ln())}</span></div>
                </div>
            }
            .into_any()
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn texts_for(spec: &ExperimentSpec) -> Vec<(&'static FieldDef, String)> {
        all_fields().zip(field_texts(spec)).collect()
    }

    #[test]
    fn every_spec_field_has_an_input() {
        // The form round-trips every preset exactly: no field is missing or misnamed.
        assert!(presets().iter().any(|p| p.spec.demo.is_some()), "a preset exercises the demo section");
        for preset in presets() {
            let checked = check(&texts_for(&preset.spec), preset.spec.demo.is_some());
            assert_eq!(checked.errors, vec![], "{}", preset.key);
            assert_eq!(checked.spec.as_ref(), Some(&preset.spec), "{}", preset.key);
        }
    }

    #[test]
    fn bad_text_names_its_field() {
        let mut texts = texts_for(&ExperimentSpec::default());
        for (def, text) in texts.iter_mut() {
            match def.path {
                "train.steps" => *text = "many".into(),
                "model.heads" => *text = "3".into(),
                _ => {}
            }
        }
        let checked = check(&texts, false);
        assert!(
            checked.errors.iter().any(|e| e.field == "train.steps" && e.message.contains("whole number")),
            "{:?}",
            checked.errors
        );
        assert!(checked
            .errors
            .iter()
            .any(|e| e.field == "model.heads" && e.message.contains("heads=3 does not divide")));
    }

    #[test]
    fn the_demo_checkbox_adds_and_removes_the_demo() {
        let plain = ExperimentSpec {
            parallel: distlab_common::ParallelSpec { dp: 4, ..Default::default() },
            ..Default::default()
        };
        // Off: no demo, whatever its fields hold.
        let mut texts = texts_for(&plain);
        assert_eq!(check(&texts, false).spec.and_then(|s| s.demo), None);
        // On: the defaults shown in its fields, then what is typed there.
        assert_eq!(check(&texts, true).spec.and_then(|s| s.demo), Some(CollectiveDemo::default()));
        for (def, text) in texts.iter_mut() {
            match def.path {
                "demo.op" => *text = "reduce_scatter".into(),
                "demo.elements" => *text = "0".into(),
                _ => {}
            }
        }
        let checked = check(&texts, true);
        assert!(checked.errors.iter().any(|e| e.field == "demo.elements"), "{:?}", checked.errors);
        assert_eq!(checked.spec.and_then(|s| s.demo).map(|d| d.op), Some(DemoOp::ReduceScatter));
        // A demo ignores the training sections; dp is kept.
        assert!(training_only("model.layers") && training_only("train.lr") && training_only("parallel.tp"));
        assert!(!training_only("parallel.dp") && !training_only("name") && !training_only("demo.op"));
        assert!(ambitious(&presets().into_iter().find(|p| p.key == "allreduce").unwrap().spec).is_empty());
    }
}
