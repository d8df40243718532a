//! The HTTP API (docs/api.md) as seen from the browser:
//! JSON requests with gloo-net and the live stream with an `EventSource`.

use distlab_common::memory::MemoryView;
use distlab_common::trace::ExperimentTrace;
use distlab_common::{
    ApiError, Attempts, Created, ExperimentList, ExperimentView, FieldError, Health, Metrics, StreamEvent,
};
use gloo_net::http::{Request, Response};
use serde::de::DeserializeOwned;
use wasm_bindgen::closure::Closure;
use wasm_bindgen::JsCast;
use web_sys::{EventSource, MessageEvent};

/// Why a request did not give the expected answer, in words for the page.
#[derive(Clone, Debug, PartialEq)]
pub struct RequestError {
    pub message: String,
    /// Field errors from a 422 answer (`{"field": "train.steps", "message": ...}`).
    pub fields: Vec<FieldError>,
    /// The answer's status (None: no answer came).
    pub status: Option<u16>,
}

impl RequestError {
    fn new(message: impl Into<String>) -> Self {
        Self { message: message.into(), fields: Vec::new(), status: None }
    }

    /// The server wants a signed-in caller (401).
    pub fn needs_sign_in(&self) -> bool {
        self.status == Some(401)
    }
}

impl std::fmt::Display for RequestError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.message)
    }
}

pub type ApiResult<T> = Result<T, RequestError>;

pub async fn health() -> ApiResult<Health> {
    get_json("/api/health").await
}

/// Who is signed in (401 when nobody is, on a server with accounts).
pub async fn me() -> ApiResult<distlab_common::Me> {
    get_json("/api/me").await
}

/// Signs in: the server sets the session cookie.
pub async fn sign_in(name: &str, password: &str) -> ApiResult<distlab_common::Me> {
    post_json("/api/session", &serde_json::json!({ "name": name, "password": password })).await
}

pub async fn sign_out() -> ApiResult<()> {
    expect_empty(Request::delete("/api/session").send().await).await
}

thread_local! {
    /// Told when the server answers 401: the browser's session has ended (it expired, or an
    /// admin reset the password), and the app falls back to the sign-in page.
    static ON_UNAUTHORIZED: std::cell::RefCell<Option<std::rc::Rc<dyn Fn()>>> = const { std::cell::RefCell::new(None) };
}

/// Calls `f` whenever a request is answered 401.
pub fn on_unauthorized(f: impl Fn() + 'static) {
    ON_UNAUTHORIZED.with(|hook| *hook.borrow_mut() = Some(std::rc::Rc::new(f)));
}

/// Every account (admins).
pub async fn list_accounts() -> ApiResult<distlab_common::AccountList> {
    get_json("/api/users").await
}

/// A new account (admins).
pub async fn create_account(account: &distlab_common::NewAccount) -> ApiResult<distlab_common::AccountView> {
    let body = serde_json::to_value(account).map_err(|e| RequestError::new(format!("could not encode: {e}")))?;
    post_json("/api/users", &body).await
}

/// A new password for the signed-in person (the current one asked again); every session of
/// the account ends but this browser's, which the server renews.
pub async fn change_password(current: &str, new: &str) -> ApiResult<distlab_common::Me> {
    let body = serde_json::to_value(distlab_common::ChangePassword { current: current.into(), new: new.into() })
        .map_err(|e| RequestError::new(format!("could not encode: {e}")))?;
    let request = Request::put("/api/me/password")
        .json(&body)
        .map_err(|e| RequestError::new(format!("could not encode: {e}")))?;
    read_json(request.send().await).await
}

/// A new password for `name` (admins); that account's sessions end.
pub async fn reset_password(name: &str, password: &str) -> ApiResult<()> {
    let url = format!("/api/users/{}/password", js_sys::encode_uri_component(name));
    let request = Request::put(&url)
        .json(&serde_json::json!({ "password": password }))
        .map_err(|e| RequestError::new(format!("could not encode: {e}")))?;
    expect_empty(request.send().await).await
}

pub async fn list_experiments(limit: u32) -> ApiResult<ExperimentList> {
    get_json(&format!("/api/experiments?limit={limit}")).await
}

