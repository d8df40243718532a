//! The schema's migrations (`migrations/*.sql`), built into the binary as sqlx's
//! `migrate!` would build them (version and description from the file name, the checksum
//! of the text), without sqlx's macros, whose compiler-side crate builds SQLite and both
//! database drivers a second time. A new migration goes at the end of [`FILES`]; a test
//! names any file of the folder missing from it.

use std::borrow::Cow;

use sqlx::migrate::{Migration, MigrationType};

/// Every migration by file name, in order.
const FILES: [(&str, &str); 21] = [
    ("0001_init.sql", include_str!("../../../migrations/0001_init.sql")),
    ("0002_traces.sql", include_str!("../../../migrations/0002_traces.sql")),
    ("0003_attempts.sql", include_str!("../../../migrations/0003_attempts.sql")),
    ("0004_loss_scale.sql", include_str!("../../../migrations/0004_loss_scale.sql")),
    ("0005_reviews.sql", include_str!("../../../migrations/0005_reviews.sql")),
    ("0006_idempotency.sql", include_str!("../../../migrations/0006_idempotency.sql")),
    ("0007_worker_capacity.sql", include_str!("../../../migrations/0007_worker_capacity.sql")),
    ("0008_accounts.sql", include_str!("../../../migrations/0008_accounts.sql")),
    ("0009_worker_credentials.sql", include_str!("../../../migrations/0009_worker_credentials.sql")),
    ("0010_expert_metrics.sql", include_str!("../../../migrations/0010_expert_metrics.sql")),
    ("0011_logit_grad_zeros.sql", include_str!("../../../migrations/0011_logit_grad_zeros.sql")),
    ("0012_quiz.sql", include_str!("../../../migrations/0012_quiz.sql")),
    ("0013_review_settings.sql", include_str!("../../../migrations/0013_review_settings.sql")),
    ("0014_val_loss.sql", include_str!("../../../migrations/0014_val_loss.sql")),
    ("0015_datasets.sql", include_str!("../../../migrations/0015_datasets.sql")),
    ("0016_runs_across_workers.sql", include_str!("../../../migrations/0016_runs_across_workers.sql")),
    ("0017_store_identity.sql", include_str!("../../../migrations/0017_store_identity.sql")),
    ("0018_disk_plan.sql", include_str!("../../../migrations/0018_disk_plan.sql")),
    ("0019_assignments.sql", include_str!("../../../migrations/0019_assignments.sql")),
    ("0020_assignment_grades.sql", include_str!("../../../migrations/0020_assignment_grades.sql")),
    ("0021_fp8_metrics.sql", include_str!("../../../migrations/0021_fp8_metrics.sql")),
];

/// The migrations, as `migrate!("../migrations")` would give them.
pub fn all() -> Vec<Migration> {
    FILES
        .iter()
        .map(|(file, sql)| {
            let (version, description) = version_and_description(file);
            let no_tx = sql.starts_with("-- no-transaction");
            Migration::new(version, Cow::Owned(description), MigrationType::Simple, Cow::Borrowed(sql), no_tx)
        })
        .collect()
}

/// `NNNN_some_words.sql`: NNNN and "some words" (as sqlx reads a migration's name).
fn version_and_description(file: &str) -> (i64, String) {
    let parsed = file.strip_suffix(".sql").and_then(|stem| stem.split_once('_'));
    let parsed = parsed.and_then(|(version, words)| Some((version.parse().ok()?, words.replace('_', " "))));
    // (FILES is a constant, each name checked by the tests below.)
    parsed.unwrap_or_else(|| panic!("migration file {file} is not named NNNN_description.sql"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn folder() -> std::path::PathBuf {
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../migrations")
    }

    #[test]
    fn every_file_of_the_folder_is_built_in_in_order() {
        let mut on_disk: Vec<String> = std::fs::read_dir(folder())
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .filter(|name| name.ends_with(".sql"))
            .collect();
        on_disk.sort();
        let built_in: Vec<&str> = FILES.iter().map(|(file, _)| *file).collect();
        assert_eq!(built_in, on_disk, "migrations/ and store/migrations.rs's FILES differ");
    }

    /// What sqlx reads from the folder at run time: the same versions, descriptions,
    /// checksums (an existing database's record of what ran) and transaction choice.
    #[tokio::test]
    async fn the_migrations_are_what_sqlx_reads_from_the_folder() {
        let read = sqlx::migrate::Migrator::new(folder()).await.unwrap();
        let built_in = all();
        assert_eq!(read.iter().count(), built_in.len());
        for (read, ours) in read.iter().zip(&built_in) {
            assert_eq!(
                (read.version, &read.description, &read.checksum, read.no_tx, read.migration_type),
                (ours.version, &ours.description, &ours.checksum, ours.no_tx, ours.migration_type),
            );
        }
    }
}
