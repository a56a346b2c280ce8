DROP TABLE txoutbox_relays;
