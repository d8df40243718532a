//! Claims about the bytes on the wire, counted by the engine's collectives on rank 0 (or by
//! the all-reduce demo's replay) and set against the planner: the ring all-reduce and its
//! phases, ZeRO's and FSDP's traffic, expert parallelism's all-to-alls, a 2-byte wire and
//! tensor parallelism's all-reduces.

use super::{bytes_text, op_counters, Inputs, Measurement, RunEvidence, SCALAR_BYTES};
use crate::analysis::pipeline::{default_step, recorded_steps};
use crate::analysis::replicas::{replica_events, ReplicaEvent};
use crate::plan::planner;
use crate::study::cards::ClaimCheck;
use crate::wire::trace::{CollectiveOp, RingPhase};

/// A ring all-reduce's bytes per rank: the demo's against 2(W-1)/W x D, or rank 0's per step against the planner.
pub(super) fn allreduce_bytes(input: &Inputs) -> Result<Measurement, String> {
    let run = input.run;
    let spec = input.spec;
    let plan = &input.plan;
    let rank0 = input.rank0;
    let traced_steps = input.traced_steps;
    if let Some(c) = run.view.summary.as_ref().and_then(|s| s.collective.as_ref()) {
        let most = c.bytes_sent.iter().copied().max().unwrap_or(0);
        let least = c.bytes_sent.iter().copied().min().unwrap_or(0);
        // The ring's steps, one after another: what its latency grows with.
        let rank0_steps = run.ranks.iter().filter(|r| r.rank == 0).flat_map(|r| &r.comm.steps);
        let steps = rank0_steps.filter(|s| s.from == 0).count();
        return Ok(input.m(
            format!("{} bytes per rank, in 2(W-1) = {} steps", c.formula_bytes, 2 * c.world.saturating_sub(1)),
            format!(
                "{least}–{most} bytes per rank ({} ranks), rank 0 sent in {steps} steps: the bytes per rank stay \
                 about 2D whatever W, the steps grow with it",
                c.world
            ),
            least == most && (most as f64 - c.formula_bytes).abs() < 0.5,
        ));
    }
    // The data-parallel ring is the one traced (tensor and pipeline rings are not).
    let rank = rank0.ok_or("the run recorded no trace")?;
    let sent: u64 = op_counters(rank, CollectiveOp::AllReduce).map(|c| c.bytes_sent).sum();
    let predicted = plan.stages[0].comm.dp_all_reduce;
    let per_step = sent / traced_steps;
    Ok(input.m(
        format!("{} per rank per step (2(W-1)/W x D, W={})", bytes_text(predicted), spec.parallel.dp),
        format!("{} on rank 0", bytes_text(per_step)),
        per_step == predicted,
    ))
}

/// The bytes each rank of the all-reduce demo sent in the reduce-scatter and in the all-gather: (W-1)/W x D each.
pub(super) fn ring_phase_bytes(input: &Inputs) -> Result<Measurement, String> {
    let run = input.run;
    let c = run
        .view
        .summary
        .as_ref()
        .and_then(|s| s.collective.as_ref())
        .ok_or("the phases are measured on the all-reduce demo's ring replay: run the allreduce preset")?;
    let per_phase = c.formula_bytes / 2.0;
    let sent = |rank: u32, phase: RingPhase| -> u64 {
        let rank_steps = run.ranks.iter().filter(|r| r.rank == rank).flat_map(|r| &r.comm.steps);
        rank_steps.filter(|s| s.from == rank && s.phase == phase).map(|s| s.bytes).sum()
    };
    let phases: Vec<(u64, u64)> =
        (0..c.world as u32).map(|r| (sent(r, RingPhase::ReduceScatter), sent(r, RingPhase::AllGather))).collect();
    if phases.iter().all(|&(rs, ag)| rs == 0 && ag == 0) {
        return Err("the run recorded no ring steps".into());
    }
    let agrees = phases.iter().all(|&(rs, ag)| rs as f64 == per_phase && ag as f64 == per_phase);
    let (rs, ag) = phases[0];
    Ok(input.m(
        format!("(W-1)/W x D = {per_phase} bytes per rank in each phase (W={})", c.world),
        format!(
            "rank 0 sent {rs} bytes in reduce-scatter and {ag} in all-gather; {}",
            if agrees { "every rank the same" } else { "not every rank the same" }
        ),
        agrees,
    ))
}

/// ZeRO-2's bytes per step on rank 0: the gradients reduce-scattered, the parameters all-gathered, 2(W-1)/W x D.
pub(super) fn zero2_traffic(input: &Inputs) -> Result<Measurement, String> {
    sharded_traffic(input, ClaimCheck::Zero2Traffic)
}

/// FSDP's bytes per step on rank 0: a reduce-scatter, all-gathers for forward and backward, under 3(W-1)/W x D.
pub(super) fn fsdp_traffic(input: &Inputs) -> Result<Measurement, String> {
    sharded_traffic(input, ClaimCheck::FsdpTraffic)
}

/// The reduce-scatters and all-gathers rank 0 sent per step, in multiples of D, against the planner (ZeRO-2 and FSDP).
fn sharded_traffic(input: &Inputs, check: ClaimCheck) -> Result<Measurement, String> {
    let spec = input.spec;
    let plan = &input.plan;
    let rank0 = input.rank0;
    let traced_steps = input.traced_steps;
    let rank = rank0.ok_or("the run recorded no trace")?;
    let (rs, ag) = (CollectiveOp::ReduceScatter, CollectiveOp::AllGather);
    let sent_in = |op| op_counters(rank, op).map(|c| c.bytes_sent).sum::<u64>() / traced_steps;
    let (rs_bytes, ag_bytes) = (sent_in(rs), sent_in(ag));
    let per_step = rs_bytes + ag_bytes;
    let stage = &plan.stages[spec.stage_of(0)];
    let planned = stage.comm.dp_reduce_scatter + stage.comm.dp_all_gather;
    // D: the gradient (or the parameters) as they cross the wire.
    let d = stage.params_per_rank.saturating_mul(planner::wire_bytes(spec.parallel.comm_dtype)).max(1);
    let w = spec.parallel.dp as f64;
    let (passes, what) = match check {
        ClaimCheck::Zero2Traffic => (2.0, "a reduce-scatter of the gradients, an all-gather of the parameters"),
        _ => (3.0, "a reduce-scatter of the gradients, all-gathers of the parameters for forward and backward"),
    };
    let multiple = passes * (w - 1.0) / w * spec.pipeline_micro_batches() as f64;
    let measured = per_step as f64 / d as f64;
    let mut got = input.m(
        format!("{passes}(W-1)/W x D = {multiple:.2} x D per rank per step (W={}): {what}", spec.parallel.dp),
        format!(
            "{measured:.3} x D: {} on rank 0, {:.3} x D reduce-scattered and {:.3} x D all-gathered (D = {}; \
             the planner's count: {})",
            bytes_text(per_step),
            rs_bytes as f64 / d as f64,
            ag_bytes as f64 / d as f64,
            bytes_text(d),
            bytes_text(planned)
        ),
        spec.parallel.sharding != crate::Sharding::None
            && per_step == planned
            && (measured - multiple).abs() <= 0.05 * multiple,
    );
    if check == ClaimCheck::FsdpTraffic {
        got.note = Some(
            "Backward gathers every unit but the embeddings (their backward needs only the token ids), \
             so FSDP sends a little less than 3(W-1)/W x D."
                .into(),
        );
    }
    Ok(got)
}

