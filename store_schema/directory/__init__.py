"""Stores in a directory (POSIX): the commit protocol by rename, `O_EXCL` fences and an flock, beside
`objstore/` (the same protocol on object storage)."""
