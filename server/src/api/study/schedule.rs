//! Spaced-repetition scheduling (FSRS-6), pure: a card's next state after a review, its
//! retrievability now, and a profile's review view (due cards, new cards, today's queue).
//!
//! The rating maps onto an FSRS grade (`Grade::from_rating`: 1, 2 -> again, 3 -> hard,
//! 4 -> good, 5 -> easy). FSRS gets the card's memory state (none for a new card) and the
//! whole days since its last review, and gives the next memory state and interval for the
//! profile's desired retention (0.9 unless it chose another, `review_settings.rs`, with the
//! parameters fitted to its log if it asked for a fit); the interval is kept fractional
//! (again on a new card is about 5 hours), and `due` = now + interval. A lapse is a failure
//! (rating 1 or 2) of a card that had been reviewed before.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::LazyLock;
use std::time::{Duration, SystemTime};

use distlab_common::cards::Card;
use distlab_common::review::*;
use time::OffsetDateTime;

use crate::clock::{self, parse_time};

/// FSRS keeps stability within (0, 36500] days.
pub(crate) const MAX_DAYS: f32 = 36_500.0;
const DAY_SECS: f64 = 86_400.0;

/// How one profile's reviews are scheduled: FSRS with its parameters (the defaults or the
/// profile's fitted ones) and its desired retention.
pub struct Scheduler {
    fsrs: fsrs::FSRS,
    desired_retention: f32,
    /// The forgetting curve's decay (parameter 20).
    decay: f32,
}

static DEFAULT_FSRS: LazyLock<fsrs::FSRS> = LazyLock::new(fsrs::FSRS::default);

impl Scheduler {
    /// `parameters` None: FSRS's defaults.
    pub fn new(parameters: Option<&[f32]>, desired_retention: f32) -> Result<Scheduler, String> {
        let parameters = parameters.unwrap_or(&fsrs::DEFAULT_PARAMETERS);
        let fsrs = fsrs::FSRS::new(parameters).map_err(|e| format!("FSRS parameters: {e}"))?;
        let decay = parameters.get(20).copied().unwrap_or(fsrs::DEFAULT_PARAMETERS[20]);
        Ok(Scheduler { fsrs, desired_retention, decay })
    }

    pub fn decay(&self) -> f32 {
        self.decay
    }
}

impl Default for Scheduler {
    fn default() -> Self {
        Scheduler {
            fsrs: DEFAULT_FSRS.clone(),
            desired_retention: DESIRED_RETENTION,
            decay: fsrs::DEFAULT_PARAMETERS[20],
        }
    }
}

// ---------------------------------------------------------------------------------------
// Scheduling (pure)

/// Whole days from `from` to `to` (0 when `to` is earlier), as FSRS counts elapsed time.
pub(crate) fn whole_days_between(from: SystemTime, to: SystemTime) -> u32 {
    days_between(from, to).floor().min(f64::from(u32::MAX)) as u32
}

/// Days from `from` to `to` (0 when `to` is earlier).
fn days_between(from: SystemTime, to: SystemTime) -> f64 {
    to.duration_since(from).map_or(0.0, |d| d.as_secs_f64() / DAY_SECS)
}

/// The start (00:00 UTC) of `now`'s day: new cards first reviewed since then count against
/// today's `NEW_PER_DAY`.
pub fn utc_day_start(now: SystemTime) -> SystemTime {
    SystemTime::from(OffsetDateTime::from(now).replace_time(time::Time::MIDNIGHT))
}

/// The probability of recalling a card `days` after its last review (FSRS-6 forgetting curve
/// with the scheduler's decay).
pub fn retrievability(stability: f32, days: f64, decay: f32) -> f32 {
    let memory = fsrs::MemoryState { stability, difficulty: 1.0 };
    let r = fsrs::current_retrievability(memory, days as f32, decay);
    if r.is_finite() {
        r.clamp(0.0, 1.0)
    } else {
        0.0
    }
}

/// `t` to the millisecond (the precision of stored times), so that a stored `due` is
/// exactly the stored `last_review` plus the interval.
pub(crate) fn whole_ms(t: SystemTime) -> SystemTime {
    parse_time(&clock::rfc3339(t)).unwrap_or(t)
}

