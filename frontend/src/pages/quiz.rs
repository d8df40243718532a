//! The quiz (`/quiz`): one question at a time. A question that asks for a number takes it
//! typed and the server grades it; any other is answered in one's head, revealed, and
//! graded by the learner. The answer comes with a link to the run or planner view that
//! shows it; the account's results are kept on the server and colour the question bar.

use distlab_common::quiz::{Question, QuizAnswer, QuizResults, QuizVerdict};
use distlab_common::ExperimentView;
use leptos::prelude::*;

use crate::api::ApiResult;
use crate::components::doc_link::DocLink;
use crate::load::{error_card, load, load_keeping, loading_card, Load, Loaded};
use crate::pages::cards::demo_link;
use crate::{api, format};

/// What the page reads once: the questions and the finished runs their demos link to.
#[derive(Clone)]
struct Quiz {
    questions: Vec<Question>,
    finished: Vec<ExperimentView>,
}

async fn load_quiz() -> ApiResult<Quiz> {
    let questions = api::get_quiz().await?;
    let finished = api::list_succeeded(200).await.map(|l| l.experiments).unwrap_or_default();
    Ok(Quiz { questions, finished })
}

/// The account's results as last loaded (none until they are in).
fn latest(results: Load<QuizResults>) -> QuizResults {
    results.get().and_then(Result::ok).unwrap_or_default()
}

/// "right" or "wrong" for a question's latest answer, "" when it has none.
fn result_class(results: &QuizResults, id: &str) -> &'static str {
    match results.results.iter().find(|r| r.question_id == id) {
        Some(r) if r.last_correct => "right",
        Some(_) => "wrong",
        None => "",
    }
}

#[component]
pub fn QuizPage() -> impl IntoView {
    let quiz = load(load_quiz);
    // Refetched after every answer; a refresh that fails keeps the last results.
    let (results, _) = load_keeping(api::quiz_results);
    // A request that failed: the results' first load, or an answer.
    let error = RwSignal::new(None::<String>);
    Effect::new(move || {
        if let Some(Err(e)) = results.get() {
            error.set(Some(e.message));
        }
    });
    let current = RwSignal::new(0usize);
    view! {
        <section class="card" id="quiz-page">
            <div class="card-head">
                <h1>"Quiz"</h1>
                <DocLink page="cards-and-quiz"/>
                <span class="muted" id="quiz-score">{move || {
                    let r = latest(results);
                    format!("right now: {} of {} answered", r.latest_right_count(), r.results.len())
                }}</span>
            </div>
            <p class="muted">"The study quiz, question by question. Type the number a question asks for, or answer in your head and reveal; every answer links to the run or the planner view that shows it. Your results are kept on the server under your account."</p>
            {move || error.get().map(|e| view! { <p class="alert error" id="quiz-error">{e}</p> })}
        </section>
        {Loaded::new(quiz)
            .loading(loading_card)
            .error(error_card)
            .view(move |quiz| view! { <QuizBoard quiz=quiz results=results current=current error=error/> })}
    }
}

#[component]
fn QuizBoard(
    quiz: Quiz,
    results: Load<QuizResults>,
    current: RwSignal<usize>,
    error: RwSignal<Option<String>>,
) -> impl IntoView {
    let quiz = StoredValue::new(quiz);
    let count = quiz.with_value(|q| q.questions.len());
    let at_end = move || current.get() + 1 >= count;
    let nav = move || {
        quiz.with_value(|q| {
            q.questions
                .iter()
                .enumerate()
                .map(|(i, question)| {
                    let id = question.id.clone();
                    let class = move || {
                        let mut c = format!("quiz-dot {}", result_class(&latest(results), &id));
                        if current.get() == i {
                            c.push_str(" current");
                        }
                        c
                    };
                    view! {
                        <button class=class data-question=question.number.to_string() title=question.question.clone()
                            on:click=move |_| current.set(i)>{question.number}</button>
                    }
                })
                .collect_view()
        })
    };
    view! {
        <section class="card">
            <div class="quiz-nav" id="quiz-nav">{nav}</div>
            {move || {
                let i = current.get().min(count.saturating_sub(1));
                quiz.with_value(|q| q.questions.get(i).cloned()).map(|question| {
                    let finished = quiz.with_value(|q| q.finished.clone());
                    view! { <QuestionView question=question finished=finished results=results error=error/> }
                })
            }}
            <div class="quiz-steps">
                <button class="button small" id="quiz-previous" disabled=move || current.get() == 0
                    on:click=move |_| current.update(|i| *i = i.saturating_sub(1))>"← previous"</button>
                <button class="button small" id="quiz-next" disabled=at_end
                    on:click=move |_| current.update(|i| *i = (*i + 1).min(count.saturating_sub(1)))>"next →"</button>
            </div>
        </section>
    }
}

