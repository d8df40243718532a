//! ZeRO-Offload (`parallel.offload`): the optimizer's state (AdamW's m and v, the fp32
//! master weights of a bf16/fp16 model) leaves the device, and so does its update.
//!
//! * `host` (ZeRO-Offload proper): the whole state in host memory. Each update brings
//!   the gradients down to the host, runs the optimizer's CPU kernel there (`ops/optimizer.rs`)
//!   and sends the updated parameters back up: the state's 8 (fp32 AdamW) or 12 (2-byte
//!   AdamW) bytes per parameter leave the GPU, for a gradient down and a parameter up
//!   crossing the bus each step. On the CPU backend the host is the device, so the spec is
//!   refused there.
//! * `disk` (ZeRO-Infinity's NVMe tier): the state in a file, streamed through one piece
//!   of `OFFLOAD_PIECE_ELEMENTS` parameters: read the piece's m, v and master, update,
//!   write them back, next piece. Only the piece is in memory, so on the CPU backend the
//!   process's resident memory really drops by the state's size, for the reads and
//!   writes each step costs (the page cache may keep the file: it is not the process's).
//!
//! The file has no name (made with `tempfile_in`, removed by the kernel when the process
//! ends however it ends) and is laid out as the state's regions one after another:
//! `[m: len][v: len][master: len]` f32s, those the state has.

use std::fs::File;
use std::ops::Range;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use distlab_common::planner::OFFLOAD_PIECE_ELEMENTS;

use crate::backend::Stored;
use crate::ops::optimizer::{needs_master, HostOptimizerBuffers, OptimizerSlices, OptimizerState, TrustPass, Update};

/// Where an optimizer's state goes (`parallel.offload`, with the directory for `disk`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum OffloadTo {
    None,
    Host,
    Disk(PathBuf),
}

/// Disk offload's file could not be made, read or written (full disk, missing directory).
#[derive(Debug, thiserror::Error)]
#[error("optimizer state offloaded to disk under {dir}: {what}: {source}")]
pub struct OffloadError {
    pub dir: PathBuf,
    pub what: &'static str,
    #[source]
    pub source: std::io::Error,
}

/// The optimizer's state off the device.
pub enum OffloadedState {
    /// All of it in host memory.
    Host(HostOptimizerBuffers<f32>),
    /// In a file, updated piece by piece.
    Disk(DiskState),
}

/// The state in a file and the one piece of it in memory.
pub struct DiskState {
    file: File,
    dir: PathBuf,
    /// Parameters the state is for.
    len: usize,
    /// The regions of the file, in order: m and v (AdamW), master (2-byte models).
    regions: Vec<Region>,
    /// Where the piece being updated is read into, `piece_len` parameters long.
    piece: HostOptimizerBuffers<f32>,
    piece_len: usize,
}

/// One of the state's buffers, a region of the file.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Region {
    M,
    V,
    Master,
}

impl Region {
    /// Its buffer in `b` (a master buffer is made if `b` has none).
    fn of(self, b: &mut HostOptimizerBuffers<f32>) -> &mut Vec<f32> {
        match self {
            Region::M => &mut b.m,
            Region::V => &mut b.v,
            Region::Master => b.master.get_or_insert_with(Vec::new),
        }
    }

    /// Its values in a checkpoint's state.
    fn in_saved(self, saved: &OptimizerState) -> &[f32] {
        match self {
            Region::M => &saved.m,
            Region::V => &saved.v,
            Region::Master => saved.master.as_deref().unwrap_or_default(),
        }
    }
}

impl OffloadedState {
    /// The whole state in host memory, for `len` parameters of a model stored as `S`.
    pub fn host<S: Stored<Acc = f32>>(len: usize, moments: bool, initial: impl FnOnce() -> Vec<f32>) -> Self {
        OffloadedState::Host(HostOptimizerBuffers::new::<S>(len, moments, initial))
    }

