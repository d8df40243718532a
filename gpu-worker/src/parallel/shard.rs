//! Which piece of the model a rank owns when state is sharded (ZeRO-1/2, FSDP).
//!
//! Every unit (embeddings, each block, the head) is one flat run of the parameter buffer
//! and is cut into W chunks like a ring buffer (`chunk_range`): rank r owns chunk r of
//! every unit. Cutting per unit, not the whole buffer at once, is what lets FSDP gather
//! one unit with a single all-gather and reduce-scatter its gradient with one collective.
//! A rank's shard buffer holds its chunks unit after unit.
//!
//! ```text
//!   unit:   | embeddings    | block 0       | ... | head          |
//!   rank 0: |##|            |##|            |     |##|            |   shard = [##][##]...[##]
//!   rank 1:    |##|            |##|         |        |##|         |
//! ```

use std::ops::Range;

use crate::comm::chunk_range;
use crate::model::{ParamLayout, Unit};
use crate::optim::{OptimGroup, ParamGroup};

/// This rank's piece of one unit.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct UnitShard {
    pub unit: Unit,
    /// The whole unit in the flat parameter buffer.
    pub global: Range<usize>,
    /// This rank's chunk, relative to the unit's start.
    pub mine: Range<usize>,
    /// Where the chunk starts in the rank's shard buffer.
    pub at: usize,
}

impl UnitShard {
    /// The chunk in the flat parameter buffer.
    pub fn global_mine(&self) -> Range<usize> {
        self.global.start + self.mine.start..self.global.start + self.mine.end
    }

    /// The chunk in the shard buffer.
    pub fn local(&self) -> Range<usize> {
        self.at..self.at + self.mine.len()
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ShardLayout {
    /// In buffer order.
    pub units: Vec<UnitShard>,
    /// Elements of the rank's shard.
    pub len: usize,
    /// The largest unit (what FSDP gathers at once).
    pub largest_unit: usize,
    /// The global index where a flat buffer of these units starts (a stage's first
    /// parameter): `optim_groups` count whole-buffer ranges from here.
    pub base: usize,
}

impl ShardLayout {
    /// The shards of `units` (a stage's, in buffer order: one contiguous run).
    pub fn new(layout: &ParamLayout, units: &[Unit], rank: usize, world: usize) -> Self {
        let mut at = 0;
        let units: Vec<UnitShard> = units
            .iter()
            .map(|&unit| {
                let global = unit.range(layout);
                let mine = chunk_range(global.len(), world, rank);
                let shard = UnitShard { unit, global, mine, at };
                at += shard.mine.len();
                shard
            })
            .collect();
        let largest_unit = units.iter().map(|u| u.global.len()).max().unwrap_or(0);
        let base = units.first().map_or(0, |u| u.global.start);
        ShardLayout { units, len: at, largest_unit, base }
    }

    pub fn unit(&self, unit: Unit) -> &UnitShard {
        self.units.iter().find(|u| u.unit == unit).expect("a unit of this stage")
    }

    /// The initial values of this rank's pieces, in shard order (computed for the pieces
    /// alone: the whole model's initial values never exist on this rank).
    pub fn init_mine(&self, layout: &ParamLayout, seed: u64) -> Vec<f32> {
        self.units.iter().flat_map(|u| layout.init_params_range::<f32>(seed, u.global_mine())).collect()
    }

    /// A unit's range in a flat buffer of these units.
    pub fn in_buffer(&self, u: &UnitShard) -> Range<usize> {
        u.global.start - self.base..u.global.end - self.base
    }

    /// The optimizer's groups for this shard: each chunk cut where weight decay changes
    /// (`groups` in global indices; `global` of the result counts from `base`).
    pub fn optim_groups(&self, groups: &[ParamGroup]) -> Vec<OptimGroup> {
        let mut out = Vec::new();
        for u in &self.units {
            let piece = u.global_mine();
            for g in groups {
                let (start, end) = (piece.start.max(g.range.start), piece.end.min(g.range.end));
                if start < end {
                    let local = u.at + (start - piece.start);
                    let global = start - self.base..end - self.base;
                    out.push(OptimGroup {
                        global,
                        local: local..local + (end - start),
                        decay: g.decay,
                        tensor: g.tensor,
                    });
                }
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use distlab_common::ModelSpec;

    #[test]
    fn the_ranks_shards_cover_every_parameter_once() {
        let spec = ModelSpec::dense(2, 12, 2, 5, 7);
        let layout = ParamLayout::new(&spec);
        for world in [1, 2, 3, 4] {
            let mut owner = vec![0u32; layout.total];
            for rank in 0..world {
                let shard = ShardLayout::new(&layout, &Unit::all(spec.layers).collect::<Vec<_>>(), rank, world);
                let groups = shard.optim_groups(&layout.param_groups(false));
                assert_eq!(groups.iter().map(|g| g.local.len()).sum::<usize>(), shard.len);
                for g in &groups {
                    assert_eq!(g.global.len(), g.local.len());
                    g.global.clone().for_each(|i| owner[i] += 1);
                }
            }
            assert!(owner.iter().all(|&n| n == 1), "W={world}");
        }
    }
}
