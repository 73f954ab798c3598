"""What an `--engine openai` job adds to the generate report, from the shards' commit
records: records quarantined while generating (a request that failed every try),
the token check of the replies, and which servers answered."""

from __future__ import annotations

from collections import Counter

MISMATCH_WARNING = 0.01  # of the checked replies


def served_report(counts: dict, commit_records, served, journaled: int, log) -> dict:
    """Fields that replace or join `planning.plan_counts`'s in the report (`journaled`:
    the replies this run found in the journal instead of asking for them); logs a
    warning naming examples when more than 1 % of the checked replies do not come
    back as the server's own tokens."""
    commit_records = list(commit_records)
    quarantined = [q for r in commit_records for q in r.get("quarantined", [])]
    checks: Counter[str] = Counter()
    examples = []
    for record in commit_records:
        token_checks = record.get("token_checks", {})
        checks.update({k: v for k, v in token_checks.items() if k != "examples"})
        examples.extend(token_checks.get("examples", []))
    by_reason = Counter(counts["quarantined_by_reason"])
    by_reason.update(q["reason"] for q in quarantined)
    mismatched = checks["mismatched"] + checks["prompt_mismatched"]
    if checks["checked"] and mismatched / checks["checked"] > MISMATCH_WARNING:
        log(
            f"warning: {mismatched} of {checks['checked']} replies ({mismatched / checks['checked']:.1%}) do not "
            f"re-tokenize to the server's own tokens (e.g. {', '.join(examples[:3])}): the corpus is not exactly "
            "what the target generated -- check that the server runs --model's tokenizer and chat template"
        )
    for q in quarantined[:5]:
        log(f"quarantined while generating: record {q['record_index']} ({q['id']!r}): {q['reason']} {q['detail']}")
    return dict(
        records=counts["records"] - len(quarantined),
        quarantined=counts["quarantined"] + len(quarantined),
        quarantined_by_reason=dict(sorted(by_reason.items())),
        quarantined_while_generating=len(quarantined),
        replies=checks["replies"],
        replies_from_journal=journaled,
        token_checked_replies=checks["checked"],
        token_mismatched_replies=checks["mismatched"],
        prompt_mismatched_replies=checks["prompt_mismatched"],
        token_mismatch_examples=examples[:10],
        server=served[0].server,
        server_version=served[0].version,
        endpoints=[s.endpoint for s in served],
    )