/// ZeRO-1's bytes per step on rank 0: DDP's all-reduce and the updated parameters' all-gather, 3(W-1)/W x D.
pub(super) fn zero1_traffic(input: &Inputs) -> Result<Measurement, String> {
    let spec = input.spec;
    let plan = &input.plan;
    let rank0 = input.rank0;
    let traced_steps = input.traced_steps;
    // DDP's all-reduce and ZeRO's all-gather of the updated parameters. The
    // all-reduce counter also holds the step's one-float all-reduces (the loss, the
    // gradient norm): at most a few hundred bytes.
    let rank = rank0.ok_or("the run recorded no trace")?;
    let sent_in = |op| op_counters(rank, op).map(|c| c.bytes_sent).sum::<u64>() / traced_steps;
    let (ar, ag) = (sent_in(CollectiveOp::AllReduce), sent_in(CollectiveOp::AllGather));
    let stage = &plan.stages[spec.stage_of(0)];
    let planned = stage.comm.dp_all_reduce + stage.comm.dp_all_gather;
    let d = stage.params_per_rank.saturating_mul(planner::wire_bytes(spec.parallel.comm_dtype)).max(1);
    let w = spec.parallel.dp as f64;
    let multiple = 3.0 * (w - 1.0) / w * spec.pipeline_micro_batches() as f64;
    let measured = (ar + ag) as f64 / d as f64;
    Ok(input.m(
        format!(
            "3(W-1)/W x D = {multiple:.2} x D per rank per step (W={}): DDP's all-reduce, 2(W-1)/W x D, \
             and the updated parameters' all-gather, (W-1)/W x D",
            spec.parallel.dp
        ),
        format!(
            "{measured:.3} x D: {:.3} x D all-reduced and {:.3} x D all-gathered on rank 0 (D = {}; the \
             planner's count: {})",
            ar as f64 / d as f64,
            ag as f64 / d as f64,
            bytes_text(d),
            bytes_text(planned)
        ),
        spec.parallel.sharding == crate::Sharding::Zero1
            && (planned..=planned + SCALAR_BYTES).contains(&(ar + ag))
            && (measured - multiple).abs() <= 0.05 * multiple,
    ))
}

/// Expert parallelism's all-to-alls on rank 0 per step, their count and bytes, against the planner.
pub(super) fn expert_all_to_all(input: &Inputs) -> Result<Measurement, String> {
    let spec = input.spec;
    let plan = &input.plan;
    let rank0 = input.rank0;
    let traced_steps = input.traced_steps;
    let rank = rank0.ok_or("the run recorded no trace")?;
    let counters: Vec<_> = op_counters(rank, CollectiveOp::AllToAll).collect();
    let bytes = counters.iter().map(|c| c.bytes_sent).sum::<u64>() / traced_steps;
    let calls = counters.iter().map(|c| c.calls).sum::<u64>() / traced_steps;
    let stage = &plan.stages[spec.stage_of(0)];
    let per_block: u64 = if spec.train.checkpointing.recomputes_blocks() { 6 } else { 4 };
    let expected_calls = per_block * stage.layers as u64 * spec.pipeline_micro_batches() as u64;
    let ep = spec.parallel.ep;
    Ok(input.m(
        format!(
            "{per_block} all-to-alls per block and micro-batch: {expected_calls} per step, each (ep-1)/ep = \
             {}/{ep} of the rank's expert slots: {} per rank and step",
            ep.saturating_sub(1),
            bytes_text(stage.comm.ep_all_to_all)
        ),
        format!("{calls} all-to-alls sending {} on rank 0", bytes_text(bytes)),
        ep > 1 && calls == expected_calls && bytes == stage.comm.ep_all_to_all,
    ))
}

/// Context parallelism (this run) against the same training on whole sequences (the
/// partner): rank 0's activations on both, each the planner's and fewer here; and rank 0's
/// exchanges per step, their count and bytes, the planner's: Ulysses' all-to-alls, or the
/// ring's passes of keys and values (and their gradients).
pub(super) fn context_parallel(input: &Inputs) -> Result<Measurement, String> {
    let memory = super::memory_pairs::two_runs_memory(ClaimCheck::ContextParallel, input.run, input.partner)?;
    let spec = input.spec;
    let rank = input.rank0.ok_or("the run recorded no trace")?;
    let (cp, ring, recomputing) =
        (spec.parallel.cp as u64, spec.parallel.cp_kind.is_ring(), spec.train.checkpointing.recomputes_blocks());
    if ring && spec.parallel.pp > 1 {
        return Err("the ring's passes are counted with the pipeline's sends: check it on a run without pp".into());
    }
    let op = if ring { CollectiveOp::Send } else { CollectiveOp::AllToAll };
    let counters: Vec<_> = op_counters(rank, op).collect();
    let bytes = counters.iter().map(|c| c.bytes_sent).sum::<u64>() / input.traced_steps;
    let calls = counters.iter().map(|c| c.calls).sum::<u64>() / input.traced_steps;
    let stage = &input.plan.stages[spec.stage_of(0)];
    let per_block = match (ring, recomputing) {
        (false, false) => 4,
        (false, true) => 6,
        (true, false) => (3 * cp).saturating_sub(2),
        (true, true) => (4 * cp).saturating_sub(3),
    };
    let expected_calls = per_block * stage.layers as u64 * spec.pipeline_micro_batches() as u64;
    let what = match ring {
        false => format!(
            "all-to-alls per block and micro-batch, each (cp-1)/cp = {}/{cp} of q, k, v or attention's output",
            cp.saturating_sub(1)
        ),
        true => {
            "passes per block and micro-batch (cp-1 forward, 2(cp-1)+1 back), each 1/cp of the sequence's k and v or \
                 their gradients"
                .to_string()
        }
    };
    Ok(Measurement {
        predicted: format!(
            "{}; {per_block} {what} ({expected_calls} a step): {} per rank and step",
            memory.predicted,
            bytes_text(stage.comm.cp_all_to_all)
        ),
        measured: format!(
            "{}; {calls} {} sending {} on rank 0",
            memory.measured,
            if ring { "passes" } else { "all-to-alls" },
            bytes_text(bytes)
        ),
        agrees: memory.agrees && cp > 1 && calls == expected_calls && bytes == stage.comm.cp_all_to_all,
        ..memory
    })
}

