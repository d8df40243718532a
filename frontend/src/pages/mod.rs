//! The screens: the list of experiments, the form for a new one, one experiment live.

pub mod experiment;
pub mod list;
pub mod new;
