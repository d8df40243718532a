//! The trained model out of the lab. Each rank writes its final parameters at the end of
//! a run (a checkpoint file holding only them); the launcher puts them back together —
//! across the data-parallel shards (`elastic::stage_sections`), the pipeline stages and
//! the tensor-parallel cuts — into the whole model's tensors, and writes them under
//! Hugging Face's names (GPT-2's or Llama's) as safetensors (`distlab_common::export` has
//! the names and config.json).
//!
//! Tensor parallelism cut each matrix by columns or by rows (`model/layout.rs`); putting
//! it back:
//!
//! ```text
//!   Columns { groups }  out[r, G_g + k*c_g + j] = part_k[r, P_g + j]   (group g: G_g where it
//!                       starts, C_g wide, c_g = C_g/tp; P_g = sum of c_h for h < g)
//!   Rows                out = part_0 rows, then part_1 rows, ...
//!   Replicated          out = part_0 (every rank holds the same)
//! ```

use std::collections::HashMap;
use std::path::Path;

use distlab_common::export::{hf_config, hf_pieces};
use distlab_common::{ExperimentSpec, ModelSpec};
use safetensors::tensor::TensorView;
use safetensors::Dtype;

use crate::checkpoint::{CheckpointDir, CheckpointError};
use crate::elastic;
use crate::model::layout::column_groups;
use crate::model::{ParamLayout, Split};
use crate::tokenizer::TOKENIZER_FILE;

