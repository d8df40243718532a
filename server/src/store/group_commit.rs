//! Group commit of submissions: the submissions that arrive while one transaction is being
//! written wait, and the next transaction writes them all, one after the other, so that
//! each sees the ones before it (the quota and the idempotency keys hold as if they had
//! come one at a time). On SQLite a write transaction's commit costs several times its
//! insert (the WAL's pages written: measured by `examples/submit_costs.rs`, about 500 µs
//! for a transaction of one insert, about 110 µs per insert in one of 16); one transaction
//! per submission held the server near 900 submissions a second, however many cores
//! answered the rest of each request.
//!
//! One writer task per database runs while submissions wait (spawned by the submission
//! that finds none), so a submission whose client goes away never takes the others'
//! transaction with it.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use tokio::sync::oneshot;

use crate::store::changes::{Data, Writing};
use crate::store::queue::{queue_one, Submission, Submitted};
use crate::store::{begin_write, ByDatabase, Db, StoreError};

/// The most submissions one transaction writes: the others wait for the next, and the
/// leases and workers' reports waiting for the write lock take their turn in between.
const MOST_PER_TRANSACTION: usize = 64;

type Answer = oneshot::Sender<Result<Submitted, StoreError>>;

/// One database's submissions waiting to be written.
#[derive(Default)]
struct Waiting {
    submissions: Vec<(Submission, Answer)>,
    /// Whether a writer task is running for them.
    writer: bool,
}

fn waiting(db: &Db) -> Arc<Mutex<Waiting>> {
    static BY_DATABASE: ByDatabase<Mutex<Waiting>> = ByDatabase::new();
    BY_DATABASE.of(db)
}

fn lock(waiting: &Mutex<Waiting>) -> std::sync::MutexGuard<'_, Waiting> {
    waiting.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// Writes `submission` in the next transaction (see the module's comment).
pub(crate) async fn submit(db: &Db, submission: Submission) -> Result<Submitted, StoreError> {
    let (answer, answered) = oneshot::channel();
    let waiting = waiting(db);
    let start_writer = {
        let mut w = lock(&waiting);
        w.submissions.push((submission, answer));
        !std::mem::replace(&mut w.writer, true)
    };
    if start_writer {
        tokio::spawn(write_while_waiting(db.clone(), waiting));
    }
    // (no answer: the writer task was dropped with its runtime)
    answered.await.map_err(|_| StoreError::Database(sqlx::Error::WorkerCrashed))?
}

/// Writes the waiting submissions, MOST_PER_TRANSACTION at a time, until none wait.
async fn write_while_waiting(db: Db, waiting: Arc<Mutex<Waiting>>) {
    let mut running = Running { waiting, done: false };
    loop {
        let (submissions, answers): (Vec<Submission>, Vec<Answer>) = {
            let mut w = lock(&running.waiting);
            let n = w.submissions.len().min(MOST_PER_TRANSACTION);
            if n == 0 {
                w.writer = false;
                running.done = true;
                return;
            }
            w.submissions.drain(..n).unzip()
        };
        let results = match write(&db, &submissions).await {
            Ok(written) => written.into_iter().map(Ok).collect(),
            Err(e) if submissions.len() == 1 => vec![Err(e)],
            // One bad submission fails the whole transaction: each is written alone, to
            // have its own answer.
            Err(_) => {
                let mut alone = Vec::with_capacity(submissions.len());
                for submission in &submissions {
                    alone.push(write(&db, std::slice::from_ref(submission)).await.map(|mut w| w.remove(0)));
                }
                alone
            }
        };
        for (answer, result) in answers.into_iter().zip(results) {
            // (a submission whose client went away is written all the same)
            let _ = answer.send(result);
        }
    }
}

/// A running writer task: however it ends (its runtime dropped mid-write included), the
/// next submission starts another.
struct Running {
    waiting: Arc<Mutex<Waiting>>,
    /// Ended by finding nothing to write, which said so under the lock.
    done: bool,
}

impl Drop for Running {
    fn drop(&mut self) {
        if !self.done {
            lock(&self.waiting).writer = false;
        }
    }
}

