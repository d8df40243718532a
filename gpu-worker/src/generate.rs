//! Sampling from a trained model: its exported weights (Hugging Face's safetensors, GPT-2's
//! or Llama's, see `export.rs`) loaded back into the engine's model on the CPU, one token
//! at a time.
//!
//! ```text
//!   each new token:  run the model on the last seq_len tokens (padded after them: the
//!                    attention is causal, so padding never reaches a real position)
//!                    p = the next-token probabilities at the last real position
//!   temperature 0:   the argmax of p (the first index on ties)
//!   otherwise:       keep the top_k largest p (all when top_k is 0),
//!                    q_j = p_j^(1/temperature) / sum, draw j from q (seeded)
//! ```

use std::collections::HashMap;

use distlab_common::export::hf_pieces;
use distlab_common::ModelSpec;

use crate::backend::{Buffers, CpuBackend};
use crate::memory::MemoryTracker;
use crate::model::{FlatState, Gpt, ParamLayout};
use crate::rng::Rng;

/// How to choose each new token.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Sampling {
    pub max_new_tokens: usize,
    /// 0: greedy.
    pub temperature: f64,
    /// Draw from the k likeliest tokens only (0: from all).
    pub top_k: usize,
    pub seed: u64,
}

/// The model's flat parameters (`ParamLayout::new` order) from a Hugging Face safetensors
/// file made for `model`: every piece of every tensor present with its shape, put back
/// into its columns (transposed back where it was transposed).
pub fn load_hf(model: &ModelSpec, safetensors: &[u8]) -> Result<Vec<f32>, String> {
    let file =
        safetensors::SafeTensors::deserialize(safetensors).map_err(|e| format!("not a safetensors file: {e}"))?;
    let stored: HashMap<String, safetensors::tensor::TensorView<'_>> = file.tensors().into_iter().collect();
    let layout = ParamLayout::new(model);
    let mut params = vec![0.0f32; layout.total];
    for t in layout.tensors.iter().filter(|t| !t.range.is_empty()) {
        let no_place = || format!("{:?} has no tensor for {}", model.family, t.name);
        let cols = t.shape.last().copied().unwrap_or(1);
        let rows = t.range.len() / cols;
        let out = &mut params[t.range.clone()];
        for piece in hf_pieces(model, &t.name, &t.shape).ok_or_else(no_place)? {
            let name = &piece.name;
            let view = stored.get(name).ok_or_else(|| format!("the file has no {name}"))?;
            let width = piece.columns.len();
            let want = match (t.shape.len(), piece.transposed) {
                (1, _) => vec![width],
                (_, true) => vec![width, rows],
                (_, false) => vec![rows, width],
            };
            if view.dtype() != safetensors::Dtype::F32 || view.shape() != want {
                return Err(format!("{name} is {:?} {:?}, the model needs F32 {want:?}", view.dtype(), view.shape()));
            }
            let values = view.data().chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]));
            for (k, v) in values.enumerate() {
                let (i, j) = if piece.transposed { (k % rows, k / rows) } else { (k / width, k % width) };
                out[i * cols + piece.columns.start + j] = v;
            }
        }
    }
    Ok(params)
}

/// A model loaded on the CPU, ready to predict.
pub struct Predictor {
    be: CpuBackend<f32>,
    gpt: Gpt<CpuBackend<f32>>,
    state: FlatState<CpuBackend<f32>>,
    probs: Vec<f32>,
}

impl Predictor {
    pub fn new(model: &ModelSpec, params: &[f32]) -> Result<Self, String> {
        let be = CpuBackend::<f32>::new(1);
        let gpt = Gpt::new(&be, model, 1, &MemoryTracker::new());
        if params.len() != gpt.layout.total {
            return Err(format!("{} parameters for a model of {}", params.len(), gpt.layout.total));
        }
        let mut state = FlatState::new(&be, &gpt.layout, 0);
        be.upload(&mut state.params, params);
        let probs = vec![0.0; model.seq_len * model.vocab];
        Ok(Self { be, gpt, state, probs })
    }

