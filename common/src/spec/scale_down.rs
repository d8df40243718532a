//! "Run it small": a planned configuration (GPT-3 on 1024 GPUs, say) shrunk to what this
//! lab can run, keeping what the planner's prediction is about: the parallel layout
//! (as far as the world-size limit allows), the sharding, the pipeline schedule and
//! micro-batches, the precision, loss scaling, checkpointing and optimizer. The model and
//! batch shrink, so the run finishes in seconds and its measured memory and bytes can
//! be set against the planner's prediction for the same small spec.

use crate::spec::validate::Limits;
use crate::{BackendKind, Dataset, ExperimentSpec, ModelFamily, DEFAULT_ROPE_THETA};

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
    // The context-parallel ranks are consecutive ranks of the data-parallel group.
    let cp = gcd(p.cp.max(1), p.dp);
    if cp != p.cp {
        changes.push(format!("cp={} became cp={cp}, which divides the small run's dp={}", p.cp, p.dp));
        p.cp = cp;
    }
    if p.dp < 2 && p.sharding != crate::Sharding::None {
        changes.push(format!("sharding={} needs dp >= 2, so the small run shards nothing", p.sharding.as_str()));
        p.sharding = crate::Sharding::None;
    }
    // (Ulysses gives each context-parallel rank heads/cp of a tensor-parallel rank's heads)
    let heads = HEADS_PER_TP_RANK * cp / gcd(HEADS_PER_TP_RANK, cp) * p.tp;
    let m = &mut small.model;
    if m.tie_embeddings {
        changes
            .push("the engine keeps the LM head apart from the token embedding, so the small model's is untied".into());
        m.tie_embeddings = false;
    }
    match m.family {
        ModelFamily::Gpt2 => (m.kv_heads, m.ffn_hidden, m.rope_theta) = (0, 0, DEFAULT_ROPE_THETA),
        ModelFamily::Llama => {
            // The same grouping of query heads on K/V heads where the small model's heads
            // allow it (Llama-3's 4 per K/V head needs 4 heads: one K/V head for its 2),
            // at least a K/V head per tensor-parallel rank, and SwiGLU's 8/3 x d_model,
            // rounded up to a multiple of 8 x tp (each rank's share a multiple of 8).
            let group = (m.heads / m.key_value_heads().max(1)).clamp(1, heads);
            m.kv_heads = (heads / group).max(p.tp * cp);
            if heads % m.kv_heads != 0 || (m.kv_heads / p.tp) % cp != 0 {
                m.kv_heads = heads;
            }
            m.ffn_hidden = (heads * HEAD_DIM * 8 / 3).div_ceil(8 * p.tp) * 8 * p.tp;
        }
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

fn gcd(a: usize, b: usize) -> usize {
    if b == 0 {
        a
    } else {
        gcd(b, a % b)
    }
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

    /// Llama-3 8B's blocks stay Llama blocks (grouped-query attention, SwiGLU, rotary base),
    /// with a K/V head for every tensor-parallel rank.
    #[test]
    fn a_llama_stays_a_llama_where_the_engine_runs_it() {
        let limits = Limits::default();
        let mut big = ExperimentSpec::default();
        big.model =
            crate::ModelSpec { rope_theta: 500_000.0, ..crate::ModelSpec::llama(32, 4096, 32, 8, 14336, 8192, 128256) };
        (big.parallel.dp, big.parallel.pp, big.parallel.sharding) = (64, 4, Sharding::Fsdp);
        let (small, changes) = run_it_small(&big, &limits);
        assert_eq!(small.validate(&limits), Ok(()), "{changes:?}");
        let m = &small.model;
        assert_eq!(
            (m.family, m.heads, m.kv_heads, m.ffn_hidden, m.rope_theta),
            (ModelFamily::Llama, 2, 1, 88, 500_000.0)
        );
        assert!(!changes.iter().any(|c| c.contains("GPT-2 blocks")), "{changes:?}");
        big.parallel.tp = 8;
        let (small, changes) = run_it_small(&big, &limits);
        assert_eq!(small.validate(&limits), Ok(()), "{changes:?}");
        let m = &small.model;
        assert_eq!((m.family, m.heads, m.kv_heads), (ModelFamily::Llama, 4, 2), "tp 8 became 2 (the world limit)");
        // (the planner, like the engine, refuses experts with tp > 1)
        (big.model.experts, big.parallel.tp) = (8, 1);
        let (small, changes) = run_it_small(&big, &limits);
        assert_eq!(small.validate(&limits), Ok(()), "{changes:?}");
        assert_eq!((small.model.family, small.model.experts), (ModelFamily::Llama, 8), "SwiGLU experts stay");
    }

    #[test]
    fn every_small_layout_validates() {
        let limits = Limits::default();
        for (dp, tp, pp) in [
            (1, 1, 1),
            (2, 1, 1),
            (8, 1, 1),
            (2, 2, 2),
            (1, 4, 1),
            (1, 1, 4),
            (4, 8, 1),
            (64, 8, 4),
            (2, 6, 1),
            (1, 3, 1),
        ] {
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
            // Llama-3 8B's blocks (32 query heads on 8 K/V heads) on the same layout.
            spec.model = crate::ModelSpec::llama(32, 4096, 32, 8, 14336, 8192, 128256);
            let (small, _) = run_it_small(&spec, &limits);
            assert_eq!(small.validate(&limits), Ok(()), "llama dp={dp} tp={tp} pp={pp}");
        }
    }
}
