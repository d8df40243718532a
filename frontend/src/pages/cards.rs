//! `/cards`: the flashcard deck, reviewed with spaced repetition. Pick (or make) a
//! profile; the server keeps its progress and schedules every card with FSRS. A card
//! shows its question; "Show answer" reveals the answer, the claim with the number a run
//! measured for it, and the live demo; rating 1-5 schedules the next review. Below: due
//! counts, progress per topic, export and import of the profile's progress.

use distlab_common::cards::{Card, Demo};
use distlab_common::claims::{self, ClaimChecks, ClaimStatus};
use distlab_common::presets::presets;
use distlab_common::review::{ReviewResult, ReviewView};
use distlab_common::ExperimentView;
use leptos::prelude::*;
use leptos_router::components::A;
use wasm_bindgen::JsCast;

use crate::api::{self, ApiResult};
use crate::components::doc_link::DocLink;
use crate::load::{error_card, load, loading_card, Loaded};
use crate::pages::scheduling::Scheduling;

/// The browser remembers the chosen profile under this key.
const PROFILE_KEY: &str = "distlab-profile";

const RATINGS: [(i64, &str); 5] = [(1, "not at all"), (2, "barely"), (3, "with effort"), (4, "well"), (5, "perfectly")];

fn storage() -> Option<web_sys::Storage> {
    web_sys::window().and_then(|w| w.local_storage().ok().flatten())
}

fn remembered_profile() -> Option<i64> {
    storage().and_then(|s| s.get_item(PROFILE_KEY).ok().flatten()).and_then(|v| v.parse().ok())
}

fn remember_profile(id: i64) {
    if let Some(s) = storage() {
        let _ = s.set_item(PROFILE_KEY, &id.to_string());
    }
}

/// Where a card's demo opens: the latest finished run of its preset when there is one
/// (ring replay, pipeline page, memory and timeline on the run's page), else the form
/// with the preset filled in; the planner with the card's example.
pub fn demo_link(demo: &Demo, finished: &[ExperimentView]) -> (String, String) {
    let latest = |key: &str| {
        let spec = presets().into_iter().find(|p| p.key == key)?.spec;
        finished.iter().find(|e| e.spec.same_up_to_name(&spec))
    };
    let run_it = |key: &str| (format!("/new?preset={key}"), format!("run the {key} preset"));
    match demo {
        Demo::Preset { preset } => run_it(preset),
        Demo::Ring { preset } => latest(preset)
            .map(|e| (format!("/experiments/{}/ring", e.id), format!("replay the ring of run #{}", e.id)))
            .unwrap_or_else(|| run_it(preset)),
        Demo::Pipeline { preset } => latest(preset)
            .map(|e| (format!("/experiments/{}/pipeline", e.id), format!("the pipeline schedule of run #{}", e.id)))
            .unwrap_or_else(|| run_it(preset)),
        Demo::Memory { preset } => latest(preset)
            .map(|e| (format!("/experiments/{}#memory-card", e.id), format!("the memory of run #{}", e.id)))
            .unwrap_or_else(|| run_it(preset)),
        Demo::Timeline { preset } => latest(preset)
            .map(|e| (format!("/experiments/{}#timeline", e.id), format!("the timeline of run #{}", e.id)))
            .unwrap_or_else(|| run_it(preset)),
        Demo::Planner { spec } => {
            let json = spec.to_string();
            let encoded = js_sys::encode_uri_component(&json).as_string().unwrap_or_default();
            (format!("/planner?spec={encoded}"), "open the planner with this example".to_string())
        }
    }
}

/// What the page reads once: the deck and the finished runs its demos link to.
#[derive(Clone)]
struct Deck {
    cards: Vec<Card>,
    finished: Vec<ExperimentView>,
}

async fn load_deck() -> ApiResult<Deck> {
    let cards = api::get_cards().await?;
    let finished = api::list_succeeded(200).await.map(|l| l.experiments).unwrap_or_default();
    Ok(Deck { cards, finished })
}

