//! How a rank runs (thread count, directories): not part of the experiment, so results do
//! not depend on it.

use std::path::PathBuf;

/// How to run (not part of the experiment: results do not depend on it).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct TrainOptions {
    /// Kernel threads; 0 = all available cores.
    pub threads: usize,
    /// Where checkpoints go (None: the run saves none, whatever `checkpoint_every` says).
    pub checkpoints: Option<CheckpointOptions>,
    /// Where `parallel.offload=disk` keeps the optimizer's state (None: the system's
    /// temporary directory).
    pub offload_dir: Option<PathBuf>,
    /// Where each rank writes its final parameters when the run succeeds (`export.rs`
    /// puts them together; None: not written).
    pub final_weights: Option<PathBuf>,
    /// The text of `data.dataset: upload` (None for the built-in datasets).
    pub dataset: Option<PathBuf>,
    /// A BPE run's text, cut into tokens once for all the ranks (`Data::write_cut`; None:
    /// each rank cuts it itself).
    pub cut_text: Option<PathBuf>,
}

/// The run's checkpoint directory and the step to resume from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CheckpointOptions {
    /// The experiment's directory (see `checkpoint.rs`), made ready by `CheckpointDir::prepare`.
    pub dir: PathBuf,
    /// Resume from the complete checkpoint of this step.
    pub resume_from: Option<u64>,
}
