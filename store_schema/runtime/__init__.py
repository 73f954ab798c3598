"""Runtime rules both sides share that are not the store layout: CLI exit codes,
progress, the host, units, the target model config."""