/// A card's state after one review at `now` (and the interval until it is due).
pub fn schedule(
    prev: Option<&CardState>,
    rating: u8,
    now: SystemTime,
    scheduler: &Scheduler,
) -> Result<(CardState, f32), String> {
    let now = whole_ms(now);
    let grade = Grade::from_rating(i64::from(rating)).map_err(|e| e.message)?;
    let (memory, days_elapsed) = match prev {
        Some(p) => {
            let last =
                parse_time(&p.last_review).ok_or_else(|| format!("unreadable last_review {:?}", p.last_review))?;
            let days = whole_days_between(last, now);
            (Some(fsrs::MemoryState { stability: p.stability, difficulty: p.difficulty }), days)
        }
        None => (None, 0),
    };
    let next = scheduler
        .fsrs
        .next_states(memory, scheduler.desired_retention, days_elapsed)
        .map_err(|e| format!("FSRS: {e}"))?;
    let item = match grade {
        Grade::Again => next.again,
        Grade::Hard => next.hard,
        Grade::Good => next.good,
        Grade::Easy => next.easy,
    };
    let interval = item.interval.clamp(0.0, MAX_DAYS);
    if !interval.is_finite() {
        return Err(format!("FSRS gave the interval {}", item.interval));
    }
    let due = now + Duration::from_secs_f64(f64::from(interval) * DAY_SECS);
    let state = CardState {
        stability: item.memory.stability,
        difficulty: item.memory.difficulty,
        due: clock::rfc3339(due),
        last_review: clock::rfc3339(now),
        reps: prev.map_or(0, |p| p.reps).saturating_add(1),
        lapses: prev.map_or(0, |p| p.lapses) + u32::from(prev.is_some() && grade.is_failure()),
        last_rating: rating,
    };
    Ok((state, interval))
}

/// A stored card as the review view shows it at `now`.
pub(crate) fn card_view(state: CardState, now: SystemTime, now_text: &str, decay: f32) -> CardView {
    let days = parse_time(&state.last_review).map_or(0.0, |last| days_between(last, now));
    let retrievability = retrievability(state.stability, days, decay);
    let is_due = state.due.as_str() <= now_text;
    CardView { state, retrievability, is_due }
}

/// The review view of a profile: `states` by card id, the deck, and the ids of cards first
/// reviewed today.
pub fn build_view(
    profile: Profile,
    deck: &[Card],
    mut states: HashMap<String, CardState>,
    first_reviewed_today: &HashSet<String>,
    now: SystemTime,
    decay: f32,
) -> ReviewView {
    let now_text = clock::rfc3339(now);
    let mut due: Vec<(String, usize, String)> = Vec::new();
    let mut new = Vec::new();
    let mut cards = BTreeMap::new();
    let mut topics: BTreeMap<u32, (TopicProgress, f32)> = BTreeMap::new();
    let mut new_today = 0;
    for (index, card) in deck.iter().enumerate() {
        let (topic, r_sum) = topics.entry(card.topic).or_insert_with(|| {
            (TopicProgress { topic: card.topic, cards: 0, reviewed: 0, due: 0, mean_retrievability: None }, 0.0)
        });
        topic.cards += 1;
        if first_reviewed_today.contains(&card.id) {
            new_today += 1;
        }
        match states.remove(&card.id) {
            None => new.push(card.id.clone()),
            Some(state) => {
                let view = card_view(state, now, &now_text, decay);
                topic.reviewed += 1;
                *r_sum += view.retrievability;
                if view.is_due {
                    topic.due += 1;
                    due.push((view.state.due.clone(), index, card.id.clone()));
                }
                cards.insert(card.id.clone(), view);
            }
        }
    }
    due.sort();
    let due: Vec<String> = due.into_iter().map(|(_, _, id)| id).collect();
    let fresh = NEW_PER_DAY.saturating_sub(new_today);
    let queue = due.iter().chain(new.iter().take(fresh)).cloned().collect();
    let counts = ReviewCounts {
        due: due.len(),
        new: new.len(),
        learned: cards.len() - due.len(),
        total: deck.len(),
        new_today,
        new_per_day: NEW_PER_DAY,
    };
    let topics = topics
        .into_values()
        .map(|(mut t, r_sum)| {
            if t.reviewed > 0 {
                t.mean_retrievability = Some(r_sum / t.reviewed as f32);
            }
            t
        })
        .collect();
    ReviewView { profile, now: now_text, due, new, queue, counts, topics, cards }
}

/// The range of each of FSRS's 21 parameters that its training keeps them in (the fsrs
/// crate's parameter clipper): an imported set outside them is refused, since the
/// schedule it would give is not one FSRS can produce.
const PARAMETER_RANGES: [(f32, f32); 21] = [
    (0.001, 100.0),
    (0.001, 100.0),
    (0.001, 100.0),
    (0.001, 100.0),
    (1.0, 10.0),
    (0.001, 4.0),
    (0.001, 4.0),
    (0.001, 0.75),
    (0.0, 4.5),
    (0.0, 0.8),
    (0.001, 3.5),
    (0.001, 5.0),
    (0.001, 0.25),
    (0.001, 0.9),
    (0.0, 4.0),
    (0.0, 1.0),
    (1.0, 6.0),
    (0.0, 2.0),
    (0.0, 2.0),
    (0.0, 0.8),
    (0.1, 0.8),
];