#[component]
fn QuestionView(
    question: Question,
    finished: Vec<ExperimentView>,
    results: Load<QuizResults>,
    error: RwSignal<Option<String>>,
) -> impl IntoView {
    let revealed = RwSignal::new(false);
    let verdict = RwSignal::new(None::<QuizVerdict>);
    let given = RwSignal::new(String::new());
    let id = question.id.clone();
    // Sends an answer, then shows the verdict and the answer and refreshes the results.
    let send = move |answer: QuizAnswer| {
        leptos::task::spawn_local(async move {
            match api::answer_quiz(&answer).await {
                Ok(v) => {
                    verdict.try_set(Some(v));
                    revealed.try_set(true);
                    error.try_set(None);
                    results.refetch();
                }
                Err(e) => {
                    error.try_set(Some(e.message));
                }
            }
        });
    };
    let (href, label) = demo_link(&question.demo, &finished);
    // One answer per visit: once the verdict (and the answer) is shown, a second try would
    // only copy it. Coming back to the question starts a new one.
    let answered = move || verdict.get().is_some();
    let answer_form = match question.expect.clone() {
        Some(expect) => {
            let id = id.clone();
            let check = move |ev: leptos::ev::SubmitEvent| {
                ev.prevent_default();
                if verdict.get_untracked().is_some() {
                    return;
                }
                match given.get_untracked().trim().parse::<f64>() {
                    Ok(number) => send(QuizAnswer { question_id: id.clone(), given: Some(number), knew: None }),
                    Err(_) => error.set(Some("type a number (like 1.75 or 3e9)".into())),
                }
            };
            view! {
                <form class="quiz-number" on:submit=check>
                    <input id="quiz-given" inputmode="decimal" placeholder="your answer" disabled=answered
                        prop:value=move || given.get() on:input=move |ev| given.set(event_target_value(&ev))/>
                    <span class="muted">{expect.unit.clone()}</span>
                    <button class="button small" id="quiz-check" type="submit" disabled=answered>"check"</button>
                </form>
            }
            .into_any()
        }
        None => {
            let (knew_id, missed_id) = (id.clone(), id.clone());
            view! {
                <div class="quiz-self">
                    <button class="button small" id="quiz-reveal" on:click=move |_| revealed.set(true)>"reveal the answer"</button>
                    <Show when=move || revealed.get() && verdict.get().is_none()>
                        <span class="muted">" did you know it? "</span>
                        <button class="button small" id="quiz-knew"
                            on:click={let id = knew_id.clone(); move |_| send(QuizAnswer { question_id: id.clone(), given: None, knew: Some(true) })}>"I knew it"</button>
                        <button class="button small secondary" id="quiz-missed"
                            on:click={let id = missed_id.clone(); move |_| send(QuizAnswer { question_id: id.clone(), given: None, knew: Some(false) })}>"I did not"</button>
                    </Show>
                </div>
            }
            .into_any()
        }
    };
    let unit = question.expect.as_ref().map(|e| e.unit.clone()).unwrap_or_default();
    let answer = question.answer.clone();
    let last = move || latest(results).results.iter().find(|x| x.question_id == id).map(|x| (x.attempts, x.correct));
    view! {
        <div class="quiz-question" id="quiz-question" data-id=question.id.clone()>
            <h2>{format!("Question {}", question.number)}</h2>
            <p class="quiz-text">{question.question.clone()}</p>
            {answer_form}
            {move || verdict.get().map(|v| {
                let text = match (v.correct, v.expected) {
                    (true, Some(e)) => format!("right: {} {unit}", format::value(e as f32)),
                    (false, Some(e)) => format!("not quite: the answer is {} {unit}", format::value(e as f32)),
                    (true, None) => "you knew it".to_string(),
                    (false, None) => "one to come back to".to_string(),
                };
                view! { <p id="quiz-verdict" class=if v.correct { "quiz-verdict right" } else { "quiz-verdict wrong" }>{text}</p> }
            })}
            <Show when=move || revealed.get()>
                <div class="quiz-answer" id="quiz-answer">
                    <p>{answer.clone()}</p>
                    <p><a id="quiz-demo" href=href.clone()>{label.clone()}</a></p>
                </div>
            </Show>
            {move || last().map(|(attempts, correct)| view! {
                <p class="muted small" id="quiz-history">{format!("answered {attempts} times, {correct} right")}</p>
            })}
        </div>
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use distlab_common::quiz::QuestionResult;

    #[test]
    fn the_bar_shows_each_questions_latest_answer() {
        let result = |id: &str, last_correct| QuestionResult {
            question_id: id.into(),
            attempts: 2,
            correct: 1,
            last_correct,
            last_given: None,
            answered_at: String::new(),
        };
        let r = QuizResults { results: vec![result("a", true), result("b", false)] };
        assert_eq!((result_class(&r, "a"), result_class(&r, "b"), result_class(&r, "c")), ("right", "wrong", ""));
        assert_eq!(r.latest_right_count(), 1);
    }
}