#[derive(Debug, thiserror::Error)]
pub enum ExportError {
    #[error(transparent)]
    Checkpoint(#[from] CheckpointError),
    #[error("the ranks' final weights do not make a model: {0}")]
    Incomplete(String),
    #[error("cannot write the model: {0}")]
    Write(String),
}

/// One of the whole model's tensors.
#[derive(Clone, Debug, PartialEq)]
pub struct NamedTensor {
    pub name: String,
    pub shape: Vec<usize>,
    pub values: Vec<f32>,
}

/// The tensors of one rank's flat parameter buffer `params`, laid out as `layout` says.
pub fn tensors_of(layout: &ParamLayout, params: &[f32]) -> Vec<NamedTensor> {
    let tensor = |t: &crate::model::TensorInfo| NamedTensor {
        name: t.name.clone(),
        shape: t.shape.clone(),
        values: params[t.range.clone()].to_vec(),
    };
    layout.tensors.iter().map(tensor).collect()
}

/// The whole model's tensors (distlab's names, model order) from the rank files of `step`
/// in `dir`, saved by a run of `spec`.
pub fn whole_model(spec: &ExperimentSpec, dir: &CheckpointDir, step: u64) -> Result<Vec<NamedTensor>, ExportError> {
    let tp = spec.parallel.tp;
    // Each tensor's part on every tensor-parallel rank.
    let mut parts: HashMap<String, Vec<Option<Vec<f32>>>> = HashMap::new();
    for tp_rank in 0..tp {
        for stage in 0..spec.parallel.pp {
            let (layout, stage_blocks, sections) = elastic::stage_sections(dir, spec, step, tp_rank, stage)?;
            let find = |name: &str| sections.iter().find(|(n, _)| n == name).map(|(_, v)| v);
            let values = find("master").or_else(|| find("params")).ok_or_else(|| {
                ExportError::Incomplete(format!("stage {stage} of TP rank {tp_rank} saved no parameters"))
            })?;
            let range = stage_blocks.range(&layout);
            for t in layout.tensors.iter().filter(|t| range.start <= t.range.start && t.range.end <= range.end) {
                let part = values[t.range.start - range.start..t.range.end - range.start].to_vec();
                parts.entry(t.name.clone()).or_insert_with(|| vec![None; tp])[tp_rank] = Some(part);
            }
        }
    }
    ParamLayout::new(&spec.model)
        .tensors
        .iter()
        .map(|t| {
            let missing = || ExportError::Incomplete(format!("no rank saved {}", t.name));
            let parts: Vec<Vec<f32>> =
                parts.remove(&t.name).ok_or_else(missing)?.into_iter().collect::<Option<_>>().ok_or_else(missing)?;
            let values = merge(t.split, &t.shape, parts).map_err(ExportError::Incomplete)?;
            Ok(NamedTensor { name: t.name.clone(), shape: t.shape.clone(), values })
        })
        .collect()
}

/// One tensor of `shape` from its tensor-parallel parts (see the module's table).
fn merge(split: Split, shape: &[usize], parts: Vec<Vec<f32>>) -> Result<Vec<f32>, String> {
    let len: usize = shape.iter().product();
    let (tp, cols) = (parts.len(), shape.last().copied().unwrap_or(1).max(1));
    let cut = !matches!(split, Split::Replicated | Split::Experts);
    if parts.iter().any(|p| if cut { p.len() * tp != len } else { p.len() != len }) {
        return Err(format!(
            "parts of {shape:?} are not {} of its {len} values each",
            if cut { "1/tp" } else { "all" }
        ));
    }
    Ok(match split {
        Split::Replicated | Split::Experts => parts.into_iter().next().unwrap_or_default(),
        Split::Rows => parts.concat(),
        Split::Columns { groups } => {
            let mut out = vec![0.0; len];
            for (k, part) in parts.iter().enumerate() {
                for (r, row) in part.chunks(cols / tp).enumerate() {
                    let mut from = 0;
                    for (start, width) in column_groups(&groups) {
                        let mine = width / tp;
                        let to = r * cols + start + k * mine;
                        out[to..to + mine].copy_from_slice(&row[from..from + mine]);
                        from += mine;
                    }
                }
            }
            out
        }
    })
}

/// The model's tensors under Hugging Face's names for `model`'s family (each matrix cut
/// into its pieces and transposed as [`hf_pieces`] says), as a safetensors file
/// `transformers` loads (`"format": "pt"` in its metadata).
pub fn hf_safetensors(model: &ModelSpec, tensors: &[NamedTensor]) -> Result<Vec<u8>, ExportError> {
    let mut named = Vec::new();
    for t in tensors.iter().filter(|t| !t.values.is_empty()) {
        let no_place = || ExportError::Write(format!("{:?} has no tensor for {}", model.family, t.name));
        for piece in hf_pieces(model, &t.name, &t.shape).ok_or_else(no_place)? {
            let cols = t.shape.last().copied().unwrap_or(1);
            let rows = t.values.len() / cols;
            let width = piece.columns.len();
            // The piece's columns, row by row ((rows, width)), or transposed ((width, rows)).
            let mut values = vec![0.0; rows * width];
            for (i, row) in t.values.chunks(cols).enumerate() {
                for (j, &v) in row[piece.columns.clone()].iter().enumerate() {
                    values[if piece.transposed { j * rows + i } else { i * width + j }] = v;
                }
            }
            let shape = match (t.shape.len(), piece.transposed) {
                (1, _) => vec![width],
                (_, true) => vec![width, rows],
                (_, false) => vec![rows, width],
            };
            named.push((piece.name, shape, values));
        }
    }
    let views = named
        .iter()
        .map(|(name, shape, values)| {
            TensorView::new(Dtype::F32, shape.clone(), bytemuck::cast_slice(values))
                .map(|view| (name.clone(), view))
                .map_err(|e| ExportError::Write(e.to_string()))
        })
        .collect::<Result<Vec<_>, _>>()?;
    let metadata = HashMap::from([("format".to_string(), "pt".to_string())]);
    safetensors::serialize(views, Some(metadata)).map_err(|e| ExportError::Write(e.to_string()))
}

/// Writes `model.safetensors` and `config.json` for `spec`'s run into `out`, from the rank
/// files of `step` in `ranks`; with a BPE's `tokenizer` (the tokenizer.json the run was
/// cut with), `tokenizer.json` and `tokenizer_config.json` too. The tokenizer goes first: a
/// directory with the weights has everything.
pub fn write_hf(
    spec: &ExperimentSpec,
    ranks: &Path,
    step: u64,
    tokenizer: Option<&Path>,
    out: &Path,
) -> Result<u64, ExportError> {
    let tensors = whole_model(spec, &CheckpointDir::new(ranks, spec.world_size()), step)?;
    let bytes = hf_safetensors(&spec.model, &tensors)?;
    let config = serde_json::to_vec_pretty(&hf_config(&spec.model)).map_err(|e| ExportError::Write(e.to_string()))?;
    let write = |name: &str, data: &[u8]| {
        std::fs::write(out.join(name), data)
            .map_err(|e| ExportError::Write(format!("{}: {e}", out.join(name).display())))
    };
    if let Some(file) = tokenizer {
        let json = std::fs::read(file).map_err(|e| ExportError::Write(format!("{}: {e}", file.display())))?;
        write(TOKENIZER_FILE, &json)?;
        write("tokenizer_config.json", TOKENIZER_CONFIG.as_bytes())?;
    }
    write(distlab_common::export::WEIGHTS_FILE, &bytes)?;
    write("config.json", &config)?;
    Ok(bytes.len() as u64)
}

/// tokenizer_config.json: tells `AutoTokenizer` to take tokenizer.json as it is (not to
/// rebuild the model family's own tokenizer around its vocabulary).
pub const TOKENIZER_CONFIG: &str = "{\"tokenizer_class\": \"PreTrainedTokenizerFast\"}\n";

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tensor_parallel_parts_go_back_where_they_were_cut() {
        // A [2, 6] q|k|v matrix cut for 2 ranks: rank k holds columns k of q, k, and v's pairs.
        let whole: Vec<f32> = (0..12).map(|i| i as f32).collect();
        let part = |k: usize| -> Vec<f32> {
            (0..2).flat_map(|r| (0..3).flat_map(move |g| (0..1).map(move |j| (r * 6 + g * 2 + k + j) as f32))).collect()
        };
        assert_eq!(merge(Split::Columns { groups: [2, 2, 2] }, &[2, 6], vec![part(0), part(1)]).unwrap(), whole);
        assert_eq!(merge(Split::Rows, &[4], vec![vec![0.0, 1.0], vec![2.0, 3.0]]).unwrap(), vec![0.0, 1.0, 2.0, 3.0]);
        assert!(merge(Split::Rows, &[4], vec![vec![0.0], vec![2.0, 3.0]]).is_err());
    }

    #[test]
    fn the_lm_head_is_transposed_and_the_file_reads_back() {
        let tensors = vec![
            NamedTensor { name: "lm_head".into(), shape: vec![2, 3], values: vec![1.0, 2.0, 3.0, 4.0, 5.0, 6.0] },
            NamedTensor { name: "blocks.0.qkv_b".into(), shape: vec![3], values: vec![7.0, 8.0, 9.0] },
        ];
        let bytes = hf_safetensors(&ModelSpec::default(), &tensors).unwrap();
        let file = safetensors::SafeTensors::deserialize(&bytes).unwrap();
        let head = file.tensor("lm_head.weight").unwrap();
        assert_eq!(head.shape(), &[3, 2]);
        let values: Vec<f32> = head.data().chunks(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect();
        assert_eq!(values, [1.0, 4.0, 2.0, 5.0, 3.0, 6.0]);
        assert_eq!(file.tensor("transformer.h.0.attn.c_attn.bias").unwrap().shape(), &[3]);
        let (_, metadata) = safetensors::SafeTensors::read_metadata(&bytes).unwrap();
        assert_eq!(metadata.metadata().as_ref().and_then(|m| m.get("format")).map(String::as_str), Some("pt"));
    }
}
