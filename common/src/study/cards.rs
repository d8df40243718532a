//! The flashcard deck: what a card says, which live demo it opens, and which of its claims
//! a small run can check. The deck itself is data (`cards/deck.json` at the repository
//! root); the server loads and checks it at start and serves it at `GET /api/cards`.

use serde::{Deserialize, Serialize};

use crate::plan::planner;
use crate::spec::presets::presets;
use crate::ExperimentSpec;

/// The deck covers this many topics, numbered 1..=TOPICS: 1..=DECK_TOPICS are the topics
/// of the flashcard deck the lab teaches from; the rest are the subjects of its chapter,
/// notes and quiz that deck has no card for (`cards/coverage.json` maps every section of
/// those texts to the cards that teach it).
pub const TOPICS: u32 = 152;
/// The flashcard deck's own topics.
pub const DECK_TOPICS: u32 = 89;

/// `cards/coverage.json`: for each study text, its sections (the chapter's numbered
/// headings, the notes' headings, the quiz's questions) and the cards that teach each.
pub type Coverage = std::collections::BTreeMap<String, Vec<CoveredSection>>;

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct CoveredSection {
    pub heading: String,
    pub cards: Vec<String>,
}

/// Checks a coverage table against a deck: every section names at least one card, every
/// card named exists, and every card beyond the flashcard deck's topics teaches some
/// section. Returns every problem.
pub fn check_coverage(coverage: &Coverage, deck: &[Card]) -> Vec<String> {
    let ids: std::collections::HashSet<&str> = deck.iter().map(|c| c.id.as_str()).collect();
    let mut problems = Vec::new();
    let mut used = std::collections::HashSet::new();
    for (text, sections) in coverage {
        let mut headings = std::collections::HashSet::new();
        for section in sections {
            let at = format!("{text}: {:?}", section.heading);
            if !headings.insert(section.heading.as_str()) {
                problems.push(format!("{at} is listed twice"));
            }
            if section.cards.is_empty() {
                problems.push(format!("{at} has no card"));
            }
            for id in &section.cards {
                if ids.contains(id.as_str()) {
                    used.insert(id.as_str());
                } else {
                    problems.push(format!("{at} names no card {id:?}"));
                }
            }
        }
    }
    for card in deck.iter().filter(|c| c.topic > DECK_TOPICS && !used.contains(c.id.as_str())) {
        problems.push(format!("card {:?} (topic {}) teaches no section of the texts", card.id, card.topic));
    }
    problems
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct Card {
    /// Stable across edits of the text (review progress is kept by id).
    pub id: String,
    /// The topic (1..=TOPICS) this card teaches.
    pub topic: u32,
    pub title: String,
    pub question: String,
    pub answer: String,
    pub demo: Demo,
    /// A number on the card that a run in the lab can check.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub claim: Option<Claim>,
}

/// The live demo a card opens.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(tag = "kind", rename_all = "snake_case", deny_unknown_fields)]
pub enum Demo {
    /// Submit a preset experiment (a key of `presets()`).
    Preset { preset: String },
    /// The ring all-reduce replay of a preset demo run.
    Ring { preset: String },
    /// The pipeline schedule page of a preset run.
    Pipeline { preset: String },
    /// The per-rank memory page of a preset run.
    Memory { preset: String },
    /// The per-rank timeline of a preset run.
    Timeline { preset: String },
    /// The planner with these spec fields filled in (the rest default).
    Planner { spec: serde_json::Value },
}

/// A checkable number on a card, and the kind of measurement that checks it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct Claim {
    pub text: String,
    pub check: ClaimCheck,
    /// Where the study texts disagree on the claim: what each says, shown side by side;
    /// the measurement says which one this lab's run matches.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub readings: Vec<Reading>,
}

/// What one study text says.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct Reading {
    /// "the chapter", "the notes", "the quiz", "the flashcard deck".
    pub source: String,
    pub says: String,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "snake_case")]
