//! A trained model in Hugging Face's GPT-2 format: tensor names, shapes and the
//! `config.json` that `transformers.GPT2LMHeadModel.from_pretrained` reads. The worker
//! writes the weights (`model.safetensors`, `gpu-worker/src/export.rs`); this is what both
//! sides and the server agree on.
//!
//! distlab's GPT is GPT-2's architecture (learned positions, pre-LayerNorm with eps 1e-5,
//! GELU with the tanh approximation, biases everywhere) with an untied LM head. Its
//! matrices are stored as (inputs, outputs), as GPT-2's Conv1D stores them, so they go
//! over unchanged; the LM head is an `nn.Linear`, (outputs, inputs): transposed.

use serde_json::{json, Value};

use crate::{ExperimentSpec, ModelSpec};

/// The weights' file name in a run's output directory.
pub const WEIGHTS_FILE: &str = "model.safetensors";

/// Why a run's model cannot be exported (None: it can).
pub fn not_exportable(spec: &ExperimentSpec) -> Option<String> {
    if spec.demo.is_some() {
        return Some("a collective demo trains no model".into());
    }
    if spec.model.is_moe() {
        return Some("GPT-2 has no Mixture-of-Experts layers: a model with experts is not exported".into());
    }
    None
}

/// GPT-2's name for one of distlab's tensors (`wte`, `blocks.3.qkv_w`, ..., `lm_head`),
/// and whether it is transposed on the way.
pub fn hf_gpt2_name(name: &str) -> Option<(String, bool)> {
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

/// `config.json` for the model (GPT2Config): untied head, no dropout, distlab's sizes.
pub fn hf_gpt2_config(m: &ModelSpec) -> Value {
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

/// The model a GPT2Config describes, for the sizes distlab's GPT has (the inverse of
/// [`hf_gpt2_config`]).
pub fn model_of_hf_gpt2_config(config: &Value) -> Result<ModelSpec, String> {
    let size = |key: &str| {
        config[key].as_u64().map(|v| v as usize).ok_or_else(|| format!("config.json has no whole number {key}"))
    };
    let model =
        ModelSpec::dense(size("n_layer")?, size("n_embd")?, size("n_head")?, size("n_positions")?, size("vocab_size")?);
    if config.get("n_inner").and_then(Value::as_u64).is_some_and(|n| n as usize != 4 * model.d_model) {
        return Err("distlab's MLP is 4 x n_embd wide; this config's n_inner differs".into());
    }
    Ok(model)
}

#[cfg(test)]
mod tests {
    use super::*;

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
        let config = hf_gpt2_config(&model);
        assert_eq!((config["n_layer"].as_u64(), config["tie_word_embeddings"].as_bool()), (Some(2), Some(false)));
        assert_eq!(model_of_hf_gpt2_config(&config), Ok(model));
        assert!(model_of_hf_gpt2_config(&serde_json::json!({"n_layer": 2})).is_err());
    }
}
