//! The quiz (`/quiz`): the study quiz's questions in the project's own words, each with its
//! answer, the run or planner view that shows it, and the flashcards that teach it. The
//! questions are data (`cards/quiz.json`), checked when the server starts; a learner's
//! results are kept per account (`GET /api/quiz/results`).
//!
//! A question that asks for one number is graded by the server from the number typed
//! (within the question's relative tolerance); any other is answered in one's head,
//! revealed, and graded by the learner ("I knew it" or not).

use serde::{Deserialize, Serialize};

use crate::plan::planner;
use crate::spec::presets::presets;
use crate::study::cards::{Card, Demo};

/// The quiz has this many questions, numbered 1..=QUESTIONS.
pub const QUESTIONS: u32 = 20;

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct Question {
    /// Stable across edits of the text (results are kept by id).
    pub id: String,
    /// The study quiz's question number.
    pub number: u32,
    pub question: String,
    pub answer: String,
    /// The number a numeric question asks for.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub expect: Option<Expected>,
    /// Where the lab shows the answer.
    pub demo: Demo,
    /// The flashcards that teach it.
    #[serde(default)]
    pub cards: Vec<String>,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct Expected {
    pub value: f64,
    /// Relative: 0.05 accepts anything within 5% of `value`.
    pub tolerance: f64,
    pub unit: String,
}

impl Expected {
    /// Whether `given` is the expected number, within the tolerance.
    pub fn accepts(&self, given: f64) -> bool {
        given.is_finite() && (given - self.value).abs() <= self.tolerance * self.value.abs()
    }
}

/// `POST /api/quiz/answers`: a typed number for a numeric question, the learner's own
/// verdict for any other.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct QuizAnswer {
    pub question_id: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub given: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub knew: Option<bool>,
}

/// The server's verdict on one answer.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct QuizVerdict {
    pub question_id: String,
    pub correct: bool,
    /// The number a numeric question expected.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub expected: Option<f64>,
}

/// `GET /api/quiz/results`: the asking account's results, one entry per question it has
/// answered.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct QuizResults {
    pub results: Vec<QuestionResult>,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct QuestionResult {
    pub question_id: String,
    pub attempts: u64,
    pub correct: u64,
    /// The latest answer's verdict.
    pub last_correct: bool,
    /// The latest number typed (numeric questions).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_given: Option<f64>,
    pub answered_at: String,
}

impl QuizResults {
    /// Questions whose latest answer was right.
    pub fn latest_right_count(&self) -> usize {
        self.results.iter().filter(|r| r.last_correct).count()
    }
}

/// Parses the quiz and checks it against the deck: ids unique, questions numbered
/// 1..=QUESTIONS once each, tolerances in (0, 0.5], every preset and card named exists,
/// every planner demo plans. Returns every problem.
pub fn load_quiz(json: &str, deck: &[Card]) -> Result<Vec<Question>, Vec<String>> {
    let questions: Vec<Question> =
        serde_json::from_str(json).map_err(|e| vec![format!("the quiz is not valid: {e}")])?;
    let mut problems = Vec::new();
    let keys: Vec<&str> = presets().iter().map(|p| p.key).collect();
    let mut ids = std::collections::HashSet::new();
    for q in &questions {
        let at = format!("question {:?}", q.id);
        if !ids.insert(q.id.as_str()) {
            problems.push(format!("{at}: the id is used twice"));
        }
        if [&q.question, &q.answer].iter().any(|t| t.trim().is_empty()) {
            problems.push(format!("{at}: an empty question or answer"));
        }
        if let Some(e) = &q.expect {
            if !(e.value.is_finite() && e.tolerance > 0.0 && e.tolerance <= 0.5) {
                problems.push(format!("{at}: expects {} within {}: not a usable number", e.value, e.tolerance));
            }
        }
        if let Some(preset) = q.demo.preset() {
            if !keys.contains(&preset) {
                problems.push(format!("{at}: no preset {preset:?}"));
            }
        }
        match q.demo.planner_spec() {
            Some(Err(e)) => problems.push(format!("{at}: the planner spec is invalid: {e}")),
            Some(Ok(spec)) if planner::plan(&spec).is_err() => {
                problems.push(format!("{at}: the planner refuses its spec"))
            }
            _ => {}
        }
        for card in q.cards.iter().filter(|c| !deck.iter().any(|d| &d.id == *c)) {
            problems.push(format!("{at}: no card {card:?}"));
        }
    }
    for n in 1..=QUESTIONS {
        match questions.iter().filter(|q| q.number == n).count() {
            1 => {}
            0 => problems.push(format!("question {n} is missing")),
            k => problems.push(format!("question {n} is there {k} times")),
        }
    }
    if let Some(q) = questions.iter().find(|q| !(1..=QUESTIONS).contains(&q.number)) {
        problems.push(format!("question {:?}: number {} is not in 1..={QUESTIONS}", q.id, q.number));
    }
    if problems.is_empty() {
        Ok(questions)
    } else {
        Err(problems)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn deck() -> Vec<Card> {
        crate::study::cards::load_deck(include_str!("../../../cards/deck.json")).unwrap()
    }

    #[test]
    fn the_quiz_asks_every_question_and_links_each_to_the_lab() {
        let quiz =
            load_quiz(include_str!("../../../cards/quiz.json"), &deck()).unwrap_or_else(|p| panic!("{}", p.join("\n")));
        assert_eq!(quiz.len(), QUESTIONS as usize);
        let numeric = quiz.iter().filter(|q| q.expect.is_some()).count();
        assert!(numeric >= 5, "questions with a number to type: {numeric}");
        assert!(quiz.iter().all(|q| !q.cards.is_empty()), "every question names the cards that teach it");
    }

    #[test]
    fn a_number_is_right_within_the_tolerance() {
        let e = Expected { value: 1.75, tolerance: 0.05, unit: "GB".into() };
        assert!(e.accepts(1.75) && e.accepts(1.8) && e.accepts(1.67));
        assert!(!e.accepts(1.6) && !e.accepts(-1.75) && !e.accepts(f64::NAN) && !e.accepts(f64::INFINITY));
    }

    #[test]
    fn a_broken_quiz_lists_every_problem() {
        let quiz = r#"[
            {"id": "a", "number": 1, "question": "q", "answer": "a", "demo": {"kind": "preset", "preset": "nope"}, "cards": ["no-card"]},
            {"id": "a", "number": 1, "question": " ", "answer": "a", "expect": {"value": 1, "tolerance": 0, "unit": ""},
             "demo": {"kind": "planner", "spec": {"parallel": {"dp": 0}}}},
            {"id": "b", "number": 21, "question": "q", "answer": "a", "demo": {"kind": "preset", "preset": "tiny"}}
        ]"#;
        let all = load_quiz(quiz, &deck()).unwrap_err().join("\n");
        for expected in [
            "no preset \"nope\"",
            "no card \"no-card\"",
            "used twice",
            "empty",
            "not a usable number",
            "the planner refuses its spec",
            "question 1 is there 2 times",
            "question 2 is missing",
            "number 21",
        ] {
            assert!(all.contains(expected), "{expected}: {all}");
        }
        assert!(load_quiz("{", &deck()).unwrap_err()[0].contains("not valid"));
    }
}
