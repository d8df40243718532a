-- distlab schema, version 17: what makes this database itself.

-- One row, `name` = 'id': a random id made when the database is first opened. A worker's
-- checkpoint directories carry it (experiment-<id>-<store id>), so that a new database whose
-- experiment 1 has the spec of an old database's experiment 1 starts afresh instead of
-- "resuming" from that run's checkpoints.
CREATE TABLE store_identity (
    name  TEXT NOT NULL PRIMARY KEY,
    value TEXT NOT NULL
);