/// The data-parallel bytes per step on an fp32 wire against a 2-byte one (the partner): half.
pub(super) fn two_byte_wire(input: &Inputs) -> Result<Measurement, String> {
    let run = input.run;
    let partner = input.partner;
    let spec = input.spec;
    // The data-parallel collectives' bytes per step on rank 0, on both runs (the
    // all-reduce counter also holds the step's few scalar floats).
    let two = partner.ok_or(
        "no finished run of the same config with comm_dtype set to its precision yet (resubmit the preset \
         with it)",
    )?;
    let dp_bytes = |r: &RunEvidence| -> Result<(u64, u64), String> {
        let ops = [CollectiveOp::AllReduce, CollectiveOp::ReduceScatter, CollectiveOp::AllGather];
        let (sent, c) = rank0_sent_and_planned(r, &ops)?;
        Ok((sent, c.dp_all_reduce + c.dp_reduce_scatter + c.dp_all_gather))
    };
    let ((wide, wide_planned), (narrow, narrow_planned)) = (dp_bytes(run)?, dp_bytes(two)?);
    let within = |got: u64, planned: u64| (planned..=planned + SCALAR_BYTES).contains(&got);
    let ratio = narrow as f64 / wide.max(1) as f64;
    Ok(input.m(
        format!(
            "the data-parallel collectives carry {} per rank and step on an fp32 wire, {} on a {} wire: half \
             (planner)",
            bytes_text(wide_planned),
            bytes_text(narrow_planned),
            two.view.spec.parallel.comm_dtype.as_str()
        ),
        format!("{} and {} on rank 0 (run {}): {ratio:.3}x", bytes_text(wide), bytes_text(narrow), two.view.id),
        spec.parallel.comm_dtype == crate::Precision::Fp32
            && two.view.spec.parallel.comm_dtype != crate::Precision::Fp32
            && within(wide, wide_planned)
            && within(narrow, narrow_planned)
            && (ratio - 0.5).abs() <= 0.01,
    ))
}

/// FSDP gathering the blocks' weights as FP8 (this run) against gathering them in the wire
/// format (the partner): each run's all-gather bytes per step on rank 0 the planner's, the
/// FP8 run's under 0.6 of the other's (the weights in one byte, the norms, biases,
/// embeddings and head as before), and the same losses step by step: the gathered values
/// are the casts the model would make of the gathered weights.
pub(super) fn fp8_all_gather(input: &Inputs) -> Result<Measurement, String> {
    let run = input.run;
    let other = input
        .partner
        .ok_or("no finished run of the same config with fp8_all_gather off yet (resubmit the preset without it)")?;
    let gathered = |r: &RunEvidence| -> Result<(u64, u64), String> {
        let (sent, c) = rank0_sent_and_planned(r, &[CollectiveOp::AllGather])?;
        Ok((sent, c.dp_all_gather))
    };
    let ((ours, ours_planned), (theirs, theirs_planned)) = (gathered(run)?, gathered(other)?);
    let ratio = ours as f64 / theirs.max(1) as f64;
    let steps = run.metrics.len().min(other.metrics.len());
    let same_losses = steps > 0
        && run.metrics.iter().zip(other.metrics).all(|(a, b)| a.step == b.step && a.loss.to_bits() == b.loss.to_bits());
    let wire = other.view.spec.parallel.comm_dtype.as_str();
    Ok(input.m(
        format!(
            "FSDP's all-gathers carry {} per rank and step with the blocks' weights in FP8, {} in {wire} \
             (planner): {:.3}x; the same losses",
            bytes_text(ours_planned),
            bytes_text(theirs_planned),
            ours_planned as f64 / theirs_planned.max(1) as f64
        ),
        format!(
            "{} and {} on rank 0 (run {}): {ratio:.3}x; {}",
            bytes_text(ours),
            bytes_text(theirs),
            other.view.id,
            match same_losses {
                true => format!("the losses of {steps} steps equal to the last bit"),
                false => "the losses differ".into(),
            }
        ),
        input.spec.parallel.fp8_all_gather
            && !other.view.spec.parallel.fp8_all_gather
            && ours == ours_planned
            && theirs == theirs_planned
            && ratio < 0.6
            && same_losses,
    ))
}

