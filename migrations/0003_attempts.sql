-- distlab schema, version 3: attempts.
--
-- One row per lease of an experiment. A worker that dies leaves its experiment to be
-- leased again; the next attempt says where it starts (from_step: 0, or the step of the
-- checkpoint it resumed from), and the steps an earlier attempt had already reported from
-- there on are the work that was lost (lost_steps; their metrics are replaced).

CREATE TABLE attempts (
    experiment_id BIGINT NOT NULL REFERENCES experiments (id) ON DELETE CASCADE,
    attempt       BIGINT NOT NULL CHECK (attempt >= 1),
    worker_id     BIGINT REFERENCES workers (id),
    started_at    TEXT NOT NULL,
    from_step     BIGINT CHECK (from_step >= 0),   -- NULL until the worker reports it
    lost_steps    BIGINT NOT NULL DEFAULT 0 CHECK (lost_steps >= 0),
    PRIMARY KEY (experiment_id, attempt)
);
