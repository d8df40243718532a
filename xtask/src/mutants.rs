//! `cargo xtask mutants`: breaks the engine on purpose, one mutant at a time, and runs the
//! tests that guard what the mutant breaks. A mutant the tests do not notice is a hole in
//! the suite: a learner would see a wrong engine and no test would say so.
//!
//! cargo-mutants would generate hundreds of mutants over `parallel/`, `comm/` and
//! `optim/`, each a rebuild of the optimised worker (minutes on 2 cores); these are the
//! mistakes that change what a learner sees, written by hand. Each names an exact piece of
//! code: when the code moves on and the piece is gone, the mutant fails loudly instead of
//! silently testing nothing. The file is restored after every mutant, even on failure.

use std::path::Path;
use std::time::Instant;

use anyhow::{bail, Context, Result};

use crate::{cargo, root};

/// One deliberate mistake and the tests that should catch it.
pub struct Mutant {
    pub name: &'static str,
    /// Relative to the repository root.
    pub file: &'static str,
    /// Code that must occur exactly once in `file`...
    pub find: &'static str,
    /// ...and what it becomes.
    pub replace: &'static str,
    /// `cargo test` arguments selecting the guarding tests.
    pub tests: &'static [&'static str],
}

pub const MUTANTS: &[Mutant] = &[
    Mutant {
        name: "A pipeline stage never marks the step's last backward (its data-parallel gradients stay local)",
        file: "gpu-worker/src/parallel/pipeline.rs",
        find: "work.backward(be, chunk, micro, received, Some(index) == last_backward[chunk])?;",
        replace: "work.backward(be, chunk, micro, received, Some(index) == last_backward[chunk] && pipe.stages == 1)?;",
        tests: &["-p", "distlab-tests", "--test", "pipeline", "pipelines_compose_with_data_parallelism"],
    },
    Mutant {
        name: "DDP sums gradients across ranks instead of averaging them",
        file: "gpu-worker/src/train/trainer.rs",
        find: "dloss: dloss * scale,",
        replace: "dloss: dloss * scale * dp_world as f64,",
        tests: &["-p", "distlab-tests", "--test", "ddp", "ddp_trains_like_one_rank"],
    },
    Mutant {
        name: "DDP never sends its last bucket (those gradients stay local)",
        file: "gpu-worker/src/parallel/ddp.rs",
        find: "(self.ready_units[b] == self.buckets[b].units.len()).then_some(b)",
        replace: "(self.ready_units[b] == self.buckets[b].units.len() && b + 1 < self.buckets.len()).then_some(b)",
        tests: &["-p", "distlab-tests", "--test", "ddp", "ddp_trains_like_one_rank"],
    },
    Mutant {
        name: "the ring's reduce-scatter sends the wrong chunk",
        file: "gpu-worker/src/comm/ring.rs",
        find: "let send_chunk = (r + 2 * w - step - 1) % w;",
        replace: "let send_chunk = (r + 2 * w - step) % w;",
        tests: &["-p", "distlab-worker", "--test", "engine", "collectives::"],
    },
    Mutant {
        name: "ZeRO/FSDP shards start one element late",
        file: "gpu-worker/src/parallel/shard.rs",
        find: "self.global.start + self.mine.start..self.global.start + self.mine.end",
        replace: "self.global.start + self.mine.start + 1..self.global.start + self.mine.end + 1",
        tests: &["-p", "distlab-tests", "--test", "sharding", "zero_and_fsdp_train_like_ddp"],
    },
    Mutant {
        name: "tensor parallel skips the all-reduce of the MLP's input gradient",
        file: "gpu-worker/src/model/block.rs",
        find: "sum_input_grad(be, &mut s.dln, mine, c, tp, TpPoint::Ln2OutputGrad, layer)?",
        replace: "0..be.buf_len(&s.dln)",
        tests: &["-p", "distlab-tests", "--test", "tensor_parallel", "tensor_parallel_trains_like_one_rank"],
    },
    Mutant {
        name: "sequence parallelism leaves each rank's LayerNorm gradients from its own tokens only",
        file: "gpu-worker/src/model/block.rs",
        find: "tp.collective(be, buf, InPlace::AllReduce(ReduceOp::Sum), TpPoint::LayerNormGrads, at)?;",
        replace: "let _ = &tp;",
        tests: &[
            "-p",
            "distlab-tests",
            "--test",
            "sequence_parallel",
            "sequence_parallelism_trains_like_tensor_parallelism",
        ],
    },
    Mutant {
        name: "the tree all-reduce copies its children's partial sums instead of adding them",
        file: "gpu-worker/src/comm/ring/all_reduce.rs",
        find: "self.recv_step(child, buf, true, step(RingPhase::Reduce, me, child))?;",
        replace: "self.recv_step(child, buf, false, step(RingPhase::Reduce, me, child))?;",
        tests: &["-p", "distlab-worker", "--test", "engine", "collectives::every_all_reduce_algorithm"],
    },
    Mutant {
        name: "tensor parallel leaves the gradient norm rank-local",
        file: "gpu-worker/src/train/trainer.rs",
        find: "grad_norm_squared = tp.sum_scalar(grad_norm_squared)?;",
        replace: "let _ = &tp;",
        tests: &["-p", "distlab-tests", "--test", "tensor_parallel", "tensor_parallel_trains_like_one_rank"],
    },
    Mutant {
        name: "dynamic loss scaling forgets to unscale the gradients",
        file: "gpu-worker/src/train/trainer.rs",
        find: "clip_scale(grad_norm, t.grad_clip) / scale)?;",
        replace: "clip_scale(grad_norm, t.grad_clip))?;",
        tests: &["-p", "distlab-tests", "--test", "mixed_precision", "loss_scaling"],
    },
    Mutant {
        name: "1F1B fills the pipe with one forward too many (same losses, more activations)",
        file: "common/src/plan/schedule.rs",
        find: "PpSchedule::OneFOneB | PpSchedule::ZbH1 => last.min(m),",
        replace: "PpSchedule::OneFOneB | PpSchedule::ZbH1 => (last + 1).min(m),",
        tests: &["-p", "distlab-tests", "--test", "pipeline", "every_stage_runs_the_schedules_order"],
    },
    Mutant {
        name: "Interleaved backwards go through a stage's chunks in forward order (waits on a gradient never sent)",
        file: "common/src/plan/schedule.rs",
        find: "Action::Backward { micro: micro(k), chunk: v - 1 - (k / p) % v }",
        replace: "Action::Backward { micro: micro(k), chunk: (k / p) % v }",
        tests: &["-p", "distlab-common", "schedule"],
    },
    Mutant {
        name: "ZB-H1 hands DDP a unit's gradient after its B, before the W completes it",
        file: "gpu-worker/src/model/state.rs",
        find: "matches!(self, Pass::Backward { .. } | Pass::Weights)",
        replace: "matches!(self, Pass::Backward { .. } | Pass::BackwardInput)",
        tests: &["-p", "distlab-tests", "--test", "pipeline", "zero_bubble_trains_like_one_rank"],
    },
    Mutant {
        name: "ZB-H1's B adds the weight gradients too (the W adds them again)",
        file: "gpu-worker/src/model/block.rs",
        find: "be.matmul_backward_input(dinp, dout, weight, c_in, c_out);\n        }",
        replace: "be.matmul_backward(Some(dinp), dweight, dbias, dout, inp, weight, c_in, c_out);\n        }",
        tests: &["-p", "distlab-tests", "--test", "pipeline", "zero_bubble_trains_like_one_rank"],
    },
    Mutant {
        name: "An interleaved stage holds every parameter from its first block to its last (other stages' blocks too)",
        file: "gpu-worker/src/parallel/pipeline.rs",
        find: "let unit_order = (0..pipe.stages).flat_map(|s| of(s).units()).collect();",
        replace: "let unit_order = crate::model::state::Unit::all(layers).collect();",
        tests: &["-p", "distlab-tests", "--test", "pipeline", "one_f_one_b_holds_fewer_activations_than_gpipe"],
    },
    Mutant {
        name: "A V stage takes the first message that came early, not the one its pass waits for",
        file: "gpu-worker/src/parallel/pipeline.rs",
        find: "if let Some(i) = self.early.iter().position(|(m, ..)| *m == wanted) {",
        replace: "if let Some(i) = self.early.iter().position(|_| true) {",
        tests: &["-p", "distlab-tests", "--test", "pipeline", "zbv_trains_like_one_rank"],
    },
    Mutant {
        name: "A V's second chunk laid out as interleaved's (stage s holds chunk P+s, not 2P-1-s)",
        file: "common/src/plan/schedule.rs",
        find: "1 if self.kind.is_v() => 2 * self.stages - 1 - stage,",
        replace: "1 if self.kind.is_v() => self.stages + stage,",
        tests: &["-p", "distlab-common", "schedule"],
    },
    Mutant {
        name: "ZeRO-2/FSDP under a split backward drops what a unit's B wrote instead of keeping it for the W",
        file: "gpu-worker/src/parallel/sharded.rs",
        find: "                self.waiting_for_weights.push((unit, grads));",
        replace: "                drop(grads);",
        tests: &["-p", "distlab-tests", "--test", "pipeline", "split_backwards_train_like_one_rank"],
    },
    Mutant {
        name: "DualPipeV runs the Ws it held back newest first, not in the order of their Bs",
        file: "common/src/plan/schedule.rs",
        find: "self.out.extend(self.owed.pop_front());",
        replace: "self.out.extend(self.owed.pop_back());",
        tests: &["-p", "distlab-common", "dualpipev"],
    },
    Mutant {
        name: "DiLoCo's outer momentum is kept but never applied (a plain outer step)",
        file: "gpu-worker/src/parallel/diloco.rs",
        find: "d + mu * *u",
        replace: "d",
        tests: &["-p", "distlab-tests", "--test", "diloco", "diloco_with_sgd_every_step_and_no_momentum_is_ddp"],
    },
    Mutant {
        name: "An asynchronous worker never learns which version it pulled (every gradient looks stale since step 0)",
        file: "gpu-worker/src/parallel/async_ps.rs",
        find: "self.version = self.push_and_pull(push)?;",
        replace: "self.push_and_pull(push)?;",
        tests: &["-p", "distlab-tests", "--test", "async_ps", "the_server_applies_every_workers_gradient"],
    },
    Mutant {
        name: "An asynchronous worker pulls the parameters but keeps training its old ones",
        file: "gpu-worker/src/parallel/async_ps.rs",
        find: "for (x, &t) in p.iter_mut().zip(incoming) {",
        replace: "for (x, &t) in p.iter_mut().zip(incoming).take(0) {",
        tests: &["-p", "distlab-tests", "--test", "async_ps", "the_server_applies_every_workers_gradient"],
    },
    Mutant {
        name: "A rejoining replica takes the parameters but a fresh optimizer state (stale m, v and step count)",
        file: "gpu-worker/src/parallel/fault_tolerant.rs",
        find: "let optimizer = OptimizerState { steps_taken, m, v, master };",
        replace: "let optimizer = OptimizerState { steps_taken: 0, m: vec![0.0; m.len()], v: vec![0.0; v.len()], master };",
        tests: &["-p", "distlab-tests", "--test", "fault_tolerance", "a_killed_replica_rejoins"],
    },
    Mutant {
        name: "LAMB's and LARS's trust ratio ignored (every tensor takes AdamW's or SGD's plain step)",
        file: "gpu-worker/src/optim/mod.rs",
        find: "let lr = lr * ratio;",
        replace: "let lr = lr * ratio.powi(0);",
        tests: &["-p", "distlab-worker", "--lib", "each_tensors"],
    },
    Mutant {
        name: "A layer-wise optimizer takes a sharded tensor's norms from this rank's piece alone",
        file: "gpu-worker/src/optim/mod.rs",
        find: "Some(comm) => sum_over(comm, &squares)?,",
        replace: "Some(_) => squares,",
        tests: &["-p", "distlab-tests", "--test", "layer_wise", "lamb_and_lars_train_like_one_rank"],
    },
    Mutant {
        name: "HSDP never all-reduces the gradient shards across the replicas",
        file: "gpu-worker/src/parallel/sharded.rs",
        find: "collective(be, &self.memory, replicas.as_mut(), &mut self.grad_shard, u.local(), op, self.wire)?;",
        replace: "let _ = (&op, &replicas);",
        tests: &["-p", "distlab-tests", "--test", "sharding", "hsdp_trains_like_one_rank"],
    },
    Mutant {
        name: "HSDP cuts the units over the replicas and all-reduces across the shard group (the groups swapped)",
        file: "gpu-worker/src/parallel/sharded.rs",
        find: "Some(HybridGroups { shard, replicas }) => (shard, Some(whole), Some(replicas)),",
        replace: "Some(HybridGroups { shard, replicas }) => (replicas, Some(whole), Some(shard)),",
        tests: &["-p", "distlab-tests", "--test", "claims", "the_hsdp_preset_sends_only_its_shards_across_the_groups"],
    },
    Mutant {
        name: "FSDP ranks initialise the whole model before keeping their shard",
        file: "gpu-worker/src/parallel/sharded.rs",
        find: "let seed = spec.train.seed;",
        replace: "let seed = spec.train.seed;\n        let _whole = layout.init_params::<f32>(seed);",
        tests: &["-p", "distlab-tests", "--test", "sharding", "fsdp_ranks_never_hold_the_whole_model"],
    },
    Mutant {
        name: "activations are booked for the whole run, not per micro-batch in flight",
        file: "gpu-worker/src/model/gpt.rs",
        find: "None => self.activations.release(index),",
        replace: "None => {}",
        tests: &["-p", "distlab-tests", "--test", "pipeline", "one_f_one_b_holds_fewer_activations_than_gpipe"],
    },
    Mutant {
        name: "LayerNorm's backward drops the x̂·mean(dx̂·x̂) term",
        file: "gpu-worker/src/ops/layernorm.rs",
        find: "*dx += r * (dy * g - mean_g - xhat * mean_gx);",
        replace: "*dx += r * (dy * g - mean_g);",
        tests: &["-p", "distlab-worker", "--test", "engine", "layernorm"],
    },
    Mutant {
        name: "DDP's shared-memory buckets are booked as heap",
        file: "gpu-worker/src/parallel/ddp.rs",
        find: "memory.alloc_shared(Category::CommBuffers, b.len)",
        replace: "memory.alloc(Category::CommBuffers, b.len)",
        tests: &["-p", "distlab-tests", "--test", "sharding", "ddp_buckets_are_booked_in_shared_memory"],
    },
    Mutant {
        name: "the f32 copy of a 2-byte buffer for a collective goes unbooked",
        file: "gpu-worker/src/parallel/mod.rs",
        find: "(std::mem::size_of::<S>() != 4).then(",
        replace: "(std::mem::size_of::<S>() == 0).then(",
        tests: &["-p", "distlab-tests", "--test", "mixed_precision", "every_rank_measures_the_bf16_memory"],
    },
    Mutant {
        name: "the shared-memory pipes between ranks go unreported",
        file: "gpu-worker/src/train/trainer.rs",
        find: "memory.set_pipe_bytes(groups.pipe_bytes);",
        replace: "let _ = groups.pipe_bytes;",
        tests: &["-p", "distlab-tests", "--test", "sharding", "ddp_buckets_are_booked_in_shared_memory"],
    },
    Mutant {
        name: "SGD ignores weight decay",
        file: "gpu-worker/src/ops/optimizer.rs",
        find: "let decay = F::from_f64(1.0 - lr * weight_decay);",
        replace: "let decay = F::from_f64(1.0 - lr * weight_decay * 0.0);",
        tests: &["-p", "distlab-worker", "--lib", "optim"],
    },
    Mutant {
        name: "gradients are not zeroed between steps",
        file: "gpu-worker/src/model/state.rs",
        find: "pub fn zero_grads(&mut self, be: &B) {",
        replace: "pub fn zero_grads(&mut self, be: &B) {\n        return;",
        tests: &["-p", "distlab-tests", "--test", "ddp", "ddp_trains_like_one_rank"],
    },
    Mutant {
        name: "a 2-byte matrix product's f32 operand copies go unbooked",
        file: "gpu-worker/src/ops/gemm.rs",
        find: "let _booked = kernel_scratch::<S::Acc>(data.len());",
        replace: "let _booked = kernel_scratch::<S::Acc>(0);",
        tests: &["-p", "distlab-tests", "--test", "mixed_precision", "every_rank_measures_the_bf16_memory"],
    },
    Mutant {
        name: "a 2-byte linear layer rounds its bias and residual to 2 bytes before the product",
        file: "gpu-worker/src/ops/linear.rs",
        find: "    unsafe { acc.set_len(rows * c_out) };\n",
        replace:
            "    unsafe { acc.set_len(rows * c_out) };\n    acc.iter_mut().for_each(|x| *x = S::store(*x).load());\n",
        tests: &["-p", "distlab-worker", "--lib", "the_forward_starts_from_bias_and_residual"],
    },
    Mutant {
        name: "a thread's block of output rows multiplies the first rows of the left operand",
        file: "gpu-worker/src/ops/gemm.rs",
        find: "lhs: (lhs.0.wrapping_add(range.start * lhs.1), lhs.1, lhs.2),",
        replace: "lhs: (lhs.0, lhs.1, lhs.2),",
        tests: &["-p", "distlab-worker", "--lib", "thread_blocks_give_the_single_threaded_bits"],
    },
    Mutant {
        name: "each depth chunk of a deep product (a weight gradient) overwrites the chunks before it",
        file: "gpu-worker/src/ops/gemm.rs",
        find: "self.accumulate || start > 0,",
        replace: "self.accumulate,",
        tests: &["-p", "distlab-worker", "--lib", "thread_blocks_give_the_single_threaded_bits"],
    },
    Mutant {
        name: "submissions written in one transaction do not count the ones before them against the quota",
        file: "server/src/store/queue.rs",
        find: "queued.insert(s.owner.clone(), owners_queue + 1);",
        replace: "queued.insert(s.owner.clone(), owners_queue);",
        tests: &["-p", "distlab-server", "--lib", "submissions_written_together_see_each_other"],
    },
    Mutant {
        name: "a transaction of submissions that fails answers its error to the first and drops the others",
        file: "server/src/store/group_commit.rs",
        find: "Err(e) if submissions.len() == 1 => vec![Err(e)],",
        replace: "Err(e) => vec![Err(e)],",
        tests: &["-p", "distlab-server", "--lib", "one_refused_submission_does_not_fail_the_others"],
    },
    Mutant {
        name: "the packed product never packs A's last, short panel (it multiplies stale values)",
        file: "gpu-worker/src/ops/packed_gemm.rs",
        find: "for (panel, out) in dst.chunks_exact_mut(MR * depth).take(rows.div_ceil(MR)).enumerate() {",
        replace: "for (panel, out) in dst.chunks_exact_mut(MR * depth).take(rows / MR).enumerate() {",
        tests: &["-p", "distlab-worker", "--lib", "products_match_the_f64_reference_on_every_level_start_and_layout"],
    },
    Mutant {
        name: "the packed product's epilogue adds the bias and residual on every depth chunk",
        file: "gpu-worker/src/ops/packed_gemm.rs",
        find: "let start = if first_chunk { p.start } else { Start::Kept };",
        replace: "let start = p.start;",
        tests: &["-p", "distlab-worker", "--lib", "products_match_the_f64_reference_on_every_level_start_and_layout"],
    },
    Mutant {
        name: "a thread's block of output columns starts its bias and residual at the first column",
        file: "gpu-worker/src/ops/gemm.rs",
        find: ".map(|(bias, residual)| (offset(bias, range.start), offset(residual, range.start * dst.2))),",
        replace: ".map(|(bias, residual)| (bias, residual)),",
        tests: &["-p", "distlab-worker", "--lib", "the_forward_starts_from_bias_and_residual"],
    },
    Mutant {
        name: "every thread's block of weight-gradient rows adds the bias gradient up (it counts once per thread)",
        file: "gpu-worker/src/ops/gemm.rs",
        find: "rhs_col_sums: if range.start == 0 { self.rhs_col_sums } else { std::ptr::null_mut() },",
        replace: "rhs_col_sums: self.rhs_col_sums,",
        tests: &["-p", "distlab-worker", "--lib", "the_bias_gradient_added_up_with_the_weights_gives_its_own_passs_bits"],
    },
    Mutant {
        name: "the packed product adds the column sums of every block of B's columns onto the first block's",
        file: "gpu-worker/src/ops/packed_gemm.rs",
        find: "Some(p.b_col_sums.add(jc))",
        replace: "Some(p.b_col_sums)",
        tests: &["-p", "distlab-worker", "--lib", "column_sums_of_b_are_added_up_in_row_order"],
    },
    Mutant {
        name: "the streaming copy out of a peer's buffer drops the tail after the last whole store",
        file: "gpu-worker/src/comm/stream_copy.rs",
        find: "    dst[body..].copy_from_slice(&src[body..]);",
        replace: "",
        tests: &["-p", "distlab-worker", "--lib", "stream_copy"],
    },
    Mutant {
        name: "the copy a checkpoint is written from goes unbooked",
        file: "gpu-worker/src/train/trainer.rs",
        find: "let booked = Some(self.memory.alloc(Category::Checkpoint, floats));",
        replace: "let booked: Option<crate::memory::Receipt> = None;",
        tests: &["-p", "distlab-tests", "--test", "resume", "the_checkpoint_copy_is_booked"],
    },
    Mutant {
        name: "flash attention's backward forgets D = rowsum(dO * O) (the softmax's own term)",
        file: "gpu-worker/src/ops/flash_attention.rs",
        find: "dsi.iter_mut().zip(pi).for_each(|(x, &pij)| *x = pij * (*x - d) * scale);",
        replace: "dsi.iter_mut().zip(pi).for_each(|(x, &pij)| *x = pij * (*x - d * S::Acc::ZERO) * scale);",
        tests: &["-p", "distlab-tests", "--test", "flash_attention", "flash_attention_trains_like"],
    },
    Mutant {
        name: "flash attention keeps only the rounded half of each log-sum-exp (its 2-byte copies drift)",
        file: "gpu-worker/src/ops/flash_attention.rs",
        find: "pair[1] = S::store(x - hi.load());",
        replace: "pair[1] = S::store(S::Acc::ZERO);",
        tests: &["-p", "distlab-worker", "--lib", "flash_attention"],
    },
    Mutant {
        name: "FSDP's prefetch is never told what comes next (it silently gathers on demand)",
        file: "gpu-worker/src/train/trainer.rs",
        find: "self.inner.announce_next(next);",
        replace: "let _ = next;",
        tests: &["-p", "distlab-tests", "--test", "prefetch", "prefetch_sends_the_same_bytes"],
    },
    Mutant {
        name: "with a 2-byte wire a rank keeps its own chunk unrounded (ranks end with different values)",
        file: "gpu-worker/src/comm/ring.rs",
        find: "buf[mine].iter_mut().for_each(|x| *x = unpack(wire, pack(wire, *x)));",
        replace: "let _ = (&buf[mine], wire);",
        tests: &["-p", "distlab-worker", "--test", "engine", "collectives::a_two_byte_wire"],
    },
    Mutant {
        name: "Gradient compression forgets what it did not send (no error feedback)",
        file: "gpu-worker/src/parallel/compression.rs",
        find: "            *g += *e;",
        replace: "            let _ = (g, e);",
        tests: &["-p", "distlab-tests", "--test", "grad_compression", "compressed_ddp_learns_within_a_margin_of_ddp"],
    },
    Mutant {
        name: "All-to-all puts what a rank received into the chunk of the rank it sent to",
        file: "gpu-worker/src/comm/ring/all_to_all.rs",
        find: "&mut output[piece(from)], false, s, to)?;",
        replace: "&mut output[piece(to)], false, s, to)?;",
        tests: &["-p", "distlab-worker", "--test", "engine", "collectives::all_to_all"],
    },
    Mutant {
        name: "A resumed compressed run starts its error-feedback residual at zero",
        file: "gpu-worker/src/parallel/ddp.rs",
        find: "sync.load_compression_state(residual, section(COMPRESSION_Q).unwrap_or_default())?;",
        replace: "let _ = (sync, residual);",
        tests: &["-p", "distlab-tests", "--test", "resume", "compressed_ddp_resumes"],
    },
    Mutant {
        name: "Elastic resume hands every new rank the first rank's shard",
        file: "gpu-worker/src/elastic.rs",
        find: "        let shards = self.shards(rank, world);\n        let sections = whole",
        replace: "        let shards = self.shards(0, world);\n        let sections = whole",
        tests: &["-p", "distlab-tests", "--test", "elastic", "a_dp4_zero2_checkpoint_continues_at_dp2"],
    },
    Mutant {
        name:
            "Expert parallelism sums the experts' gradients over the data-parallel group (ranks holding other experts)",
        file: "gpu-worker/src/parallel/ddp.rs",
        find: "let experts_apart = layout.ep.size > 1;",
        replace: "let experts_apart = false;",
        tests: &["-p", "distlab-tests", "--test", "experts", "expert_parallelism_trains_like"],
    },
    Mutant {
        name: "An expert-parallel checkpoint keeps DP rank 0's experts alone (every rank reloads them)",
        file: "gpu-worker/src/parallel/ddp.rs",
        find: "let replicated = self.layout.ep.size <= 1;",
        replace: "let replicated = true;",
        tests: &["-p", "distlab-tests", "--test", "resume", "expert_parallel_ddp_resumes"],
    },
    Mutant {
        name: "Expert parallelism's DDP sends buckets while backward's all-to-alls share the links",
        file: "gpu-worker/src/parallel/ddp.rs",
        find: "let shares_links = experts_apart || context_parallel || be.reaches(g.grads.as_mut());",
        replace: "let shares_links = context_parallel || be.reaches(g.grads.as_mut());",
        tests: &["-p", "distlab-tests", "--test", "experts", "expert_parallelism_trains_like"],
    },
    Mutant {
        name: "The router's load-balancing loss has no gradient",
        file: "gpu-worker/src/model/experts.rs",
        find: "let dlogits = route_backward(&a.routing, &probs, &dgates, balance_weight);",
        replace: "let dlogits = route_backward(&a.routing, &probs, &dgates, 0.0);",
        tests: &["-p", "distlab-worker", "--test", "engine", "gradcheck::mixture_of_experts"],
    },
    Mutant {
        name: "The routers' dropped assignments are not counted",
        file: "gpu-worker/src/model/experts.rs",
        find: "self.dropped += r.dropped as u64;",
        replace: "self.dropped += 0;",
        tests: &["-p", "distlab-worker", "--test", "engine", "gradcheck::mixture_of_experts"],
    },
    Mutant {
        name: "Llama: RoPE's backward turns the gradient forward again instead of back",
        file: "gpu-worker/src/ops/rope.rs",
        find: "self.rope(dqkv, shape, (theta, positions), -1.0);",
        replace: "self.rope(dqkv, shape, (theta, positions), 1.0);",
        tests: &["-p", "distlab-worker", "--test", "engine", "gradcheck::rope"],
    },
    Mutant {
        name: "Llama: the blocks' backward leaves q and k's gradients turned (rope_backward dropped)",
        file: "gpu-worker/src/model/attend.rs",
        find: "be.rope_backward(be.all_mut(dqkv), d.heads, d.rope_theta, d.positions);",
        replace: "let _ = (&dqkv, d.rope_theta);",
        tests: &["-p", "distlab-worker", "--test", "engine", "gradcheck::whole_llama"],
    },
    Mutant {
        name: "Llama: grouped-query attention keeps each query head's K/V gradient instead of the group's sum",
        file: "gpu-worker/src/ops/attention.rs",
        find: "let add = h % shape.group() != 0;",
        replace: "let add = false;",
        tests: &["-p", "distlab-worker", "--test", "engine", "attention_grouped::cpu_fp32"],
    },
    Mutant {
        name: "Llama: SwiGLU's gate gradient drops the sigmoid's derivative",
        file: "gpu-worker/src/ops/swiglu.rs",
        find: "*dg = dh * u * sig * (F::ONE + g * (F::ONE - sig));",
        replace: "*dg = dh * u * sig;",
        tests: &["-p", "distlab-worker", "--test", "engine", "swiglu::cpu_fp32"],
    },
    Mutant {
        name: "Llama: RMSNorm's input gradient forgets the normalisation's own term",
        file: "gpu-worker/src/ops/rmsnorm.rs",
        find: "*dx += r * (dy * g - x * r * mean_gx);",
        replace: "*dx += r * dy * g;",
        tests: &["-p", "distlab-worker", "--test", "engine", "rmsnorm::cpu_fp32"],
    },
    Mutant {
        name: "SwiGLU experts: an expert's backward skips SwiGLU's backward (fc gets a stale gate and up gradient)",
        file: "gpu-worker/src/model/experts.rs",
        find: "                be.swiglu_backward(dgu, be.view(dfch, r_h), fc_out, f);\n                be.view(dgate_up, r_in)",
        replace: "                let _ = (dgu, fc_out, r_h);\n                be.view(dgate_up, r_in)",
        tests: &["-p", "distlab-worker", "--test", "engine", "gradcheck::swiglu_experts"],
    },
    Mutant {
        name: "Selective recompute: backward never recomputes the probabilities (each block reads the last forward's)",
        file: "gpu-worker/src/model/gpt.rs",
        find: "timed(be, &mut self.recomputes_timed, l, || recompute_probabilities(be, a, s, dims));",
        replace: "let _ = (a, &s);",
        tests: &["-p", "distlab-tests", "--test", "checkpointing", "recomputing_gives_exactly_the_training_without_it"],
    },
    Mutant {
        name: "Ulysses: q, k and v leave as they are, not re-arranged by heads (a missing transpose)",
        file: "gpu-worker/src/parallel/context.rs",
        find: "let pack = |mine: &[f32]| heads_blocks(mine, &shape, cp);",
        replace: "let pack = |mine: &[f32]| mine.to_vec();",
        tests: &["-p", "distlab-tests", "--test", "context_parallel", "context_parallelism_trains_like_whole_sequences"],
    },
    Mutant {
        name: "Context parallelism: DDP's buckets go on the wire during backward, over the links the exchanges use",
        file: "gpu-worker/src/parallel/ddp.rs",
        find: "let context_parallel = spec.parallel.cp > 1;",
        replace: "let context_parallel = spec.parallel.cp > 64;",
        tests: &["-p", "distlab-tests", "--test", "context_parallel", "context_parallelism_trains_like_whole_sequences"],
    },
    Mutant {
        name: "Ring attention: each block's attention replaces the output instead of merging by log-sum-exp",
        file: "gpu-worker/src/ops/ring_attention.rs",
        find: "            if first {\n                for (y, &x) in row.iter_mut().zip(&o) {",
        replace: "            if first || tq > 0 {\n                for (y, &x) in row.iter_mut().zip(&o) {",
        tests: &["-p", "distlab-tests", "--test", "context_parallel", "context_parallelism_trains_like_whole_sequences"],
    },
    Mutant {
        name: "Activation offload: a block's activations are never read back from disk (its backward reads zeros)",
        file: "gpu-worker/src/model/activation_offload.rs",
        find: "self.file.read_exact_at(bytes, at)?;",
        replace: "let _ = &self.file;",
        tests: &["-p", "distlab-tests", "--test", "activation_offload", "offloaded_activations_train_bit_for_bit"],
    },
    Mutant {
        name: "Activation offload: the ledger books the blocks on the device but not the copies on their way to disk",
        file: "gpu-worker/src/model/activation_offload.rs",
        find: "self.staging_on_device.then(|| self.book(Category::Activations))",
        replace: "None",
        tests: &["-p", "distlab-tests", "--test", "activation_offload", "offloaded_activations_train_bit_for_bit"],
    },
    Mutant {
        name: "FP8: delayed scaling never updates a scale (every cast at 1)",
        file: "gpu-worker/src/model/fp8_linear.rs",
        find: "            self.scale.record(self.seen.amax);",
        replace: "            let _ = self.seen.amax;",
        tests: &["-p", "distlab-tests", "--test", "fp8", "fp8_trains_within_its_margin_of_bf16"],
    },
    Mutant {
        name: "FP8: backward multiplies the output gradient as it is, not cast to E5M2",
        file: "gpu-worker/src/model/fp8_linear.rs",
        find: "let (g, x) = (be.all(&g), be.all(&x));",
        replace: "let (g, x) = (dout, be.all(&x));",
        tests: &["-p", "distlab-worker", "--lib", "fp8_linear::tests"],
    },
    Mutant {
        name: "FP8: a resumed run forgets the checkpoint's amax histories (delayed scaling starts again at 1)",
        file: "gpu-worker/src/train/trainer.rs",
        find: "            self.model.fp8_restore(&find(FP8_SCALES)?)?;",
        replace: "            let _ = find(FP8_SCALES)?;",
        tests: &["-p", "distlab-tests", "--test", "resume", "fp8_with_delayed_scaling_resumes"],
    },
    Mutant {
        name: "FSDP's FP8 gather: current scaling scales each rank's shard by its own amax, not the weight's",
        file: "gpu-worker/src/parallel/sharded.rs",
        find: "                Some(Fp8Recipe::Current) => {",
        replace: "                Some(Fp8Recipe::None) => {",
        tests: &["-p", "distlab-tests", "--test", "fp8", "fsdp_gathers_the_weights_in_fp8"],
    },
    Mutant {
        name: "FSDP's FP8 gather: the weights arrive as FP8 values, not divided by their scales",
        file: "gpu-worker/src/parallel/fp8_gather.rs",
        find: "F8E4M3::from_bits(message[at - 1]).to_f32() / scales[k]",
        replace: "F8E4M3::from_bits(message[at - 1]).to_f32()",
        tests: &["-p", "distlab-tests", "--test", "fp8", "fsdp_gathers_the_weights_in_fp8"],
    },
    Mutant {
        name: "FP8: the cast rounds ties away from zero instead of to even",
        file: "gpu-worker/src/ops/fp8.rs",
        find: "((a / quantum).round_ties_even() * quantum)",
        replace: "((a / quantum).round() * quantum)",
        tests: &["-p", "distlab-worker", "--lib", "fp8::tests::rounding_matches_nvidias_conversion"],
    },
    Mutant {
        name: "BPE: the validation windows are cut from the training text's tokens",
        file: "gpu-worker/src/data.rs",
        find: "text.held_out.window((index % windows) * seq_len, inp, tgt);",
        replace: "text.trained.window((index % windows) * seq_len, inp, tgt);",
        tests: &["-p", "distlab-worker", "--lib", "data::"],
    },
    Mutant {
        name: "BPE: a rank reads the text cut once with its parts swapped (trains on the held-out ids)",
        file: "gpu-worker/src/data.rs",
        find: "let (trained, held_out) = (ids(CUT_TRAINED, \"training\")?, ids(CUT_HELD_OUT, \"held-out\")?);",
        replace: "let (trained, held_out) = (ids(CUT_HELD_OUT, \"training\")?, ids(CUT_TRAINED, \"held-out\")?);",
        tests: &["-p", "distlab-worker", "--lib", "data::"],
    },
    Mutant {
        name: "BPE: Try the model decodes a BPE run's tokens as bytes",
        file: "server/src/api/sampling.rs",
        find: "let text = tokenizer.decode(&tokens).unwrap_or_default();",
        replace: "let text = TextTokenizer::Bytes.decode(&tokens).unwrap_or_default();",
        tests: &["-p", "distlab-tests", "--test", "e2e", "a_bpe_run"],
    },
    Mutant {
        name: "The server keeps serving its experiment list after a worker's metrics (their write not counted)",
        file: "server/src/store/reports.rs",
        find: "        let _writing = Writing::to(db, Data::Experiments);\n        let _turn = db::write_turn().await;",
        replace: "        let _turn = db::write_turn().await;",
        tests: &["-p", "distlab-server", "--test", "api", "the_list_shows_every_change_at_the_next_request"],
    },
    Mutant {
        name: "A signed-out session stays kept by the server (the sign-out's write not counted)",
        file: "server/src/store/accounts.rs",
        find: "pub async fn close_session(db: &Db, token: &str) -> Result<(), StoreError> {\n    let _writing = Writing::to(db, Data::Sessions);\n",
        replace: "pub async fn close_session(db: &Db, token: &str) -> Result<(), StoreError> {\n",
        tests: &["-p", "distlab-server", "--test", "accounts"],
    },
];