/// DiLoCo's all-reduce bytes per step against DDP's (the partner), both the planner's.
pub(super) fn diloco_bytes(input: &Inputs) -> Result<Measurement, String> {
    let ddp = input
        .partner
        .ok_or("no finished run of the same config with sync every_step yet (resubmit the preset with it)")?;
    // (all-reduce bytes per step on rank 0, the planner's, the last step's loss)
    let read = |r: &RunEvidence| -> Result<(u64, u64, f64), String> {
        let (sent, c) = rank0_sent_and_planned(r, &[CollectiveOp::AllReduce])?;
        Ok((sent, c.dp_all_reduce, r.metrics.last().map_or(f64::NAN, |m| m.loss)))
    };
    let ((ours, ours_planned, ours_loss), (theirs, theirs_planned, theirs_loss)) = (read(input.run)?, read(ddp)?);
    let every = input.spec.parallel.outer_steps_every;
    let ratio = theirs as f64 / ours.max(1) as f64;
    // (each step's one-float all-reduce of the loss rides along; DiLoCo's per step is its
    // outer all-reduce over H, rounded down)
    let near = |measured: u64, planned: u64| (planned..=planned + SCALAR_BYTES + every).contains(&measured);
    Ok(input.m(
        format!(
            "every {every} steps 2(W-1)/W x N x 4 bytes of parameter changes: {} per rank and step against DDP's {} \
             of gradients every step (planner), 1/{every} of it",
            bytes_text(ours_planned),
            bytes_text(theirs_planned)
        ),
        format!(
            "{} and {} per step on rank 0 (run {}): {ratio:.2}x fewer; last loss {ours_loss:.4} against DDP's \
             {theirs_loss:.4}",
            bytes_text(ours),
            bytes_text(theirs),
            ddp.view.id
        ),
        input.spec.parallel.sync == crate::DataSync::Diloco
            && ddp.view.spec.parallel.sync == crate::DataSync::EveryStep
            && near(ours, ours_planned)
            && near(theirs, theirs_planned)
            && (ratio - every as f64).abs() <= 0.02 * every as f64,
    ))
}

/// Asynchronous SGD (this run) against DDP on the same ranks (the partner): the bytes rank
/// 0, the parameter server, sent per step (the parameters back to every other worker for
/// each of their gradients) against a DDP rank's ring all-reduce, both the planner's.
pub(super) fn parameter_server_bottleneck(input: &Inputs) -> Result<Measurement, String> {
    let ddp = input
        .partner
        .ok_or("no finished run of the same config with sync every_step yet (resubmit the preset with it)")?;
    let server = input.plan.parameter_server.as_ref().ok_or("the run is not asynchronous (sync async_ps)")?;
    let (ours, _) = rank0_sent_and_planned(input.run, &[CollectiveOp::Send])?;
    let (theirs, ddp_planned) = rank0_sent_and_planned(ddp, &[CollectiveOp::AllReduce])?;
    let (planned, w) = (server.comm.ps_push_pull, input.spec.parallel.dp as f64);
    let ratio = ours as f64 / theirs.max(1) as f64;
    Ok(input.m(
        format!(
            "the server sends the parameters back for each of the W-1 = {} other workers' gradients, (W-1) x 4N: {} \
             per round, where a ring all-reduce sends 2(W-1)/W x 4N = {} from every rank: W/2 = {:.1}x as much",
            input.spec.parallel.dp - 1,
            bytes_text(planned),
            bytes_text(ddp_planned.dp_all_reduce),
            w / 2.0
        ),
        format!(
            "{} per step from rank 0, DDP's rank 0 (run {}) {}: {ratio:.2}x",
            bytes_text(ours),
            ddp.view.id,
            bytes_text(theirs)
        ),
        input.spec.parallel.sync == crate::DataSync::AsyncPs
            && ddp.view.spec.parallel.sync == crate::DataSync::EveryStep
            && ours == planned
            && (ddp_planned.dp_all_reduce..=ddp_planned.dp_all_reduce + SCALAR_BYTES).contains(&theirs)
            && (ratio - w / 2.0).abs() <= 0.05 * w / 2.0,
    ))
}

/// Fault-tolerant replicas (this run, whose drill or a crash killed a replica): the
/// replacement's copy of a live replica's state, in the planner's bytes, the parameters it
/// took the ones its source sent (their digests), and every step's point.
pub(super) fn replica_rejoin(input: &Inputs) -> Result<Measurement, String> {
    let planned =
        input.plan.rejoin.as_ref().ok_or("the run has no fault-tolerant replicas (fault_tolerance replicas)")?;
    let events = replica_events(input.run.ranks);
    let rejoin = events.iter().find_map(|e| match e {
        ReplicaEvent::Rejoined { step, rank, source, copy_ms, bytes, same_parameters } => {
            Some((*step, *rank, *source, *copy_ms, *bytes, *same_parameters))
        }
        ReplicaEvent::Lost { .. } => None,
    });
    let (step, rank, source, copy_ms, bytes, same) =
        rejoin.ok_or("no replica rejoined in this run (it needs a fault_drill, or a rank that died)")?;
    let lost = events.iter().filter(|e| matches!(e, ReplicaEvent::Lost { .. })).count();
    let (points, steps) = (input.run.metrics.len(), input.spec.train.steps);
    let moments = if input.spec.train.optimizer.keeps_moments() { "m and v" } else { "no moments" };
    Ok(input.m(
        format!(
            "a header and, in fp32, the parameters and the optimizer's {moments}{}: {}; no step lost ({steps} \
             points); the parameters taken are the ones sent",
            if input.spec.train.precision == crate::Precision::Fp32 { "" } else { " and master weights" },
            bytes_text(planned.state_bytes)
        ),
        format!(
            "{lost} loss(es); rank {rank} rejoined at step {step} with {} from rank {source} in {copy_ms:.1} ms, its \
             parameters {} what rank {source} sent; {points} of {steps} step points",
            bytes_text(bytes),
            match same {
                Some(true) => "the same as",
                Some(false) => "NOT",
                None => "not comparable with",
            }
        ),
        bytes == planned.state_bytes && same == Some(true) && points as u64 == steps && lost > 0,
    ))
}

