//! All-to-all written out pairwise, with the ring's own steps and pipes so that it is
//! traced and replayed like the ring.
//!
//! ```text
//!   W = 4, rank r's buffer cut into chunks r0 r1 r2 r3 (chunk j is for rank j):
//!   step 1: every rank sends to the rank 1 place after it:  r -> r+1 chunk (r+1)
//!   step 2: 2 places after it                                 r -> r+2 chunk (r+2)
//!   step 3: 3 places after it                                 r -> r+3 chunk (r+3)
//!   at the end rank j holds 0j 1j 2j 3j: chunk i of its output is what rank i meant for it
//! ```
//!
//! W-1 steps; every rank sends (W-1)/W x D, like a ring's all-gather, but to a different
//! peer at every step: all the links between the ranks are used, not a ring of them.

use distlab_common::trace::{CollectiveOp, RingPhase};

use super::{RingCommunicator, Step};
use crate::comm::CommError;

impl RingCommunicator {
    /// The exchange of one all-to-all (`input` and `output` as long, a multiple of W).
    pub(super) fn all_to_all_steps(&mut self, input: &[f32], output: &mut [f32], id: u64) -> Result<(), CommError> {
        let (w, me) = (self.members.len(), self.me);
        let chunk = input.len() / w;
        let piece = |j: usize| j * chunk..(j + 1) * chunk;
        output[piece(me)].copy_from_slice(&input[piece(me)]);
        for step in 1..w {
            let (to, from) = ((me + step) % w, (me + w - step) % w);
            let s = Step {
                op: CollectiveOp::AllToAll,
                id,
                phase: RingPhase::Exchange,
                step: step as u32 - 1,
                steps: w as u32 - 1,
            };
            self.ring_step((to, from), &input[piece(to)], &mut output[piece(from)], false, s, to)?;
        }
        Ok(())
    }
}
