//! Training data: the `markov` and `text` datasets, the global batch of a step, and the
//! held-out sequences of the validation loss (the text's last tenth; for the chain, a
//! random stream of its own). A text becomes tokens by the run's tokenizer
//! (`tokenizer.rs`): its bytes, or a BPE learned from the training part only, so that the
//! held-out text is new to the tokenizer as it is to the model.
//!
//! The global batch of optimizer step t is a pure function of (data seed, t):
//! sequence i of it depends on (seed, t, i) alone. A caller asks for sequences
//! `[start, start + count)` of step t's batch, so a data-parallel rank (or a
//! micro-batch) takes its own disjoint slice and every strategy sees the same data.
//! Each sequence has seq_len + 1 tokens; inputs are the first seq_len, targets the
//! last seq_len (the same tokens shifted by one).

use std::path::Path;
use std::sync::Arc;

use distlab_common::{DataSpec, Dataset, ModelSpec, TokenizerKind};

use crate::rng::Rng;
use crate::tokenizer::{TextTokenizer, TokenizerError};

/// The text dataset: ~256 KiB of Shakespeare, one token per byte.
pub static SHAKESPEARE: &[u8] = include_bytes!("../data/shakespeare.txt");

/// Likely successors of each token in the Markov chain.
pub const MARKOV_SUCCESSORS: usize = 4;
/// Probability that the next token is drawn uniformly instead (keeps the chain
/// irreducible and aperiodic, so its stationary distribution is unique).
pub const MARKOV_UNIFORM_MIX: f64 = 0.05;

/// The files [`Data::write_cut`] leaves: both parts' token ids (little-endian u32) and the
/// bytes each part came from; beside them the tokenizer's own file (`tokenizer.json`).
const CUT_TRAINED: &str = "trained.ids";
const CUT_HELD_OUT: &str = "held_out.ids";
const CUT_BYTES: &str = "bytes.json";

/// Names the random streams, so that the chain and the sequences never share one.
const CHAIN_STREAM: u64 = 0x4348_4149_4e00_0001;
const SEQUENCE_STREAM: u64 = 0x5345_5155_454e_4345;
const EPOCH_STREAM: u64 = 0x4550_4f43_4800_0001;
const VALIDATION_STREAM: u64 = 0x5641_4c49_4441_5445;

#[derive(Debug, thiserror::Error, PartialEq)]
pub enum DataError {
    #[error("the text dataset has one token per byte, so vocab must be at least 256 (it is {0})")]
    VocabTooSmallForText(usize),
    #[error(
        "seq_len={seq_len} needs a window of {} bytes to train on and one held out, but the text has only {len} \
         bytes",
        seq_len + 1
    )]
    TextTooShort { seq_len: usize, len: usize },
    #[error("dataset=upload: this run was given no file for uploaded dataset {0}")]
    NoUploadedFile(i64),
    #[error("the uploaded dataset's file {path}: {message}")]
    UploadUnreadable { path: String, message: String },
    #[error(
        "seq_len={seq_len} needs windows of {} tokens, but the {part} text is only {tokens} tokens after BPE",
        seq_len + 1
    )]
    TooFewTokens { seq_len: usize, part: &'static str, tokens: usize },
    #[error("{0}")]
    Tokenizer(String),
    #[error("the text cut into tokens for this run, in {path}: {message}")]
    CutText { path: String, message: String },
}

impl From<TokenizerError> for DataError {
    fn from(e: TokenizerError) -> Self {
        DataError::Tokenizer(e.to_string())
    }
}

fn cut_error(dir: &Path, message: String) -> DataError {
    DataError::CutText { path: dir.display().to_string(), message }
}

/// A random Markov chain over the vocabulary, fixed by the data seed:
/// P(i -> j) = eps/V + (1 - eps) w_ij, where w_i puts Dirichlet(1) weights on
/// `MARKOV_SUCCESSORS` distinct random successors of i.
#[derive(Clone, Debug)]
pub struct MarkovChain {
    vocab: usize,
    /// `k` successors per token, row-major.
    successors: Vec<u32>,
    /// Cumulative weights of each token's successors (the last of each row is 1).
    cumulative: Vec<f64>,
    /// Cumulative stationary distribution, for the first token of a sequence.
    stationary_cdf: Vec<f64>,
    /// sum_i pi_i H(P_i), nats per token: the best possible loss.
    entropy_rate: f64,
}

