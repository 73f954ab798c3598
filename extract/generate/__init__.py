"""`python -m extract generate`: the target regenerates every assistant turn of a
corpus, so the drafter trains on the target's own words (the DFlash recipe).

- `config`: the job's settings (`GenerateConfig`) and what identifies its output.
- `turns`: one record's conversation, prompts and parsed replies (pure, no model).
- `planning`: records -> a plan of shards, bad records quarantined with reasons.
- `worker`: the Ray actor that holds the target and generates shards.
- `job`: the generate job (manifest, resume, report) run by the one sharded-job driver (`extract.jobs.driver`).

The output is a generated corpus (`extract.generated_corpus`)."""
