//! `GET /api/cards`: the flashcard deck, each card with its topic and its live demo.
//!
//! The deck is `cards/deck.json` in the repository, built into the server and checked
//! when the server starts (`serve` refuses to start on a broken deck; the tests check it
//! too, see `distlab_common::cards::load_deck`).

use std::sync::LazyLock;

use axum::Json;
use distlab_common::cards::{load_deck, Card};

use crate::api::error::HttpError;

/// The deck's text as built into the server.
const DECK_JSON: &str = include_str!("../../../../cards/deck.json");

static DECK: LazyLock<Result<Vec<Card>, Vec<String>>> = LazyLock::new(|| load_deck(DECK_JSON));

/// The deck, or every problem found in it.
pub fn deck() -> Result<&'static [Card], String> {
    DECK.as_deref().map_err(|problems| format!("the flashcard deck is broken: {}", problems.join("; ")))
}

#[utoipa::path(
    get, path = "/cards", operation_id = "list_cards", tag = "flashcards",
    responses(
        (status = 200, body = Vec<distlab_common::cards::Card>),
    ),
)]
pub async fn cards() -> Result<Json<&'static [Card]>, HttpError> {
    deck().map(Json).map_err(|e| HttpError::internal("flashcards", e))
}