/// The newest finished-with-success experiments (for "compare with" lists).
pub async fn list_succeeded(limit: u32) -> ApiResult<ExperimentList> {
    get_json(&format!("/api/experiments?status=succeeded&limit={limit}")).await
}

/// `GET /api/compare?ids=...` (the caller builds the URL, which the page also links to).
pub async fn get_compare(url: &str) -> ApiResult<distlab_common::compare::CompareView> {
    get_json(url).await
}

/// The flashcard deck.
pub async fn get_cards() -> ApiResult<Vec<distlab_common::cards::Card>> {
    get_json("/api/cards").await
}

/// Every card claim's latest measurement (or what to run to check it).
pub async fn get_claim_checks() -> ApiResult<distlab_common::claims::ClaimChecks> {
    get_json("/api/cards/checks").await
}

pub async fn list_profiles() -> ApiResult<distlab_common::review::ProfileList> {
    get_json("/api/profiles").await
}

pub async fn create_profile(name: &str) -> ApiResult<distlab_common::review::Profile> {
    post_json("/api/profiles", &serde_json::json!({ "name": name })).await
}

/// A profile's queue, counts, per-topic progress and card states, as of now.
pub async fn get_review(profile: i64) -> ApiResult<distlab_common::review::ReviewView> {
    get_json(&format!("/api/profiles/{profile}/review")).await
}

pub async fn review_card(profile: i64, card_id: &str, rating: i64) -> ApiResult<distlab_common::review::ReviewResult> {
    post_json(&format!("/api/profiles/{profile}/reviews"), &serde_json::json!({ "card_id": card_id, "rating": rating }))
        .await
}

pub async fn review_settings(profile: i64) -> ApiResult<distlab_common::review::ReviewSettings> {
    get_json(&format!("/api/profiles/{profile}/settings")).await
}

pub async fn set_review_settings(
    profile: i64,
    settings: &distlab_common::review::NewReviewSettings,
) -> ApiResult<distlab_common::review::ReviewSettings> {
    let request = Request::put(&format!("/api/profiles/{profile}/settings"))
        .json(settings)
        .map_err(|e| RequestError::new(format!("could not encode: {e}")))?;
    read_json(request.send().await).await
}

/// Fits FSRS's parameters to the profile's review log.
pub async fn fit_parameters(profile: i64) -> ApiResult<distlab_common::review::ParameterFit> {
    post_json(&format!("/api/profiles/{profile}/fit"), &serde_json::json!({})).await
}

pub async fn get_quiz() -> ApiResult<Vec<distlab_common::quiz::Question>> {
    get_json("/api/quiz").await
}

/// A typed number (a numeric question) or one's own verdict after the reveal.
pub async fn answer_quiz(answer: &distlab_common::quiz::QuizAnswer) -> ApiResult<distlab_common::quiz::QuizVerdict> {
    let body = serde_json::to_value(answer).map_err(|e| RequestError::new(format!("could not encode: {e}")))?;
    post_json("/api/quiz/answers", &body).await
}

pub async fn quiz_results() -> ApiResult<distlab_common::quiz::QuizResults> {
    get_json("/api/quiz/results").await
}

/// Replaces the profile's progress with an exported document (sent as it was read).
pub async fn import_progress(profile: i64, document: &str) -> ApiResult<distlab_common::review::ImportResult> {
    let request = Request::post(&format!("/api/profiles/{profile}/import"))
        .header("Content-Type", "application/json")
        .body(document.to_string())
        .map_err(|e| RequestError::new(format!("could not send the file: {e}")))?;
    read_json(request.send().await).await
}

/// Every assignment, newest first.
pub async fn list_assignments() -> ApiResult<Vec<distlab_common::assignments::Assignment>> {
    get_json("/api/assignments").await
}

/// One assignment, its instructions as HTML and the submissions the caller may see.
pub async fn get_assignment(id: i64) -> ApiResult<distlab_common::assignments::AssignmentView> {
    get_json(&format!("/api/assignments/{id}")).await
}

