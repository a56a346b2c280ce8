-- txoutbox 002: relay membership, so that relays share the partitions fairly.
-- Each running relay keeps one row, written on its lease connection (the session that holds
-- its partition locks). A relay is alive while that backend exists (pg_stat_activity) and its
-- heartbeat is recent; the partitions it holds are its advisory locks in pg_locks, so this
-- table never has to be trusted about leases.

CREATE TABLE txoutbox_relays (
    -- One per relay process start (a restarted relay is a new member).
    instance          uuid        PRIMARY KEY,
    -- Config.ID / --relay-id, for people: hostname:pid by default.
    relay_id          text        NOT NULL,
    -- pg_backend_pid() of the relay's lease session.
    backend_pid       integer     NOT NULL,
    -- The relay's Config.Partitions: every relay of one outbox must agree.
    partitions        integer     NOT NULL,
    lease_interval_ms integer     NOT NULL,
    started_at        timestamptz NOT NULL DEFAULT now(),
    heartbeat_at      timestamptz NOT NULL DEFAULT now()
);