/// Mistakes in the CUDA kernels, whose guarding tests run on the emulated GPU (the CUDA op
/// tests, `cargo xtask emulated-gpu`): a dropped barrier, an index off by one (caught by the
/// guard page after the buffer), a wrong transpose flag.
pub const KERNEL_MUTANTS: &[Mutant] = &[
    Mutant {
        name: "a block sum reads the warps' partial sums before every warp has written its own (a dropped barrier)",
        file: "gpu-worker/src/backend/cuda/cuda_prelude.cu",
        find: "    if (lane == 0) shared[warp] = x;\n    __syncthreads();\n    float total = 0.0f;",
        replace: "    if (lane == 0) shared[warp] = x;\n    float total = 0.0f;",
        tests: &["--include-ignored", "crossentropy::cuda_fp32"],
    },
    Mutant {
        name: "add_bias's last thread writes one element past the output (an index off by one)",
        file: "gpu-worker/src/ops/linear.cu",
        find: "if (i >= (long long)rows * c) return;",
        replace: "if (i > (long long)rows * c) return;",
        tests: &["--include-ignored", "matmul::cuda_fp32"],
    },
    Mutant {
        name: "a linear layer's forward product reads its weight transposed (a wrong transpose flag)",
        file: "gpu-worker/src/ops/linear.rs",
        find: "            gpu.gemm(\n                (false, false),\n                (c_out, rows, c_in),",
        replace: "            gpu.gemm(\n                (true, false),\n                (c_out, rows, c_in),",
        tests: &["--include-ignored", "matmul::cuda_fp32"],
    },
    Mutant {
        name: "Llama: flash attention's key kernel sums a K/V head's gradients over the group's first query head only",
        file: "gpu-worker/src/ops/flash_attention.cu",
        find: "for (int h = r.head * group; h < (r.head + 1) * group; h++) {",
        replace: "for (int h = r.head * group; h < r.head * group + 1; h++) {",
        tests: &["--include-ignored", "flash_attention_grouped::cuda_fp32"],
    },
    Mutant {
        name: "FP8: the GPU's cast truncates to the FP8 grid instead of rounding to nearest even",
        file: "gpu-worker/src/ops/fp8.cu",
        find: "float r = fminf(rintf(__uint_as_float(a) / quantum) * quantum, largest);",
        replace: "float r = fminf(truncf(__uint_as_float(a) / quantum) * quantum, largest);",
        tests: &["--include-ignored", "fp8_cast::cuda_fp32"],
    },
];

