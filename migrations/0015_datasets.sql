-- distlab schema, version 15: uploaded texts to train on.
--
-- A row per text (`data.dataset: "upload"`, `data.upload_id`); the text itself is the file
-- DATA_DIR/datasets/dataset-<id>.txt. Anyone may train on any of them; its owner or an
-- admin may delete it: the file goes, the row stays with `deleted_at` set, so that its id
-- is never handed out again (a finished run's spec keeps naming the text it trained on).

CREATE TABLE datasets (
    id          INTEGER PRIMARY KEY,
    name        TEXT NOT NULL,
    owner       TEXT NOT NULL,
    bytes       BIGINT NOT NULL CHECK (bytes >= 0),
    created_at  TEXT NOT NULL,
    deleted_at  TEXT
);
