-- txoutbox 006: what each relay says about itself in its heartbeat, for the fleet view of
-- `relay status` and every relay's status page: its version, its state, its NATS connection
-- and its throughput. Every lease round (Config.LeaseInterval) writes them with the
-- heartbeat. Relays that predate this migration leave the defaults.

ALTER TABLE txoutbox_relays
    -- The relay's txoutbox version (a module version such as v1.4.0, or the VCS revision of
    -- a development build).
    ADD COLUMN version      text             NOT NULL DEFAULT '',
    -- relay.Health: starting, ok, standby, postgres_unavailable, nats_unavailable.
    ADD COLUMN health       text             NOT NULL DEFAULT '',
    -- The state of the relay's NATS connection: CONNECTED, RECONNECTING, CLOSED, ...
    ADD COLUMN nats_state   text             NOT NULL DEFAULT '',
    -- Rows this relay process has published, and its rate over about the last minute.
    ADD COLUMN published    bigint           NOT NULL DEFAULT 0,
    ADD COLUMN publish_rate double precision NOT NULL DEFAULT 0;

-- The fleet as a query, for psql and SQL dashboards: every relay with what it reported, live
-- ones first (alive: its lease session exists and its heartbeat is recent, as the relays
-- themselves decide). It runs with this migration's search_path.
CREATE FUNCTION txoutbox_relay_fleet()
RETURNS TABLE (relay_id text, alive boolean, health text, nats_state text, publish_rate double precision,
               published bigint, version text, started_at timestamptz, heartbeat_at timestamptz)
LANGUAGE sql STABLE
SET search_path FROM CURRENT
AS $fn$
    SELECT r.relay_id,
           EXISTS (SELECT 1 FROM pg_stat_activity a WHERE a.pid = r.backend_pid)
             AND r.heartbeat_at > now() - greatest(r.lease_interval_ms * 10, 30000) * interval '1 millisecond',
           r.health, r.nats_state, r.publish_rate, r.published, r.version, r.started_at, r.heartbeat_at
    FROM txoutbox_relays r
    ORDER BY 2 DESC, r.started_at, r.instance
$fn$;
