//! A trained model in Hugging Face's format: tensor names, shapes and the `config.json`
//! that `transformers.GPT2LMHeadModel.from_pretrained` (GPT-2 blocks) or
//! `LlamaForCausalLM.from_pretrained` (Llama blocks) reads. The worker writes the weights
//! (`model.safetensors`, `gpu-worker/src/export.rs`) and reads them back to sample from
//! (`gpu-worker/src/generate.rs`); this is what both sides and the server agree on.
//!
//! distlab's GPT is GPT-2's architecture (learned positions, pre-LayerNorm with eps 1e-5,
//! GELU with the tanh approximation, biases everywhere) with an untied LM head. Its
//! matrices are stored as (inputs, outputs), as GPT-2's Conv1D stores them, so they go
//! over unchanged; the LM head is an `nn.Linear`, (outputs, inputs): transposed.
//!
//! distlab's Llama is Hugging Face's (RMSNorm with eps 1e-5, rotary positions in its
//! "rotate half" layout, so q and k need no permutation, SwiGLU, no biases): every matrix
//! is an `nn.Linear`, transposed on the way, and the two that distlab keeps side by side
//! are cut in pieces: qkv_w into q_proj, k_proj and v_proj, fc_w into gate_proj and
//! up_proj.

use serde_json::{json, Value};

use crate::{ExperimentSpec, ModelFamily, ModelSpec, DEFAULT_ROPE_THETA};

/// The weights' file name in a run's output directory.
pub const WEIGHTS_FILE: &str = "model.safetensors";

/// Why a run's model cannot be exported (None: it can).
pub fn not_exportable(spec: &ExperimentSpec) -> Option<String> {
    if spec.demo.is_some() {
        return Some("a collective demo trains no model".into());
    }
    if spec.model.is_moe() {
        return Some(
            "Hugging Face's GPT-2 has no Mixture-of-Experts layers: a model with experts is not exported".into(),
        );
    }
    None
}

/// One Hugging Face tensor made of columns `columns` of one of distlab's (a vector: all of
/// it), transposed or not.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HfPiece {
    pub name: String,
    pub columns: std::ops::Range<usize>,
    pub transposed: bool,
}

/// The Hugging Face tensors one of distlab's tensors (`wte`, `blocks.3.qkv_w`, ...,
/// `lm_head`, `shape` as distlab stores it) becomes in `model`'s family (None: that family
/// has no place for it).
pub fn hf_pieces(model: &ModelSpec, name: &str, shape: &[usize]) -> Option<Vec<HfPiece>> {
    let cols = shape.last().copied().unwrap_or(0);
    let piece = |name: String, columns: std::ops::Range<usize>, transposed| HfPiece { name, columns, transposed };
    let whole = |name: String, transposed| Some(vec![piece(name, 0..cols, transposed)]);
    if model.family.is_gpt2() {
        let (name, transposed) = hf_gpt2_name(name)?;
        return whole(name, transposed);
    }
    match name {
        "wte" => return whole("model.embed_tokens.weight".into(), false),
        "lnf_g" => return whole("model.norm.weight".into(), false),
        "lm_head" => return whole("lm_head.weight".into(), true),
        _ => {}
    }
    let (block, tensor) = name.strip_prefix("blocks.")?.split_once('.')?;
    let block: usize = block.parse().ok()?;
    let at = |part: &str| format!("model.layers.{block}.{part}.weight");
    let (q, kv, ff) = (model.d_model, (model.qkv_width() as usize - model.d_model) / 2, model.d_ff());
    Some(match tensor {
        "ln1_g" => vec![piece(at("input_layernorm"), 0..cols, false)],
        "qkv_w" => vec![
            piece(at("self_attn.q_proj"), 0..q, true),
            piece(at("self_attn.k_proj"), q..q + kv, true),
            piece(at("self_attn.v_proj"), q + kv..q + 2 * kv, true),
        ],
        "attn_proj_w" => vec![piece(at("self_attn.o_proj"), 0..cols, true)],
        "ln2_g" => vec![piece(at("post_attention_layernorm"), 0..cols, false)],
        "fc_w" => vec![piece(at("mlp.gate_proj"), 0..ff, true), piece(at("mlp.up_proj"), ff..2 * ff, true)],
        "fc_proj_w" => vec![piece(at("mlp.down_proj"), 0..cols, true)],
        _ => return None,
    })
}