impl MarkovChain {
    pub fn new(vocab: usize, seed: u64) -> Self {
        let k = MARKOV_SUCCESSORS.min(vocab);
        let mut rng = Rng::from_parts(&[seed, CHAIN_STREAM, vocab as u64]);
        let mut successors = Vec::with_capacity(vocab * k);
        let mut weights = Vec::with_capacity(vocab * k);
        for _ in 0..vocab {
            let row_start = successors.len();
            while successors.len() < row_start + k {
                let s = rng.below(vocab as u64) as u32;
                if !successors[row_start..].contains(&s) {
                    successors.push(s);
                }
            }
            // Dirichlet(1): normalised exponential deviates.
            let w: Vec<f64> = (0..k).map(|_| -(1.0 - rng.uniform()).ln() + 1e-12).collect();
            let total: f64 = w.iter().sum();
            weights.extend(w.iter().map(|x| x / total));
        }
        let cumulative: Vec<f64> = weights
            .chunks_exact(k)
            .flat_map(|row| {
                row.iter()
                    .scan(0.0, |acc, &w| {
                        *acc += w;
                        Some(*acc)
                    })
                    .collect::<Vec<_>>()
            })
            .collect();

        let uniform = MARKOV_UNIFORM_MIX / vocab as f64;
        let stationary = stationary_distribution(vocab, k, &successors, &weights);
        let entropy_rate = (0..vocab)
            .map(|i| {
                let peaked: f64 = weights[i * k..(i + 1) * k]
                    .iter()
                    .map(|&w| {
                        let p = uniform + (1.0 - MARKOV_UNIFORM_MIX) * w;
                        -p * p.ln()
                    })
                    .sum();
                let rest = (vocab - k) as f64 * -uniform * uniform.ln();
                stationary[i] * (peaked + rest)
            })
            .sum();
        let stationary_cdf = stationary
            .iter()
            .scan(0.0, |acc, &p| {
                *acc += p;
                Some(*acc)
            })
            .collect();
        Self { vocab, successors, cumulative, stationary_cdf, entropy_rate }
    }

    /// The entropy rate in nats per token: the loss of a model that knows the chain.
    pub fn entropy_rate(&self) -> f64 {
        self.entropy_rate
    }

    fn first_token(&self, rng: &mut Rng) -> u32 {
        let u = rng.uniform();
        self.stationary_cdf.partition_point(|&c| c <= u).min(self.vocab - 1) as u32
    }

    fn next_token(&self, current: u32, rng: &mut Rng) -> u32 {
        let u = rng.uniform();
        if u < MARKOV_UNIFORM_MIX {
            return rng.below(self.vocab as u64) as u32;
        }
        let u = (u - MARKOV_UNIFORM_MIX) / (1.0 - MARKOV_UNIFORM_MIX);
        let k = self.successors.len() / self.vocab;
        let row = current as usize * k;
        let pick = self.cumulative[row..row + k].iter().position(|&c| u < c).unwrap_or(k - 1);
        self.successors[row + pick]
    }
}

/// pi = pi P by power iteration from the uniform distribution. The uniform mix
/// makes P a contraction (factor 1 - eps), so this converges geometrically.
fn stationary_distribution(vocab: usize, k: usize, successors: &[u32], weights: &[f64]) -> Vec<f64> {
    let uniform = MARKOV_UNIFORM_MIX / vocab as f64;
    let mut pi = vec![1.0 / vocab as f64; vocab];
    let mut next = vec![0.0; vocab];
    for _ in 0..10_000 {
        let mass: f64 = pi.iter().sum();
        next.fill(uniform * mass);
        for i in 0..vocab {
            let pi_i = (1.0 - MARKOV_UNIFORM_MIX) * pi[i];
            for j in 0..k {
                next[successors[i * k + j] as usize] += pi_i * weights[i * k + j];
            }
        }
        let change: f64 = pi.iter().zip(&next).map(|(a, b)| (a - b).abs()).sum();
        std::mem::swap(&mut pi, &mut next);
        if change < 1e-14 {
            break;
        }
    }
    let total: f64 = pi.iter().sum();
    pi.iter_mut().for_each(|p| *p /= total);
    pi
}

/// A text's tokens: its bytes as they are, or a tokenizer's ids.
#[derive(Clone, Debug)]
enum Tokens {
    Bytes(Arc<[u8]>),
    Ids(Arc<[u32]>),
}

impl Tokens {
    fn len(&self) -> usize {
        match self {
            Tokens::Bytes(b) => b.len(),
            Tokens::Ids(ids) => ids.len(),
        }
    }

    /// Tokens `[offset, offset + n)` into `inputs` and the ones after each into `targets`
    /// (n = their length).
    fn window(&self, offset: usize, inputs: &mut [u32], targets: &mut [u32]) {
        let n = inputs.len();
        match self {
            Tokens::Bytes(b) => {
                let w = &b[offset..offset + n + 1];
                inputs.iter_mut().zip(w).for_each(|(x, &t)| *x = u32::from(t));
                targets.iter_mut().zip(&w[1..]).for_each(|(y, &t)| *y = u32::from(t));
            }
            Tokens::Ids(ids) => {
                inputs.copy_from_slice(&ids[offset..offset + n]);
                targets.copy_from_slice(&ids[offset + 1..offset + n + 1]);
            }
        }
    }
}

