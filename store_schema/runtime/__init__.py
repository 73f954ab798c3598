"""The ground floor both sides share: CLI exit codes, progress, the host, units, crc32c,
the target model and its config. It imports nothing else of the store."""