/// Writes `submissions` in one transaction: what each did, in order.
async fn write(db: &Db, submissions: &[Submission]) -> Result<Vec<Submitted>, StoreError> {
    let _writing = Writing::to(db, Data::Experiments);
    let (mut tx, _turn) = begin_write(db).await?;
    let mut queued = HashMap::new();
    let mut written = Vec::with_capacity(submissions.len());
    for submission in submissions {
        written.push(queue_one(&mut tx, submission, &mut queued).await?);
    }
    tx.commit().await?;
    Ok(written)
}

#[cfg(test)]
mod tests {
    use std::time::SystemTime;

    use distlab_common::disk::DiskPlan;
    use distlab_common::BackendKind;

    use super::*;
    use crate::store::queue::Quota;
    use crate::store::{open, Location};

    fn submission(name: &str, key: Option<&str>, max_queued: usize) -> Submission {
        Submission {
            owner: "ada".into(),
            name: name.into(),
            backend: BackendKind::Cpu,
            spec_json: format!(r#"{{"name": "{name}"}}"#),
            key: key.map(str::to_string),
            quota: Quota { max_queued, max_disk_bytes: None },
            disk: DiskPlan { checkpoint: 0, model: 0 },
            now: SystemTime::now(),
        }
    }

    /// Submissions made at once on one thread: the first starts the writer, which runs
    /// only once all of them wait, so they share its first transaction.
    async fn at_once(db: &Db, submissions: Vec<Submission>) -> Vec<Result<Submitted, StoreError>> {
        futures::future::join_all(submissions.into_iter().map(|s| submit(db, s))).await
    }

    /// Written together, each submission sees the ones before it: the quota counts them,
    /// a repeated idempotency key finds the first one's experiment.
    #[tokio::test(flavor = "current_thread")]
    async fn submissions_written_together_see_each_other() {
        let dir = tempfile::tempdir().expect("a temporary directory");
        let db = open(Location::DataDir(dir.path())).await.expect("a database");
        let answers = at_once(&db, (0..8).map(|i| submission(&format!("q{i}"), None, 3)).collect()).await;
        let answers: Vec<Submitted> = answers.into_iter().map(|a| a.expect("written")).collect();
        assert!(answers[..3].iter().all(|a| matches!(a, Submitted::New(_))), "{answers:?}");
        assert!(answers[3..].iter().all(|a| *a == Submitted::OverQuota { queued: 3 }), "{answers:?}");

        let answers = at_once(&db, (0..4).map(|_| submission("again", Some("k"), 100)).collect()).await;
        let Ok(Submitted::New(id)) = answers[0] else { panic!("{answers:?}") };
        for a in &answers[1..] {
            assert!(matches!(a, Ok(Submitted::Existing { id: same, same_spec: true }) if *same == id), "{answers:?}");
        }
    }

    /// A submission the database refuses fails alone: the others of its transaction are
    /// written again one by one, and queued.
    #[tokio::test(flavor = "current_thread")]
    async fn one_refused_submission_does_not_fail_the_others() {
        let dir = tempfile::tempdir().expect("a temporary directory");
        let db = open(Location::DataDir(dir.path())).await.expect("a database");
        sqlx::query(
            "CREATE TRIGGER refuse BEFORE INSERT ON experiments WHEN NEW.name = 'refused' \
             BEGIN SELECT RAISE(ABORT, 'refused by the test'); END",
        )
        .execute(&db)
        .await
        .expect("a trigger");
        let names = ["a", "b", "refused", "c"];
        let answers = at_once(&db, names.iter().map(|n| submission(n, None, 100)).collect()).await;
        for (name, answer) in names.iter().zip(&answers) {
            match (*name, answer) {
                ("refused", Err(e)) => assert!(e.to_string().contains("refused by the test"), "{e}"),
                (_, Ok(Submitted::New(_))) if *name != "refused" => {}
                _ => panic!("{name}: {answer:?}"),
            }
        }
        let queued: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM experiments").fetch_one(&db).await.expect("a count");
        assert_eq!(queued, 3);
    }
}
