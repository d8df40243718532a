//! Fault-tolerant replicas' changes of membership, read back from their ranks' traces
//! (`trace::membership` names the spans): each loss with the ranks that went on without
//! it, and each rejoin with how long the copy of the state took, its bytes, and whether the
//! parameters the replacement took are the ones its source sent (their digests).

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::trace::membership::{COPIED, LOST, LOST_RANKS, PARAMETERS, REJOINED};
use crate::trace::RankTrace;

/// One change, at the step it happened in.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum ReplicaEvent {
    /// `lost` were dropped from the quorum; `seen_by` noticed it (they went on).
    Lost { step: u64, lost: Vec<u32>, seen_by: Vec<u32> },
    /// `rank` took its state from `source`: the copy's time on the replacement (from its
    /// request to join to the state loaded), its bytes, and whether the parameters it
    /// took hash to what the source sent (None: the source's record is missing).
    Rejoined { step: u64, rank: u32, source: u32, copy_ms: f64, bytes: u64, same_parameters: Option<bool> },
}

impl ReplicaEvent {
    pub fn step(&self) -> u64 {
        match self {
            ReplicaEvent::Lost { step, .. } | ReplicaEvent::Rejoined { step, .. } => *step,
        }
    }
}

/// "[2, 3]" as numbers.
fn rank_list(text: &str) -> Vec<u32> {
    let inside = text.trim().trim_start_matches('[').split(']').next().unwrap_or_default();
    inside.split(',').filter_map(|r| r.trim().parse().ok()).collect()
}

/// The number `text` starts with.
fn leading_number(text: &str) -> Option<u32> {
    text.split(|c: char| !c.is_ascii_digit()).next()?.parse().ok()
}

/// Every loss and rejoin the ranks recorded, in step order (a loss once, with every rank
/// that recorded it).
pub fn replica_events(ranks: &[RankTrace]) -> Vec<ReplicaEvent> {
    let mut lost: BTreeMap<(u64, Vec<u32>), Vec<u32>> = BTreeMap::new();
    // (step, joiner) -> the digest its source sent.
    let mut sent: BTreeMap<(u64, u32), String> = BTreeMap::new();
    let mut rejoins = Vec::new();
    for r in ranks {
        for span in &r.spans {
            let digest = || span.name.split(PARAMETERS).nth(1).map(str::to_string);
            if let Some(rest) = span.name.strip_prefix(LOST) {
                let ranks = rest.split(LOST_RANKS).nth(1).map(rank_list).unwrap_or_default();
                lost.entry((span.step, ranks)).or_default().push(r.rank);
            } else if let Some(rest) = span.name.strip_prefix(REJOINED) {
                let source = leading_number(rest).unwrap_or(0);
                let copy_ms = span.end_us.saturating_sub(span.start_us) as f64 / 1e3;
                rejoins.push((span.step, r.rank, source, copy_ms, span.bytes.unwrap_or(0), digest()));
            } else if let Some(rest) = span.name.strip_prefix(COPIED) {
                if let (Some(joiner), Some(d)) = (leading_number(rest), digest()) {
                    sent.insert((span.step, joiner), d);
                }
            }
        }
    }
    let mut events: Vec<ReplicaEvent> = lost
        .into_iter()
        .map(|((step, lost), mut seen_by)| {
            seen_by.sort_unstable();
            seen_by.dedup();
            ReplicaEvent::Lost { step, lost, seen_by }
        })
        .collect();
    events.extend(rejoins.into_iter().map(|(step, rank, source, copy_ms, bytes, took)| {
        let same_parameters = sent.get(&(step, rank)).map(|s| Some(s) == took.as_ref());
        ReplicaEvent::Rejoined { step, rank, source, copy_ms, bytes, same_parameters }
    }));
    events.sort_by_key(|e| (e.step(), matches!(e, ReplicaEvent::Rejoined { .. })));
    events
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::trace::{Span, SpanKind};

    fn span(name: &str, step: u64, us: u64, bytes: u64) -> Span {
        Span {
            kind: SpanKind::Idle,
            name: name.into(),
            step,
            lane: "dp-blocking".into(),
            start_us: 1000,
            end_us: 1000 + us,
            layer: None,
            bucket: None,
            bytes: Some(bytes),
            micro: None,
            chunk: None,
        }
    }

    fn rank(rank: u32, spans: Vec<Span>) -> RankTrace {
        RankTrace { rank, world: 4, spans, ..RankTrace::default() }
    }

    #[test]
    fn losses_are_merged_and_rejoins_checked_against_what_the_source_sent() {
        let ranks = vec![
            rank(
                0,
                vec![
                    span("replica lost: gradients again without rank(s) [2]", 4, 300, 0),
                    span("state copied to rank 2, which rejoins: parameters 00ff", 6, 1800, 1324056),
                ],
            ),
            rank(1, vec![span("replica lost: gradients again without rank(s) [2]", 4, 250, 0)]),
            rank(2, vec![span("rejoined: state copied from rank 0, parameters 00ff", 6, 13780, 1324056)]),
            rank(3, vec![span("replica lost: rank(s) [2, 1]", 9, 10, 0)]),
        ];
        let events = replica_events(&ranks);
        assert_eq!(
            events,
            vec![
                ReplicaEvent::Lost { step: 4, lost: vec![2], seen_by: vec![0, 1] },
                ReplicaEvent::Rejoined {
                    step: 6,
                    rank: 2,
                    source: 0,
                    copy_ms: 13.78,
                    bytes: 1324056,
                    same_parameters: Some(true)
                },
                ReplicaEvent::Lost { step: 9, lost: vec![2, 1], seen_by: vec![3] },
            ]
        );
        // A replacement that took other parameters than the source sent is flagged.
        let mut wrong = ranks.clone();
        wrong[2].spans[0].name = "rejoined: state copied from rank 0, parameters 0100".into();
        assert!(replica_events(&wrong)
            .iter()
            .any(|e| matches!(e, ReplicaEvent::Rejoined { same_parameters: Some(false), .. })));
    }
}