/// Mistakes in the NCCL path, whose guarding tests are the cuda training tests on 8
/// emulated GPUs (a GPU per rank, so the groups run over the emulated NCCL).
pub const NCCL_MUTANTS: &[Mutant] = &[Mutant {
    name: "NCCL's uneven in-place reduce-scatter leaves its result in the padded buffer (a copy back dropped)",
    file: "gpu-worker/src/comm/nccl.rs",
    find: "                    self.device_copy(kind, element(mine.start), self.base(true), mine.len())?;\n",
    replace: "",
    tests: &["--include-ignored", "every_strategy_on_cuda_follows_the_cpu_in_fp32"],
}];

/// Restores a mutated file when dropped (the mutant's test may panic or be interrupted).
struct Restore<'a> {
    path: &'a Path,
    original: String,
}

impl Drop for Restore<'_> {
    fn drop(&mut self) {
        if let Err(e) = std::fs::write(self.path, &self.original) {
            eprintln!("xtask: CANNOT RESTORE {}: {e}; `git checkout` it", self.path.display());
        }
    }
}

/// What became of one mutant.
#[derive(Debug, PartialEq, Eq)]
pub enum Outcome {
    Caught,
    Missed,
}

/// `find` replaced by `replace` in `text`; an error unless `find` occurs exactly once.
pub fn mutate(text: &str, m: &Mutant) -> Result<String> {
    match text.matches(m.find).count() {
        1 => Ok(text.replacen(m.find, m.replace, 1)),
        n => bail!(
            "mutant \"{}\": `{}` occurs {n} times in {} (must be once): update the mutant",
            m.name,
            m.find,
            m.file
        ),
    }
}

