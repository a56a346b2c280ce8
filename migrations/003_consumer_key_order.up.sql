-- txoutbox 003: per-key applied order of ordered consumers (consumer.Config.Ordered).
-- One row per (durable consumer, stream, ordering key): the highest stream sequence of that
-- key whose effect the consumer applied (or dead-lettered). The consumer locks the key's row
-- in the transaction that applies a message and applies it only when no earlier message of
-- the key is still unsettled, so that applied effects follow the stream's per-key order
-- across consumer restarts and instances.

CREATE TABLE txoutbox_consumer_key_order (
    consumer    text        NOT NULL,
    stream      text        NOT NULL,
    order_key   text        NOT NULL,
    applied_seq bigint      NOT NULL,
    updated_at  timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (consumer, stream, order_key)
);