#[component]
pub fn CardsPage() -> impl IntoView {
    let deck = load(load_deck);
    // The claims' measurements arrive after the deck (the server reads the runs' traces);
    // without them the cards show what to run.
    let checks = LocalResource::new(|| async {
        api::get_claim_checks().await.map(|c: ClaimChecks| c.checks).unwrap_or_default()
    });
    let profiles = load(api::list_profiles);
    let profile = RwSignal::new(remembered_profile());
    let error = RwSignal::new(None::<String>);
    // The remembered profile if it is still there, else the first.
    Effect::new(move || {
        profiles.with(|answer| match answer {
            Some(Ok(list)) if profile.get_untracked().is_none_or(|id| !list.profiles.iter().any(|p| p.id == id)) => {
                profile.set(list.profiles.first().map(|p| p.id));
            }
            Some(Err(e)) => error.set(Some(e.message.clone())),
            _ => {}
        })
    });
    let new_name = RwSignal::new(String::new());
    let create = move |ev: leptos::ev::SubmitEvent| {
        ev.prevent_default();
        let name = new_name.get_untracked();
        leptos::task::spawn_local(async move {
            match api::create_profile(&name).await {
                Ok(p) => {
                    remember_profile(p.id);
                    profile.try_set(Some(p.id));
                    profiles.try_update(|answer| {
                        if let Some(Ok(list)) = answer {
                            list.profiles.push(p);
                        }
                    });
                    new_name.try_set(String::new());
                    error.try_set(None);
                }
                Err(e) => {
                    error.try_set(Some(e.message));
                }
            }
        });
    };
    let choose_profile = move |ev: leptos::ev::Event| {
        if let Ok(id) = event_target_value(&ev).parse::<i64>() {
            remember_profile(id);
            profile.set(Some(id));
        }
    };
    view! {
        <section class="card" id="cards-page">
            <div class="card-head">
                <h1>"Flashcards"</h1>
                <DocLink page="cards-and-quiz"/>
                <div class="profile-bar">
                    <label>"profile "
                        <select id="profile" prop:value=move || profile.get().map(|p| p.to_string()).unwrap_or_default()
                            on:change=choose_profile>
                            {move || profiles.get().and_then(Result::ok).map(|l| l.profiles).unwrap_or_default().into_iter().map(|p| view! {
                                <option value=p.id.to_string() selected=profile.get_untracked() == Some(p.id)>{p.name}</option>
                            }).collect_view()}
                        </select>
                    </label>
                    <form class="new-profile" on:submit=create>
                        <input id="new-profile-name" placeholder="new profile name" maxlength="64"
                            prop:value=move || new_name.get() on:input=move |ev| new_name.set(event_target_value(&ev))/>
                        <button class="button small" id="create-profile" type="submit">"create"</button>
                    </form>
                </div>
            </div>
            <p class="muted">"One card per topic of distributed training. Answer in your head, reveal, and rate how well you knew it: the scheduler (FSRS) brings a card back just before you would forget it. Every card opens a live demo, and numbers a run can check show what the lab measured."</p>
            {move || error.get().map(|e| view! { <p class="alert error" id="cards-error">{e}</p> })}
        </section>
        {Loaded::new(deck).loading(loading_card).error(error_card).view(move |deck| match profile.get() {
            None => view! {
                <section class="card" id="no-profile"><p>"Create a profile above to start reviewing: your progress is kept on the server under it."</p></section>
            }.into_any(),
            Some(id) => view! { <Review deck=deck checks=checks profile=id/> }.into_any(),
        })}
    }
}