/// Where a mutant's guarding tests run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Engine {
    /// `cargo test ARGS`.
    Cpu,
    /// The CUDA op tests on the emulated GPU: `cargo test -p distlab-worker --features cuda
    /// --test engine -- ARGS`.
    EmulatedGpu,
    /// The cuda training tests on 8 emulated GPUs: `cargo test --workspace --features
    /// distlab-worker/cuda --test cuda -- ARGS` (the worker binary they start built with cuda).
    EmulatedGpus,
}

fn run_one(m: &Mutant, engine: Engine) -> Result<Outcome> {
    let path = root().join(m.file);
    let original = std::fs::read_to_string(&path).with_context(|| format!("read {}", m.file))?;
    let mutated = mutate(&original, m)?;
    let _restore = Restore { path: &path, original };
    std::fs::write(&path, mutated).with_context(|| format!("write {}", m.file))?;
    // The mutant must build: a mutant that does not compile tests nothing. A mutant of the
    // server's code is in the server binary the end-to-end tests start.
    if !build_worker(engine)? || (m.file.starts_with("server/") && !build_server()?) {
        bail!("mutant \"{}\" does not compile: fix the mutant", m.name);
    }
    Ok(if run_tests(m.tests, engine)? { Outcome::Missed } else { Outcome::Caught })
}

