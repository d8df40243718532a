//! The study pages' API: the flashcard deck and the claims its cards make, checked against
//! the class's runs (`cards.rs`, `claims.rs`), spaced-repetition review with its profiles
//! and settings (`review.rs`, `review_settings.rs`; the scheduling itself: `schedule.rs`),
//! the quiz (`quiz.rs`), and a teacher's assignments with the students' submissions
//! (`assignments.rs`).

pub mod assignments;
pub mod cards;
pub mod claims;
pub mod quiz;
pub mod review;
pub mod review_settings;
pub mod schedule;