pub enum ClaimCheck {
    /// A ring all-reduce sends 2(W-1)/W x D bytes per rank.
    AllreduceBytes,
    /// Each phase of a ring all-reduce (reduce-scatter, then all-gather) sends (W-1)/W x D
    /// bytes per rank.
    RingPhaseBytes,
    /// DDP on W ranks gives the losses of one rank with W times the batch.
    DdpEqualsOneRank,
    /// The measured pipeline bubble next to (P-1)/(M+P-1).
    BubbleFraction,
    /// 16 bytes per parameter with Adam, in fp32 or mixed precision.
    BytesPerParam,
    /// Activation checkpointing: the saved activations fall (measured against a run without it).
    ActivationCheckpointingMemory,
    /// Activation checkpointing's price: the recomputed forwards' time as a share of the
    /// step's forward and backward, measured on the run's timeline.
    CheckpointingRecomputeTime,
    /// 1F1B against GPipe: each stage's activation peak, measured on both runs.
    PipelineActivationPeaks,
    /// ZeRO-2's bytes per rank and step: a reduce-scatter and an all-gather, 2(W-1)/W x D.
    Zero2Traffic,
    /// FSDP's bytes per rank and step: a reduce-scatter and two all-gathers, 3(W-1)/W x D.
    FsdpTraffic,
    /// ZeRO-1's bytes per rank and step: DDP's all-reduce and an all-gather of the updated
    /// parameters, 3(W-1)/W x D.
    Zero1Traffic,
    /// Expert parallelism's all-to-alls: four per block and micro-batch, each (ep-1)/ep of
    /// a rank's expert slots.
    ExpertAllToAll,
    /// A Mixture-of-Experts rank's parameters, with the experts spread over ep ranks.
    ExpertParameters,
    /// FlashAttention's activations against the naive attention's (no T x T scores kept).
    FlashAttentionMemory,
    /// Selective recompute's activations against none's (no T x T probabilities kept), and
    /// the time it spends making them again against the planner's FLOPs.
    SelectiveRecompute,
    /// Ulysses context parallelism against the same training on whole sequences: each
    /// rank's activations against the planner's, and the all-to-alls' count and bytes.
    ContextParallel,
    /// FSDP's gathered weights with prefetch (two units at once) against without (one).
    PrefetchGatheredPeak,
    /// Tensor parallelism's activations with sequence parallelism against without.
    SequenceParallelActivations,
    /// Data-parallel bytes with a 2-byte wire (`comm_dtype`) against fp32's: half.
    TwoByteWire,
    /// A tree all-reduce: rank 0 sends ceil(log2 W) whole buffers, in 2 ceil(log2 W) steps.
    TreeAllreduce,
    /// A hierarchical all-reduce: only the nodes' leaders send between nodes, 2(n-1) steps.
    HierarchicalAllreduce,
    /// Compressed gradients: the bytes a rank sends per step against the all-reduce's.
    CompressedGradients,
    /// Gradient accumulation: one gradient all-reduce per step, however many micro-batches.
    AccumulationAllreduces,
    /// Expert capacity: assignments beyond C are dropped; with room for every token, none.
    ExpertCapacity,
    /// The optimizer's state offloaded to disk: one piece of it in memory at a time.
    DiskOffloadMemory,
    /// Activation offload: the activations on the device against a run keeping them all,
    /// each against the planner, and what is off the device.
    ActivationOffloadMemory,
    /// FSDP's weights on a rank: its shard kept, one unit gathered at a time.
    FsdpGatheredPeak,
    /// Model-state bytes per rank for each ZeRO stage.
    ZeroMemory,
    /// Four tensor-parallel all-reduces per block per micro-batch.
    TpAllreduces,
    /// fp16 gradients underflow without loss scaling.
    LossScalingUnderflow,
    /// bf16 trains without loss scaling.
    Bf16NoScaling,
    /// FP8 with delayed scaling: the first step's gradients underflow, then the scales
    /// follow the amaxes and the loss falls as without FP8.
    Fp8DelayedScaling,
    /// FSDP gathering the blocks' weights as FP8 against gathering them in the wire
    /// format: both the planner's bytes, the FP8 gathers near half, the losses the same.
    Fp8AllGather,
    /// ZBV's step, replayed with a core per stage, idles less than ZB-H1's on the same
    /// model, and every stage's activation peak under each is the planner's.
    ZbvBubble,
    /// DualPipeV's step, replayed with a core per stage, idles less than 1F1B's formula
    /// says, and its highest stage holds less than ZBV's on the same V, every stage's peak
    /// in both runs the planner's.
    #[serde(rename = "dualpipev_against_zbv")]
    DualPipeVAgainstZbv,
    /// DiLoCo's all-reduces of the parameter changes every H steps carry 1/H of DDP's
    /// gradient all-reduces per step, both the planner's; the two runs' losses side by side.
    DilocoBytes,
    /// Asynchronous SGD's parameter server sends each other worker the parameters for each
    /// gradient it pushed: (W-1) x 4N bytes a round on rank 0, W/2 times what a ring
    /// all-reduce sends from each rank of DDP on the same ranks, both the planner's.
    ParameterServerBottleneck,
    /// A fault-tolerant replica killed mid-run costs no step: its replacement copies a live
    /// replica's parameters and optimizer state, the planner's bytes, and takes exactly the
    /// parameters its source sent.
    ReplicaRejoin,
    /// LAMB against AdamW at the same large batch and learning rate: AdamW's loss climbs
    /// above its start before it falls, LAMB's does not, and LAMB ends lower.
    LambLargeBatch,
    /// HSDP against FSDP on the same ranks: only the shards' all-reduce crosses between
    /// the shard groups (the planner's), far less than FSDP's ring sends across.
    HsdpAcrossGroups,
    /// MFU: the model's FLOPs per second (6N + attention per token x tokens/s) over the
    /// devices' peak, recomputed from the run's step times.
    ModelFlopUtilisation,
}

