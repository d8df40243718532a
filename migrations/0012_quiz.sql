-- distlab schema, version 12: the quiz's results, per account.
--
-- One row per account and question (cards/quiz.json; questions are referred to by their
-- stable text ids, the quiz itself is not in the database): how often the question was
-- answered and answered right, and the latest answer. The embedded single-user mode's
-- account is 'local'.

CREATE TABLE quiz_results (
    owner         TEXT NOT NULL,
    question_id   TEXT NOT NULL,
    attempts      BIGINT NOT NULL CHECK (attempts >= 1),
    correct       BIGINT NOT NULL CHECK (correct >= 0 AND correct <= attempts),
    last_correct  BIGINT NOT NULL CHECK (last_correct IN (0, 1)),
    last_given    DOUBLE PRECISION,
    answered_at   TEXT NOT NULL,
    PRIMARY KEY (owner, question_id)
);
