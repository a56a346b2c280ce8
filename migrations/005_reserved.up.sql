-- txoutbox 005: reserved for the scheduled-messages migration being written on another
-- branch. This no-op only keeps the versions without a gap on this branch (the runner refuses
-- a gap); delete this file and 005_reserved.down.sql when that migration is merged.
SELECT 1;