/// HSDP (this run) against FSDP on the same ranks (the partner): the bytes every rank
/// together sent per step to ranks outside its shard group, from the traces' per-peer
/// counts. HSDP's are its shards' all-reduce across the groups (the planner's, with the
/// step's scalars); FSDP's ring crosses between the groups in every collective.
pub(super) fn hsdp_across_groups(input: &Inputs) -> Result<Measurement, String> {
    let fsdp = input
        .partner
        .ok_or("no finished run of the same config with sharding fsdp yet (resubmit the preset with it)")?;
    let spec = input.spec;
    let ways = spec.parallel.shard_ways().max(1);
    let ranks_per_replica = (spec.parallel.tp * spec.parallel.pp).max(1);
    let group = |rank: u32| rank as usize / ranks_per_replica / ways;
    // (bytes per step, all ranks together, to peers of another group)
    let across = |r: &RunEvidence| -> Result<u64, String> {
        if r.ranks.is_empty() || r.ranks.iter().all(|x| x.comm.sent_to.is_empty()) {
            return Err(format!("run {} recorded no bytes per peer", r.view.id));
        }
        let sent = r.ranks.iter().flat_map(|x| x.comm.sent_to.iter().map(move |p| (x.rank, p)));
        let crossing = sent.filter(|(from, p)| group(*from) != group(p.to)).map(|(_, p)| p.bytes).sum::<u64>();
        Ok(crossing / r.traced_steps.max(1))
    };
    let (ours, theirs) = (across(input.run)?, across(fsdp)?);
    let world = spec.world_size() as u64;
    let planned = input.plan.stages.iter().map(|s| s.comm.dp_all_reduce).max().unwrap_or(0).saturating_mul(world);
    Ok(input.m(
        format!(
            "only each rank's gradient shard crosses between the groups of {ways}: {} per step, all ranks together \
             (the planner's shard all-reduce), far less than FSDP's ring over all {} ranks",
            bytes_text(planned),
            spec.parallel.dp
        ),
        format!(
            "{} per step across the groups, FSDP (run {}) {}: {:.1}x less",
            bytes_text(ours),
            fsdp.view.id,
            bytes_text(theirs),
            theirs as f64 / ours.max(1) as f64
        ),
        spec.parallel.sharding == crate::Sharding::Hsdp
            && fsdp.view.spec.parallel.sharding == crate::Sharding::Fsdp
            && (planned..=planned + SCALAR_BYTES * world).contains(&ours)
            && theirs > 2 * ours,
    ))
}

/// Rank 0's bytes per traced step in `ops` (its counters), and the planner's traffic for
/// its stage.
fn rank0_sent_and_planned(r: &RunEvidence, ops: &[CollectiveOp]) -> Result<(u64, planner::CommVolume), String> {
    let rank = r.ranks.iter().find(|x| x.rank == 0).ok_or_else(|| format!("run {} recorded no trace", r.view.id))?;
    let sent: u64 = ops.iter().flat_map(|&op| op_counters(rank, op)).map(|c| c.bytes_sent).sum();
    let plan = planner::plan(&r.view.spec).map_err(|_| "the planner cannot plan the run's spec".to_string())?;
    let stage = plan.stages.into_iter().nth(r.view.spec.stage_of(0)).ok_or("the plan has no stage for rank 0")?;
    Ok((sent / r.traced_steps.max(1), stage.comm))
}

/// Tensor parallelism's all-reduces on rank 0 in one step: 4 per block and micro-batch (6 with checkpointing).
pub(super) fn tp_allreduces(input: &Inputs) -> Result<Measurement, String> {
    let run = input.run;
    let spec = input.spec;
    let plan = &input.plan;
    let rank0 = input.rank0;
    let step = default_step(&recorded_steps(run.ranks)).ok_or("the run recorded no timeline")?;
    let rank = rank0.ok_or("the run recorded no trace")?;
    let calls = rank.spans.iter().filter(|s| s.step == step && s.lane == crate::wire::trace::lane::TP).count();
    let layers = plan.stages[spec.stage_of(0)].layers;
    // Checkpointing recomputes each block's forward, with its two all-reduces.
    let per_block = if spec.train.checkpointing.recomputes_blocks() { 6 } else { 4 };
    let micro_batches = spec.pipeline_micro_batches();
    let predicted = per_block * layers * micro_batches;
    Ok(Measurement {
        note: Some(
            "Texts that count one all-reduce per layer count the MLP's alone; two per layer are the \
             attention's and the MLP's in the forward pass. Backward adds as many again, in the reverse \
             order: the gradient of each block's input is summed over the ranks."
                .into(),
        ),
        ..input.m(
            format!("{per_block} x {layers} blocks x {micro_batches} micro-batches = {predicted} per step"),
            format!("{calls} on rank 0 in step {step}"),
            calls == predicted,
        )
    })
}

#[cfg(test)]
mod tests {
    use crate::plan::planner;
    use crate::spec::presets::presets;
    use crate::study::cards::ClaimCheck;
    use crate::study::claims::test_runs::{counter, succeeded_view, traced};
    use crate::study::claims::{canonical_preset, is_partner, measure, RunEvidence};
    use crate::wire::trace::{CollectiveOp, RankTrace, RingPhase};
    use crate::ExperimentSpec;

    #[test]
    fn a_collective_demo_checks_its_byte_counts() {
        let spec = presets().into_iter().find(|p| p.key == "allreduce").map(|p| p.spec).unwrap_or_default();
        let collective = crate::CollectiveCheck {
            world: 4,
            elements: 16,
            bytes_sent: vec![96; 4],
            formula_bytes: 96.0,
            ..Default::default()
        };
        let mut v =
            succeeded_view(7, spec, Some(crate::RunSummary { collective: Some(collective), ..Default::default() }));
        let got = measure(
            ClaimCheck::AllreduceBytes,
            &RunEvidence { view: &v, metrics: &[], ranks: &[], traced_steps: 1 },
            None,
        )
        .unwrap();
        assert!(got.agrees && got.measured.starts_with("96–96 bytes"), "{got:?}");
        if let Some(c) = v.summary.as_mut().and_then(|s| s.collective.as_mut()) {
            c.bytes_sent[2] = 112;
        }
        let got = measure(
            ClaimCheck::AllreduceBytes,
            &RunEvidence { view: &v, metrics: &[], ranks: &[], traced_steps: 1 },
            None,
        )
        .unwrap();
        assert!(!got.agrees, "{got:?}");
        let err = measure(
            ClaimCheck::DdpEqualsOneRank,
            &RunEvidence { view: &v, metrics: &[], ranks: &[], traced_steps: 1 },
            None,
        );
        assert!(err.unwrap_err().contains("one-rank"));
    }

