-- distlab schema, version 5: flashcard review with spaced repetition (FSRS).
--
-- A profile is one person's review progress through the deck (cards/deck.json; cards are
-- referred to by their stable text ids, the deck itself is not in the database). Like
-- experiments, every profile has an owner; the embedded single-user mode is 'local'.

CREATE TABLE profiles (
    id         INTEGER PRIMARY KEY,
    owner      TEXT NOT NULL DEFAULT 'local',
    name       TEXT NOT NULL,
    created_at TEXT NOT NULL,
    UNIQUE (owner, name)
);

-- The FSRS memory state of each card a profile has reviewed at least once (a card with no
-- row is new). last_rating is the deck's 1..5 self-rating.
CREATE TABLE card_reviews (
    profile_id  BIGINT NOT NULL REFERENCES profiles (id) ON DELETE CASCADE,
    card_id     TEXT NOT NULL,
    stability   DOUBLE PRECISION NOT NULL CHECK (stability > 0),
    difficulty  DOUBLE PRECISION NOT NULL CHECK (difficulty BETWEEN 1 AND 10),
    due         TEXT NOT NULL,
    last_review TEXT NOT NULL,
    reps        BIGINT NOT NULL CHECK (reps >= 1),
    lapses      BIGINT NOT NULL DEFAULT 0 CHECK (lapses >= 0),
    last_rating BIGINT NOT NULL CHECK (last_rating BETWEEN 1 AND 5),
    PRIMARY KEY (profile_id, card_id)
);

CREATE INDEX card_reviews_due ON card_reviews (profile_id, due);

-- Every review, so that progress can be exported and replayed; id keeps the order of
-- reviews stored within the same millisecond.
CREATE TABLE review_log (
    id            INTEGER PRIMARY KEY,
    profile_id    BIGINT NOT NULL REFERENCES profiles (id) ON DELETE CASCADE,
    card_id       TEXT NOT NULL,
    rating        BIGINT NOT NULL CHECK (rating BETWEEN 1 AND 5),
    reviewed_at   TEXT NOT NULL,
    interval_days DOUBLE PRECISION NOT NULL CHECK (interval_days >= 0)
);

CREATE INDEX review_log_profile ON review_log (profile_id, reviewed_at, id);
