//! The router: every API route registered with its OpenAPI entry (one list, so that a
//! route cannot exist without its entry), the layers around them (body limits, JSON errors,
//! same-origin checks, compression, request logging, metrics), and the frontend's files.

use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::http::{Request, Response, StatusCode};
use axum::{middleware, Extension, Router};
use distlab_common::AuthMode;
use tower_http::catch_panic::CatchPanicLayer;
use tower_http::compression::predicate::{DefaultPredicate, NotForContentType, Predicate};
use tower_http::compression::CompressionLayer;
use tower_http::limit::RequestBodyLimitLayer;
use tower_http::timeout::TimeoutLayer;
use tower_http::trace::TraceLayer;
use tracing::{Level, Span};
use utoipa::OpenApi;
use utoipa_axum::router::{OpenApiRouter, UtoipaMethodRouterExt};
use utoipa_axum::routes;

use crate::api::extract::BodyLimit;
use crate::api::study::{assignments, cards, claims, quiz, review, review_settings};
use crate::api::{
    compare, datasets, error, experiments, health, memory, metrics, models, openapi, plan, sampling, session, stream,
    traces, workers,
};
use crate::static_files;
use crate::AppState;

/// The whole HTTP app: /api (JSON), /api/experiments/{id}/stream (SSE), /metrics
/// (Prometheus), /api/openapi.json (every route of the first three), and the frontend.
pub fn app(state: AppState) -> Router {
    let config = state.config.clone();
    let (routes, doc) = api_routes(&state).split_for_parts();
    let doc = openapi::Document(Arc::new(serde_json::to_string(&doc).expect("the OpenAPI document is JSON")));
    let routes = routes.layer(Extension(doc));

    let largest_body =
        [config.max_body_bytes, config.max_event_batch_bytes, config.max_model_bytes, config.max_dataset_bytes]
            .into_iter()
            .max()
            .unwrap_or(config.max_body_bytes);
    let routes = routes
        .merge(static_files::router(&config.static_dir))
        // Counted with the route each request matched (set by the routing, inside).
        .layer(middleware::from_fn_with_state(state.clone(), metrics::record))
        .layer(RequestBodyLimitLayer::new(largest_body))
        .layer(middleware::from_fn(error::same_origin))
        .layer(middleware::from_fn(error::json_errors))
        // A panic in a handler is a bug; the client still gets the JSON 500 and the
        // connection stays up.
        .layer(CatchPanicLayer::custom(error::panic_response))
        // Skips SSE (text/event-stream), images, tiny bodies and model downloads (binary
        // floats barely compress, and the file is streamed as it is read).
        .layer(
            CompressionLayer::new()
                .compress_when(DefaultPredicate::new().and(NotForContentType::const_new("application/octet-stream"))),
        )
        // Every response is logged with its status (`log_response`), an internal error's cause
        // by `HttpError::internal`: tower-http's own ERROR line for each 5xx would turn a
        // sign-in flood's 503s into a flood of ERROR lines.
        .layer(
            TraceLayer::new_for_http()
                .make_span_with(request_span)
                .on_request(())
                .on_response(log_response)
                .on_failure(()),
        );
    let routes = match config.auth {
        AuthMode::None => routes.layer(middleware::from_fn(error::loopback_names_only)),
        AuthMode::Accounts => routes,
    };
    routes.with_state(state)
}

