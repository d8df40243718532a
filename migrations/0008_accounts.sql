-- distlab schema, version 8: accounts (`distlab-server --auth accounts`).
--
-- Passwords are argon2id hashes (PHC strings). A session is a random token the browser
-- keeps in an HttpOnly cookie; only its SHA-256 is stored. Experiments and flashcard
-- profiles already name their owner ('local' in the single-user mode); with accounts the
-- owner is the account's name.

CREATE TABLE users (
    id            INTEGER PRIMARY KEY,
    name          TEXT NOT NULL UNIQUE,
    password_hash TEXT NOT NULL,
    admin         BOOLEAN NOT NULL DEFAULT FALSE,
    created_at    TEXT NOT NULL
);

CREATE TABLE sessions (
    token_sha256 TEXT PRIMARY KEY,
    user_name    TEXT NOT NULL REFERENCES users (name) ON DELETE CASCADE,
    created_at   TEXT NOT NULL,
    expires_at   TEXT NOT NULL
);
CREATE INDEX sessions_by_user ON sessions (user_name);
CREATE INDEX experiments_by_owner_status ON experiments (owner, status);