#[component]
fn Review(deck: Deck, checks: LocalResource<Vec<ClaimStatus>>, profile: i64) -> impl IntoView {
    let deck = StoredValue::new(deck);
    // Kept here, so that the import's message outlives the view it refreshes.
    let import_message = RwSignal::new(None::<(bool, String)>);
    let revealed = RwSignal::new(false);
    let last = RwSignal::new(None::<(String, ReviewResult)>);
    let busy = RwSignal::new(false);
    let review = load(move || async move {
        let answer = api::get_review(profile).await;
        revealed.try_set(false);
        busy.try_set(false);
        answer
    });
    let refresh = move || review.refetch();
    let rate = move |card_id: String, rating: i64| {
        if busy.get_untracked() {
            return;
        }
        busy.set(true);
        leptos::task::spawn_local(async move {
            match api::review_card(profile, &card_id, rating).await {
                Ok(result) => {
                    let title = deck.with_value(|d| d.cards.iter().find(|c| c.id == card_id).map(|c| c.title.clone()));
                    last.try_set(Some((title.unwrap_or(card_id), result)));
                    refresh();
                }
                Err(e) => {
                    review.try_set(Some(Err(e)));
                    busy.try_set(false);
                }
            }
        });
    };

    let queue = move |r: ReviewView| {
        let current = r.queue.first().and_then(|id| deck.with_value(|d| d.cards.iter().find(|c| &c.id == id).cloned()));
        let counts = r.counts;
        view! {
            <section class="card" id="review">
                <div class="review-counts" id="review-counts" data-due=counts.due.to_string() data-queue=r.queue.len().to_string()>
                    <span><strong>{r.queue.len()}</strong>" in today's queue"</span>
                    <span>{counts.due}" due"</span>
                    <span>{format!("{} new today (of {} a day)", counts.new_today, counts.new_per_day)}</span>
                    <span>{format!("{} of {} cards learned", counts.learned, counts.total)}</span>
                </div>
                {move || last.get().map(|(title, result)| view! {
                    <p class="muted small" id="last-review" data-card=result.card_id.clone() data-due=result.state.state.due.clone()>
                        {format!("“{title}” rated {}: next review {}", result.rating, next_review_text(result.interval_days))}
                    </p>
                })}
                {match current {
                    Some(card) => card_view(card, deck, checks, revealed, rate, busy).into_any(),
                    None => view! {
                        <p class="empty" id="queue-empty">"Nothing left for today. Come back when cards fall due — or browse the deck below."</p>
                    }.into_any(),
                }}
            </section>
            <section class="card" id="progress">
                <div class="card-head">
                    <h2>"Progress by topic"</h2>
                    <ExportImport profile=profile message=import_message on_import=move || refresh()/>
                </div>
                <div class="topics" id="topics">
                    {r.topics.iter().map(|t| {
                        let share = if t.cards == 0 { 0.0 } else { t.reviewed as f64 / t.cards as f64 };
                        let title = deck.with_value(|d| d.cards.iter().find(|c| c.topic == t.topic).map(|c| c.title.clone()).unwrap_or_default());
                        let recall = t.mean_retrievability.map(|p| format!("recall {:.0}%", 100.0 * p)).unwrap_or_else(|| "new".into());
                        view! {
                            <div class="topic" data-topic=t.topic.to_string() data-reviewed=t.reviewed.to_string()
                                title=format!("topic {}: {title} — {} of {} reviewed, {} due, {recall}", t.topic, t.reviewed, t.cards, t.due)>
                                <span class="topic-num">{t.topic}</span>
                                <span class="topic-bar"><span style=format!("width:{:.0}%", 100.0 * share)></span></span>
                            </div>
                        }
                    }).collect_view()}
                </div>
                <p class="muted small">"Each square is a topic; its bar fills as you review its cards (hover for recall)."</p>
            </section>
            <Scheduling profile=profile/>
            <section class="card" id="browse">
                <details>
                    <summary>"Browse the whole deck, with every claim's measurement"</summary>
                    <ol class="deck-list">
                        {deck.with_value(|d| d.cards.iter().map(|c| {
                            let (href, label) = demo_link(&c.demo, &d.finished);
                            let card = c.clone();
                            view! {
                                <li data-card=c.id.clone()>
                                    <strong>{c.title.clone()}</strong>" · "<A href=href>{label}</A>
                                    {move || claim_line(&card, checks.get().as_deref())}
                                </li>
                            }
                        }).collect_view())}
                    </ol>
                </details>
            </section>
        }
    };
    Loaded::new(review)
        .loading(|| view! { <section class="card"><p class="muted">"loading your queue…"</p></section> })
        .error(error_card)
        .view(queue)
}