impl Demo {
    /// The preset a demo runs, if it runs one.
    pub fn preset(&self) -> Option<&str> {
        match self {
            Demo::Preset { preset }
            | Demo::Ring { preset }
            | Demo::Pipeline { preset }
            | Demo::Memory { preset }
            | Demo::Timeline { preset } => Some(preset),
            Demo::Planner { .. } => None,
        }
    }

    /// A planner demo's spec: its fields over the defaults.
    pub fn planner_spec(&self) -> Option<Result<ExperimentSpec, String>> {
        let Demo::Planner { spec } = self else { return None };
        Some(
            ExperimentSpec::from_json_value(spec.clone())
                .map_err(|errors| errors.iter().map(|e| e.to_string()).collect::<Vec<_>>().join("; ")),
        )
    }
}

/// Parses a deck and checks it: ids unique, every topic 1..=TOPICS covered and no other,
/// every preset a demo names exists, every planner demo plans. Returns every problem.
pub fn load_deck(json: &str) -> Result<Vec<Card>, Vec<String>> {
    let cards: Vec<Card> = serde_json::from_str(json).map_err(|e| vec![format!("the deck is not valid: {e}")])?;
    let mut problems = Vec::new();
    let keys: Vec<&str> = presets().iter().map(|p| p.key).collect();
    let mut ids = std::collections::HashSet::new();
    for card in &cards {
        let at = format!("card {:?}", card.id);
        if !ids.insert(card.id.as_str()) {
            problems.push(format!("{at}: the id is used twice"));
        }
        if !(1..=TOPICS).contains(&card.topic) {
            problems.push(format!("{at}: topic {} is not in 1..={TOPICS}", card.topic));
        }
        if [&card.title, &card.question, &card.answer].iter().any(|t| t.trim().is_empty()) {
            problems.push(format!("{at}: an empty title, question or answer"));
        }
        if let Some(claim) = &card.claim {
            if claim.readings.len() == 1 {
                problems.push(format!("{at}: one reading: texts disagree in two or more"));
            }
            if claim.readings.iter().any(|r| r.source.trim().is_empty() || r.says.trim().is_empty()) {
                problems.push(format!("{at}: a reading without its source or what it says"));
            }
        }
        if let Some(preset) = card.demo.preset() {
            if !keys.contains(&preset) {
                problems.push(format!("{at}: no preset {preset:?}"));
            }
        }
        match card.demo.planner_spec() {
            Some(Err(e)) => problems.push(format!("{at}: the planner spec is invalid: {e}")),
            Some(Ok(spec)) => {
                if let Err(errors) = planner::plan(&spec) {
                    let why: Vec<String> = errors.iter().map(|e| e.to_string()).collect();
                    problems.push(format!("{at}: the planner refuses its spec: {}", why.join("; ")));
                }
            }
            None => {}
        }
    }
    for topic in 1..=TOPICS {
        if !cards.iter().any(|c| c.topic == topic) {
            problems.push(format!("topic {topic} has no card"));
        }
    }
    if problems.is_empty() {
        Ok(cards)
    } else {
        Err(problems)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_deck_covers_every_topic_and_every_demo_exists() {
        let cards = load_deck(include_str!("../../../cards/deck.json")).unwrap_or_else(|p| panic!("{}", p.join("\n")));
        assert!(cards.len() >= TOPICS as usize);
        let claims = cards.iter().filter(|c| c.claim.is_some()).count();
        assert!(claims > 0, "some cards state a number a run checks");
        // Where the texts disagree, the card shows each side: the bubble formula, the ZeRO
        // master copy, ZeRO's traffic, TP's all-reduces per layer, the ring's cost in N,
        // fp16's failure, checkpointing's price.
        let disputed = [
            "pipeline-bubble-formula",
            "zero-redundancy",
            "zero-memory-table",
            "zero2-reduce-scatter-volume",
            "column-vs-row-parallel",
            "ring-allreduce-cost",
            "fp16-nan-vs-stall",
            "activation-checkpointing-tradeoff",
        ];
        for id in disputed {
            let card = cards.iter().find(|c| c.id == id).unwrap_or_else(|| panic!("no card {id}"));
            assert!(card.claim.as_ref().is_some_and(|c| c.readings.len() >= 2), "{id}");
        }
    }

    /// The texts' sections, counted from the texts themselves: the chapter's numbered
    /// headings (17 to 29.x), every heading of the notes, the quiz's 20 questions. A
    /// section dropped from the table, or a card it names removed, fails here.
    #[test]
    fn every_section_of_the_chapter_notes_and_quiz_has_a_card() {
        let deck = load_deck(include_str!("../../../cards/deck.json")).unwrap_or_else(|p| panic!("{}", p.join("\n")));
        let coverage: Coverage = serde_json::from_str(include_str!("../../../cards/coverage.json")).unwrap();
        let problems = check_coverage(&coverage, &deck);
        assert!(problems.is_empty(), "{}", problems.join("\n"));
        let count = |text: &str| coverage.get(text).map_or(0, |s| s.len());
        assert_eq!(count("chapter-training-optimization.txt"), 44);
        assert_eq!(count("notes-parallelism-tradeoffs.txt"), 62);
        assert_eq!(coverage.len(), 3);
        let quiz = &coverage["quiz-distributed-training.txt"];
        for (i, section) in quiz.iter().enumerate() {
            assert!(section.heading.starts_with(&format!("Question {}: ", i + 1)), "{}", section.heading);
        }
        assert_eq!(quiz.len(), 20);
        // A table that loses a card, or a card that teaches nothing, is reported.
        let mut broken = coverage.clone();
        broken.get_mut("quiz-distributed-training.txt").unwrap()[2].cards = vec!["no-such-card".into()];
        let problems = check_coverage(&broken, &deck).join("\n");
        assert!(problems.contains("names no card \"no-such-card\""), "{problems}");
        assert!(problems.contains("set-epoch-distributed-sampler"), "{problems}");
    }

    #[test]
    fn a_broken_deck_lists_every_problem() {
        let deck = r#"[
            {"id": "a", "topic": 1, "title": "t", "question": "q", "answer": "a", "demo": {"kind": "preset", "preset": "nope"}},
            {"id": "a", "topic": 999, "title": "t", "question": "q", "answer": " ", "demo": {"kind": "planner", "spec": {"parallel": {"dp": 0}}}},
            {"id": "b", "topic": 3, "title": "t", "question": "q", "answer": "a", "demo": {"kind": "preset", "preset": "tiny"},
             "claim": {"text": "c", "check": "allreduce_bytes", "readings": [{"source": "the chapter", "says": "x"}]}}
        ]"#;
        let problems = load_deck(deck).unwrap_err();
        let all = problems.join("\n");
        for expected in
            ["no preset \"nope\"", "used twice", "topic 999", "empty", "planner", "topic 2 has no card", "one reading"]
        {
            assert!(all.contains(expected), "{expected}: {all}");
        }
        assert!(load_deck("{").unwrap_err()[0].contains("not valid"));
        let unknown =
            r#"[{"id": "a", "topic": 1, "title": "t", "question": "q", "answer": "a", "demo": {"kind": "video"}}]"#;
        assert!(load_deck(unknown).unwrap_err()[0].contains("not valid"));
    }
}