/// Builds the worker (library and the binary the end-to-end tests start); for the cuda
/// training tests with the `cuda` feature and the features the test run builds with (a
/// test target alone does not build the binaries it starts).
fn build_worker(engine: Engine) -> Result<bool> {
    let mut cmd = cargo();
    match engine {
        Engine::Cpu | Engine::EmulatedGpu => cmd.args(["build", "-p", "distlab-worker"]),
        Engine::EmulatedGpus => cmd.arg("build").args(crate::TEST_BUILD).arg("--bins"),
    };
    Ok(cmd.status().context("cannot start cargo build")?.success())
}

/// Builds the server binary the end-to-end tests start.
fn build_server() -> Result<bool> {
    Ok(cargo().args(["build", "-p", "distlab-server"]).status().context("cannot start cargo build")?.success())
}

/// Whether the tests `args` select pass on `engine`.
fn run_tests(args: &[&str], engine: Engine) -> Result<bool> {
    let mut cmd = match engine {
        Engine::Cpu => {
            let mut cmd = cargo();
            cmd.arg("test");
            cmd
        }
        Engine::EmulatedGpu => {
            let mut cmd = crate::emulated_gpu::cargo(1)?;
            cmd.args(["test", "-p", "distlab-worker", "--features", "cuda", "--test", "engine", "--"]);
            cmd
        }
        Engine::EmulatedGpus => {
            let mut cmd = crate::emulated_gpu::cargo(8)?;
            cmd.arg("test").args(crate::TEST_BUILD).args(["--test", "cuda", "--"]);
            cmd
        }
    };
    Ok(cmd.args(args).status().context("cannot start cargo test")?.success())
}