/// A text cut into tokens: training windows from `trained`, validation windows from
/// `held_out`.
#[derive(Clone, Debug)]
struct Text {
    trained: Tokens,
    held_out: Tokens,
    /// The bytes each part came from.
    trained_bytes: usize,
    held_out_bytes: usize,
    tokenizer: TextTokenizer,
}

#[derive(Clone, Debug)]
enum Source {
    Markov(MarkovChain),
    Text(Text),
}

/// A dataset with its seed: hands out any slice of any step's global batch.
#[derive(Clone, Debug)]
pub struct Data {
    seed: u64,
    source: Source,
    /// Sequences per optimizer step (all ranks): numbers the text's samples across steps.
    global_batch: usize,
    /// The uploaded dataset's id (for the log).
    uploaded: Option<i64>,
}

impl Data {
    /// A built-in dataset (an uploaded one needs its file: [`Data::open`]).
    pub fn new(data: &DataSpec, model: &ModelSpec, global_batch: usize) -> Result<Self, DataError> {
        Self::open(data, model, global_batch, None)
    }

    /// The spec's dataset; `uploaded` is the file of `dataset: upload`'s text (the worker
    /// fetched it from the server).
    pub fn open(
        data: &DataSpec,
        model: &ModelSpec,
        global_batch: usize,
        uploaded: Option<&std::path::Path>,
    ) -> Result<Self, DataError> {
        let source = match data.dataset {
            Dataset::Markov => Source::Markov(MarkovChain::new(model.vocab, data.seed)),
            Dataset::Text => Self::text(SHAKESPEARE, data, model)?,
            Dataset::Upload => {
                let path = uploaded.ok_or(DataError::NoUploadedFile(data.upload_id.unwrap_or(0)))?;
                let bytes = std::fs::read(path).map_err(|e| DataError::UploadUnreadable {
                    path: path.display().to_string(),
                    message: e.to_string(),
                })?;
                Self::text(&bytes, data, model)?
            }
        };
        Ok(Self { seed: data.seed, source, global_batch, uploaded: data.upload_id })
    }

    /// A text as a dataset, split by [`distlab_common::text_split`]: the last tenth held out
    /// (at least one window of seq_len + 1 bytes on each side; with BPE, the split moved to
    /// the next character's start, and each part cut into tokens on its own).
    fn text(bytes: &[u8], data: &DataSpec, model: &ModelSpec) -> Result<Source, DataError> {
        if model.vocab < 256 {
            return Err(DataError::VocabTooSmallForText(model.vocab));
        }
        let mut split = distlab_common::text_split(bytes.len(), model.seq_len)
            .ok_or(DataError::TextTooShort { seq_len: model.seq_len, len: bytes.len() })?;
        let (trained, held_out, tokenizer) = match data.tokenizer {
            TokenizerKind::Bytes => {
                (Tokens::Bytes(bytes[..split].into()), Tokens::Bytes(bytes[split..].into()), TextTokenizer::Bytes)
            }
            TokenizerKind::Bpe => {
                // A UTF-8 continuation byte is 0b10xx_xxxx.
                while split < bytes.len() && bytes[split] & 0xC0 == 0x80 {
                    split += 1;
                }
                let tokenizer = TextTokenizer::learn(TokenizerKind::Bpe, &bytes[..split], model.vocab)?;
                let ids = |part: &[u8], name| {
                    let ids = tokenizer.encode(part)?;
                    if ids.len() <= model.seq_len {
                        return Err(DataError::TooFewTokens { seq_len: model.seq_len, part: name, tokens: ids.len() });
                    }
                    Ok(Tokens::Ids(ids.into()))
                };
                (ids(&bytes[..split], "training")?, ids(&bytes[split..], "held-out")?, tokenizer)
            }
        };
        let (trained_bytes, held_out_bytes) = (split, bytes.len() - split);
        Ok(Source::Text(Text { trained, held_out, trained_bytes, held_out_bytes, tokenizer }))
    }

    /// Writes a BPE text's tokenizer and both parts' token ids into `dir`, for the ranks of
    /// the run to read ([`Data::open_cut`]) instead of each learning the BPE and cutting the
    /// text again (about 25 s for a 16 MiB text on this machine's cores, per rank). Returns
    /// false, writing nothing, for a text of bytes or the Markov chain.
    pub fn write_cut(&self, dir: &Path) -> Result<bool, DataError> {
        let Source::Text(text) = &self.source else { return Ok(false) };
        let (Tokens::Ids(trained), Tokens::Ids(held_out), Some(json)) =
            (&text.trained, &text.held_out, text.tokenizer.to_json())
        else {
            return Ok(false);
        };
        let write = |name: &str, bytes: &[u8]| {
            std::fs::write(dir.join(name), bytes).map_err(|e| cut_error(dir, format!("writing {name}: {e}")))
        };
        let ids = |ids: &[u32]| ids.iter().flat_map(|id| id.to_le_bytes()).collect::<Vec<u8>>();
        write(crate::tokenizer::TOKENIZER_FILE, json.as_bytes())?;
        write(CUT_TRAINED, &ids(trained))?;
        write(CUT_HELD_OUT, &ids(held_out))?;
        write(CUT_BYTES, format!("[{}, {}]", text.trained_bytes, text.held_out_bytes).as_bytes())?;
        Ok(true)
    }

