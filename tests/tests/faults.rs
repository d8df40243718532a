//! Faults a shared server meets: killed mid-burst, its database held by someone else.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Barrier, Mutex};
use std::time::{Duration, Instant};

use distlab_common::*;
use distlab_tests::*;
use serde_json::json;
use sqlx::Connection;

/// 200 clients submit as fast as the server answers; the server is SIGKILLed in the middle
/// of it. Once it is started again, every submission it answered 201 is there, with its spec.
#[test]
fn every_submission_answered_201_survives_a_killed_server() {
    const CLIENTS: usize = 200;
    // Each client stops at its first failure (the kill), and after this many at most.
    const MAX_PER_CLIENT: usize = 50;
    let args = ["--max-queued-per-user", "100000", "--max-disk-per-user-mb", "0"].map(String::from).to_vec();
    let mut lab = Lab::start_with(LabOptions { local_workers: 0, args, ..LabOptions::default() });
    let url = lab.url("/api/experiments");
    let accepted = Arc::new(Mutex::new(Vec::<(i64, String)>::new()));
    let answered = Arc::new(AtomicUsize::new(0));
    let start = Arc::new(Barrier::new(CLIENTS + 1));
    let clients: Vec<_> = (0..CLIENTS)
        .map(|client| {
            let (url, accepted, answered, start) = (url.clone(), accepted.clone(), answered.clone(), start.clone());
            std::thread::spawn(move || {
                let agent = http_agent();
                start.wait();
                let mut failures = 0;
                for n in 0..MAX_PER_CLIENT {
                    let name = format!("burst-{client}-{n}");
                    let spec = json!({"name": name, "train": {"steps": 5}});
                    let Ok(mut resp) = agent.post(&url).send_json(&spec) else {
                        failures += 1;
                        break;
                    };
                    let status = resp.status().as_u16();
                    let body: serde_json::Value = resp.body_mut().read_json().unwrap_or_default();
                    match (status, body["id"].as_i64()) {
                        (201, Some(id)) => {
                            accepted.lock().unwrap().push((id, name));
                            answered.fetch_add(1, Ordering::Relaxed);
                        }
                        _ => {
                            failures += 1;
                            break;
                        }
                    }
                }
                failures
            })
        })
        .collect();
    start.wait();
    // Kill once a few hundred are in: every client has a request open or about to be.
    let deadline = Instant::now() + Duration::from_secs(60);
    while answered.load(Ordering::Relaxed) < 300 {
        assert!(Instant::now() < deadline, "the burst did not get 300 answers in 60 s");
        std::thread::sleep(Duration::from_millis(1));
    }
    lab.kill_server_and_restart();
    let cut_short: usize = clients.into_iter().map(|c| c.join().expect("client thread")).sum();
    let accepted = accepted.lock().unwrap().clone();
    eprintln!("{} submissions answered 201 before the kill; {cut_short} clients were cut short", accepted.len());
    assert!(cut_short > 0, "the kill came after the burst: no submission was in flight");
    for (id, name) in &accepted {
        let (status, body) = lab.get(&format!("/api/experiments/{id}"));
        assert_eq!(status, 200, "experiment {id} ({name}) was answered 201, and is gone after the restart: {body}");
        assert_eq!(body["spec"]["name"], json!(name), "experiment {id}");
    }
}

/// Someone holds SQLite's write lock for 15 s (a backup, a teacher's sqlite3 shell): a
/// submission meanwhile gets 503 with Retry-After and stores nothing, the worker keeps
/// retrying instead of exiting, and afterwards the queue drains: the run that was going and
/// the ones queued behind it all succeed, on the same worker process.
#[test]
fn a_worker_survives_a_database_locked_for_15_seconds_and_the_queue_drains() {
    let mut lab = Lab::start_with(LabOptions { local_workers: 0, ..LabOptions::default() });
    let worker = lab.spawn_worker("steady");
    let running = lab.submit(&quick_spec("running through the lock", 60));
    let queued: Vec<i64> = (0..2).map(|i| lab.submit(&quick_spec(&format!("queued-{i}"), 5))).collect();
    lab.wait_for(running, Duration::from_secs(60), |e| e.status == ExperimentStatus::Running);

    let db = lab.data_dir.path().join("distlab.db");
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("runtime");
    let mut holder = runtime.block_on(async {
        let url = format!("sqlite://{}", db.display());
        let mut conn = sqlx::SqliteConnection::connect(&url).await.expect("open the server's database");
        sqlx::query("BEGIN IMMEDIATE").execute(&mut conn).await.expect("take the write lock");
        conn
    });
    let locked_at = Instant::now();
    let before = lab.get_as::<ExperimentList>("/api/experiments").total;
    let mut resp = http_agent()
        .post(&lab.url("/api/experiments"))
        .send_json(json!({"name": "during the lock", "train": {"steps": 5}}))
        .expect("an answer");
    assert_eq!(resp.status().as_u16(), 503, "{}", resp.body_mut().read_to_string().unwrap_or_default());
    assert_eq!(resp.headers().get("retry-after").and_then(|v| v.to_str().ok()), Some("1"));
    std::thread::sleep(Duration::from_secs(15).saturating_sub(locked_at.elapsed()));
    assert!(lab.worker_alive(worker), "the worker exited while the database was locked");
    runtime.block_on(async {
        sqlx::query("ROLLBACK").execute(&mut holder).await.expect("release the write lock");
        holder.close().await.expect("close");
    });
    eprintln!("the write lock was held {:.1} s", locked_at.elapsed().as_secs_f64());
    let after = lab.get_as::<ExperimentList>("/api/experiments").total;
    assert_eq!(after, before, "the refused submission is not stored");

    for id in std::iter::once(running).chain(queued) {
        let exp = lab.wait_finished(id, Duration::from_secs(180));
        assert_eq!(exp.status, ExperimentStatus::Succeeded, "{exp:?}");
    }
    let steps = lab.get_as::<Metrics>(&format!("/api/experiments/{running}/metrics")).steps;
    assert_eq!(steps.len(), 60, "every step of the run that went on through the lock is stored");
    assert!(lab.worker_alive(worker), "the worker exited");
}
