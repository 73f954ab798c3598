"""`python -m extract run` / `plan`: hidden-state extraction as a sharded job.

- `config`: the job's settings (`JobConfig`).
- `planning`: corpus -> plan (tokenization, quarantine, shards); `resume`: a store's plan reused.
- `layers`: the job's context layer ids; `estimate`: sizes for `plan --dry-run`.
- `worker`: the Ray actor that holds the target and writes shards, through `runner`
  (forward hooks capturing the chosen layers).
- `job`: the extraction job (fingerprint, store root, report) run by `extract.jobs.driver`."""
