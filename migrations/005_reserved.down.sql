-- txoutbox 005: reserved (see 005_reserved.up.sql).
SELECT 1;
