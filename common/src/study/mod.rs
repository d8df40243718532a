//! The study side of the lab:
//!
//! - `assignments.rs`: a teacher's exercises, whose answers the students' own runs check;
//! - `cards.rs`: the flashcard deck (`cards/deck.json`): what a card says, which live demo
//!   it opens and which claim a small run can check;
//! - `claims/`: a card's claim checked by a finished run, predicted next to measured;
//! - `quiz.rs`: the quiz's questions (`cards/quiz.json`) and how an answer is graded;
//! - `review.rs`: spaced-repetition review's API bodies (the FSRS scheduling itself runs
//!   in the server).
//!
//! Imports [`crate::spec`], [`crate::plan`], [`crate::wire`] and [`crate::analysis`].

pub mod assignments;
pub mod cards;
pub mod claims;
pub mod quiz;
pub mod review;
