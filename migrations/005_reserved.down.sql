DROP FUNCTION txoutbox_reserved_005();
