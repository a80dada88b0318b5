from dcr_log._entry import entry

entry()