    /// A BPE text as [`Data::write_cut`] left it in `dir`, checked against the spec: the
    /// tokenizer no larger than the vocabulary, every id in it, each part longer than a
    /// window.
    pub fn open_cut(data: &DataSpec, model: &ModelSpec, global_batch: usize, dir: &Path) -> Result<Self, DataError> {
        let read = |name: &str| std::fs::read(dir.join(name)).map_err(|e| cut_error(dir, format!("{name}: {e}")));
        let json = String::from_utf8(read(crate::tokenizer::TOKENIZER_FILE)?)
            .map_err(|_| cut_error(dir, "tokenizer.json is not UTF-8".into()))?;
        let tokenizer = TextTokenizer::from_json(&json)?;
        if tokenizer.vocab_size() > model.vocab {
            let message =
                format!("its tokenizer has {} tokens, more than vocab={}", tokenizer.vocab_size(), model.vocab);
            return Err(cut_error(dir, message));
        }
        let ids = |name: &str, part: &'static str| -> Result<Tokens, DataError> {
            let bytes = read(name)?;
            if !bytes.len().is_multiple_of(4) {
                return Err(cut_error(dir, format!("{name} is not a whole number of 4-byte ids")));
            }
            let ids: Vec<u32> = bytes.chunks_exact(4).map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect();
            if let Some(id) = ids.iter().find(|&&id| id as usize >= model.vocab) {
                return Err(cut_error(dir, format!("{name} holds token {id}, outside vocab={}", model.vocab)));
            }
            if ids.len() <= model.seq_len {
                return Err(DataError::TooFewTokens { seq_len: model.seq_len, part, tokens: ids.len() });
            }
            Ok(Tokens::Ids(ids.into()))
        };
        let (trained, held_out) = (ids(CUT_TRAINED, "training")?, ids(CUT_HELD_OUT, "held-out")?);
        let [trained_bytes, held_out_bytes]: [usize; 2] =
            serde_json::from_slice(&read(CUT_BYTES)?).map_err(|e| cut_error(dir, format!("{CUT_BYTES}: {e}")))?;
        let text = Text { trained, held_out, trained_bytes, held_out_bytes, tokenizer };
        Ok(Self { seed: data.seed, source: Source::Text(text), global_batch, uploaded: data.upload_id })
    }

    /// A text's split: (bytes trained on, bytes held out); None for the Markov chain
    /// (its validation sequences come from a stream of their own).
    pub fn split(&self) -> Option<(usize, usize)> {
        match &self.source {
            Source::Markov(_) => None,
            Source::Text(text) => Some((text.trained_bytes, text.held_out_bytes)),
        }
    }

    /// A text's tokenizer (None for the Markov chain, whose tokens are ids already).
    pub fn tokenizer(&self) -> Option<&TextTokenizer> {
        match &self.source {
            Source::Markov(_) => None,
            Source::Text(text) => Some(&text.tokenizer),
        }
    }

    /// The held-out text's bytes per token (1 for bytes): a validation loss per token over
    /// this is the loss per byte, which compares across tokenizers.
    pub fn held_out_bytes_per_token(&self) -> Option<f64> {
        match &self.source {
            Source::Markov(_) => None,
            Source::Text(text) => Some(text.held_out_bytes as f64 / text.held_out.len() as f64),
        }
    }

    /// The best achievable loss, when known (the Markov chain's entropy rate).
    pub fn loss_floor(&self) -> Option<f64> {
        match &self.source {
            Source::Markov(chain) => Some(chain.entropy_rate()),
            Source::Text(_) => None,
        }
    }

    /// One line for the run's log.
    pub fn describe(&self) -> String {
        match &self.source {
            Source::Markov(chain) => format!(
                "data: random Markov chain over {} tokens (seed {}), {} likely successors per token; \
                 best possible loss (entropy rate) {:.4} nats vs {:.4} for uniform guessing",
                chain.vocab,
                self.seed,
                MARKOV_SUCCESSORS.min(chain.vocab),
                chain.entropy_rate(),
                (chain.vocab as f64).ln()
            ),
            Source::Text(text) => {
                let tokens = match &text.tokenizer {
                    TextTokenizer::Bytes => "one token per byte".to_string(),
                    TextTokenizer::Bpe(_) => format!(
                        "a byte-level BPE of {} tokens learned from the training part ({} training and {} held-out \
                         tokens, {:.3} bytes per token held out)",
                        text.tokenizer.vocab_size(),
                        text.trained.len(),
                        text.held_out.len(),
                        self.held_out_bytes_per_token().unwrap_or(1.0)
                    ),
                };
                format!(
                    "data: {}, {} bytes, {tokens} (seed {}): {} bytes for training, the last {} held out for the \
                     validation loss",
                    self.uploaded.map_or("Shakespeare text".to_string(), |id| format!("uploaded text {id}")),
                    text.trained_bytes + text.held_out_bytes,
                    self.seed,
                    text.trained_bytes,
                    text.held_out_bytes
                )
            }
        }
    }

    /// Writes sequences `[start, start + count)` of step `step`'s global batch:
    /// `inputs` and `targets` each get `count * seq_len` tokens, sequence by sequence.
    ///
    /// Markov: sequence i of step t is sampled from the chain with a generator seeded by
    /// (seed, t, i). Text (DistributedSampler semantics): the text is cut into
    /// non-overlapping windows; every epoch visits all of them in an order shuffled from
    /// (seed, epoch); the global batch of step t takes the next `global_batch` windows of
    /// that order, so the data-parallel ranks, which take disjoint slices of the global
    /// batch, see disjoint windows.
    pub fn fill_batch(
        &self,
        step: u64,
        start: usize,
        count: usize,
        seq_len: usize,
        inputs: &mut [u32],
        targets: &mut [u32],
    ) {
        let inputs = &mut inputs[..count * seq_len];
        let targets = &mut targets[..count * seq_len];
        let mut epoch_order: Option<(u64, Vec<u32>)> = None;
        for (i, (inp, tgt)) in inputs.chunks_exact_mut(seq_len).zip(targets.chunks_exact_mut(seq_len)).enumerate() {
            let index = (start + i) as u64;
            match &self.source {
                Source::Markov(chain) => {
                    let mut rng = Rng::from_parts(&[self.seed, SEQUENCE_STREAM, step, index]);
                    let mut current = chain.first_token(&mut rng);
                    for (x, y) in inp.iter_mut().zip(tgt.iter_mut()) {
                        let next = chain.next_token(current, &mut rng);
                        *x = current;
                        *y = next;
                        current = next;
                    }
                }
                Source::Text(text) => {
                    let windows = ((text.trained.len() - 1) / seq_len) as u64;
                    let global = step * self.global_batch as u64 + index;
                    let (epoch, position) = (global / windows, global % windows);
                    let order = match &epoch_order {
                        Some((e, order)) if *e == epoch => order,
                        _ => &epoch_order.insert((epoch, shuffled(windows as usize, self.seed, epoch))).1,
                    };
                    text.trained.window(order[position as usize] as usize * seq_len, inp, tgt);
                }
            }
        }
    }
}

