//! Activation offload (`train.activation_offload=disk` on the CPU backend): each block's
//! activations but its output go to a file after its forward and come back, read one block
//! ahead, for its backward. The training is bit for bit the same on every layout it
//! composes with; the ledger's resident activations and the offloaded bytes are the
//! planner's; the timeline shows every block going out and coming back, and the heap the
//! process measured drops.

use distlab_common::planner::plan;
use distlab_common::trace::lane;
use distlab_common::*;
use distlab_tests::*;

/// 4 blocks, so that most of a step's activations can leave.
fn spec(name: &str, offload: Offload) -> ExperimentSpec {
    let mut spec = quick_spec(name, 4);
    spec.model = ModelSpec::dense(4, 64, 4, 64, 64);
    spec.train.micro_batch = 2;
    spec.train.activation_offload = offload;
    spec
}

type Variant = fn(&mut ExperimentSpec);

const VARIANTS: [(&str, Variant); 10] = [
    ("one rank, fp32", |_| {}),
    ("one rank, 3 micro-batches accumulated, an evaluation every 2 steps", |s| {
        (s.train.grad_accum, s.train.eval_every) = (3, 2)
    }),
    ("dp=2 FSDP bf16", |s| {
        (s.parallel.dp, s.parallel.sharding, s.train.precision) = (2, Sharding::Fsdp, Precision::Bf16)
    }),
    ("pp=2 1F1B, 4 micro-batches", |s| (s.parallel.pp, s.train.micro_batches) = (2, 4)),
    ("pp=2 interleaved (2 chunks a stage)", |s| {
        (s.parallel.pp, s.parallel.pp_schedule, s.parallel.virtual_stages, s.train.micro_batches) =
            (2, PpSchedule::Interleaved, 2, 4)
    }),
    ("tp=2 with sequence parallelism", |s| (s.parallel.tp, s.parallel.sequence_parallel) = (2, true)),
    ("selective recompute", |s| s.train.checkpointing = Checkpointing::Selective),
    ("Llama with grouped-query attention, flash attention", |s| {
        s.model = ModelSpec::llama(4, 64, 4, 2, 176, 64, 64);
        s.train.attention = Attention::Flash;
    }),
    ("Mixture of Experts, ep=2", |s| {
        s.model.experts = 4;
        (s.parallel.dp, s.parallel.ep) = (2, 2);
    }),
    ("ring attention cp=2", |s| {
        (s.parallel.dp, s.parallel.cp, s.parallel.cp_kind, s.train.attention) =
            (2, 2, ContextParallel::Ring, Attention::Flash)
    }),
];

#[test]
fn offloaded_activations_train_bit_for_bit_and_book_as_planned() {
    let _serial = one_at_a_time();
    for (name, variant) in VARIANTS {
        let (mut kept, mut offloaded) = (spec(name, Offload::None), spec(name, Offload::Disk));
        variant(&mut kept);
        variant(&mut offloaded);
        let (losses, trace) = run_with_trace(&offloaded);
        let bits = |losses: &[f64]| losses.iter().map(|l| l.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&losses), bits(&run_losses(&kept)), "{name}: the same losses, bit for bit");

        let (predicted, without) = (plan(&offloaded).unwrap(), plan(&kept).unwrap());
        for rank in &trace.ranks {
            let stage = offloaded.stage_of(rank.rank as usize);
            let what = format!("{name}, rank {}", rank.rank);
            let (peak, want) = (&rank.memory.as_ref().unwrap().peak, &predicted.stages[stage].memory);
            assert_eq!(peak.activations, want.activations, "{what}: activations on the device");
            assert_eq!(peak.offloaded, want.offloaded, "{what}: activations off it");
            assert!(want.activations <= without.stages[stage].memory.activations, "{what}: no more on the device");
            // Every block of every micro-batch of a recorded step goes out and comes back once.
            let moves: Vec<_> = rank.spans.iter().filter(|s| s.step == 1 && s.lane == lane::OFFLOAD).collect();
            let blocks = offloaded.model.layers / offloaded.parallel.pp;
            let micro = offloaded.train.micro_batches * offloaded.train.grad_accum;
            assert_eq!(moves.len(), 2 * blocks * micro, "{what}: moves of a step");
            let outs = moves.iter().filter(|m| m.name.contains(" out ")).count();
            assert_eq!(2 * outs, moves.len(), "{what}: as many back as out");
            let block_bytes = moves[0].bytes.unwrap_or(0);
            assert!(block_bytes > 0 && moves.iter().all(|m| m.bytes == Some(block_bytes)), "{what}: one block's bytes");
            assert_eq!(want.offloaded % block_bytes, 0, "{what}: whole blocks offloaded");
        }
    }
}

/// The heap the process measured at its peak drops by about what the planner says leaves
/// the device, less the two blocks on their way.
#[test]
fn offloaded_activations_lower_the_measured_heap() {
    let _serial = one_at_a_time();
    let mut peaks = Vec::new();
    for offload in [Offload::None, Offload::Disk] {
        let mut s = spec("heap", offload);
        s.model = ModelSpec::dense(8, 64, 4, 256, 64);
        (s.train.micro_batch, s.train.steps, s.train.warmup_steps, s.train.eval_every) = (4, 2, 1, 0);
        let (_, trace) = run_with_trace(&s);
        let memory = trace.ranks[0].memory.clone().unwrap();
        let heap = memory.process.and_then(|p| p.heap_peak).expect("the heap is measured");
        peaks.push((memory.peak.activations, heap, plan(&s).unwrap().stages[0].memory.activations));
    }
    let [(kept, heap, _), (resident, heap_offloaded, planned)] = peaks[..] else { unreachable!() };
    assert_eq!(resident, planned);
    let saved = heap.saturating_sub(heap_offloaded);
    eprintln!("activations {kept} B kept, {resident} B offloaded; heap peak {heap} B -> {heap_offloaded} B");
    assert!(
        saved as f64 >= 0.8 * (kept - resident) as f64,
        "the heap peak dropped by {saved} B, the ledger's activations by {} B",
        kept - resident
    );
}