/// Every route but the frontend's files, each registered with its OpenAPI entry.
fn api_routes(state: &AppState) -> OpenApiRouter<AppState> {
    let config = &state.config;
    let worker_credential = || middleware::from_fn_with_state(state.clone(), workers::require_credential);
    let worker_api = OpenApiRouter::new()
        .routes(routes!(workers::lease))
        .routes(routes!(workers::heartbeat))
        .routes(routes!(workers::events).layer(Extension(BodyLimit(config.max_event_batch_bytes))))
        .routes(routes!(workers::complete))
        .routes(routes!(workers::fail))
        .routes(routes!(workers::rendezvous))
        .routes(routes!(datasets::text))
        .route_layer(worker_credential())
        .routes(
            routes!(workers::register).layer(middleware::from_fn_with_state(state.clone(), workers::require_token)),
        );

    // Everything a person does: `identify` puts the caller on the request (401 without a
    // session when the server has accounts).
    let identify = || middleware::from_fn_with_state(state.clone(), session::identify);
    let user_api = OpenApiRouter::new()
        .routes(routes!(session::who))
        .routes(routes!(session::change_password))
        .routes(routes!(session::list_users, session::create_user))
        .routes(routes!(session::reset_password))
        .routes(routes!(session::unlock))
        .routes(routes!(experiments::list, experiments::create))
        .routes(routes!(experiments::get_one, experiments::delete))
        .routes(routes!(experiments::metrics))
        .routes(routes!(experiments::attempts))
        .routes(routes!(traces::trace))
        .routes(routes!(memory::memory))
        .routes(routes!(experiments::cancel))
        .routes(routes!(models::download))
        .routes(routes!(models::config))
        .routes(routes!(models::download_tokenizer))
        .routes(routes!(sampling::generate))
        .routes(routes!(plan::plan))
        .routes(routes!(plan::layouts))
        .routes(routes!(cards::cards))
        .routes(routes!(claims::checks))
        .routes(routes!(review::list_profiles, review::create_profile))
        .routes(routes!(review::review_view))
        .routes(routes!(review::review))
        .routes(routes!(review_settings::settings, review_settings::update))
        .routes(routes!(review_settings::fit_parameters))
        .routes(routes!(review::export))
        .routes(routes!(review::import).layer(Extension(BodyLimit(review::MAX_IMPORT_BYTES))))
        .routes(routes!(compare::compare))
        .routes(routes!(quiz::list))
        .routes(routes!(quiz::answer))
        .routes(routes!(quiz::results))
        .routes(routes!(datasets::list, datasets::upload))
        .routes(routes!(datasets::delete))
        .routes(routes!(assignments::list, assignments::create))
        .routes(routes!(assignments::get_one))
        .routes(routes!(assignments::submit))
        .routes(routes!(assignments::grade))
        .routes(routes!(assignments::grades))
        .route_layer(identify());

    let api = OpenApiRouter::new()
        .routes(routes!(health::health))
        .routes(routes!(session::sign_in, session::sign_out))
        .routes(routes!(openapi::document))
        .merge(user_api)
        .nest("/workers", worker_api)
        .layer(TimeoutLayer::with_status_code(StatusCode::REQUEST_TIMEOUT, config.request_timeout))
        // Added after the timeout layer, so that long-lived streams and large model uploads
        // are not cut.
        .routes(routes!(stream::stream).layer(identify()))
        .routes(routes!(models::upload).layer(worker_credential()))
        .routes(routes!(models::upload_tokenizer).layer(worker_credential()))
        .fallback(error::api_not_found);

    OpenApiRouter::with_openapi(openapi::ApiDoc::openapi())
        .nest("/api", api)
        .routes(routes!(metrics::metrics).layer(middleware::from_fn_with_state(state.clone(), metrics::require_reader)))
}

/// Worker polling is frequent: its requests are logged at debug, everything else at info.
fn request_span(req: &Request<Body>) -> Span {
    if req.uri().path().starts_with("/api/workers/") {
        tracing::debug_span!("request", method = %req.method(), path = %req.uri().path())
    } else {
        tracing::info_span!("request", method = %req.method(), path = %req.uri().path())
    }
}

fn log_response<B>(res: &Response<B>, latency: Duration, span: &Span) {
    let quiet = span.metadata().is_none_or(|m| *m.level() > Level::INFO);
    let ms = latency.as_secs_f64() * 1e3;
    if quiet {
        tracing::debug!(status = res.status().as_u16(), ms, "response");
    } else {
        tracing::info!(status = res.status().as_u16(), ms, "response");
    }
}