/// Runs every mutant whose name contains `filter` (all when None) and prints caught/missed.
pub fn run(filter: Option<&str>) -> Result<bool> {
    let all = MUTANTS
        .iter()
        .map(|m| (m, Engine::Cpu))
        .chain(KERNEL_MUTANTS.iter().map(|m| (m, Engine::EmulatedGpu)))
        .chain(NCCL_MUTANTS.iter().map(|m| (m, Engine::EmulatedGpus)));
    let chosen: Vec<(&Mutant, Engine)> = all.filter(|(m, _)| filter.is_none_or(|f| m.name.contains(f))).collect();
    if chosen.is_empty() {
        bail!("no mutant's name contains {filter:?}");
    }
    // The end-to-end tests start the server too: built unmutated here, and again with a
    // mutant of the server's own code (`run_one`).
    if !build_server()? {
        bail!("the server does not build");
    }
    // The unmutated engine must pass the same tests, or "caught" means nothing.
    let mut guards: Vec<(&[&str], Engine)> = chosen.iter().map(|(m, e)| (m.tests, *e)).collect();
    guards.dedup();
    for (args, engine) in guards {
        if !build_worker(engine)? {
            bail!("the worker does not build");
        }
        if !run_tests(args, engine)? {
            bail!("`cargo test {}` fails without any mutant: fix that first", args.join(" "));
        }
    }
    let mut results = Vec::new();
    for (m, engine) in &chosen {
        let start = Instant::now();
        eprintln!("xtask: mutant: {}", m.name);
        let outcome = run_one(m, *engine)?;
        eprintln!("xtask: mutant: {} -> {outcome:?} ({:.0} s)", m.name, start.elapsed().as_secs_f64());
        results.push((m.name, outcome));
    }
    // Rebuild the real engine so the binary under target/ is not a mutant's (with cuda
    // when a mutant's tests needed it).
    let needs_cuda = chosen.iter().any(|(_, e)| *e == Engine::EmulatedGpus);
    if !build_worker(if needs_cuda { Engine::EmulatedGpus } else { Engine::Cpu })? || !build_server()? {
        bail!("the unmutated worker or server does not build");
    }
    let caught = results.iter().filter(|(_, o)| *o == Outcome::Caught).count();
    println!("\nmutant | outcome");
    println!("--- | ---");
    for (name, outcome) in &results {
        println!("{name} | {}", if *outcome == Outcome::Caught { "caught" } else { "MISSED" });
    }
    println!("\n{caught} caught, {} missed", results.len() - caught);
    Ok(caught == results.len())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every mutant still names code that exists exactly once, so none silently tests
    /// nothing after the engine changes.
    #[test]
    fn every_mutant_applies_to_the_code_as_it_is() {
        for m in MUTANTS.iter().chain(KERNEL_MUTANTS).chain(NCCL_MUTANTS) {
            let text = std::fs::read_to_string(root().join(m.file)).expect(m.file);
            let mutated = mutate(&text, m).unwrap_or_else(|e| panic!("{e}"));
            assert_ne!(mutated, text, "{}", m.name);
        }
    }

    #[test]
    fn a_piece_of_code_found_twice_is_refused() {
        let m = Mutant { name: "twice", file: "f.rs", find: "a", replace: "b", tests: &[] };
        assert!(mutate("a a", &m).is_err());
        assert!(mutate("c", &m).is_err());
        assert_eq!(mutate("a c", &m).unwrap(), "b c");
    }
}
