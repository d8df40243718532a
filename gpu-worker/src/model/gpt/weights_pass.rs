//! ZB-H1's W pass ([`Gpt::weights_stage`]): after a micro-batch's B (`backward_stage` with
//! a split backward) has kept each matmul's output gradient (`WeightStash`), the W turns
//! them and the inputs forward saved into the weight gradients, unit by unit, and then
//! releases the micro-batch's activations.

use distlab_common::ModelSpec;

use super::Gpt;
use crate::backend::Backend;
use crate::comm::CommError;
use crate::model::activations::InFlight;
use crate::model::block::{block_weights, shift, split_block};
use crate::model::stage::Upcoming;
use crate::model::state::{ModelState, Pass, Unit};

impl<B: Backend> Gpt<B> {
    /// ZB-H1's W of micro-batch `micro` through chunk `chunk`, after its B: every matmul's
    /// weight (and bias) gradient, `dW += inpᵀ · dout`, from the output gradients the B
    /// kept and the inputs forward saved; then the micro-batch's activations are released.
    pub fn weights_stage(
        &mut self,
        be: &B,
        state: &mut dyn ModelState<B>,
        chunk: usize,
        micro: usize,
    ) -> Result<(), CommError> {
        let ModelSpec { d_model: c, vocab, .. } = self.spec;
        let dims = self.dims();
        let index = self.activations.index_of(chunk, micro);
        let mut upcoming = Upcoming::new(self.stage.weights_opens(chunk));
        let lay = &self.layout;
        let InFlight { acts, stash, .. } = &self.activations.in_flight[index];
        let Some((stash, _)) = stash else {
            panic!("the W of micro-batch {micro} in chunk {chunk} before its B");
        };
        if let Some(head) = &acts.head {
            upcoming.before_open(state, Unit::Head, Pass::Weights);
            {
                let (g, g_at) = state.open(be, Unit::Head, Pass::Weights)?.grads.expect("the W has gradients");
                let g_lm_head = be.view_mut(g, shift(&lay.lm_head, g_at));
                be.matmul_backward_weights(g_lm_head, None, be.all(&head.logits), be.all(&head.lnf), c, vocab);
            }
            state.close(be, Unit::Head, Pass::Weights)?;
        }
        let first_block = self.stage.chunks[chunk].start;
        for (i, kept) in stash.iter().enumerate().rev() {
            let l = first_block + i;
            upcoming.before_open(state, Unit::Block(l), Pass::Weights);
            {
                let (g, g_at) = state.open(be, Unit::Block(l), Pass::Weights)?.grads.expect("the W has gradients");
                let gw = split_block(be, be.view_mut(g, shift(&Unit::Block(l).range(lay), g_at)), &lay.blocks[l]);
                block_weights(be, gw, &acts.blocks[i], kept, dims);
            }
            state.close(be, Unit::Block(l), Pass::Weights)?;
        }
        self.activations.release(index);
        Ok(())
    }
}
