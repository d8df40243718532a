-- distlab schema, version 2: per-rank traces.
--
-- One row per rank of an experiment: the latest RankTrace that rank reported (spans of its
-- timeline and the steps of its collectives), as JSON text. A re-run after a requeue
-- overwrites the rows of the earlier attempt rank by rank.

CREATE TABLE traces (
    experiment_id BIGINT NOT NULL REFERENCES experiments (id) ON DELETE CASCADE,
    rank          BIGINT NOT NULL CHECK (rank >= 0),
    trace         TEXT NOT NULL,      -- JSON RankTrace
    updated_at    TEXT NOT NULL,
    PRIMARY KEY (experiment_id, rank)
);