    #[test]
    fn the_ring_phases_are_checked_from_the_bytes_each_rank_sent_in_each() {
        let spec = presets().into_iter().find(|p| p.key == "allreduce").map(|p| p.spec).unwrap_or_default();
        let collective = crate::CollectiveCheck {
            world: 2,
            elements: 16,
            bytes_sent: vec![64; 2],
            formula_bytes: 64.0,
            ..Default::default()
        };
        let v = succeeded_view(3, spec, Some(crate::RunSummary { collective: Some(collective), ..Default::default() }));
        let step = |from: u32, phase: RingPhase, bytes: u64| crate::wire::trace::RingStep {
            collective: 0,
            phase,
            step: 0,
            chunk: from,
            from,
            to: 1 - from,
            bytes,
            start_us: 0,
            end_us: 1,
            values: None,
        };
        let rank = |r: u32, rs: u64, ag: u64| RankTrace {
            rank: r,
            comm: crate::wire::trace::RankCommTrace {
                steps: vec![step(r, RingPhase::ReduceScatter, rs), step(r, RingPhase::AllGather, ag)],
                ..Default::default()
            },
            ..RankTrace::default()
        };
        let check = |ranks: &[RankTrace]| {
            measure(ClaimCheck::RingPhaseBytes, &RunEvidence { view: &v, metrics: &[], ranks, traced_steps: 1 }, None)
        };
        let right = check(&[rank(0, 32, 32), rank(1, 32, 32)]).unwrap();
        assert!(right.agrees && right.measured.contains("32 bytes in reduce-scatter"), "{right:?}");
        // An all-reduce that sends the right total but splits it wrongly between the phases.
        assert!(!check(&[rank(0, 48, 16), rank(1, 48, 16)]).unwrap().agrees);
        assert!(check(&[]).is_err());
    }

    #[test]
    fn zero1_sends_ddps_all_reduce_and_an_all_gather() {
        let spec = presets().into_iter().find(|p| p.key == "zero1").map(|p| p.spec).unwrap_or_default();
        let comm = planner::plan(&spec).unwrap().stages[0].comm.clone();
        let v = succeeded_view(1, spec, None);
        let check = |ranks: &[RankTrace]| {
            measure(ClaimCheck::Zero1Traffic, &RunEvidence { view: &v, metrics: &[], ranks, traced_steps: 2 }, None)
                .unwrap()
        };
        // Two steps, with the loss's and the gradient norm's floats in the all-reduce.
        let ok = traced(
            vec![
                counter(CollectiveOp::AllReduce, 4, 2 * comm.dp_all_reduce + 32),
                counter(CollectiveOp::AllGather, 2, 2 * comm.dp_all_gather),
            ],
            0,
        );
        let got = check(&ok);
        assert!(got.agrees && got.predicted.contains("2.25 x D"), "{got:?}");
        // The ZeRO paper's count (a reduce-scatter in place of the all-reduce) is not this run.
        let paper = traced(
            vec![
                counter(CollectiveOp::AllReduce, 2, 32),
                counter(CollectiveOp::ReduceScatter, 2, comm.dp_all_reduce),
                counter(CollectiveOp::AllGather, 2, 2 * comm.dp_all_gather),
            ],
            0,
        );
        assert!(!check(&paper).agrees);
    }

    #[test]
    fn the_parameter_server_is_held_to_its_bytes_against_a_ring_ranks() {
        let spec = presets().into_iter().find(|p| p.key == "async-ps").map(|p| p.spec).unwrap_or_default();
        let mut ddp = spec.clone();
        ddp.parallel.sync = crate::DataSync::EveryStep;
        assert_eq!(is_partner(ClaimCheck::ParameterServerBottleneck, &spec, &ddp), Some(true));
        assert_eq!(canonical_preset(ClaimCheck::ParameterServerBottleneck), "async-ps");
        let server = planner::plan(&spec).unwrap().parameter_server.unwrap().comm.ps_push_pull;
        let ring = planner::plan(&ddp).unwrap().stages[0].comm.dp_all_reduce;
        let (v, dv) = (succeeded_view(1, spec, None), succeeded_view(2, ddp, None));
        let check = |sent: u64, ring_sent: u64| {
            let ours = traced(vec![counter(CollectiveOp::Send, 6, 2 * sent)], 0);
            let theirs = traced(vec![counter(CollectiveOp::AllReduce, 4, 2 * ring_sent)], 0);
            let partner = RunEvidence { view: &dv, metrics: &[], ranks: &theirs, traced_steps: 2 };
            let run = RunEvidence { view: &v, metrics: &[], ranks: &ours, traced_steps: 2 };
            measure(ClaimCheck::ParameterServerBottleneck, &run, Some(&partner)).unwrap()
        };
        // Two steps; DDP's loss float rides along in its all-reduce.
        let got = check(server, ring + 16);
        assert!(got.agrees, "{got:?}");
        assert!(got.predicted.contains("W/2 = 2.0x"), "{}", got.predicted);
        // A server that sent the parameters to only one worker a round, or every gradient
        // back to every worker as an all-reduce would, is not the run the card describes.
        assert!(!check(server / 3, ring + 16).agrees);
        assert!(!check(server, 2 * ring).agrees);
    }

    #[test]
    fn a_rejoin_is_held_to_the_planners_bytes_and_its_sources_parameters() {
        let spec = presets().into_iter().find(|p| p.key == "lost-replica").map(|p| p.spec).unwrap_or_default();
        assert_eq!(canonical_preset(ClaimCheck::ReplicaRejoin), "lost-replica");
        let planned = planner::plan(&spec).unwrap().rejoin.unwrap().state_bytes;
        let n = planner::plan(&spec).unwrap().stages[0].params_per_rank;
        assert_eq!(planned, 24 + 4 * n * 3, "fp32 AdamW: parameters, m and v");
        let v = succeeded_view(3, spec.clone(), None);
        let span = |name: &str, step: u64, bytes: u64| crate::wire::trace::Span {
            kind: crate::wire::trace::SpanKind::Idle,
            name: name.into(),
            step,
            lane: "dp-blocking".into(),
            start_us: 0,
            end_us: 2000,
            layer: None,
            bucket: None,
            bytes: Some(bytes),
            micro: None,
            chunk: None,
        };
        let check = |took: &str, bytes: u64, points: u64| {
            let ranks = vec![
                RankTrace {
                    rank: 0,
                    spans: vec![
                        span("replica lost: rank(s) [2]", 6, 0),
                        span("state copied to rank 2, which rejoins: parameters 00aa", 8, bytes),
                    ],
                    ..RankTrace::default()
                },
                RankTrace { rank: 2, spans: vec![span(took, 8, bytes)], ..RankTrace::default() },
            ];
            let metrics: Vec<crate::MetricPoint> =
                (0..points).map(|step| crate::MetricPoint { step, ..Default::default() }).collect();
            measure(
                ClaimCheck::ReplicaRejoin,
                &RunEvidence { view: &v, metrics: &metrics, ranks: &ranks, traced_steps: 3 },
                None,
            )
            .unwrap()
        };
        let steps = spec.train.steps;
        let got = check("rejoined: state copied from rank 0, parameters 00aa", planned, steps);
        assert!(got.agrees, "{got:?}");
        // Other parameters than the source sent, a copy without the optimizer's moments, or
        // a lost step: not the run the card describes.
        assert!(!check("rejoined: state copied from rank 0, parameters 00ab", planned, steps).agrees);
        assert!(!check("rejoined: state copied from rank 0, parameters 00aa", 24 + 4 * n, steps).agrees);
        assert!(!check("rejoined: state copied from rank 0, parameters 00aa", planned, steps - 1).agrees);
    }