    /// The next-token probabilities after each of `tokens` (at most seq_len of them, each
    /// in the vocabulary), one row of vocab values per token.
    pub fn probabilities(&mut self, tokens: &[u32]) -> Result<&[f32], String> {
        let ModelSpec { seq_len: t, vocab, .. } = self.gpt.spec;
        if tokens.is_empty() || tokens.len() > t {
            return Err(format!("1 to {t} tokens at a time, got {}", tokens.len()));
        }
        if let Some(&bad) = tokens.iter().find(|&&x| x as usize >= vocab) {
            return Err(format!("token {bad} is outside the model's vocabulary of {vocab}"));
        }
        let mut inputs = tokens.to_vec();
        inputs.resize(t, 0);
        self.gpt.forward(&self.be, &mut self.state, &inputs, &vec![0; t]).map_err(|e| e.to_string())?;
        self.be.download(self.gpt.probabilities().ok_or("the model kept no probabilities")?, &mut self.probs);
        Ok(&self.probs[..tokens.len() * vocab])
    }
}

/// Continues `prompt` by up to `s.max_new_tokens` tokens, calling `on_token` with each as
/// it is chosen (it answers whether to go on: a caller's time budget); returns the new
/// tokens.
pub fn generate(
    model: &ModelSpec,
    params: &[f32],
    prompt: &[u32],
    s: &Sampling,
    mut on_token: impl FnMut(u32) -> bool,
) -> Result<Vec<u32>, String> {
    if prompt.is_empty() {
        return Err("the prompt is empty".into());
    }
    let mut predictor = Predictor::new(model, params)?;
    let mut rng = Rng::new(s.seed);
    let mut context = prompt.to_vec();
    let mut made = Vec::with_capacity(s.max_new_tokens);
    for _ in 0..s.max_new_tokens {
        let window = &context[context.len().saturating_sub(model.seq_len)..];
        let rows = predictor.probabilities(window)?;
        let next = choose(&rows[rows.len() - model.vocab..], s, &mut rng);
        made.push(next);
        context.push(next);
        if !on_token(next) {
            break;
        }
    }
    Ok(made)
}

/// One token from the probabilities `p` (see the module's table).
fn choose(p: &[f32], s: &Sampling, rng: &mut Rng) -> u32 {
    if s.temperature <= 0.0 {
        // The first index of the largest value.
        let best = p.iter().enumerate().fold(0, |best, (j, &v)| if v > p[best] { j } else { best });
        return best as u32;
    }
    let mut order: Vec<usize> = (0..p.len()).collect();
    order.sort_by(|&a, &b| p[b].total_cmp(&p[a]).then(a.cmp(&b)));
    if s.top_k > 0 {
        order.truncate(s.top_k);
    }
    // (p / p_max)^(1/T): the same distribution as p^(1/T), without underflowing to 0 at a
    // low temperature.
    let top = f64::from(p[order[0]]).max(f64::MIN_POSITIVE);
    let weights: Vec<f64> = order.iter().map(|&j| (f64::from(p[j]) / top).powf(1.0 / s.temperature)).collect();
    let total: f64 = weights.iter().sum();
    let mut u = rng.uniform() * total;
    for (&j, w) in order.iter().zip(&weights) {
        if u < *w {
            return j as u32;
        }
        u -= w;
    }
    order[0] as u32
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn greedy_takes_the_first_largest_and_top_k_draws_only_from_the_k_likeliest() {
        let p = [0.1, 0.4, 0.4, 0.1];
        let greedy = Sampling { max_new_tokens: 1, temperature: 0.0, top_k: 0, seed: 1 };
        assert_eq!(choose(&p, &greedy, &mut Rng::new(1)), 1);
        let top2 = Sampling { temperature: 1.0, top_k: 2, ..greedy };
        let mut rng = Rng::new(7);
        let drawn: Vec<u32> = (0..200).map(|_| choose(&p, &top2, &mut rng)).collect();
        assert!(drawn.iter().all(|&j| j == 1 || j == 2));
        assert!(drawn.contains(&1) && drawn.contains(&2));
        // A low temperature all but picks the likeliest.
        let cold = Sampling { temperature: 0.05, top_k: 0, ..greedy };
        let p = [0.1, 0.5, 0.3, 0.1];
        assert!((0..100).all(|_| choose(&p, &cold, &mut rng) == 1));
    }
}

