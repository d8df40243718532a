-- distlab schema, version 16: runs across several workers (gang scheduling).

-- How many ranks a worker runs at once (NULL: as many as a run has), and until when it
-- counts as idle: it asked for work then, and a lease or a part given to it clears it.
ALTER TABLE workers ADD COLUMN ranks BIGINT CHECK (ranks IS NULL OR ranks >= 1);
ALTER TABLE workers ADD COLUMN idle_until TEXT;

-- An attempt placed on several workers, one row per host: host h runs `ranks` consecutive
-- ranks from `first_rank`, host 0 from rank 0 (its worker is the experiment's worker_id and
-- reports the run's metrics and its end). A host's worker takes its part at its next lease
-- (joined_at) and renews it with heartbeats (lease_until; host 0's lease is the
-- experiment's own); every connection between the hosts proves the attempt's secret.
CREATE TABLE parts (
    experiment_id BIGINT NOT NULL REFERENCES experiments (id) ON DELETE CASCADE,
    attempt       BIGINT NOT NULL CHECK (attempt >= 1),
    host          BIGINT NOT NULL CHECK (host >= 0),
    worker_id     BIGINT NOT NULL REFERENCES workers (id),
    first_rank    BIGINT NOT NULL CHECK (first_rank >= 0),
    ranks         BIGINT NOT NULL CHECK (ranks >= 1),
    secret        TEXT NOT NULL,
    joined_at     TEXT,
    lease_until   TEXT,
    PRIMARY KEY (experiment_id, attempt, host)
);

CREATE INDEX parts_by_worker ON parts (worker_id, joined_at);

-- What the hosts of an attempt tell each other while it starts (like torchrun's store):
-- their ranks' addresses, the checkpoint step they all resume from.
CREATE TABLE rendezvous (
    experiment_id BIGINT NOT NULL REFERENCES experiments (id) ON DELETE CASCADE,
    attempt       BIGINT NOT NULL,
    name          TEXT NOT NULL,
    value         TEXT NOT NULL,
    PRIMARY KEY (experiment_id, attempt, name)
);