impl Data {
    /// Writes validation sequences `[start, start + count)` (the same ones at every
    /// evaluation, so that the losses compare): Markov, sequence i sampled from the chain
    /// with a generator of its own (seed, i); text, the held-out part cut into windows,
    /// sequence i the (i mod windows)-th.
    pub fn fill_validation(&self, start: usize, count: usize, seq_len: usize, inputs: &mut [u32], targets: &mut [u32]) {
        let inputs = &mut inputs[..count * seq_len];
        let targets = &mut targets[..count * seq_len];
        for (i, (inp, tgt)) in inputs.chunks_exact_mut(seq_len).zip(targets.chunks_exact_mut(seq_len)).enumerate() {
            let index = start + i;
            match &self.source {
                Source::Markov(chain) => {
                    let mut rng = Rng::from_parts(&[self.seed, VALIDATION_STREAM, index as u64]);
                    let mut current = chain.first_token(&mut rng);
                    for (x, y) in inp.iter_mut().zip(tgt.iter_mut()) {
                        let next = chain.next_token(current, &mut rng);
                        (*x, *y) = (current, next);
                        current = next;
                    }
                }
                Source::Text(text) => {
                    let windows = (text.held_out.len() - 1) / seq_len;
                    text.held_out.window((index % windows) * seq_len, inp, tgt);
                }
            }
        }
    }
}