    /// The state in a new file under `dir`: m and v start at zero, master (2-byte models)
    /// at `initial`.
    pub fn disk<S: Stored<Acc = f32>>(
        dir: &Path,
        len: usize,
        moments: bool,
        initial: impl FnOnce() -> Vec<f32>,
    ) -> Result<Self, OffloadError> {
        let fail = |what| move |source| OffloadError { dir: dir.to_path_buf(), what, source };
        std::fs::create_dir_all(dir).map_err(fail("making the directory"))?;
        let file = tempfile::tempfile_in(dir).map_err(fail("making the file"))?;
        let mut regions = if moments { vec![Region::M, Region::V] } else { Vec::new() };
        if needs_master::<S>() {
            regions.push(Region::Master);
        }
        let piece_len = len.min(OFFLOAD_PIECE_ELEMENTS);
        let piece = HostOptimizerBuffers::new::<S>(piece_len, moments, || vec![0.0; piece_len]);
        let disk = DiskState { file, dir: dir.to_path_buf(), len, regions, piece, piece_len: piece_len.max(1) };
        // Zeros where the file is extended; the master weights written once.
        disk.file.set_len((disk.regions.len() * len * 4) as u64).map_err(fail("sizing the file"))?;
        if let Some(at) = disk.regions.iter().position(|&r| r == Region::Master) {
            let values = initial();
            assert_eq!(values.len(), len, "master weights for every parameter this optimizer updates");
            disk.write(at, 0, &values)?;
        }
        Ok(OffloadedState::Disk(disk))
    }

    /// One update of `params` (the model's, on the host) from `grads`, whose state is `range`.
    pub fn update<S: Stored<Acc = f32>>(
        &mut self,
        params: &mut [S],
        grads: &[S],
        range: Range<usize>,
        update: &Update,
    ) -> Result<(), OffloadError> {
        match self {
            OffloadedState::Host(buffers) => {
                buffers.update(params, grads, range, update);
                Ok(())
            }
            OffloadedState::Disk(disk) => disk.update(params, grads, range, update),
        }
    }

    /// A layer-wise update's first pass over a piece of one tensor (see
    /// `HostOptimizerBuffers::trust_squares`); from disk, streamed through the piece.
    pub fn trust_squares<S: Stored<Acc = f32>>(
        &mut self,
        params: &[S],
        grads: &[S],
        range: Range<usize>,
        pass: &TrustPass,
    ) -> Result<(f64, f64), OffloadError> {
        match self {
            OffloadedState::Host(buffers) => Ok(buffers.trust_squares(params, grads, range, pass)),
            OffloadedState::Disk(disk) => {
                let (mut w2, mut u2) = (0.0, 0.0);
                let piece_len = disk.piece_len;
                for ((params, grads), at) in
                    params.chunks(piece_len).zip(grads.chunks(piece_len)).zip(range.step_by(piece_len))
                {
                    let n = params.len();
                    disk.through_piece(at, n, |piece| {
                        let (w, u) = piece.trust_squares(params, grads, 0..n, pass);
                        (w2, u2) = (w2 + w, u2 + u);
                    })?;
                }
                Ok((w2, u2))
            }
        }
    }

