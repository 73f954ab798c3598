"""What an offline tau stands for. `eval` rolls the drafter out against the store's
replies, so its tau estimates decoding at the settings those replies were generated
with: greedy replies -> greedy decoding; replies sampled at temperature T -> decoding at
T (the full distribution, as `extract generate` samples); replies the target did not
write (a plain corpus, another model) -> a proxy only. Against the target's stored
top-1 (`--labels target`) it is greedy decoding whatever the replies."""

from __future__ import annotations

from store_schema.provenance import TARGET


def tau_stands_for(fingerprint, labels: str) -> dict:
    """{"decoding", "thinking", "proxy", "note"} for a store's `fingerprint` and eval's `labels`."""
    sampling = dict(fingerprint.response_sampling)
    thinking = sampling.get("thinking", "unknown")
    if labels == "target":
        return {"decoding": "greedy", "thinking": thinking, "proxy": False, "note": "against the target's own top-1"}
    if fingerprint.response_provenance != TARGET or not sampling:
        where = "a plain corpus" if fingerprint.response_provenance != "other" else "another model"
        return {
            "decoding": "unknown",
            "thinking": thinking,
            "proxy": True,
            "note": f"a proxy: the store's replies come from {where}, not from the target; "
            "measure served acceptance with `speculate`",
        }
    temperature = sampling["temperature"]
    decoding = "greedy" if temperature == 0 else f"temperature {temperature:g} (top-p 1, top-k 0)"
    return {
        "decoding": decoding,
        "thinking": thinking,
        "proxy": False,
        "note": f"the target's own replies, generated {decoding}, thinking {thinking}",
    }


def describe(stands_for: dict) -> str:
    """The one line `eval` prints under its figures."""
    return f"tau stands for: {stands_for['note']}" + (
        "" if stands_for["proxy"] else f" (decoding {stands_for['decoding']}, thinking {stands_for['thinking']})"
    )