/// A new assignment (admins); a 422 names each field that is wrong.
pub async fn create_assignment(
    assignment: &distlab_common::assignments::NewAssignment,
) -> ApiResult<distlab_common::assignments::Assignment> {
    let body = serde_json::to_value(assignment).map_err(|e| RequestError::new(format!("could not encode: {e}")))?;
    post_json("/api/assignments", &body).await
}

/// A run of the assignment and its answers; the run is queued as the caller's experiment.
pub async fn submit_assignment(
    id: i64,
    submission: &distlab_common::assignments::NewSubmission,
) -> ApiResult<distlab_common::assignments::Submission> {
    let body = serde_json::to_value(submission).map_err(|e| RequestError::new(format!("could not encode: {e}")))?;
    post_json(&format!("/api/assignments/{id}/submissions"), &body).await
}

/// The teacher's verdict on a text answer (admins); the submission as judged now.
pub async fn grade_answer(
    assignment: i64,
    submission: i64,
    grade: distlab_common::assignments::TextGrade,
) -> ApiResult<distlab_common::assignments::Submission> {
    let request = Request::put(&format!("/api/assignments/{assignment}/submissions/{submission}/grade"))
        .json(&grade)
        .map_err(|e| RequestError::new(format!("could not encode: {e}")))?;
    read_json(request.send().await).await
}

/// Every uploaded text, newest first.
pub async fn list_datasets() -> ApiResult<distlab_common::DatasetList> {
    get_json("/api/datasets").await
}

/// Uploads `file` (a text) as a dataset called `name`: its bytes go as they are, so the
/// server judges the encoding.
pub async fn upload_dataset(name: &str, file: web_sys::File) -> ApiResult<distlab_common::DatasetView> {
    let url = format!("/api/datasets?name={}", js_sys::encode_uri_component(name));
    let request = Request::post(&url)
        .header("Content-Type", "text/plain")
        .body(file)
        .map_err(|e| RequestError::new(format!("could not send the file: {e}")))?;
    read_json(request.send().await).await
}

async fn post_json<T: DeserializeOwned>(url: &str, body: &serde_json::Value) -> ApiResult<T> {
    let request = Request::post(url).json(body).map_err(|e| RequestError::new(format!("could not encode: {e}")))?;
    read_json(request.send().await).await
}

/// The layout search for a model, a cluster and a global batch (run on the server).
pub async fn search_layouts(
    request: &distlab_common::layout_search::SearchRequest,
) -> ApiResult<distlab_common::layout_search::SearchResult> {
    let body = serde_json::to_value(request).map_err(|e| RequestError::new(format!("could not encode: {e}")))?;
    post_json("/api/plan/layouts", &body).await
}

/// Continues a prompt with a succeeded run's model (sampled on the server).
pub async fn generate(
    id: i64,
    request: &distlab_common::api::GenerateRequest,
) -> ApiResult<distlab_common::api::Generated> {
    let body = serde_json::to_value(request).map_err(|e| RequestError::new(format!("could not encode: {e}")))?;
    post_json(&format!("/api/experiments/{id}/generate"), &body).await
}

pub async fn get_experiment(id: i64) -> ApiResult<ExperimentView> {
    get_json(&format!("/api/experiments/{id}")).await
}

pub async fn get_metrics(id: i64) -> ApiResult<Metrics> {
    get_json(&format!("/api/experiments/{id}/metrics")).await
}

/// Every lease of the experiment: where each attempt began and the work it redid.
pub async fn get_attempts(id: i64) -> ApiResult<Attempts> {
    get_json(&format!("/api/experiments/{id}/attempts")).await
}

/// Every rank's trace: timeline spans and collective steps (`{"ranks": []}` before any).
pub async fn get_trace(id: i64) -> ApiResult<ExperimentTrace> {
    get_json(&format!("/api/experiments/{id}/trace")).await
}

/// Every rank's measured memory next to the planner's prediction.
pub async fn get_memory(id: i64) -> ApiResult<MemoryView> {
    get_json(&format!("/api/experiments/{id}/memory")).await
}

/// `POST /api/experiments` with the spec as JSON; a 422 comes back with its field errors.
pub async fn create_experiment(spec: &serde_json::Value) -> ApiResult<Created> {
    let request = Request::post("/api/experiments")
        .json(spec)
        .map_err(|e| RequestError::new(format!("could not encode the spec: {e}")))?;
    read_json(request.send().await).await
}

