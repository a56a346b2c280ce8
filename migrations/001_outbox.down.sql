DROP TABLE txoutbox_consumer_dedup;
DROP TABLE txoutbox_messages;