/// GPT-2's name for one of distlab's tensors (`wte`, `blocks.3.qkv_w`, ..., `lm_head`),
/// and whether it is transposed on the way.
fn hf_gpt2_name(name: &str) -> Option<(String, bool)> {
    let whole = |n: &str| Some((n.to_string(), false));
    match name {
        "wte" => return whole("transformer.wte.weight"),
        "wpe" => return whole("transformer.wpe.weight"),
        "lnf_g" => return whole("transformer.ln_f.weight"),
        "lnf_b" => return whole("transformer.ln_f.bias"),
        "lm_head" => return Some(("lm_head.weight".into(), true)),
        _ => {}
    }
    let (block, tensor) = name.strip_prefix("blocks.")?.split_once('.')?;
    let block: usize = block.parse().ok()?;
    let hf = match tensor {
        "ln1_g" => "ln_1.weight",
        "ln1_b" => "ln_1.bias",
        "qkv_w" => "attn.c_attn.weight",
        "qkv_b" => "attn.c_attn.bias",
        "attn_proj_w" => "attn.c_proj.weight",
        "attn_proj_b" => "attn.c_proj.bias",
        "ln2_g" => "ln_2.weight",
        "ln2_b" => "ln_2.bias",
        "fc_w" => "mlp.c_fc.weight",
        "fc_b" => "mlp.c_fc.bias",
        "fc_proj_w" => "mlp.c_proj.weight",
        "fc_proj_b" => "mlp.c_proj.bias",
        _ => return None,
    };
    Some((format!("transformer.h.{block}.{hf}"), false))
}

/// `config.json` for the model: GPT2Config or LlamaConfig.
pub fn hf_config(m: &ModelSpec) -> Value {
    match m.family {
        ModelFamily::Gpt2 => hf_gpt2_config(m),
        ModelFamily::Llama => hf_llama_config(m),
    }
}

/// `config.json` for a GPT-2 model (GPT2Config): untied head, no dropout, distlab's sizes.
fn hf_gpt2_config(m: &ModelSpec) -> Value {
    json!({
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        "vocab_size": m.vocab,
        "n_positions": m.seq_len,
        "n_ctx": m.seq_len,
        "n_embd": m.d_model,
        "n_layer": m.layers,
        "n_head": m.heads,
        "n_inner": 4 * m.d_model,
        "activation_function": "gelu_new",
        "layer_norm_epsilon": 1e-5,
        "resid_pdrop": 0.0,
        "embd_pdrop": 0.0,
        "attn_pdrop": 0.0,
        "initializer_range": 0.02,
        "scale_attn_weights": true,
        "tie_word_embeddings": false,
        "bos_token_id": 0,
        "eos_token_id": 0,
        "torch_dtype": "float32",
    })
}

/// `config.json` for a Llama model (LlamaConfig): grouped-query attention, SwiGLU of its
/// width, RMSNorm eps 1e-5, rotary base, no biases, untied head.
fn hf_llama_config(m: &ModelSpec) -> Value {
    json!({
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": m.vocab,
        "max_position_embeddings": m.seq_len,
        "hidden_size": m.d_model,
        "intermediate_size": m.d_ff(),
        "num_hidden_layers": m.layers,
        "num_attention_heads": m.heads,
        "num_key_value_heads": m.key_value_heads(),
        "head_dim": m.d_model / m.heads.max(1),
        "hidden_act": "silu",
        "rms_norm_eps": 1e-5,
        "rope_theta": m.rope_theta,
        "attention_bias": false,
        "mlp_bias": false,
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "tie_word_embeddings": false,
        "bos_token_id": 0,
        "eos_token_id": 0,
        "torch_dtype": "float32",
    })
}

