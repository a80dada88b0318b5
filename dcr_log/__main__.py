from ._entry import entry

entry()
