-- txoutbox 001: the outbox table and the consumer dedup table.
-- Unqualified names: the runner (and your deploy tool) choose the schema through search_path.

CREATE TABLE txoutbox_messages (
    -- Ordering sequence. For one key, id order is commit order: EnqueueTx takes the key's
    -- advisory lock before the id is drawn, and a committed half message draws a new id.
    id              bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    message_id      uuid        NOT NULL,
    subject         text        NOT NULL,
    msg_key         text,
    -- 31-bit hash of msg_key (of message_id when there is no key); partition = partition_key % N.
    partition_key   integer     NOT NULL CHECK (partition_key >= 0),
    headers         jsonb,
    payload         bytea       NOT NULL,
    state           text        NOT NULL DEFAULT 'ready'
        CHECK (state IN ('prepared', 'ready', 'published', 'rolled_back', 'dead', 'check_exhausted')),
    attempts        integer     NOT NULL DEFAULT 0,
    next_attempt_at timestamptz NOT NULL DEFAULT now(),
    last_error      text,
    created_at      timestamptz NOT NULL DEFAULT now(),
    -- When the row became ready (committed); commit -> publish latency is measured from here.
    ready_at        timestamptz,
    published_at    timestamptz,
    stream          text,
    stream_seq      bigint,
    -- Half messages (prepared -> ready | rolled_back | check_exhausted).
    producer_group  text,
    check_mode      text CHECK (check_mode IN ('checker', 'fence')),
    check_count     integer     NOT NULL DEFAULT 0,
    next_check_at   timestamptz,
    settled_by      text,
    settled_at      timestamptz,
    CONSTRAINT txoutbox_messages_message_id_key UNIQUE (message_id)
)
-- A queue table: rows are inserted and deleted all day. Vacuum it early so dead tuples
-- do not pile up in front of the claim index.
WITH (autovacuum_vacuum_scale_factor = 0.01, autovacuum_vacuum_cost_delay = 1);

-- The relay's claim: ready rows in id order.
CREATE INDEX txoutbox_messages_ready_idx ON txoutbox_messages (id) WHERE state = 'ready';

-- Per-key hold-back: earlier rows of a key that failed (in backoff, or dead) block the later ones.
-- Only rows that failed at least once are indexed, so the index stays tiny.
CREATE INDEX txoutbox_messages_blocked_idx ON txoutbox_messages (msg_key, id)
    WHERE attempts > 0 AND state IN ('ready', 'dead');

-- The check-back: prepared rows whose next check is due.
CREATE INDEX txoutbox_messages_prepared_idx ON txoutbox_messages (next_check_at) WHERE state = 'prepared';

-- Operator views and retention.
CREATE INDEX txoutbox_messages_dead_idx ON txoutbox_messages (id) WHERE state IN ('dead', 'check_exhausted');
CREATE INDEX txoutbox_messages_published_idx ON txoutbox_messages (published_at) WHERE state = 'published';
CREATE INDEX txoutbox_messages_rolled_back_idx ON txoutbox_messages (settled_at) WHERE state = 'rolled_back';

CREATE TABLE txoutbox_consumer_dedup (
    consumer        text        NOT NULL,
    idempotency_key text        NOT NULL,
    message_id      text,
    stream_seq      bigint,
    processed_at    timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (consumer, idempotency_key)
);

CREATE INDEX txoutbox_consumer_dedup_processed_idx ON txoutbox_consumer_dedup (processed_at);