/// 0..n in the order of epoch `epoch` (Fisher-Yates from (seed, epoch)).
fn shuffled(n: usize, seed: u64, epoch: u64) -> Vec<u32> {
    let mut order: Vec<u32> = (0..n as u32).collect();
    let mut rng = Rng::from_parts(&[seed, EPOCH_STREAM, epoch]);
    for i in (1..n).rev() {
        let j = rng.below(i as u64 + 1) as usize;
        order.swap(i, j);
    }
    order
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The text's last tenth is held out: no training window, over many epochs' worth of
    /// steps, is one of the held-out windows, and every validation window is.
    #[test]
    fn the_held_out_text_is_never_trained_on() {
        let (data_spec, model) = spec(Dataset::Text, 256, 64);
        let data = Data::new(&data_spec, &model, 64).unwrap();
        let (trained, held_out) = data.split().unwrap();
        assert_eq!(trained + held_out, SHAKESPEARE.len());
        assert_eq!(held_out, SHAKESPEARE.len() / 10);
        let seq = model.seq_len;
        let held: std::collections::HashSet<&[u8]> = SHAKESPEARE[trained..].windows(seq).collect();
        let (mut inputs, mut targets) = (vec![0u32; 64 * seq], vec![0u32; 64 * seq]);
        let bytes = |tokens: &[u32]| tokens.iter().map(|&t| t as u8).collect::<Vec<u8>>();
        // 64 windows per step, 4,000-odd training windows: 200 steps are three epochs.
        for step in 0..200 {
            data.fill_batch(step, 0, 64, seq, &mut inputs, &mut targets);
            for window in inputs.chunks(seq) {
                assert!(!held.contains(bytes(window).as_slice()), "step {step} trains on held-out text");
            }
        }
        data.fill_validation(0, 64, seq, &mut inputs, &mut targets);
        for (window, target) in inputs.chunks(seq).zip(targets.chunks(seq)) {
            assert!(held.contains(bytes(window).as_slice()));
            assert_eq!(&target[..seq - 1], &window[1..], "targets are the next tokens");
        }
        // The same sequences at every evaluation.
        let again = {
            let (mut i, mut t) = (vec![0u32; 64 * seq], vec![0u32; 64 * seq]);
            data.fill_validation(0, 64, seq, &mut i, &mut t);
            i
        };
        assert_eq!(again, inputs);
    }

    /// An uploaded text is read from the file the worker was given and split like the
    /// built-in one; without the file, or with too few bytes, the error says so.
    #[test]
    fn an_uploaded_text_comes_from_its_file() {
        let (mut data_spec, model) = spec(Dataset::Upload, 256, 16);
        data_spec.upload_id = Some(7);
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("dataset-7.txt");
        std::fs::write(&file, "abcdefghij".repeat(20)).unwrap();
        let data = Data::open(&data_spec, &model, 4, Some(&file)).unwrap();
        assert_eq!(data.split(), Some((180, 20)));
        assert!(data.describe().starts_with("data: uploaded text 7, 200 bytes"), "{}", data.describe());
        let (mut inputs, mut targets) = (vec![0u32; 4 * 16], vec![0u32; 4 * 16]);
        data.fill_validation(0, 1, 16, &mut inputs, &mut targets);
        assert_eq!(inputs[..3], [b'a' as u32, b'b' as u32, b'c' as u32], "the held-out part starts at byte 180");
        assert_eq!(Data::open(&data_spec, &model, 4, None).unwrap_err(), DataError::NoUploadedFile(7));
        std::fs::write(&file, "short").unwrap();
        assert_eq!(
            Data::open(&data_spec, &model, 4, Some(&file)).unwrap_err(),
            DataError::TextTooShort { seq_len: 16, len: 5 }
        );
    }

    /// With BPE, the tokenizer is learned from the training part: every window decodes to
    /// text of its part (training windows to the training text, validation windows to the
    /// held-out text), Shakespeare takes about two bytes per token at 512 tokens, and a text
    /// too short in tokens says so.
    #[test]
    fn bpe_windows_are_the_texts_own_pieces() {
        let (mut data_spec, mut model) = spec(Dataset::Text, 512, 64);
        data_spec.tokenizer = TokenizerKind::Bpe;
        let data = Data::new(&data_spec, &model, 8).unwrap();
        let tokenizer = data.tokenizer().unwrap().clone();
        assert_eq!(tokenizer.vocab_size(), 512);
        let per_token = data.held_out_bytes_per_token().unwrap();
        assert!((1.8..2.4).contains(&per_token), "{per_token} bytes per token");
        assert!(data.describe().contains("a byte-level BPE of 512 tokens"), "{}", data.describe());
        let (trained, _) = data.split().unwrap();
        let (training_text, held_out_text) =
            (String::from_utf8_lossy(&SHAKESPEARE[..trained]), String::from_utf8_lossy(&SHAKESPEARE[trained..]));
        let (mut x, mut y) = (vec![0u32; 8 * 64], vec![0u32; 8 * 64]);
        data.fill_batch(3, 0, 8, 64, &mut x, &mut y);
        for (inputs, targets) in x.chunks(64).zip(y.chunks(64)) {
            assert!(training_text.contains(&tokenizer.decode(inputs).unwrap()));
            assert_eq!(&inputs[1..], &targets[..63]);
        }
        data.fill_validation(0, 8, 64, &mut x, &mut y);
        for window in x.chunks(64) {
            assert!(held_out_text.contains(&tokenizer.decode(window).unwrap()));
        }
        // 300 bytes hold a byte window of 64 on each side, but not one of BPE tokens.
        model.seq_len = 24;
        data_spec.dataset = Dataset::Upload;
        data_spec.upload_id = Some(1);
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("short.txt");
        std::fs::write(&file, "the cat sat on the mat. ".repeat(13)).unwrap();
        let err = Data::open(&data_spec, &model, 4, Some(&file)).unwrap_err();
        assert!(matches!(err, DataError::TooFewTokens { part: "held-out", .. }), "{err}");
    }

    /// A BPE text cut once and read back by a rank is the same data: the same batches and
    /// validation windows, split, tokenizer and log line; a bytes text writes nothing; a
    /// damaged cut (an id outside the vocabulary, a tokenizer larger than it, a missing
    /// file) is refused saying what is wrong.
    #[test]
    fn a_text_cut_once_reads_back_as_the_same_data() {
        let (mut data_spec, mut model) = spec(Dataset::Text, 400, 32);
        data_spec.tokenizer = TokenizerKind::Bpe;
        let cut = Data::new(&data_spec, &model, 8).unwrap();
        let dir = tempfile::tempdir().unwrap();
        assert!(cut.write_cut(dir.path()).unwrap());
        let read = Data::open_cut(&data_spec, &model, 8, dir.path()).unwrap();
        assert_eq!(read.split(), cut.split());
        assert_eq!(read.describe(), cut.describe());
        assert_eq!(read.tokenizer().unwrap().to_json(), cut.tokenizer().unwrap().to_json());
        let windows = |d: &Data| {
            let (mut x, mut y) = (vec![0u32; 8 * 32], vec![0u32; 8 * 32]);
            d.fill_batch(5, 0, 8, 32, &mut x, &mut y);
            let (mut vx, mut vy) = (vec![0u32; 8 * 32], vec![0u32; 8 * 32]);
            d.fill_validation(0, 8, 32, &mut vx, &mut vy);
            (x, y, vx, vy)
        };
        assert_eq!(windows(&read), windows(&cut));
        // bytes: nothing to cut once
        let (bytes_spec, bytes_model) = spec(Dataset::Text, 256, 32);
        let empty = tempfile::tempdir().unwrap();
        assert!(!Data::new(&bytes_spec, &bytes_model, 8).unwrap().write_cut(empty.path()).unwrap());
        // a vocabulary smaller than the cut's tokenizer and ids
        model.vocab = 300;
        let err = Data::open_cut(&data_spec, &model, 8, dir.path()).unwrap_err();
        assert!(err.to_string().contains("more than vocab=300"), "{err}");
        model.vocab = 400;
        std::fs::write(dir.path().join(CUT_HELD_OUT), 9999u32.to_le_bytes().repeat(40)).unwrap();
        let err = Data::open_cut(&data_spec, &model, 8, dir.path()).unwrap_err();
        assert!(err.to_string().contains("holds token 9999, outside vocab=400"), "{err}");
        std::fs::remove_file(dir.path().join(CUT_TRAINED)).unwrap();
        let err = Data::open_cut(&data_spec, &model, 8, dir.path()).unwrap_err();
        assert!(matches!(err, DataError::CutText { .. }) && err.to_string().contains("trained.ids"), "{err}");
    }

    /// Markov validation sequences come from the chain but never repeat a training one.
    #[test]
    fn markov_validation_sequences_are_drawn_apart() {
        let (data_spec, model) = spec(Dataset::Markov, 64, 32);
        let data = Data::new(&data_spec, &model, 8).unwrap();
        assert_eq!(data.split(), None);
        let seq = model.seq_len;
        let (mut train, mut val, mut t) = (vec![0u32; 8 * seq], vec![0u32; 8 * seq], vec![0u32; 8 * seq]);
        data.fill_validation(0, 8, seq, &mut val, &mut t);
        for step in 0..50 {
            data.fill_batch(step, 0, 8, seq, &mut train, &mut t);
            for (a, b) in train.chunks(seq).zip(val.chunks(seq)) {
                assert_ne!(a, b);
            }
        }
    }

    fn spec(dataset: Dataset, vocab: usize, seq_len: usize) -> (DataSpec, ModelSpec) {
        (DataSpec { dataset, seed: 3, ..DataSpec::default() }, ModelSpec { vocab, seq_len, ..ModelSpec::default() })
    }

    #[test]
    fn markov_floor_is_well_below_uniform_and_matches_sampling() {
        let chain = MarkovChain::new(64, 1);
        let h = chain.entropy_rate();
        let uniform = (64f64).ln();
        assert!(h > 0.5 && h < 0.6 * uniform, "entropy rate {h} vs ln V {uniform}");
        // The empirical -log p of a long sampled path converges to the entropy rate.
        let k = MARKOV_SUCCESSORS;
        let prob = |i: u32, j: u32| {
            let mut p = MARKOV_UNIFORM_MIX / 64.0;
            let row = i as usize * k;
            for s in 0..k {
                if chain.successors[row + s] == j {
                    let w = chain.cumulative[row + s] - if s == 0 { 0.0 } else { chain.cumulative[row + s - 1] };
                    p += (1.0 - MARKOV_UNIFORM_MIX) * w;
                }
            }
            p
        };
        let mut rng = Rng::new(9);
        let mut x = chain.first_token(&mut rng);
        let n = 400_000;
        let mut nll = 0.0;
        for _ in 0..n {
            let y = chain.next_token(x, &mut rng);
            nll -= prob(x, y).ln();
            x = y;
        }
        let empirical = nll / n as f64;
        assert!((empirical - h).abs() < 0.02, "empirical {empirical} vs entropy rate {h}");
    }

    #[test]
    fn stationary_distribution_is_stationary() {
        let chain = MarkovChain::new(10, 5);
        let pi: Vec<f64> = std::iter::once(chain.stationary_cdf[0])
            .chain(chain.stationary_cdf.windows(2).map(|w| w[1] - w[0]))
            .collect();
        let k = MARKOV_SUCCESSORS;
        let mut next = vec![MARKOV_UNIFORM_MIX / 10.0; 10];
        for i in 0..10 {
            for s in 0..k {
                let w = chain.cumulative[i * k + s] - if s == 0 { 0.0 } else { chain.cumulative[i * k + s - 1] };
                next[chain.successors[i * k + s] as usize] += (1.0 - MARKOV_UNIFORM_MIX) * pi[i] * w;
            }
        }
        for (a, b) in pi.iter().zip(&next) {
            assert!((a - b).abs() < 1e-12);
        }
        assert!((chain.stationary_cdf[9] - 1.0).abs() < 1e-12);
    }

    #[test]
    fn tiny_vocab_works() {
        let chain = MarkovChain::new(2, 1);
        assert!(chain.entropy_rate() > 0.0 && chain.entropy_rate() <= 2f64.ln() + 1e-12);
    }

    #[test]
    fn a_slice_of_the_batch_equals_the_same_sequences_of_the_whole_batch() {
        for dataset in [Dataset::Markov, Dataset::Text] {
            let (d, m) = spec(dataset, 256, 16);
            let data = Data::new(&d, &m, 8).unwrap();
            let (mut xa, mut ya) = (vec![0; 8 * 16], vec![0; 8 * 16]);
            data.fill_batch(5, 0, 8, 16, &mut xa, &mut ya);
            let (mut xb, mut yb) = (vec![0; 3 * 16], vec![0; 3 * 16]);
            data.fill_batch(5, 2, 3, 16, &mut xb, &mut yb);
            assert_eq!(&xa[2 * 16..5 * 16], &xb[..]);
            assert_eq!(&ya[2 * 16..5 * 16], &yb[..]);
            // targets are inputs shifted by one
            assert_eq!(&xa[1..16], &ya[..15]);
            // another step gives other data
            let (mut xc, mut yc) = (vec![0; 8 * 16], vec![0; 8 * 16]);
            data.fill_batch(6, 0, 8, 16, &mut xc, &mut yc);
            assert_ne!(xa, xc);
            assert!(xa.iter().all(|&t| t < 256));
        }
    }

    #[test]
    fn text_needs_a_byte_vocab() {
        let (d, m) = spec(Dataset::Text, 64, 16);
        assert_eq!(Data::new(&d, &m, 8).unwrap_err(), DataError::VocabTooSmallForText(64));
        let (d, m) = spec(Dataset::Text, 256, 16);
        assert!(Data::new(&d, &m, 8).unwrap().loss_floor().is_none());
    }

    #[test]
    fn text_epochs_visit_every_window_once_in_a_seeded_order() {
        let (d, m) = spec(Dataset::Text, 256, 64);
        let data = Data::new(&d, &m, 16).unwrap();
        let (trained, _) = data.split().unwrap();
        let windows = (trained - 1) / 64;
        let steps = windows / 16;
        let mut seen = std::collections::HashSet::new();
        let (mut x, mut y) = (vec![0u32; 16 * 64], vec![0u32; 16 * 64]);
        for step in 0..steps as u64 {
            // Two ranks' halves of the global batch are disjoint and make up the whole.
            data.fill_batch(step, 0, 8, 64, &mut x[..8 * 64], &mut y[..8 * 64]);
            data.fill_batch(step, 8, 8, 64, &mut x[8 * 64..], &mut y[8 * 64..]);
            for seq in x.chunks(64) {
                assert!(seen.insert(seq.to_vec()), "a window repeats within the epoch");
            }
        }
        assert_eq!(seen.len(), steps * 16);
        // The next epoch uses another order.
        assert_ne!(shuffled(windows, 3, 0), shuffled(windows, 3, 1));
    }
}
