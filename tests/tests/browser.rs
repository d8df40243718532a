//! The web app in a real headless Chromium, against the real server and worker:
//! fill the form (with an instant validation error on the way), submit, watch the
//! run finish on the experiment page, and save screenshots to target/screenshots/.
//!
//! Needs `chromium` and `chromedriver` (Debian: `apt-get install chromium chromium-driver`;
//! `cargo xtask test` installs them) and a built frontend (`cargo xtask build-frontend`).
//! Without a browser the test fails and says so, unless DISTLAB_SKIP_BROWSER=1.

use std::future::Future;
use std::net::{TcpListener, TcpStream};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context, Result};
use distlab_common::ExperimentStatus;
use distlab_tests::{repo_root, Lab};
use fantoccini::{Client, ClientBuilder, Locator};
use serde_json::{json, Value};

fn chromium_path() -> PathBuf {
    std::env::var_os("DISTLAB_CHROMIUM").map(PathBuf::from).unwrap_or_else(|| "/usr/bin/chromium".into())
}

fn chromedriver_path() -> PathBuf {
    std::env::var_os("DISTLAB_CHROMEDRIVER").map(PathBuf::from).unwrap_or_else(|| "/usr/bin/chromedriver".into())
}

/// `chromedriver --port=<free>`, killed on drop.
struct ChromeDriver {
    child: Child,
    port: u16,
}