/// The model a GPT2Config or LlamaConfig describes, for the sizes distlab trains (the
/// inverse of [`hf_config`]).
pub fn model_of_hf_config(config: &Value) -> Result<ModelSpec, String> {
    let size = |key: &str| {
        config[key].as_u64().map(|v| v as usize).ok_or_else(|| format!("config.json has no whole number {key}"))
    };
    match config["model_type"].as_str() {
        Some("llama") => {
            let heads = size("num_attention_heads")?;
            let mut model = ModelSpec::llama(
                size("num_hidden_layers")?,
                size("hidden_size")?,
                heads,
                // (Hugging Face's defaults where a key is left out)
                size("num_key_value_heads").unwrap_or(heads),
                size("intermediate_size")?,
                size("max_position_embeddings")?,
                size("vocab_size")?,
            );
            model.rope_theta = config.get("rope_theta").and_then(Value::as_f64).unwrap_or(DEFAULT_ROPE_THETA);
            // What distlab's Llama does not do: refused rather than predicted wrongly.
            let eps = config.get("rms_norm_eps").and_then(Value::as_f64).unwrap_or(1e-6);
            if (eps - 1e-5).abs() > 1e-12 {
                return Err(format!("distlab's RMSNorm has eps 1e-5; this config's rms_norm_eps is {eps}"));
            }
            if let Some(head_dim) = config.get("head_dim").and_then(Value::as_u64) {
                if head_dim as usize * heads != model.d_model {
                    return Err(format!("distlab's heads are hidden_size / num_attention_heads wide, not {head_dim}"));
                }
            }
            if config.get("rope_scaling").is_some_and(|s| !s.is_null()) {
                return Err("distlab's rotary positions are not scaled; this config has rope_scaling".into());
            }
            for key in ["attention_bias", "mlp_bias", "tie_word_embeddings"] {
                if config.get(key).and_then(Value::as_bool) == Some(true) {
                    return Err(format!("distlab's Llama has no {key}"));
                }
            }
            if config.get("hidden_act").and_then(Value::as_str).is_some_and(|act| act != "silu") {
                return Err("distlab's Llama MLP is SwiGLU (hidden_act silu)".into());
            }
            Ok(model)
        }
        Some("gpt2") | None => {
            let model = ModelSpec::dense(
                size("n_layer")?,
                size("n_embd")?,
                size("n_head")?,
                size("n_positions")?,
                size("vocab_size")?,
            );
            if config.get("n_inner").and_then(Value::as_u64).is_some_and(|n| n as usize != 4 * model.d_model) {
                return Err("distlab's MLP is 4 x n_embd wide; this config's n_inner differs".into());
            }
            Ok(model)
        }
        Some(other) => Err(format!("distlab trains gpt2 and llama models, not model_type {other}")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_tensor_of_a_llama_block_has_its_pieces() {
        let model = ModelSpec::llama(2, 64, 4, 2, 176, 32, 256);
        let shapes = [("ln1_g", vec![64]), ("qkv_w", vec![64, 128]), ("attn_proj_w", vec![64, 64])]
            .into_iter()
            .chain([("ln2_g", vec![64]), ("fc_w", vec![64, 352]), ("fc_proj_w", vec![176, 64])]);
        let mut seen = std::collections::BTreeSet::new();
        for (n, shape) in shapes {
            let pieces = hf_pieces(&model, &format!("blocks.1.{n}"), &shape).unwrap();
            // the pieces tile the tensor's columns in order
            let mut next = 0;
            for p in &pieces {
                assert!(p.name.starts_with("model.layers.1.") && p.columns.start == next, "{p:?}");
                assert_eq!(p.transposed, shape.len() == 2, "{p:?}");
                next = p.columns.end;
                assert!(seen.insert(p.name.clone()));
            }
            assert_eq!(next, shape[shape.len() - 1], "{n}");
        }
        assert_eq!(seen.len(), 9);
        let k = &hf_pieces(&model, "blocks.0.qkv_w", &[64, 128]).unwrap()[1];
        assert_eq!((k.name.as_str(), k.columns.clone()), ("model.layers.0.self_attn.k_proj.weight", 64..96));
        assert_eq!(hf_pieces(&model, "blocks.0.qkv_b", &[128]), None);
        let config = hf_config(&model);
        assert_eq!(config["num_key_value_heads"].as_u64(), Some(2));
        assert_eq!(model_of_hf_config(&config), Ok(model));
        assert!(model_of_hf_config(&serde_json::json!({"model_type": "t5"})).is_err());
        let mut scaled = config.clone();
        scaled["rope_scaling"] = serde_json::json!({"rope_type": "llama3", "factor": 8.0});
        assert!(model_of_hf_config(&scaled).unwrap_err().contains("rope_scaling"));
        let mut other_eps = config.clone();
        other_eps["rms_norm_eps"] = serde_json::json!(1e-6);
        assert!(model_of_hf_config(&other_eps).unwrap_err().contains("eps 1e-5"));
    }

    #[test]
    fn every_tensor_of_a_block_has_a_gpt2_name() {
        let names = ["ln1_g", "ln1_b", "qkv_w", "qkv_b", "attn_proj_w", "attn_proj_b", "ln2_g", "ln2_b"]
            .into_iter()
            .chain(["fc_w", "fc_b", "fc_proj_w", "fc_proj_b"]);
        let mut seen = std::collections::BTreeSet::new();
        for n in names {
            let (hf, transposed) = hf_gpt2_name(&format!("blocks.11.{n}")).unwrap();
            assert!(hf.starts_with("transformer.h.11.") && !transposed, "{hf}");
            assert!(seen.insert(hf));
        }
        assert_eq!(hf_gpt2_name("lm_head"), Some(("lm_head.weight".into(), true)));
        assert_eq!(hf_gpt2_name("blocks.0.router_w"), None);
        assert_eq!(hf_gpt2_name("blocks.x.qkv_w"), None);
        let model = ModelSpec::dense(2, 64, 4, 32, 256);
        let config = hf_config(&model);
        assert_eq!((config["n_layer"].as_u64(), config["tie_word_embeddings"].as_bool()), (Some(2), Some(false)));
        assert_eq!(model_of_hf_config(&config), Ok(model));
        assert!(model_of_hf_config(&serde_json::json!({"n_layer": 2})).is_err());
    }
}
