//! "Run it small": a planned configuration (GPT-3 on 1024 GPUs, say) shrunk to what this
//! lab can run, keeping what the planner's prediction is about: the parallel layout
//! (as far as the world-size limit allows), the sharding, the pipeline schedule and
//! micro-batches, the precision, loss scaling, checkpointing and optimizer. The model and
//! batch shrink, so the run finishes in seconds and its measured memory and bytes can
//! be set against the planner's prediction for the same small spec.

use crate::spec::validate::Limits;
use crate::{BackendKind, Dataset, ExperimentSpec};

/// Attention heads per tensor-parallel rank, and the width of one head, in the small model.
const HEADS_PER_TP_RANK: usize = 2;
const HEAD_DIM: usize = 16;

/// The small spec and one line per thing that changed beyond the model's size.
pub fn run_it_small(spec: &ExperimentSpec, limits: &Limits) -> (ExperimentSpec, Vec<String>) {
    let mut small = spec.clone();
    let mut changes = Vec::new();
    let p = &mut small.parallel;
    let (dp, tp, pp) = (p.dp.max(1), p.tp.max(1), p.pp.max(1));
    (p.dp, p.tp, p.pp) = (dp, tp, pp);
    // Halve the widest axis (on ties dp, then tp, then pp) until the mesh fits the limit,
    // so that every axis the plan uses survives as long as it can (16x8x8 -> 2x2x2).
    let max_world = limits.max_world_size.max(1);
    while p.dp * p.tp * p.pp > max_world {
        let widest = p.dp.max(p.tp).max(p.pp);
        if p.dp == widest {
            p.dp /= 2;
        } else if p.tp == widest {
            p.tp /= 2;
        } else {
            p.pp /= 2;
        }
    }
    if (p.dp, p.tp, p.pp) != (dp, tp, pp) {
        changes.push(format!(
            "the mesh dp={dp} x tp={tp} x pp={pp} ({} ranks) became dp={} x tp={} x pp={} ({} ranks), this lab's limit",
            dp * tp * pp,
            p.dp,
            p.tp,
            p.pp,
            p.dp * p.tp * p.pp
        ));
    }
    if p.dp < 2 && p.sharding != crate::Sharding::None {
        changes.push(format!("sharding={} needs dp >= 2, so the small run shards nothing", p.sharding.as_str()));
        p.sharding = crate::Sharding::None;
    }
    let heads = HEADS_PER_TP_RANK * p.tp;
    let blocks = |m: &crate::ModelSpec| (m.family, m.kv_heads, m.ffn_hidden, m.tie_embeddings);
    let gpt2 = blocks(&crate::ModelSpec::default());
    if blocks(&small.model) != gpt2 {
        changes.push(
            "the engine trains GPT-2 blocks (LayerNorm, a GELU MLP of 4 x d_model, a K and V per head, an untied \
             LM head), so the small model has them"
                .to_string(),
        );
        (small.model.family, small.model.kv_heads, small.model.ffn_hidden, small.model.tie_embeddings) = gpt2;
    }
    small.model.heads = heads;
    small.model.d_model = heads * HEAD_DIM;
    small.model.layers = p.pp.max(2);
    small.model.seq_len = 32;
    small.model.vocab = 256;
    if p.pp == 1 {
        small.train.micro_batches = 1;
    } else {
        small.train.micro_batches = small.train.micro_batches.clamp(1, 8);
    }
    if p.pp_schedule == crate::PpSchedule::Interleaved {
        if p.pp < 2 {
            changes.push("the interleaved schedule needs pp >= 2, so the small run has one stage".to_string());
            (p.pp_schedule, p.virtual_stages) = (crate::PpSchedule::OneFOneB, 1);
        } else {
            // pp * v chunks of one block each, micro-batches in whole groups of pp.
            let v = p.virtual_stages.clamp(2, 4);
            if v != p.virtual_stages {
                changes.push(format!("virtual_stages={} became {v}", p.virtual_stages));
                p.virtual_stages = v;
            }
            small.model.layers = p.pp * v;
            let m = (small.train.micro_batches / p.pp).max(1) * p.pp;
            if m != small.train.micro_batches {
                changes.push(format!(
                    "micro_batches={} became {m}: interleaving takes them in groups of pp={}",
                    small.train.micro_batches, p.pp
                ));
                small.train.micro_batches = m;
            }
        }
    }
    small.train.micro_batch = 4;
    small.train.grad_accum = 1;
    small.train.steps = 20;
    small.train.warmup_steps = 2;
    small.train.checkpoint_every = 0;
    small.data.dataset = Dataset::Markov;
    small.data.upload_id = None;
    if small.backend != BackendKind::Cpu {
        small.backend = BackendKind::Cpu;
        changes.push("the backend is the CPU".to_string());
    }
    small.demo = None;
    small.name = format!("small: {}", spec.name).chars().take(limits.max_name_len.max(8)).collect();
    (small, changes)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Checkpointing, PpSchedule, Precision, Sharding};

    #[test]
    fn a_big_plan_shrinks_to_a_valid_spec_that_keeps_its_layout() {
        let mut big = ExperimentSpec { name: "gpt3".into(), ..ExperimentSpec::default() };
        big.model.layers = 96;
        big.model.d_model = 12288;
        big.model.heads = 96;
        big.model.seq_len = 2048;
        big.model.vocab = 50257;
        (big.parallel.dp, big.parallel.tp, big.parallel.pp) = (16, 8, 8);
        big.parallel.sharding = Sharding::Zero1;
        big.parallel.pp_schedule = PpSchedule::Gpipe;
        big.train.micro_batches = 96;
        big.train.precision = Precision::Bf16;
        big.train.checkpointing = Checkpointing::Every;
        let limits = Limits::default();
        let (small, changes) = run_it_small(&big, &limits);
        assert_eq!(small.validate(&limits), Ok(()));
        assert_eq!((small.parallel.dp, small.parallel.tp, small.parallel.pp), (2, 2, 2));
        assert!(changes[0].contains("(1024 ranks) became dp=2 x tp=2 x pp=2 (8 ranks)"), "{changes:?}");
        assert_eq!(small.parallel.sharding, Sharding::Zero1);
        assert_eq!(small.parallel.pp_schedule, PpSchedule::Gpipe);
        assert_eq!(small.train.micro_batches, 8);
        assert_eq!(small.train.precision, Precision::Bf16);
        assert_eq!(small.train.checkpointing, Checkpointing::Every);
        assert_eq!(small.name, "small: gpt3");
    }

    #[test]
    fn every_small_layout_validates() {
        let limits = Limits::default();
        for (dp, tp, pp) in [(1, 1, 1), (2, 1, 1), (8, 1, 1), (2, 2, 2), (1, 4, 1), (1, 1, 4), (4, 8, 1), (64, 8, 4)] {
            for sharding in [Sharding::None, Sharding::Zero1, Sharding::Zero2, Sharding::Fsdp] {
                let mut spec = ExperimentSpec::default();
                (spec.parallel.dp, spec.parallel.tp, spec.parallel.pp) = (dp, tp, pp);
                spec.parallel.sharding = sharding;
                spec.train.micro_batches = 4;
                let (small, _) = run_it_small(&spec, &limits);
                assert_eq!(small.validate(&limits), Ok(()), "dp={dp} tp={tp} pp={pp} {sharding:?}");
                assert!(small.world_size() <= limits.max_world_size);
            }
            // Interleaved (v = 3 on a planned 96-layer model, 6 micro-batches).
            let mut spec = ExperimentSpec::default();
            (spec.parallel.dp, spec.parallel.tp, spec.parallel.pp) = (dp, tp, pp);
            (spec.parallel.pp_schedule, spec.parallel.virtual_stages) = (PpSchedule::Interleaved, 3);
            (spec.model.layers, spec.train.micro_batches) = (96, 6);
            let (small, _) = run_it_small(&spec, &limits);
            assert_eq!(small.validate(&limits), Ok(()), "interleaved dp={dp} tp={tp} pp={pp}");
        }
    }
}
