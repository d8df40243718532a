//! "Try the model": a succeeded run's trained model, sampled on the server
//! (`POST /api/experiments/{id}/generate`), and its files to take away (GPT-2's
//! safetensors and config.json, and a BPE run's tokenizer.json). A model trained on text
//! takes a text prompt (cut into tokens on the server as the run cut its text); the
//! Markov-chain models take token ids.

use distlab_common::api::{GenerateRequest, Generated, MAX_NEW_TOKENS};
use leptos::prelude::*;

use crate::api;

/// Token ids typed as numbers separated by spaces or commas.
fn parse_tokens(text: &str) -> Result<Vec<u32>, String> {
    text.split(|c: char| c.is_whitespace() || c == ',')
        .filter(|s| !s.is_empty())
        .map(|s| s.parse::<u32>().map_err(|_| format!("'{s}' is not a token id")))
        .collect()
}

#[component]
pub fn TryModel(id: i64, text: bool, bpe: bool, vocab: usize) -> impl IntoView {
    let prompt = RwSignal::new(if text { "ROMEO:".to_string() } else { "1 2 3".to_string() });
    let max_new = RwSignal::new("64".to_string());
    let temperature = RwSignal::new("0.8".to_string());
    let top_k = RwSignal::new("0".to_string());
    let seed = RwSignal::new("0".to_string());
    // The answer, with the prompt it continues (as sent, whatever the box holds now).
    let result = RwSignal::new(None::<(String, Generated)>);
    let error = RwSignal::new(None::<String>);
    let busy = RwSignal::new(false);
    let run = move |_| {
        let number = |s: RwSignal<String>, what: &str| {
            s.get().trim().parse::<f64>().map_err(|_| format!("{what}: '{}' is not a number", s.get()))
        };
        let whole = |s: RwSignal<String>, what: &str| {
            s.get().trim().parse::<u64>().map_err(|_| format!("{what}: '{}' is not a whole number", s.get()))
        };
        let request = (|| -> Result<GenerateRequest, String> {
            let (prompt_text, prompt_tokens) =
                if text { (Some(prompt.get()), None) } else { (None, Some(parse_tokens(&prompt.get())?)) };
            Ok(GenerateRequest {
                prompt: prompt_text,
                prompt_tokens,
                max_new_tokens: whole(max_new, "new tokens")? as usize,
                temperature: number(temperature, "temperature")?,
                top_k: whole(top_k, "top-k")? as usize,
                seed: whole(seed, "seed")?,
            })
        })();
        match request {
            Err(e) => error.set(Some(e)),
            Ok(request) => {
                busy.set(true);
                error.set(None);
                let sent = request.prompt.clone().unwrap_or_default();
                leptos::task::spawn_local(async move {
                    match api::generate(id, &request).await {
                        Ok(g) => result.set(Some((sent, g))),
                        Err(e) => error.set(Some(e.to_string())),
                    }
                    busy.set(false);
                });
            }
        }
    };
    let hint = if bpe {
        format!("Text in, text out: cut into tokens by the run's byte-level BPE of {vocab} tokens, as the model was trained.")
    } else if text {
        "Text in, text out: one token per byte, as the model was trained.".to_string()
    } else {
        format!(
            "This model was trained on a Markov chain of {vocab} tokens: the prompt is token ids (0 to {}).",
            vocab - 1
        )
    };
    view! {
        <section class="card" id="try-model">
            <h2>"Try the model"</h2>
            <p class="muted small">
                {hint} " Temperature 0 takes the likeliest token each time; higher draws more freely, from the top-k likeliest when k is set; the same seed draws the same text. "
                "Take it with you: "
                <a href=format!("/api/experiments/{id}/model") id="download-model">"model.safetensors"</a>
                " and "
                <a href=format!("/api/experiments/{id}/model/config") id="download-config">"config.json"</a>
                {bpe.then(|| view! {
                    ", " <a href=format!("/api/experiments/{id}/model/tokenizer") id="download-tokenizer">"tokenizer.json"</a>
                })}
                " in one directory load with transformers' AutoModelForCausalLM.from_pretrained (GPT-2 or Llama, as trained)"
                {bpe.then_some(", the tokenizer with AutoTokenizer")} "."
            </p>
            <textarea id="prompt" rows="3" prop:value=move || prompt.get() on:input=move |ev| prompt.set(event_target_value(&ev))></textarea>
            <div class="row">
                <label>"new tokens " <input id="max-new-tokens" type="number" min="1" max=MAX_NEW_TOKENS.to_string() prop:value=move || max_new.get() on:input=move |ev| max_new.set(event_target_value(&ev))/></label>
                <label>"temperature " <input id="temperature" type="number" step="0.1" min="0" prop:value=move || temperature.get() on:input=move |ev| temperature.set(event_target_value(&ev))/></label>
                <label>"top-k " <input id="top-k" type="number" min="0" prop:value=move || top_k.get() on:input=move |ev| top_k.set(event_target_value(&ev))/></label>
                <label>"seed " <input id="seed" type="number" min="0" prop:value=move || seed.get() on:input=move |ev| seed.set(event_target_value(&ev))/></label>
                <button class="button" id="generate" on:click=run disabled=move || busy.get()>
                    {move || if busy.get() { "Sampling…" } else { "Generate" }}
                </button>
            </div>
            {move || error.get().map(|e| view! { <p class="alert error" id="generate-error">{e}</p> })}
            {move || result.get().map(|(sent, g)| view! {
                <pre class="generated" id="generated">
                    {sent}
                    <b>{if text { g.text.clone() } else { g.tokens.iter().map(u32::to_string).collect::<Vec<_>>().join(" ") }}</b>
                </pre>
                <p class="muted small" id="generated-stats">
                    {format!("{} tokens in {:.0} ms (measured on the server)", g.tokens.len(), g.ms)}
                    {g.stopped_early.then_some("; stopped at the server's time budget for one request")}
                </p>
            })}
        </section>
    }
}