    /// Shows `f` the whole state, read into memory for the call from disk.
    pub fn read<R>(&self, f: impl FnOnce(OptimizerSlices<'_>) -> R) -> Result<R, OffloadError> {
        match self {
            OffloadedState::Host(b) => Ok(f(OptimizerSlices { m: &b.m, v: &b.v, master: b.master.as_deref() })),
            OffloadedState::Disk(disk) => {
                let whole = disk.read_all()?;
                Ok(f(OptimizerSlices { m: &whole.m, v: &whole.v, master: whole.master.as_deref() }))
            }
        }
    }

    /// Puts back a checkpoint's state, which must be as long as this one.
    pub fn load(&mut self, saved: &OptimizerState) -> Result<(), String> {
        match self {
            OffloadedState::Host(b) => b.load(saved),
            OffloadedState::Disk(disk) => disk.load(saved),
        }
    }

    /// Floats of it in host memory at every step: all of a host state, a disk state's piece.
    pub fn host_floats(&self) -> usize {
        match self {
            OffloadedState::Host(b) => b.m.len() + b.v.len() + b.master.as_ref().map_or(0, Vec::len),
            OffloadedState::Disk(disk) => disk.piece_floats(),
        }
    }

    /// Floats a checkpoint's read of it holds for the call beyond those (a disk state read whole).
    pub fn read_floats(&self) -> usize {
        match self {
            OffloadedState::Host(_) => 0,
            OffloadedState::Disk(disk) => disk.regions.len() * disk.len,
        }
    }
}

impl DiskState {
    fn fail(&self, what: &'static str) -> impl FnOnce(std::io::Error) -> OffloadError + '_ {
        move |source| OffloadError { dir: self.dir.clone(), what, source }
    }

    /// Byte offset of parameter `at` of the `region`-th region.
    fn offset(&self, region: usize, at: usize) -> u64 {
        ((region * self.len + at) * 4) as u64
    }

    fn read(&self, region: usize, at: usize, into: &mut [f32]) -> Result<(), OffloadError> {
        let bytes: &mut [u8] = bytemuck::cast_slice_mut(into);
        self.file.read_exact_at(bytes, self.offset(region, at)).map_err(self.fail("reading"))
    }

    fn write(&self, region: usize, at: usize, from: &[f32]) -> Result<(), OffloadError> {
        self.file.write_all_at(bytemuck::cast_slice(from), self.offset(region, at)).map_err(self.fail("writing"))
    }

    /// Streams `range` of the state through the piece: read, update, write back.
    fn update<S: Stored<Acc = f32>>(
        &mut self,
        params: &mut [S],
        grads: &[S],
        range: Range<usize>,
        update: &Update,
    ) -> Result<(), OffloadError> {
        let piece_len = self.piece_len;
        let (params, grads) = (params.chunks_mut(piece_len), grads.chunks(piece_len));
        for ((params, grads), at) in params.zip(grads).zip(range.step_by(piece_len)) {
            let n = params.len();
            self.through_piece(at, n, |piece| piece.update(params, grads, 0..n, update))?;
        }
        Ok(())
    }

    /// Reads the state of parameters `at..at + n` into the piece, runs `f` on it, writes
    /// it back.
    fn through_piece(
        &mut self,
        at: usize,
        n: usize,
        f: impl FnOnce(&mut HostOptimizerBuffers<f32>),
    ) -> Result<(), OffloadError> {
        let mut piece = std::mem::take(&mut self.piece);
        let result = (|| {
            for (i, region) in self.regions.iter().enumerate() {
                self.read(i, at, &mut region.of(&mut piece)[..n])?;
            }
            f(&mut piece);
            for (i, region) in self.regions.iter().enumerate() {
                self.write(i, at, &region.of(&mut piece)[..n])?;
            }
            Ok(())
        })();
        self.piece = piece;
        result
    }

    /// The whole state in memory (for a checkpoint).
    fn read_all(&self) -> Result<HostOptimizerBuffers<f32>, OffloadError> {
        let mut whole = HostOptimizerBuffers::default();
        for (i, region) in self.regions.iter().enumerate() {
            let values = region.of(&mut whole);
            values.resize(self.len, 0.0);
            self.read(i, 0, values)?;
        }
        Ok(whole)
    }

    fn load(&mut self, saved: &OptimizerState) -> Result<(), String> {
        let has = |r| if self.regions.contains(&r) { self.len } else { 0 };
        saved.check_lengths(has(Region::M), has(Region::Master))?;
        for (i, region) in self.regions.iter().enumerate() {
            self.write(i, 0, region.in_saved(saved)).map_err(|e| e.to_string())?;
        }
        Ok(())
    }

    /// Floats of the piece.
    fn piece_floats(&self) -> usize {
        self.regions.len() * self.piece_len.min(self.len)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::{Buffers, CpuBackend};
    use crate::memory::MemoryTracker;
    use crate::optim::{Indexing, OptimGroup, OptimGroups, Optimizer};
    use distlab_common::planner::RankMemory;
    use distlab_common::TrainSpec;

    /// More parameters than two pieces: the disk state streams through three.
    const LEN: usize = 2 * OFFLOAD_PIECE_ELEMENTS + 1000;

    fn initial() -> Vec<f32> {
        (0..LEN).map(|i| ((i as f32) * 0.37).sin() * 0.1).collect()
    }

    struct Run<S> {
        params: Vec<S>,
        state: OptimizerState,
        ledger: RankMemory,
    }

    /// `steps` updates (AdamW or LAMB) of LEN parameters (two tensors, one decayed) with
    /// the state where `offload` says, from `start` (a checkpoint's state) when given.
    fn train<S: Stored<Acc = f32>>(
        offload: &OffloadTo,
        optimizer: distlab_common::Optimizer,
        steps: u64,
        start: Option<(&[S], OptimizerState)>,
    ) -> Run<S> {
        let be = CpuBackend::<S>::new(1);
        let memory = MemoryTracker::new();
        let train = TrainSpec { weight_decay: 0.1, optimizer, ..TrainSpec::default() };
        let runs = vec![
            OptimGroup { global: 0..LEN / 3, local: 0..LEN / 3, decay: true, tensor: 0 },
            OptimGroup { global: LEN / 3..LEN, local: LEN / 3..LEN, decay: false, tensor: 1 },
        ];
        let groups = OptimGroups { runs, tensors: 2 };
        let mut optimizer = Optimizer::new(&be, &train, groups, LEN, initial, &memory, offload).unwrap();
        let mut params = be.alloc(LEN);
        match start {
            Some((values, state)) => {
                be.upload(&mut params, values);
                optimizer.load_state(&be, state).unwrap();
            }
            None => be.upload(&mut params, &initial().into_iter().map(S::store).collect::<Vec<_>>()),
        }
        let mut grads = be.alloc(LEN);
        for step in 0..steps {
            let g: Vec<S> = (0..LEN).map(|i| S::store(((i as f32 + step as f32) * 0.11).cos() * 0.01)).collect();
            be.upload(&mut grads, &g);
            optimizer.step(&be, (&mut params, Indexing::Global), (&grads, Indexing::Global), 1e-3, 0.5, None).unwrap();
        }
        let state = optimizer
            .read(&be, |s, steps_taken| OptimizerState {
                steps_taken,
                m: s.m.to_vec(),
                v: s.v.to_vec(),
                master: s.master.map(<[f32]>::to_vec),
            })
            .unwrap();
        Run { params, state, ledger: memory.current() }
    }

    fn offloaded_trains_like_on_device<S: Stored<Acc = f32>>(optimizer: distlab_common::Optimizer) {
        let disk_dir = tempfile::tempdir().unwrap();
        let disk = OffloadTo::Disk(disk_dir.path().to_path_buf());
        let device = train::<S>(&OffloadTo::None, optimizer, 3, None);
        let floats_per_param = 2 + needs_master::<S>() as usize;
        for offload in [OffloadTo::Host, disk.clone()] {
            let off = train::<S>(&offload, optimizer, 3, None);
            let bits = |p: &[S]| p.iter().map(|x| x.load().to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&off.params), bits(&device.params), "{offload:?}: parameters");
            assert_eq!(off.state, device.state, "{offload:?}: m, v, master");
            // Off the device, all of it; in memory, a disk state's piece and nothing else (a host
            // state is in the CPU backend's memory whole: why specs are refused that offload).
            let whole = LEN * floats_per_param * 4;
            assert_eq!(off.ledger.offloaded, whole as u64, "{offload:?}");
            let resident =
                if offload == OffloadTo::Host { whole } else { OFFLOAD_PIECE_ELEMENTS * floats_per_param * 4 };
            assert_eq!(off.ledger.optimizer_state, resident as u64, "{offload:?}");
        }
        assert_eq!(device.ledger.offloaded, 0);
        // Resume: the disk state put back from a checkpoint goes on like the device's.
        let further = train::<S>(&OffloadTo::None, optimizer, 1, Some((&device.params, device.state.clone())));
        let resumed = train::<S>(&disk, optimizer, 1, Some((&device.params, device.state)));
        assert_eq!(resumed.state, further.state);
        // The files have no names: nothing is left in the directory.
        assert_eq!(std::fs::read_dir(disk_dir.path()).unwrap().count(), 0);
    }

    #[test]
    fn offloaded_state_trains_bit_for_bit_like_state_on_the_device() {
        // LAMB's first pass streams the disk state through its piece as the update does.
        for optimizer in [distlab_common::Optimizer::Adamw, distlab_common::Optimizer::Lamb] {
            offloaded_trains_like_on_device::<f32>(optimizer);
            offloaded_trains_like_on_device::<half::bf16>(optimizer);
        }
    }

    #[test]
    fn a_directory_that_cannot_be_made_is_a_clear_error() {
        let dir = Path::new("/proc/distlab-offload-test");
        let Err(e) = OffloadedState::disk::<f32>(dir, 10, true, Vec::new) else { panic!("made a file in /proc") };
        assert!(e.to_string().contains("/proc/distlab-offload-test: making the directory"), "{e}");
    }

    #[test]
    fn a_checkpoint_of_another_length_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let mut disk = OffloadedState::disk::<f32>(dir.path(), 10, true, Vec::new).unwrap();
        let saved = OptimizerState { m: vec![0.0; 9], v: vec![0.0; 9], ..OptimizerState::default() };
        assert_eq!(disk.load(&saved).unwrap_err(), "m has 9 values saved, this rank's optimizer holds 10");
    }
}
