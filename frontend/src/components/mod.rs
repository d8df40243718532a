//! Pieces the pages share.

pub mod dataset_upload;
pub mod doc_link;
pub mod layout_search;
pub mod link_table;
pub mod loss_chart;
pub mod memory_bars;
pub mod memory_section;
pub mod memory_timeline;
pub mod overlay_chart;
pub mod pipeline_chart;
pub mod plan_panel;
pub mod progress;
pub mod ring_view;
pub mod spec_view;
pub mod staleness_chart;
pub mod status_badge;
pub mod timeline;
pub mod try_model;