fn next_review_text(days: f32) -> String {
    let hours = days * 24.0;
    if hours < 1.0 {
        format!("in {:.0} minutes", (hours * 60.0).max(1.0))
    } else if hours < 20.0 {
        format!("in {hours:.1} hours")
    } else if days < 1.5 {
        "tomorrow".to_string()
    } else {
        format!("in {days:.0} days")
    }
}

fn card_view(
    card: Card,
    deck: StoredValue<Deck>,
    checks: LocalResource<Vec<ClaimStatus>>,
    revealed: RwSignal<bool>,
    rate: impl Fn(String, i64) + Clone + Send + Sync + 'static,
    busy: RwSignal<bool>,
) -> impl IntoView {
    let (href, label) = deck.with_value(|d| demo_link(&card.demo, &d.finished));
    let claim_card = card.clone();
    let id = card.id.clone();
    view! {
        <article class="flashcard" id="flashcard" data-card=card.id.clone()>
            <div class="muted small">{format!("topic {} · {}", card.topic, card.title)}</div>
            <p class="question" id="question">{card.question.clone()}</p>
            {move || if revealed.get() {
                let rate = rate.clone();
                let id = id.clone();
                view! {
                    <div class="answer" id="answer">{card.answer.clone()}</div>
                    {let claim_card = claim_card.clone(); move || claim_line(&claim_card, checks.get().as_deref())}
                    <p class="demo"><A href=href.clone() attr:id="demo-link">{format!("Live demo: {label} →")}</A></p>
                    <div class="ratings" id="ratings">
                        <span class="muted small">"How well did you know this?"</span>
                        {RATINGS.iter().map(|&(n, what)| {
                            let rate = rate.clone();
                            let id = id.clone();
                            view! {
                                <button class="button rating" id=format!("rate-{n}") disabled=move || busy.get()
                                    on:click=move |_| rate(id.clone(), n)>
                                    <strong>{n}</strong>" "<span class="small">{what}</span>
                                </button>
                            }
                        }).collect_view()}
                    </div>
                }.into_any()
            } else {
                view! { <button class="button primary" id="reveal" on:click=move |_| revealed.set(true)>"Show answer"</button> }.into_any()
            }}
        </article>
    }
}

/// The card's claim with its measurement, or why it is not checked yet (None: the checks
/// are still loading); nothing for a card without a claim.
fn claim_line(card: &Card, checks: Option<&[ClaimStatus]>) -> Option<impl IntoView + Clone> {
    let claim = card.claim.as_ref()?;
    let preset = claims::preset_for(card)?;
    let status = checks.unwrap_or_default().iter().find(|s| s.check == claim.check && s.preset == preset);
    let (class, text) = match status.and_then(|s| s.measurement.as_ref().map(|m| (s, m))) {
        Some((_, m)) => (
            if m.agrees { "check agrees" } else { "check disagrees" },
            format!(
                "predicted {}, measured {} (run #{}){}",
                m.predicted,
                m.measured,
                m.experiment_id,
                if m.agrees { " ✓" } else { " ✗ — they disagree" }
            ),
        ),
        None if checks.is_none() => ("check unchecked", "looking for a run that checks it…".to_string()),
        None => ("check unchecked", status.map(|s| s.how.clone()).unwrap_or_else(|| "not checked yet".into())),
    };
    let claim_text = claim.text.clone();
    let note = status.and_then(|s| s.measurement.as_ref()).and_then(|m| m.note.clone());
    // Where the texts disagree, what each says, side by side above the measurement.
    let readings = (!claim.readings.is_empty()).then(|| {
        let columns = claim
            .readings
            .iter()
            .map(|r| view! { <div class="reading"><span class="source">{r.source.clone()}</span>" says: "{r.says.clone()}</div> })
            .collect_view();
        view! { <div class="readings" title="the study texts disagree here; the measurement below says which one this lab's run matches">{columns}</div> }
    });
    Some(view! {
        <div class="claim">
            <div>{claim_text}</div>
            {readings}
            <div class=class data-check=serde_json::to_value(claim.check).ok().and_then(|v| v.as_str().map(str::to_string)).unwrap_or_default()>
                {text}
            </div>
            {note.map(|n| view! { <div class="muted small check-note">{n}</div> })}
        </div>
    })
}