pub async fn cancel_experiment(id: i64) -> ApiResult<()> {
    expect_empty(Request::post(&format!("/api/experiments/{id}/cancel")).send().await).await
}

/// Ok for any success, whatever the body.
async fn expect_empty(response: Result<Response, gloo_net::Error>) -> ApiResult<()> {
    let response = response.map_err(network_error)?;
    if response.ok() {
        Ok(())
    } else {
        Err(error_from(response).await)
    }
}

async fn get_json<T: DeserializeOwned>(url: &str) -> ApiResult<T> {
    read_json(Request::get(url).send().await).await
}

async fn read_json<T: DeserializeOwned>(response: Result<Response, gloo_net::Error>) -> ApiResult<T> {
    let response = response.map_err(network_error)?;
    if !response.ok() {
        return Err(error_from(response).await);
    }
    response.json::<T>().await.map_err(|e| RequestError::new(format!("unexpected answer from the server: {e}")))
}

fn network_error(e: gloo_net::Error) -> RequestError {
    RequestError::new(format!("cannot reach the server: {e}"))
}

/// Turns an error answer into words, using the server's `ApiError` body when there is one.
/// A 401 also tells `on_unauthorized`'s hook.
async fn error_from(response: Response) -> RequestError {
    let status = response.status();
    if status == 401 {
        if let Some(hook) = ON_UNAUTHORIZED.with(|hook| hook.borrow().clone()) {
            hook();
        }
    }
    let text = response.text().await.unwrap_or_default();
    let error = match serde_json::from_str::<ApiError>(&text) {
        Ok(body) => RequestError { message: body.error, fields: body.fields, status: None },
        Err(_) if text.trim().is_empty() => RequestError::new(format!("the server answered {status}")),
        Err(_) => RequestError::new(format!("the server answered {status}: {}", text.trim())),
    };
    RequestError { status: Some(status), ..error }
}

/// A live `GET /api/experiments/{id}/stream`: calls `on_event` for every `status`,
/// `start`, `metric`, `log` and `trace` message, and `on_error` (with the source, so that it can close
/// it) when the connection ends or fails. The browser reconnects by itself unless
/// the source is closed (the server then replays the stored metrics: callers
/// de-duplicate by step). Dropping the stream closes it.
pub struct EventStream {
    source: EventSource,
    _listeners: Vec<Closure<dyn FnMut(MessageEvent)>>,
    _on_error: Closure<dyn FnMut()>,
}

impl EventStream {
    pub fn open(
        id: i64,
        on_event: impl Fn(StreamEvent) + 'static,
        on_error: impl Fn(&EventSource) + 'static,
    ) -> ApiResult<Self> {
        let url = format!("/api/experiments/{id}/stream");
        let source =
            EventSource::new(&url).map_err(|_| RequestError::new("this browser cannot open an event stream"))?;
        let on_event = std::rc::Rc::new(on_event);
        let mut listeners = Vec::new();
        for name in ["status", "start", "metric", "log", "trace", "message"] {
            let on_event = on_event.clone();
            let listener = Closure::<dyn FnMut(MessageEvent)>::new(move |message: MessageEvent| {
                let Some(text) = message.data().as_string() else { return };
                match serde_json::from_str::<StreamEvent>(&text) {
                    Ok(event) => on_event(event),
                    Err(e) => leptos::logging::warn!("ignoring a stream message that does not parse ({e}): {text}"),
                }
            });
            source
                .add_event_listener_with_callback(name, listener.as_ref().unchecked_ref())
                .map_err(|_| RequestError::new("cannot listen to the event stream"))?;
            listeners.push(listener);
        }
        let handle = source.clone();
        let on_error = Closure::<dyn FnMut()>::new(move || on_error(&handle));
        source.set_onerror(Some(on_error.as_ref().unchecked_ref()));
        Ok(Self { source, _listeners: listeners, _on_error: on_error })
    }
}

impl Drop for EventStream {
    fn drop(&mut self) {
        self.source.set_onerror(None);
        self.source.close();
    }
}