    #[test]
    fn expert_all_to_alls_and_parameters_are_measured_against_the_planner() {
        let spec = presets().into_iter().find(|p| p.key == "experts").map(|p| p.spec).unwrap_or_default();
        let stage = planner::plan(&spec).unwrap().stages[0].clone();
        let calls = 4 * stage.layers as u64 * spec.pipeline_micro_batches() as u64;
        let v = succeeded_view(1, spec.clone(), None);
        let check = |check, ranks: &[RankTrace]| {
            measure(check, &RunEvidence { view: &v, metrics: &[], ranks, traced_steps: 1 }, None).unwrap()
        };
        let good =
            traced(vec![counter(CollectiveOp::AllToAll, calls, stage.comm.ep_all_to_all)], stage.memory.parameters);
        assert!(check(ClaimCheck::ExpertAllToAll, &good).agrees);
        assert!(check(ClaimCheck::ExpertParameters, &good).agrees);
        // Two all-to-alls per block (a backward that sends nothing back) disagree; so does
        // a rank holding every expert.
        let half = traced(vec![counter(CollectiveOp::AllToAll, calls / 2, stage.comm.ep_all_to_all / 2)], 0);
        assert!(!check(ClaimCheck::ExpertAllToAll, &half).agrees);
        let mut all = spec.clone();
        all.parallel.ep = 1;
        let every_expert = planner::plan(&all).unwrap().stages[0].memory.parameters;
        assert!(every_expert > stage.memory.parameters);
        assert!(!check(ClaimCheck::ExpertParameters, &traced(vec![], every_expert)).agrees);
    }

    #[test]
    fn ulysses_is_held_to_the_planners_activations_and_all_to_alls() {
        let spec = presets().into_iter().find(|p| p.key == "ulysses").map(|p| p.spec).unwrap_or_default();
        assert_eq!(canonical_preset(ClaimCheck::ContextParallel), "ulysses");
        let mut whole = spec.clone();
        (whole.parallel.dp, whole.parallel.cp) = (1, 1);
        assert_eq!(is_partner(ClaimCheck::ContextParallel, &spec, &whole), Some(true));
        let stage = |s: &ExperimentSpec| planner::plan(s).unwrap().stages[0].clone();
        let (ours, theirs) = (stage(&spec), stage(&whole));
        assert!(2 * ours.memory.activations < theirs.memory.activations * 21 / 20, "about half, or less");
        let calls = 4 * ours.layers as u64 * spec.pipeline_micro_batches() as u64;
        let ranks = |calls: u64, bytes: u64, activations: u64| {
            let mut ranks = traced(vec![counter(CollectiveOp::AllToAll, calls, bytes)], 0);
            ranks[0].memory.as_mut().unwrap().peak.activations = activations;
            ranks
        };
        let (v, w) = (succeeded_view(1, spec.clone(), None), succeeded_view(2, whole.clone(), None));
        let r_whole = ranks(0, 0, theirs.memory.activations);
        let check = |r: &[RankTrace]| {
            let run = RunEvidence { view: &v, metrics: &[], ranks: r, traced_steps: 1 };
            let partner = RunEvidence { view: &w, metrics: &[], ranks: &r_whole, traced_steps: 1 };
            measure(ClaimCheck::ContextParallel, &run, Some(&partner)).unwrap()
        };
        let good = check(&ranks(calls, ours.comm.cp_all_to_all, ours.memory.activations));
        assert!(good.agrees, "{good:?}");
        // Whole sequences kept after all, the all-to-alls of the backward missing, or every
        // rank sending everything (no 1/cp kept home): disagrees.
        assert!(!check(&ranks(calls, ours.comm.cp_all_to_all, theirs.memory.activations)).agrees);
        assert!(!check(&ranks(calls / 2, ours.comm.cp_all_to_all / 2, ours.memory.activations)).agrees);
        assert!(!check(&ranks(calls, 2 * ours.comm.cp_all_to_all, ours.memory.activations)).agrees);
    }

    #[test]
    fn the_ring_is_held_to_the_planners_activations_and_passes() {
        let spec = presets().into_iter().find(|p| p.key == "ring").map(|p| p.spec).unwrap_or_default();
        let mut whole = spec.clone();
        (whole.parallel.dp, whole.parallel.cp) = (1, 1);
        assert_eq!(is_partner(ClaimCheck::ContextParallel, &spec, &whole), Some(true));
        let stage = |s: &ExperimentSpec| planner::plan(s).unwrap().stages[0].clone();
        let (ours, theirs) = (stage(&spec), stage(&whole));
        assert!(ours.memory.activations < theirs.memory.activations);
        // cp = 2: one pass forward, three back, per block
        let passes = 4 * ours.layers as u64 * spec.pipeline_micro_batches() as u64;
        let ranks = |op, calls: u64, bytes: u64, activations: u64| {
            let mut ranks = traced(vec![counter(op, calls, bytes)], 0);
            ranks[0].memory.as_mut().unwrap().peak.activations = activations;
            ranks
        };
        let (v, w) = (succeeded_view(1, spec.clone(), None), succeeded_view(2, whole.clone(), None));
        let r_whole = ranks(CollectiveOp::Send, 0, 0, theirs.memory.activations);
        let check = |r: &[RankTrace]| {
            let run = RunEvidence { view: &v, metrics: &[], ranks: r, traced_steps: 1 };
            let partner = RunEvidence { view: &w, metrics: &[], ranks: &r_whole, traced_steps: 1 };
            measure(ClaimCheck::ContextParallel, &run, Some(&partner)).unwrap()
        };
        let bytes = ours.comm.cp_all_to_all;
        let good = check(&ranks(CollectiveOp::Send, passes, bytes, ours.memory.activations));
        assert!(good.agrees, "{good:?}");
        // The gradients never brought home (a pass short), or all-to-alls in place of the
        // passes: disagrees.
        let short = passes - ours.layers as u64;
        assert!(!check(&ranks(CollectiveOp::Send, short, bytes * 3 / 4, ours.memory.activations)).agrees);
        assert!(!check(&ranks(CollectiveOp::AllToAll, passes, bytes, ours.memory.activations)).agrees);
    }

