"""The extract commands' handlers, one module each, named by the parsers in extract/cli/."""
