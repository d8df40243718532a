//! Pieces the pages share.

pub mod loss_chart;
pub mod progress;
pub mod ring_view;
pub mod spec_view;
pub mod status_badge;
pub mod timeline;