/// Whether `parameters` is a set FSRS could have fitted: 21 values, each in its range.
pub fn check_parameters(parameters: &[f32]) -> Result<(), String> {
    if parameters.len() != PARAMETER_RANGES.len() {
        return Err(format!("FSRS has {} parameters, got {}", PARAMETER_RANGES.len(), parameters.len()));
    }
    for (i, (&w, (low, high))) in parameters.iter().zip(PARAMETER_RANGES).enumerate() {
        if !(low..=high).contains(&w) {
            return Err(format!("parameter {i} must be from {low} to {high}, got {w}"));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t(text: &str) -> SystemTime {
        parse_time(text).unwrap()
    }

    #[test]
    fn times_parse_and_days_start_at_midnight_utc() {
        let now = t("2025-03-04T15:16:17.189Z");
        assert_eq!(clock::rfc3339(now), "2025-03-04T15:16:17.189Z");
        assert_eq!(clock::rfc3339(t("2025-03-04T16:16:17+01:00")), "2025-03-04T15:16:17.000Z");
        assert_eq!(clock::rfc3339(utc_day_start(now)), "2025-03-04T00:00:00.000Z");
        assert!(parse_time("yesterday").is_none());
        assert!(parse_time("2025-03-04").is_none());
        assert!(parse_time("9999-12-31T23:59:59Z").is_none(), "year 9999 plus an interval overflows");
        assert!(parse_time("1969-12-31T23:59:59Z").is_none());
    }

    #[test]
    fn a_new_card_is_scheduled_by_its_grade() {
        let d = Scheduler::default();
        let now = t("2025-01-01T00:00:00.000Z");
        let intervals: Vec<f32> = (1..=5).map(|r| schedule(None, r, now, &d).unwrap().1).collect();
        // FSRS-6 default initial stabilities: again 0.212, hard 1.2931, good 2.3065, easy 8.2956.
        assert_eq!(intervals[0], intervals[1], "1 and 2 are both again");
        assert!(intervals[0] < 1.0 && intervals[1] < intervals[2] && intervals[2] < intervals[3]);
        assert!(intervals[3] < intervals[4]);
        let (good, interval) = schedule(None, 4, now, &d).unwrap();
        assert!((interval - 2.3065).abs() < 1e-4, "{interval}");
        assert_eq!(good.reps, 1);
        assert_eq!(good.lapses, 0, "forgetting a new card is not a lapse");
        assert_eq!(good.last_review, "2025-01-01T00:00:00.000Z");
        assert_eq!(good.due, clock::rfc3339(now + Duration::from_secs_f64(f64::from(interval) * DAY_SECS)));
        assert!(schedule(None, 0, now, &d).is_err() && schedule(None, 6, now, &d).is_err());
    }

    #[test]
    fn remembering_after_the_interval_lengthens_it_and_forgetting_is_a_lapse() {
        let d = Scheduler::default();
        let start = t("2025-01-01T00:00:00.000Z");
        let (first, i1) = schedule(None, 4, start, &d).unwrap();
        let later = parse_time(&first.due).unwrap();
        let (second, i2) = schedule(Some(&first), 4, later, &d).unwrap();
        assert!(i2 > 2.0 * i1, "{i1} -> {i2}");
        assert_eq!((second.reps, second.lapses), (2, 0));
        let (forgot, i3) = schedule(Some(&second), 1, parse_time(&second.due).unwrap(), &d).unwrap();
        assert!(i3 < i2);
        assert_eq!((forgot.reps, forgot.lapses, forgot.last_rating), (3, 1, 1));
    }

    #[test]
    fn a_lower_desired_retention_spaces_reviews_further_apart() {
        let now = t("2025-01-01T00:00:00.000Z");
        let at = |r| schedule(None, 4, now, &Scheduler::new(None, r).unwrap()).unwrap().1;
        assert!(at(0.8) > at(0.9) && at(0.9) > at(0.95), "{} {} {}", at(0.8), at(0.9), at(0.95));
        assert!(Scheduler::new(Some(&[1.0, 2.0]), 0.9).is_err(), "too few parameters");
    }

    #[test]
    fn retrievability_falls_from_one_to_ninety_percent_at_the_stability() {
        let decay = Scheduler::default().decay();
        assert!((retrievability(3.0, 0.0, decay) - 1.0).abs() < 1e-6);
        assert!((retrievability(3.0, 3.0, decay) - 0.9).abs() < 1e-3);
        assert!(retrievability(3.0, 30.0, decay) < 0.9);
    }
}
