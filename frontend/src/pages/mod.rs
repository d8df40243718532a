//! The screens: the list of experiments, the form for a new one, one experiment live,
//! the ring replay of its collectives, the flashcards and the quiz, signing in and the
//! teacher's accounts page, and the assignments a teacher hands out.

pub mod accounts;
pub mod assignments;
pub mod cards;
pub mod compare;
pub mod experiment;
pub mod list;
pub mod new;
pub mod pipeline;
pub mod planner;
pub mod quiz;
pub mod ring;
pub mod scheduling;
pub mod sign_in;
