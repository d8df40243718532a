-- distlab schema, version 1.
--
-- Written for SQLite and kept close to portable SQL so that a Postgres port needs
-- only the id columns changed (INTEGER PRIMARY KEY -> BIGINT GENERATED ALWAYS AS IDENTITY).
-- Timestamps are RFC3339 UTC text with millisecond precision and a fixed width
-- ("2025-01-31T12:00:00.000Z"), so that comparing them as text compares the times.
-- JSON documents (spec, summary, backends, devices) are stored as text.

CREATE TABLE workers (
    id            INTEGER PRIMARY KEY,
    name          TEXT NOT NULL,
    backends      TEXT NOT NULL,      -- JSON array, e.g. ["cpu", "cuda"]
    devices       TEXT NOT NULL,      -- JSON array of human-readable device names
    version       TEXT NOT NULL,
    registered_at TEXT NOT NULL,
    last_seen     TEXT NOT NULL
);

CREATE TABLE experiments (
    id               INTEGER PRIMARY KEY,
    -- Every experiment belongs to someone; the embedded single-user mode is 'local'.
    owner            TEXT NOT NULL DEFAULT 'local',
    name             TEXT NOT NULL,
    spec             TEXT NOT NULL,   -- JSON ExperimentSpec
    -- Copied out of the spec so that leasing can filter on it in plain SQL.
    backend          TEXT NOT NULL,
    status           TEXT NOT NULL DEFAULT 'queued'
                     CHECK (status IN ('queued', 'running', 'succeeded', 'failed', 'cancelled')),
    -- How many times a worker has leased it.
    attempt          BIGINT NOT NULL DEFAULT 0,
    worker_id        BIGINT REFERENCES workers (id),
    lease_until      TEXT,
    cancel_requested BOOLEAN NOT NULL DEFAULT FALSE,
    error            TEXT,
    summary          TEXT,            -- JSON RunSummary
    created_at       TEXT NOT NULL,
    started_at       TEXT,
    finished_at      TEXT
);

CREATE INDEX experiments_status_id ON experiments (status, id);
CREATE INDEX experiments_owner_id ON experiments (owner, id);

-- One row per optimizer step; a re-run after a requeue overwrites its steps.
CREATE TABLE metrics (
    experiment_id BIGINT NOT NULL REFERENCES experiments (id) ON DELETE CASCADE,
    step          BIGINT NOT NULL,
    loss          DOUBLE PRECISION NOT NULL,
    lr            DOUBLE PRECISION NOT NULL,
    grad_norm     DOUBLE PRECISION NOT NULL,
    tokens_per_s  DOUBLE PRECISION NOT NULL,
    step_ms       DOUBLE PRECISION NOT NULL,
    PRIMARY KEY (experiment_id, step)
);

CREATE TABLE logs (
    id            INTEGER PRIMARY KEY,
    experiment_id BIGINT NOT NULL REFERENCES experiments (id) ON DELETE CASCADE,
    created_at    TEXT NOT NULL,
    level         TEXT NOT NULL CHECK (level IN ('info', 'warn', 'error')),
    message       TEXT NOT NULL
);

CREATE INDEX logs_experiment_id ON logs (experiment_id, id);