#[cfg(test)]
mod round_trip {
    use super::*;
    use crate::export::{hf_safetensors, tensors_of};

    /// A Llama's parameters through Hugging Face's Llama file (q, k, v and gate, up cut
    /// apart, every matrix transposed) and back, bit for bit.
    #[test]
    fn parameters_survive_the_llama_file() {
        let model = ModelSpec::llama(2, 16, 4, 2, 24, 8, 11);
        let layout = ParamLayout::new(&model);
        let mut rng = Rng::new(6);
        let params: Vec<f32> = (0..layout.total).map(|_| rng.normal() as f32).collect();
        let file = hf_safetensors(&model, &tensors_of(&layout, &params)).unwrap();
        assert_eq!(load_hf(&model, &file).unwrap(), params);
        let stored = safetensors::SafeTensors::deserialize(&file).unwrap();
        assert_eq!(stored.tensor("model.layers.1.self_attn.k_proj.weight").unwrap().shape(), &[8, 16]);
        assert_eq!(stored.tensor("model.layers.0.mlp.down_proj.weight").unwrap().shape(), &[16, 24]);
        assert_eq!(stored.len(), 1 + 2 * 9 + 2);
        let gpt2 = ModelSpec::dense(2, 16, 4, 8, 11);
        assert!(load_hf(&gpt2, &file).unwrap_err().contains("the file has no transformer.wte.weight"));
    }

    /// A model's parameters through GPT-2's file and back, bit for bit; greedy sampling
    /// follows the forward's own argmax and is the same every time.
    #[test]
    fn parameters_survive_the_gpt2_file_and_greedy_sampling_is_the_argmax() {
        let model = ModelSpec::dense(2, 16, 2, 8, 11);
        let layout = ParamLayout::new(&model);
        let mut rng = Rng::new(5);
        let params: Vec<f32> = (0..layout.total).map(|_| rng.normal() as f32).collect();
        let file = hf_safetensors(&model, &tensors_of(&layout, &params)).unwrap();
        assert_eq!(load_hf(&model, &file).unwrap(), params);
        let wrong = ModelSpec::dense(2, 16, 2, 8, 12);
        assert!(load_hf(&wrong, &file).unwrap_err().contains("the model needs F32"));

        let greedy = Sampling { max_new_tokens: 5, temperature: 0.0, top_k: 0, seed: 0 };
        let mut seen = Vec::new();
        let made = generate(&model, &params, &[3, 1, 4], &greedy, |t| {
            seen.push(t);
            true
        })
        .unwrap();
        assert_eq!(made, seen);
        assert_eq!(made, generate(&model, &params, &[3, 1, 4], &greedy, |_| true).unwrap());
        // The first token is the argmax of one forward's last row.
        let mut predictor = Predictor::new(&model, &params).unwrap();
        let probs = predictor.probabilities(&[3, 1, 4]).unwrap();
        let row = &probs[2 * 11..3 * 11];
        let best = (0..11).fold(0, |b, j| if row[j] > row[b] { j } else { b });
        assert_eq!(made[0], best as u32);
        assert!(generate(&model, &params, &[11], &greedy, |_| true).unwrap_err().contains("outside"));
        // Past seq_len the model sees the last 8 tokens.
        let long = Sampling { max_new_tokens: 12, ..greedy };
        assert_eq!(generate(&model, &params, &[3, 1, 4], &long, |_| true).unwrap().len(), 12);
        // A caller that says stop gets what was made so far.
        let mut left = 3;
        let stopped = generate(&model, &params, &[3], &long, |_| {
            left -= 1;
            left > 0
        });
        assert_eq!(stopped.unwrap().len(), 3);
    }
}
