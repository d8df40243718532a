//! The flashcard deck: what a card says, which live demo it opens, and which of its claims
//! a small run can check. The deck itself is data (`cards/deck.json` at the repository
//! root); the server loads and checks it at start and serves it at `GET /api/cards`.

use serde::{Deserialize, Serialize};

use crate::planner;
use crate::presets::presets;
use crate::ExperimentSpec;

/// The deck covers this many topics, numbered 1..=TOPICS.
pub const TOPICS: u32 = 89;

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
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
#[serde(deny_unknown_fields)]
pub struct Claim {
    pub text: String,
    pub check: ClaimCheck,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
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
    /// Activation checkpointing: activations fall, compute rises by about a third.
    ActivationCheckpointingMemory,
    /// 1F1B against GPipe: each stage's activation peak, measured on both runs.
    PipelineActivationPeaks,
    /// ZeRO-2's bytes per rank and step: a reduce-scatter and an all-gather, 2(W-1)/W x D.
    Zero2Traffic,
    /// FSDP's bytes per rank and step: a reduce-scatter and two all-gathers, 3(W-1)/W x D.
    FsdpTraffic,
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
        let cards = load_deck(include_str!("../../cards/deck.json")).unwrap_or_else(|p| panic!("{}", p.join("\n")));
        assert!(cards.len() >= TOPICS as usize);
        let claims = cards.iter().filter(|c| c.claim.is_some()).count();
        assert!(claims > 0, "some cards state a number a run checks");
    }

    #[test]
    fn a_broken_deck_lists_every_problem() {
        let deck = r#"[
            {"id": "a", "topic": 1, "title": "t", "question": "q", "answer": "a", "demo": {"kind": "preset", "preset": "nope"}},
            {"id": "a", "topic": 90, "title": "t", "question": "q", "answer": " ", "demo": {"kind": "planner", "spec": {"parallel": {"dp": 0}}}}
        ]"#;
        let problems = load_deck(deck).unwrap_err();
        let all = problems.join("\n");
        for expected in ["no preset \"nope\"", "used twice", "topic 90", "empty", "planner", "topic 2 has no card"] {
            assert!(all.contains(expected), "{expected}: {all}");
        }
        assert!(load_deck("{").unwrap_err()[0].contains("not valid"));
        let unknown =
            r#"[{"id": "a", "topic": 1, "title": "t", "question": "q", "answer": "a", "demo": {"kind": "video"}}]"#;
        assert!(load_deck(unknown).unwrap_err()[0].contains("not valid"));
    }
}
