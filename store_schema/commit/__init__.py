"""The commit protocol: a shard is staged, recorded (size + crc32c of every file), fenced
by its attempt and renamed into place, then entered in the store's journal. The store
and the generated corpus both commit through it."""
