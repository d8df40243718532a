//! `GET /api/openapi.json`: the HTTP API described as OpenAPI 3.1, generated from the code.
//! Every route is registered through `utoipa_axum`'s router with its handler's
//! `#[utoipa::path]` attribute, so a route cannot exist without its entry (the schemas are
//! `distlab_common`'s types, derived with its `openapi` feature).

use std::sync::Arc;

use axum::http::header;
use axum::response::{IntoResponse, Response};
use axum::Extension;
use utoipa::OpenApi;

/// The document's fixed parts: what the API is, its tags, how callers prove who they are.
#[derive(OpenApi)]
#[openapi(
    info(
        title = "distlab",
        description = "A lab for distributed deep-learning training: submit experiments, watch them run, \
                       read what every rank measured, plan models of any size, study flashcards. \
                       People sign in with POST /api/session (a session cookie) when the server has accounts; \
                       workers send Authorization: Bearer with their credential. Errors are JSON \
                       {\"error\", \"fields\"}."
    ),
    tags(
        (name = "experiments", description = "Submit, list, watch and compare training runs"),
        (name = "models", description = "A finished run's trained model: download, sample"),
        (name = "datasets", description = "Uploaded texts to train on"),
        (name = "planner", description = "The analytic planner and the layout search (nothing runs)"),
        (name = "flashcards", description = "The deck, its claim checks, spaced repetition, the quiz"),
        (name = "assignments", description = "A teacher's exercises, checked by the students' own runs"),
        (name = "accounts", description = "Sessions and accounts"),
        (name = "workers", description = "The API the worker processes use"),
        (name = "operations", description = "Health, metrics and this document")
    )
)]
pub struct ApiDoc;

/// The finished document, serialised once when the app is built.
#[derive(Clone)]
pub struct Document(pub Arc<String>);

#[utoipa::path(
    get, path = "/openapi.json", operation_id = "openapi_document", tag = "operations",
    responses(
        (status = 200, description = "this document (OpenAPI 3.1)", content_type = "application/json"),
    ),
)]
pub async fn document(Extension(doc): Extension<Document>) -> Response {
    ([(header::CONTENT_TYPE, "application/json")], doc.0.as_str().to_owned()).into_response()
}
