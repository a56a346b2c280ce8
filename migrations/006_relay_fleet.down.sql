DROP FUNCTION txoutbox_relay_fleet();
ALTER TABLE txoutbox_relays
    DROP COLUMN version,
    DROP COLUMN health,
    DROP COLUMN nats_state,
    DROP COLUMN published,
    DROP COLUMN publish_rate;