    #[test]
    fn a_two_byte_wire_halves_the_data_parallel_bytes() {
        let spec = presets().into_iter().find(|p| p.key == "zero2").map(|p| p.spec).unwrap_or_default();
        let mut narrow = spec.clone();
        narrow.parallel.comm_dtype = crate::Precision::Bf16;
        assert_eq!(is_partner(ClaimCheck::TwoByteWire, &spec, &narrow), Some(true));
        let comm = |s: &ExperimentSpec| planner::plan(s).unwrap().stages[0].comm.clone();
        let ranks = |c: planner::CommVolume| {
            traced(
                vec![
                    counter(CollectiveOp::AllReduce, 1, 24),
                    counter(CollectiveOp::ReduceScatter, 1, c.dp_reduce_scatter),
                    counter(CollectiveOp::AllGather, 1, c.dp_all_gather),
                ],
                0,
            )
        };
        let (v_wide, v_narrow) = (succeeded_view(1, spec.clone(), None), succeeded_view(2, narrow.clone(), None));
        let (r_wide, r_narrow) = (ranks(comm(&spec)), ranks(comm(&narrow)));
        let run = |v, r| RunEvidence { view: v, metrics: &[], ranks: r, traced_steps: 1 };
        let got = measure(ClaimCheck::TwoByteWire, &run(&v_wide, &r_wide), Some(&run(&v_narrow, &r_narrow))).unwrap();
        assert!(got.agrees && got.measured.ends_with("0.500x"), "{got:?}");
        // A wire that still sends 4 bytes per element disagrees.
        let got = measure(ClaimCheck::TwoByteWire, &run(&v_wide, &r_wide), Some(&run(&v_narrow, &r_wide))).unwrap();
        assert!(!got.agrees, "{got:?}");
    }

    #[test]
    fn fp8_all_gathers_are_held_to_the_planners_bytes_and_the_same_losses() {
        let spec = presets().into_iter().find(|p| p.key == "fp8-all-gather").map(|p| p.spec).unwrap_or_default();
        assert!(spec.parallel.fp8_all_gather);
        let mut wide = spec.clone();
        wide.parallel.fp8_all_gather = false;
        assert_eq!(is_partner(ClaimCheck::Fp8AllGather, &spec, &wide), Some(true));
        let gathers = |s: &ExperimentSpec| planner::plan(s).unwrap().stages[0].comm.dp_all_gather;
        let ranks = |bytes: u64| traced(vec![counter(CollectiveOp::AllGather, 1, bytes)], 0);
        let points = |losses: &[f64]| -> Vec<crate::MetricPoint> {
            let point = |(step, &loss)| crate::MetricPoint { step: step as u64, loss, ..Default::default() };
            losses.iter().enumerate().map(point).collect()
        };
        let (v_fp8, v_wide) = (succeeded_view(1, spec.clone(), None), succeeded_view(2, wide.clone(), None));
        let (r_fp8, r_wide) = (ranks(gathers(&spec)), ranks(gathers(&wide)));
        let (same, other) = (points(&[5.5, 5.0, 4.6]), points(&[5.5, 5.0, 4.7]));
        let check = |r_fp8: &[RankTrace], fp8_losses: &[crate::MetricPoint]| {
            let ours = RunEvidence { view: &v_fp8, metrics: fp8_losses, ranks: r_fp8, traced_steps: 1 };
            let theirs = RunEvidence { view: &v_wide, metrics: &same, ranks: &r_wide, traced_steps: 1 };
            measure(ClaimCheck::Fp8AllGather, &ours, Some(&theirs)).unwrap()
        };
        let got = check(&r_fp8, &same);
        assert!(got.agrees, "{got:?}");
        // Weights still gathered in bf16, or the gathered values not the model's casts: disagrees.
        assert!(!check(&r_wide, &same).agrees);
        assert!(!check(&r_fp8, &other).agrees);
    }

    #[test]
    fn sharded_traffic_is_measured_in_multiples_of_d() {
        for (key, check) in [("zero2", ClaimCheck::Zero2Traffic), ("fsdp", ClaimCheck::FsdpTraffic)] {
            let spec = presets().into_iter().find(|p| p.key == key).map(|p| p.spec).unwrap_or_default();
            assert_eq!(canonical_preset(check), key);
            let comm = planner::plan(&spec).unwrap().stages[0].comm.clone();
            let counter = |op, bytes_sent| crate::wire::trace::CollectiveCounter {
                op,
                calls: 1,
                elements: 0,
                bytes_sent,
                bytes_from_formula: false,
                total_us: 0,
            };
            // Three steps of the planned reduce-scatter and all-gather bytes, and a few scalars.
            let ranks = |rs: u64, ag: u64| {
                vec![RankTrace {
                    comm: crate::wire::trace::RankCommTrace {
                        counters: vec![
                            counter(CollectiveOp::ReduceScatter, 3 * rs),
                            counter(CollectiveOp::AllGather, 3 * ag),
                            counter(CollectiveOp::AllReduce, 24),
                        ],
                        ..Default::default()
                    },
                    ..RankTrace::default()
                }]
            };
            let v = succeeded_view(1, spec.clone(), None);
            let good = ranks(comm.dp_reduce_scatter, comm.dp_all_gather);
            let got =
                measure(check, &RunEvidence { view: &v, metrics: &[], ranks: &good, traced_steps: 3 }, None).unwrap();
            assert!(got.agrees, "{key}: {got:?}");
            let want = if key == "zero2" { "1.50 x D" } else { "2.25 x D" };
            assert!(got.predicted.contains(want), "{key}: {}", got.predicted);
            // Without the parameters' all-gather (a broken ZeRO) the bytes fall short.
            let broken = ranks(comm.dp_reduce_scatter, 0);
            let got =
                measure(check, &RunEvidence { view: &v, metrics: &[], ranks: &broken, traced_steps: 3 }, None).unwrap();
            assert!(!got.agrees, "{key}: {got:?}");
        }
    }
}
