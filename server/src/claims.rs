//! `GET /api/cards/checks`: for every (claim check, preset) the deck uses, the latest
//! finished run of that preset measured against the card's number
//! (`distlab_common::claims`), or what to run to check it.

use std::collections::HashMap;

use axum::extract::State;
use axum::Json;
use distlab_common::cards::{ClaimCheck, Demo};
use distlab_common::claims::{self, ClaimChecks, ClaimStatus, RunEvidence};
use distlab_common::compare::why_not_equal;
use distlab_common::presets::presets;
use distlab_common::trace::RankTrace;
use distlab_common::{ExperimentSpec, ExperimentView, MetricPoint};

use crate::error::HttpError;
use crate::{cards, compare, experiments, AppState};

/// Finished runs searched for a preset's latest run, newest first.
const RECENT_RUNS: i64 = 500;

pub async fn checks(State(state): State<AppState>) -> Result<Json<ClaimChecks>, HttpError> {
    let deck = cards::deck().map_err(|e| HttpError::internal("flashcards", e))?;
    let mut wanted: Vec<(ClaimCheck, String)> = Vec::new();
    for card in deck {
        let Some(claim) = &card.claim else { continue };
        let preset = match &card.demo {
            Demo::Planner { .. } | Demo::Ring { .. } => claims::canonical_preset(claim.check).to_string(),
            demo => demo.preset().unwrap_or(claims::canonical_preset(claim.check)).to_string(),
        };
        if !wanted.contains(&(claim.check, preset.clone())) {
            wanted.push((claim.check, preset));
        }
    }
    let runs = experiments::recent_succeeded(&state.db, RECENT_RUNS).await?;
    let mut loaded: HashMap<i64, (Vec<MetricPoint>, Vec<RankTrace>)> = HashMap::new();
    let mut checks = Vec::with_capacity(wanted.len());
    for (check, preset) in wanted {
        let Some(preset_spec) = presets().into_iter().find(|p| p.key == preset).map(|p| p.spec) else { continue };
        let Some(run) = runs.iter().find(|r| same_spec(&r.spec, &preset_spec)) else {
            checks.push(ClaimStatus {
                check,
                preset: preset.clone(),
                measurement: None,
                how: format!("not checked yet: run the {preset} preset"),
            });
            continue;
        };
        let partner = claims::partner_spec(check, &run.spec).and_then(|want| {
            runs.iter().find(|r| {
                r.id != run.id
                    && match check {
                        ClaimCheck::DdpEqualsOneRank => {
                            r.spec.world_size() == 1 && why_not_equal(&run.spec, &r.spec).is_empty()
                        }
                        _ => same_spec(&r.spec, &want),
                    }
            })
        });
        for view in [Some(run), partner].into_iter().flatten() {
            if let std::collections::hash_map::Entry::Vacant(slot) = loaded.entry(view.id) {
                let metrics = experiments::load_metrics(&state.db, view.id).await?;
                let ranks = compare::load_traces(&state, view.id).await?;
                slot.insert((metrics, ranks));
            }
        }
        let result = claims::measure(check, &evidence(&loaded, run), partner.map(|p| evidence(&loaded, p)).as_ref());
        checks.push(match result {
            Ok(m) => ClaimStatus { check, preset, measurement: Some(m), how: String::new() },
            Err(why) => ClaimStatus { check, preset, measurement: None, how: format!("not checked yet: {why}") },
        });
    }
    Ok(Json(ClaimChecks { checks }))
}

fn evidence<'a>(
    loaded: &'a HashMap<i64, (Vec<MetricPoint>, Vec<RankTrace>)>,
    view: &'a ExperimentView,
) -> RunEvidence<'a> {
    let (metrics, ranks) = &loaded[&view.id];
    RunEvidence { view, metrics, ranks }
}

/// Equal specs up to their names.
fn same_spec(a: &ExperimentSpec, b: &ExperimentSpec) -> bool {
    let mut b = b.clone();
    b.name = a.name.clone();
    *a == b
}
