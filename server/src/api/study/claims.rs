//! `GET /api/cards/checks`: for every (claim check, preset) the deck uses, the latest
//! finished run of that preset measured against the card's number
//! (`distlab_common::claims`), or what to run to check it.

use std::collections::HashMap;

use axum::extract::State;
use axum::Json;
use distlab_common::cards::ClaimCheck;
use distlab_common::claims::{self, ClaimChecks, ClaimStatus, RunEvidence};
use distlab_common::presets::presets;
use distlab_common::trace::RankTrace;
use distlab_common::{ExperimentView, MetricPoint};

use crate::api::error::HttpError;
use crate::api::study::cards;
use crate::api::{compare, experiments};
use crate::{store, AppState};

/// Finished runs searched for a preset's latest run, newest first (as many as the list
/// endpoint gives the browser, so a card's demo link and its check find the same run).
const RECENT_RUNS: i64 = experiments::MAX_PAGE;

#[utoipa::path(
    get, path = "/cards/checks", operation_id = "claim_checks", tag = "flashcards",
    responses(
        (status = 200, body = distlab_common::claims::ClaimChecks),
    ),
)]
pub async fn checks(State(state): State<AppState>) -> Result<Json<ClaimChecks>, HttpError> {
    let deck = cards::deck().map_err(|e| HttpError::internal("flashcards", e))?;
    let mut wanted: Vec<(ClaimCheck, &str)> = Vec::new();
    for card in deck {
        let (Some(claim), Some(preset)) = (&card.claim, claims::preset_for(card)) else { continue };
        if !wanted.contains(&(claim.check, preset)) {
            wanted.push((claim.check, preset));
        }
    }
    let runs = store::experiments::recent_succeeded(&state.db, RECENT_RUNS).await?;
    let mut loaded: HashMap<i64, Evidence> = HashMap::new();
    let mut checks = Vec::with_capacity(wanted.len());
    for (check, preset) in wanted {
        let Some(preset_spec) = presets().into_iter().find(|p| p.key == preset).map(|p| p.spec) else { continue };
        let preset = preset.to_string();
        let Some(run) = runs.iter().find(|r| r.spec.same_up_to_name(&preset_spec)) else {
            checks.push(ClaimStatus {
                check,
                preset: preset.clone(),
                measurement: None,
                how: format!("not checked yet: run the {preset} preset"),
            });
            continue;
        };
        let partner =
            runs.iter().find(|r| r.id != run.id && claims::is_partner(check, &run.spec, &r.spec) == Some(true));
        for view in [Some(run), partner].into_iter().flatten() {
            if let std::collections::hash_map::Entry::Vacant(slot) = loaded.entry(view.id) {
                let metrics = store::experiments::load_metrics(&state.db, view.id).await?;
                let ranks = store::traces::load(&state.db, view.id).await?;
                let traced = compare::traced_steps(&state, view).await?;
                slot.insert(Evidence { metrics, ranks, traced });
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

/// What a check reads of a run, loaded once per run.
struct Evidence {
    metrics: Vec<MetricPoint>,
    ranks: Vec<RankTrace>,
    traced: u64,
}

fn evidence<'a>(loaded: &'a HashMap<i64, Evidence>, view: &'a ExperimentView) -> RunEvidence<'a> {
    let e = &loaded[&view.id];
    RunEvidence { view, metrics: &e.metrics, ranks: &e.ranks, traced_steps: e.traced }
}