#[component]
fn ExportImport(
    profile: i64,
    message: RwSignal<Option<(bool, String)>>,
    on_import: impl Fn() + Clone + Send + Sync + 'static,
) -> impl IntoView {
    let on_change = move |ev: leptos::ev::Event| {
        let Some(input) = ev.target().and_then(|t| t.dyn_into::<web_sys::HtmlInputElement>().ok()) else { return };
        let Some(file) = input.files().and_then(|f| f.get(0)) else { return };
        input.set_value("");
        let on_import = on_import.clone();
        leptos::task::spawn_local(async move {
            let text = match wasm_bindgen_futures::JsFuture::from(file.text()).await {
                Ok(t) => t.as_string().unwrap_or_default(),
                Err(_) => {
                    message.try_set(Some((false, "could not read the file".into())));
                    return;
                }
            };
            match api::import_progress(profile, &text).await {
                Ok(r) => {
                    let skipped = if r.skipped_cards + r.skipped_log > 0 {
                        format!(
                            " ({} states and {} reviews of cards no longer in the deck skipped)",
                            r.skipped_cards, r.skipped_log
                        )
                    } else {
                        String::new()
                    };
                    message.try_set(Some((
                        true,
                        format!("imported {} card states and {} reviews{skipped}", r.cards, r.log),
                    )));
                    on_import();
                }
                Err(e) => {
                    message.try_set(Some((false, format!("nothing was changed: {}", e.message))));
                }
            }
        });
    };
    view! {
        <div class="export-import">
            <a class="button small" id="export-progress" href=format!("/api/profiles/{profile}/export") download="distlab-progress.json">"export progress"</a>
            <label class="button small">"import…"
                <input type="file" id="import-progress" accept="application/json,.json" class="hidden-file" on:change=on_change/>
            </label>
            {move || message.get().map(|(ok, m)| view! { <span class=if ok { "muted small" } else { "alert error small" } id="import-message">{m}</span> })}
        </div>
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn demo_links_open_the_latest_run_or_the_preset() {
        let preset = presets().into_iter().find(|p| p.key == "pipeline").expect("preset");
        let ring = Demo::Pipeline { preset: "pipeline".into() };
        assert_eq!(demo_link(&ring, &[]).0, "/new?preset=pipeline");
        let run = ExperimentView {
            id: 12,
            name: "renamed".into(),
            owner: "local".into(),
            status: distlab_common::ExperimentStatus::Succeeded,
            spec: distlab_common::ExperimentSpec { name: "renamed".into(), ..preset.spec },
            created_at: String::new(),
            started_at: None,
            finished_at: None,
            error: None,
            summary: None,
            attempt: 1,
            steps_done: 0,
        };
        assert_eq!(demo_link(&ring, std::slice::from_ref(&run)).0, "/experiments/12/pipeline");
        assert_eq!(demo_link(&Demo::Preset { preset: "tiny".into() }, &[run]).0, "/new?preset=tiny");
    }
}