impl ChromeDriver {
    fn start() -> Result<Self> {
        let port = TcpListener::bind("127.0.0.1:0")?.local_addr()?.port();
        let child = Command::new(chromedriver_path())
            .arg(format!("--port={port}"))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .with_context(|| format!("cannot start {}", chromedriver_path().display()))?;
        let driver = ChromeDriver { child, port };
        let deadline = Instant::now() + Duration::from_secs(15);
        while TcpStream::connect(("127.0.0.1", port)).is_err() {
            if Instant::now() > deadline {
                bail!("chromedriver did not listen on port {port} within 15 s");
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        Ok(driver)
    }

    async fn connect(&self) -> Result<Client> {
        let mut caps = serde_json::Map::new();
        caps.insert(
            "goog:chromeOptions".into(),
            json!({
                "binary": chromium_path(),
                "args": [
                    "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                    "--disable-background-networking", "--disable-component-update", "--disable-sync", "--hide-scrollbars",
                    "--window-size=1280,900",
                ],
            }),
        );
        let connector = hyper_util::client::legacy::connect::HttpConnector::new();
        ClientBuilder::new(connector)
            .capabilities(caps)
            .connect(&format!("http://127.0.0.1:{}", self.port))
            .await
            .context("cannot open a Chromium session through chromedriver")
    }
}

impl Drop for ChromeDriver {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Whether the browser test can run; an explanation when it cannot.
fn browser_missing() -> Option<String> {
    let missing: Vec<String> = [chromium_path(), chromedriver_path()]
        .into_iter()
        .filter(|p| !p.exists())
        .map(|p| p.display().to_string())
        .collect();
    (!missing.is_empty()).then(|| {
        format!(
            "the browser test needs {} (Debian: `apt-get install -y chromium chromium-driver`, or run `cargo xtask test`, \
             which installs them; DISTLAB_CHROMIUM / DISTLAB_CHROMEDRIVER point elsewhere). \
             Set DISTLAB_SKIP_BROWSER=1 to skip it.",
            missing.join(" and ")
        )
    })
}

fn screenshot_dir() -> PathBuf {
    repo_root().join("target/screenshots")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn submit_in_the_browser_and_watch_the_loss_fall() -> Result<()> {
    if let Some(why) = browser_missing() {
        if std::env::var_os("DISTLAB_SKIP_BROWSER").is_some_and(|v| v == "1") {
            eprintln!("SKIPPED (DISTLAB_SKIP_BROWSER=1): {why}");
            return Ok(());
        }
        panic!("{why}");
    }
    let site = repo_root().join("target/site/index.html");
    assert!(site.exists(), "{} is missing: build the frontend first with `cargo xtask build-frontend`", site.display());

    let lab = Lab::start();
    let driver = ChromeDriver::start()?;
    let client = driver.connect().await?;
    let result = scenario(&client, &lab).await;
    if result.is_err() {
        // Whatever the page showed when it went wrong.
        let _ = save_screenshot(&client, "failure.png").await;
    }
    let _ = client.close().await;
    result
}

async fn scenario(c: &Client, lab: &Lab) -> Result<()> {
    // The form, from the tiny preset.
    c.goto(&lab.url("/new")).await?;
    wait_for(c, "the form to load", Duration::from_secs(30), || exists(c, "#submit")).await?;
    c.find(Locator::Css("#preset-tiny")).await?.click().await?;
    assert_eq!(value_of(c, "model.heads").await?, "4");
    assert!(text(c, "#support-note").await?.contains("not yet supported"));

    // An invalid value: the message appears at once, next to its field, and submit is disabled.
    set_field(c, "model.heads", "3").await?;
    let heads_error = ".field-error[data-field='model.heads']";
    wait_for(c, "the instant error for model.heads", Duration::from_secs(5), || async {
        Ok(text(c, heads_error).await?.contains("heads=3 does not divide d_model=64"))
    })
    .await?;
    assert!(disabled(c, "#submit").await?, "submit must be disabled while the spec is invalid");
    save_full_page(c, "new.png").await?;

    // Fixed: the error goes away and submit is enabled again.
    set_field(c, "model.heads", "4").await?;
    wait_for(c, "the error to go away", Duration::from_secs(5), || async { Ok(!exists(c, heads_error).await?) })
        .await?;
    // A name with markup: it must come back as text, never as HTML.
    let name = "tiny <b>browser</b> & co";
    set_field(c, "name", name).await?;
    set_field(c, "train.steps", "60").await?;
    wait_for(c, "submit to be enabled", Duration::from_secs(5), || async { Ok(!disabled(c, "#submit").await?) })
        .await?;
    c.find(Locator::Css("#submit")).await?.click().await?;

    // The experiment page.
    wait_for(c, "the experiment page", Duration::from_secs(15), || async {
        Ok(c.current_url().await?.path().starts_with("/experiments/"))
    })
    .await?;
    let url = c.current_url().await?;
    let id: i64 = url.path().trim_start_matches("/experiments/").parse().with_context(|| format!("id in {url}"))?;
    wait_for(c, "the experiment name", Duration::from_secs(15), || exists(c, "#experiment-name")).await?;
    assert_eq!(text(c, "#experiment-name").await?, name, "the name is shown as typed");
    assert!(!exists(c, "#experiment-name b").await?, "user text must not become markup");

    wait_for(c, "the run to succeed", Duration::from_secs(120), || async {
        let status = text(c, "#status").await.unwrap_or_default();
        if status == "failed" || status == "cancelled" {
            let error = text(c, "#error").await.unwrap_or_default();
            bail!("the experiment {status}: {error}");
        }
        Ok(status == "succeeded")
    })
    .await?;
    wait_for(c, "the summary", Duration::from_secs(10), || exists(c, "#summary")).await?;
    wait_for(c, "all 60 points on the chart", Duration::from_secs(10), || async {
        Ok(attr(c, "#loss-chart", "data-points").await?.as_deref() == Some("60"))
    })
    .await?;
    let dots = c.find_all(Locator::Css("#loss-chart circle.loss-point")).await?.len();
    assert!(dots >= 10, "the chart shows {dots} points");
    assert!(exists(c, "#loss-chart path.loss-line").await?);
    assert!(exists(c, "#loss-chart line.ref-uniform").await?, "the ln(vocab) reference line is drawn");
    let chart = text(c, "#loss-chart").await?;
    for needle in ["step", "loss (nats/token)", "uniform guess: ln(64)", "training loss"] {
        assert!(chart.contains(needle), "the chart says {needle:?}: {chart}");
    }
    assert_eq!(text(c, "#step").await?, "60 / 60");
    assert!(!exists(c, "#cancel").await?, "no cancel button once finished");
    save_full_page(c, "experiment.png").await?;

    // The server agrees with the page.
    let exp = lab.experiment(id);
    assert_eq!(exp.status, ExperimentStatus::Succeeded);
    assert_eq!(exp.name, name);

    // The list shows it, newest first.
    c.goto(&lab.url("/")).await?;
    let row = format!(".experiment-row[data-id='{id}']");
    wait_for(c, "the experiment in the list", Duration::from_secs(15), || exists(c, &row)).await?;
    assert_eq!(attr(c, &row, "data-status").await?.as_deref(), Some("succeeded"));
    save_full_page(c, "list.png").await?;

    watch_a_long_run_live_and_cancel_it(c, lab).await
}

/// Points reach the chart while the run is going (server-sent events), and the
/// cancel button stops it.
async fn watch_a_long_run_live_and_cancel_it(c: &Client, lab: &Lab) -> Result<()> {
    let spec = distlab_tests::quick_spec("long run, cancelled from the page", 20_000);
    let id = lab.submit(&spec);
    c.goto(&lab.url(&format!("/experiments/{id}"))).await?;
    let points = || async {
        let n = attr(c, "#loss-chart", "data-points").await?.unwrap_or_default();
        Ok::<u64, anyhow::Error>(n.parse().unwrap_or(0))
    };
    wait_for(c, "the first points of the long run", Duration::from_secs(60), || async { Ok(points().await? >= 5) })
        .await?;
    assert_eq!(text(c, "#status").await?, "running");
    let seen = points().await?;
    wait_for(c, "more points while it runs", Duration::from_secs(30), || async { Ok(points().await? > seen + 5) })
        .await?;
    save_full_page(c, "running.png").await?;

    c.find(Locator::Css("#cancel")).await?.click().await?;
    wait_for(c, "the run to be cancelled", Duration::from_secs(30), || async {
        Ok(text(c, "#status").await.unwrap_or_default() == "cancelled")
    })
    .await?;
    wait_for(c, "the cancel button to go away", Duration::from_secs(5), || async { Ok(!exists(c, "#cancel").await?) })
        .await?;
    let exp = lab.wait_finished(id, Duration::from_secs(30));
    assert_eq!(exp.status, ExperimentStatus::Cancelled, "{exp:?}");
    Ok(())
}

/// Polls `check` every 100 ms until it holds; an error names what did not happen.
async fn wait_for<F, Fut>(c: &Client, what: &str, timeout: Duration, check: F) -> Result<()>
where
    F: Fn() -> Fut,
    Fut: Future<Output = Result<bool>>,
{
    let start = Instant::now();
    loop {
        if check().await? {
            return Ok(());
        }
        if start.elapsed() > timeout {
            let url = c.current_url().await.map(|u| u.to_string()).unwrap_or_default();
            bail!("timed out after {timeout:?} waiting for {what} (page {url})");
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

async fn js(c: &Client, script: &str, selector: &str) -> Result<Value> {
    c.execute(script, vec![json!(selector)]).await.map_err(|e| anyhow!("script on {selector}: {e}"))
}

async fn exists(c: &Client, selector: &str) -> Result<bool> {
    Ok(js(c, "return document.querySelector(arguments[0]) !== null;", selector).await? == json!(true))
}

async fn text(c: &Client, selector: &str) -> Result<String> {
    let v = js(c, "const e = document.querySelector(arguments[0]); return e ? e.textContent.trim() : null;", selector)
        .await?;
    v.as_str().map(str::to_string).ok_or_else(|| anyhow!("no element {selector}"))
}

async fn attr(c: &Client, selector: &str, name: &str) -> Result<Option<String>> {
    let v = c
        .execute(
            "const e = document.querySelector(arguments[0]); return e ? e.getAttribute(arguments[1]) : null;",
            vec![json!(selector), json!(name)],
        )
        .await?;
    Ok(v.as_str().map(str::to_string))
}

async fn disabled(c: &Client, selector: &str) -> Result<bool> {
    Ok(js(c, "const e = document.querySelector(arguments[0]); return !!(e && e.disabled);", selector).await?
        == json!(true))
}

async fn value_of(c: &Client, field: &str) -> Result<String> {
    let v = js(c, "const e = document.querySelector(`[name='${arguments[0]}']`); return e ? e.value : null;", field)
        .await?;
    v.as_str().map(str::to_string).ok_or_else(|| anyhow!("no field {field}"))
}

/// Types into the input named by its spec path, replacing what was there.
async fn set_field(c: &Client, field: &str, value: &str) -> Result<()> {
    let input = c.find(Locator::Css(&format!("[name='{field}']"))).await?;
    input.clear().await?;
    input.send_keys(value).await?;
    let now = value_of(c, field).await?;
    if now != value {
        bail!("field {field} holds {now:?} after typing {value:?}");
    }
    Ok(())
}

async fn save_screenshot(c: &Client, file: &str) -> Result<PathBuf> {
    let png = c.screenshot().await?;
    let dir = screenshot_dir();
    std::fs::create_dir_all(&dir)?;
    let path = dir.join(file);
    std::fs::write(&path, png)?;
    eprintln!("screenshot: {}", path.display());
    Ok(path)
}

/// A screenshot of the whole page: the window is made as tall as the document first.
async fn save_full_page(c: &Client, file: &str) -> Result<PathBuf> {
    let height = c.execute("return Math.ceil(document.documentElement.scrollHeight);", vec![]).await?;
    let height = height.as_u64().unwrap_or(900).clamp(600, 4000) as u32;
    c.set_window_size(1280, height + 120).await?;
    tokio::time::sleep(Duration::from_millis(300)).await;
    let path = save_screenshot(c, file).await?;
    c.set_window_size(1280, 900).await?;
    Ok(path)
}
